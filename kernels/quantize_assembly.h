// A sharded MXFP8 / FP8 block-scaled grouped quantize, returned as the
// unsharded quantize (docs/quantization.md, "Through the service").
//
// Every row shard quantizes its own groups (the per-shard semantics). Group g
// of the unsharded op holds the rows of expert g on every row shard that has
// that expert, in row-shard order. Block scales run from each group's first
// row, so a shard's scales are the unsharded op's exactly when its rows of
// every group start at a block boundary of that group; the coordinator then
// copies each shard's scale blocks into the global padded layout.
#ifndef SHARDGEMM_KERNELS_QUANTIZE_ASSEMBLY_H_
#define SHARDGEMM_KERNELS_QUANTIZE_ASSEMBLY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/quantize.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

// One row shard: group_sizes entries [sizes_begin, sizes_begin + local_groups)
// are its rows of groups first_group, first_group + 1, ... of the unsharded op.
struct RowShard {
  int64_t sizes_begin = 0;
  int64_t first_group = 0;
};

// The unsharded op's groups.
struct GlobalGroups {
  std::vector<int64_t> sizes;        // [num_groups]
  std::vector<int64_t> group;        // per group_sizes entry: its group
  std::vector<int64_t> piece_start;  // per group_sizes entry: its first row within the group
};

// `shards` in row-shard order (the order of x's rows). `sizes` are validated
// (non-negative, each shard's sum within its rows).
absl::StatusOr<GlobalGroups> MakeGlobalGroups(const std::vector<int64_t>& sizes,
                                              const std::vector<RowShard>& shards,
                                              int64_t local_groups, int64_t num_groups);

// Rows a scale block spans along M: 32 for MXFP8 colwise, 128 for 1x128
// colwise and for 128x128; 1 where every scale runs along K only (rowwise
// MXFP8 and 1x128), which any split keeps.
int64_t ScaleRowBlock(ScalingMode mode, bool rowwise, bool colwise);

// OK when every shard's rows of each group start at a multiple of
// `row_block` within the group; otherwise InvalidArgument naming the first
// group_sizes entry whose rows start inside a block.
absl::Status CheckBlockAligned(const std::vector<int64_t>& sizes, const GlobalGroups& groups,
                               int64_t row_block, absl::string_view what);

// The kernels' layout for `sizes` (GetQuantizeLayout; x dtype and format do
// not change it).
absl::StatusOr<QuantizeLayout> BlockLayout(ScalingMode mode, int64_t m, int64_t k, bool rowwise,
                                           bool colwise, const std::vector<int64_t>& sizes);

// What one row shard's worker returned (tensors it was not asked for are empty).
struct ShardBlockOutputs {
  RowShard shard;
  int64_t m = 0;  // the shard's rows
  const HostTensor* scale_inv = nullptr;          // rowwise, its local padded layout
  const HostTensor* colwise_scale_inv = nullptr;  // colwise, its local padded layout
  const HostTensor* colwise_data = nullptr;       // 1x128 / 128x128: per local group [K, m_g]
};

// The unsharded op's per-group outputs: the scales in the padded layout for
// groups.sizes (flat), and for 1x128 / 128x128 the transposed colwise data
// ([m, k] bytes, per group [K, m_g] at row offset * K; MXFP8's colwise data
// follows x's rows and is not assembled here).
struct BlockOutputs {
  HostTensor scale_inv, colwise_scale_inv, colwise_data;
};

struct BlockQuantize {
  ScalingMode mode = ScalingMode::kMxfp8;
  int64_t m = 0, k = 0;  // the unsharded op's rows and columns
  bool rowwise = true, colwise = false;
  DType data_dtype = DType::kF8E4M3;
};

// Callers have checked the pieces with CheckBlockAligned.
absl::StatusOr<BlockOutputs> AssembleBlockOutputs(const BlockQuantize& q,
                                                  const std::vector<int64_t>& sizes,
                                                  int64_t local_groups, const GlobalGroups& groups,
                                                  const std::vector<ShardBlockOutputs>& shards);

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_QUANTIZE_ASSEMBLY_H_
