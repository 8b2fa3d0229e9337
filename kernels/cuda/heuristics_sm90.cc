// Strategy choice on sm_90. The rules, in order, with the reason for each
// (figures: H200, BF16, docs/performance/gpu_gemm.md and
// /work/shared/PERFORMANCE.md):
//
// Ragged M
//  1. Without host group sizes the cuBLAS routes would need a blocking
//     device-to-host copy of the sizes, so the sm90 kernel (which reads the
//     sizes on the device) is taken whenever it can run the shape.
//  2. When one group alone fills the GPU (at least ~1 wave of 128x256 output
//     tiles per group), one cuBLASLt call per group is best: cuBLAS has a
//     tuned kernel for every big shape, and the side streams overlap each
//     call's tail with the next (mixtral/deepseek presets: 700-830 TFLOP/s).
//  3. Otherwise a per-group loop leaves most SMs idle (qwen3 G16 m512: 24
//     tiles a group for 132 SMs) and pays a launch per group, so one launch
//     over all groups wins: our sm90 kernel when it can run the shape.
//  4. Failing that: equal groups → one strided-batched cuBLASLt call; ragged
//     groups → cublasGemmGroupedBatchedEx, the one cuBLAS call that takes
//     groups of different sizes.
// Ragged K (wgrad: out[g] is K x N, the group is the contracting dim)
//  5. Equal groups → strided-batched cuBLASLt; else one call per group.
#include "kernels/cuda/heuristics_sm90.h"

namespace shardgemm {
namespace cuda {

absl::string_view StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kAuto: return "auto";
    case Strategy::kLtLoop: return "lt_loop";
    case Strategy::kLtLoopGraph: return "lt_loop_graph";
    case Strategy::kLtBatched: return "lt_batched";
    case Strategy::kGroupedBatched: return "grouped_batched";
    case Strategy::kSm90: return "sm90";
  }
  return "?";
}

namespace {
bool Eligible(const ShapeInfo& s, Strategy st) { return (s.eligible >> static_cast<int>(st)) & 1u; }
}  // namespace

Choice ChooseSm90(const ShapeInfo& s) {
  Choice c;
  const int64_t g = s.num_groups > 0 ? s.num_groups : 1;
  const int64_t avg_rows = s.m / g;  // padding rows included: an estimate
  if (s.ragged_k) {
    c.strategy = (s.equal_groups && Eligible(s, Strategy::kLtBatched)) ? Strategy::kLtBatched
                                                                        : Strategy::kLtLoop;
    return c;
  }
  c.sm90_tile_m = avg_rows <= 64 ? 64 : 128;
  const bool sm90 = Eligible(s, Strategy::kSm90);
  if (!s.has_host_sizes && sm90) {  // rule 1
    c.strategy = Strategy::kSm90;
    return c;
  }
  const int64_t rows = s.has_host_sizes ? s.max_group : avg_rows;
  const int64_t tiles_per_group = ((rows + 127) / 128) * ((s.n + 255) / 256);
  if (tiles_per_group >= s.num_sms && Eligible(s, Strategy::kLtLoop)) {  // rule 2
    c.strategy = Strategy::kLtLoop;
    return c;
  }
  if (sm90) {  // rule 3
    c.strategy = Strategy::kSm90;
    return c;
  }
  if (s.equal_groups && Eligible(s, Strategy::kLtBatched)) {  // rule 4
    c.strategy = Strategy::kLtBatched;
  } else if (Eligible(s, Strategy::kGroupedBatched) && avg_rows < 1024) {
    c.strategy = Strategy::kGroupedBatched;
  } else {
    c.strategy = Strategy::kLtLoop;
  }
  return c;
}

}  // namespace cuda
}  // namespace shardgemm
