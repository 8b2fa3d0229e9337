#include "server/output_assembly.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::StatusOr<HostTensor> AssembleBlocks(const planner::Mesh& mesh, DType dtype, const std::vector<int64_t>& shape,
                                          const planner::PartitionSpec& spec,
                                          const std::function<absl::StatusOr<HostTensor>(int rank)>& block) {
  auto out = ZerosTensor(dtype, shape);
  if (!out.ok()) return out.status();
  auto local_shape = planner::LocalShape("out", shape, spec, mesh);
  if (!local_shape.ok()) return local_shape.status();
  const int num_workers = static_cast<int>(planner::NumWorkers(mesh));
  std::vector<std::vector<int64_t>> seen;
  for (int r = 0; r < num_workers; ++r) {
    auto offsets = planner::BlockOffsets("out", shape, spec, mesh, r);
    if (!offsets.ok()) return offsets.status();
    if (std::find(seen.begin(), seen.end(), *offsets) != seen.end()) continue;
    seen.push_back(*offsets);
    auto b = block(r);
    if (!b.ok()) return b.status();
    if (b->shape != *local_shape || b->dtype != dtype) {
      return absl::InternalError(absl::StrCat("worker ", r, " returned a ", DTypeName(b->dtype), " ",
                                              ShapeToString(b->shape), " block, expected ", DTypeName(dtype), " ",
                                              ShapeToString(*local_shape)));
    }
    InsertBlock(*b, *offsets, &*out);
  }
  return out;
}

}  // namespace shardgemm
