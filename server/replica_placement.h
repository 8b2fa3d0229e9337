// Where the copies of a resident tensor's blocks live (--replicas=N): every
// distinct block on N workers. The ranks its spec gives the same block count
// as copies (a replicated tensor is on every rank already); standby copies
// make up the rest, each on a worker that holds no copy of that block, so
// that one worker's death never takes every copy. Pure: no gRPC, no I/O.
#ifndef SHARDGEMM_SERVER_REPLICA_PLACEMENT_H_
#define SHARDGEMM_SERVER_REPLICA_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/mesh.h"
#include "planner/spec.h"

namespace shardgemm {

// The block of `block_rank` (the lowest rank whose own block it is), also
// held by `holder_rank`.
struct StandbyCopy {
  int block_rank = 0;
  int holder_rank = 0;
  bool operator==(const StandbyCopy& o) const { return block_rank == o.block_rank && holder_rank == o.holder_rank; }
};

// The name a standby copy of `shard_name` ("name@generation") has on its
// holder, which may hold a block of its own under `shard_name`.
std::string StandbyShardName(const std::string& shard_name, int block_rank);

// For each rank, the lowest rank holding the same block of a tensor of
// `shape` split by `spec` (ranks that differ only on axes the spec does not
// use hold the same block).
absl::StatusOr<std::vector<int>> BlockOwners(const planner::Mesh& mesh, absl::string_view name,
                                             const std::vector<int64_t>& shape, const planner::PartitionSpec& spec);

// The standby copies that give every block `replicas` holders. A block the
// spec gives k ranks needs max(0, replicas - k) more, on ranks holding no
// copy of it: those with the fewest `load_bytes` first (ties: the nearest
// after the block's rank, cyclically); each copy placed adds `block_bytes`
// to its holder's load. `load_bytes` has an entry per rank. INVALID_ARGUMENT
// naming --replicas when it is not within 1 and the number of ranks.
absl::StatusOr<std::vector<StandbyCopy>> PlaceStandbyCopies(const std::vector<int>& block_owners, int replicas,
                                                            int64_t block_bytes, std::vector<int64_t> load_bytes);

// How many ranks hold a copy of `block_rank`'s block (its own and standby).
int CopiesOfBlock(const std::vector<int>& block_owners, const std::vector<StandbyCopy>& standby, int block_rank);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_REPLICA_PLACEMENT_H_
