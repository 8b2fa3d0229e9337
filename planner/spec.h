// Partition specs (which mesh axes split which tensor dimension) and the
// shard geometry they imply.
#ifndef SHARDGEMM_PLANNER_SPEC_H_
#define SHARDGEMM_PLANNER_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/mesh.h"

namespace shardgemm {
namespace planner {

// One entry per dimension; an empty entry is a replicated dimension, a
// non-empty one splits the dimension over the product of its axes, first
// axis major. A spec shorter than the tensor's rank is padded with
// replicated entries.
struct PartitionSpec {
  std::vector<std::vector<std::string>> dims;
};
bool operator==(const PartitionSpec& a, const PartitionSpec& b);
inline bool operator!=(const PartitionSpec& a, const PartitionSpec& b) { return !(a == b); }

// Parses JAX-style text, quotes optional: "(('fsdp','ep'), None, 'tp')",
// "((fsdp,ep),None,tp)", "(ep,)", "()"; the empty string is fully
// replicated. Only syntax is checked here (see ValidatePartitionSpec).
absl::StatusOr<PartitionSpec> ParsePartitionSpec(absl::string_view text);

// Canonical text: "((fsdp, ep), None, tp)", "(ep,)", "()". Re-parses to the
// same spec.
std::string FormatPartitionSpec(const PartitionSpec& spec);
// "(fsdp, ep)" for a list of axes, "None" when empty, "tp" for one axis.
std::string FormatAxes(const std::vector<std::string>& axes);

// `spec` padded with replicated entries to `rank` (unchanged if longer).
PartitionSpec PadSpec(const PartitionSpec& spec, size_t rank);

// Checks `spec` against a tensor of `shape` on `mesh`: not longer than the
// rank, every axis a mesh axis and used at most once, every dimension
// divisible by the product of its axes. Errors name the tensor, dimension
// and axis.
absl::Status ValidatePartitionSpec(absl::string_view tensor,
                                   const std::vector<int64_t>& shape,
                                   const PartitionSpec& spec, const Mesh& mesh);

// Product of the sizes of `axes` (unknown axes count as 1).
int64_t AxesProduct(const Mesh& mesh, const std::vector<std::string>& axes);

// Block index along one dimension split over `axes` for a worker at
// `coords` (first axis major).
int64_t BlockIndex(const Mesh& mesh, const std::vector<std::string>& axes,
                   const std::vector<int64_t>& coords);

// The group a collective over `axes` runs in, as seen from worker `rank`:
// the ranks that differ from it only on `axes`, ordered by their piece index
// (BlockIndex over `axes`, first axis major); `rank` itself is at its own
// piece index. Unknown or repeated axes are an InvalidArgument error.
absl::StatusOr<std::vector<int64_t>> PeerRanks(const Mesh& mesh,
                                               const std::vector<std::string>& axes,
                                               int64_t rank);

// Shape of every worker's shard (all shards have the same shape because
// dimensions must divide evenly). Validates first.
absl::StatusOr<std::vector<int64_t>> LocalShape(absl::string_view tensor,
                                                const std::vector<int64_t>& shape,
                                                const PartitionSpec& spec,
                                                const Mesh& mesh);

// Offset, per dimension, of the block that worker `rank` holds.
absl::StatusOr<std::vector<int64_t>> BlockOffsets(absl::string_view tensor,
                                                  const std::vector<int64_t>& shape,
                                                  const PartitionSpec& spec,
                                                  const Mesh& mesh, int64_t rank);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_SPEC_H_
