// A sharded tensor put back together from its ranks' blocks (a resident
// tensor's shards, a request's output blocks).
#ifndef SHARDGEMM_SERVER_OUTPUT_ASSEMBLY_H_
#define SHARDGEMM_SERVER_OUTPUT_ASSEMBLY_H_

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"
#include "planner/mesh.h"
#include "planner/spec.h"

namespace shardgemm {

// The [shape] tensor split by `spec` over `mesh`, from `block(rank)`:
// replicated dimensions give several ranks the same block, and each
// distinct block is fetched once (from the lowest rank holding it). A block
// of the wrong shape or dtype is INTERNAL naming the rank.
absl::StatusOr<HostTensor> AssembleBlocks(const planner::Mesh& mesh, DType dtype, const std::vector<int64_t>& shape,
                                          const planner::PartitionSpec& spec,
                                          const std::function<absl::StatusOr<HostTensor>(int rank)>& block);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_OUTPUT_ASSEMBLY_H_
