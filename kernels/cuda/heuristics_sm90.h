// Which grouped-GEMM strategy to run on a Hopper GPU (sm_90), per shape.
// Kept apart from the kernels: a small pure function of the shape, cached by
// the runner per shape. heuristics_sm90.cc explains each rule and the
// measurements behind it (docs/performance/gpu_gemm.md).
#ifndef SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_
#define SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace shardgemm {
namespace cuda {

enum class Strategy : int {
  kAuto = 0,
  kLtLoop = 1,          // one cuBLASLt matmul per group, spread over side streams
  kLtLoopGraph = 2,     // the same, captured once in a CUDA graph and replayed
  kLtBatched = 3,       // one strided-batched cuBLASLt matmul (all groups equal)
  kGroupedBatched = 4,  // cublasGemmGroupedBatchedEx, one call
  kSm90 = 5,            // our persistent TMA + wgmma kernel (ragged M only)
};
constexpr int kNumStrategies = 6;
absl::string_view StrategyName(Strategy s);  // "lt_loop", ...

// What the heuristic looks at.
struct ShapeInfo {
  bool ragged_k = false;
  int64_t num_groups = 0;
  int64_t m = 0, k = 0, n = 0;   // m = rows of lhs (padding included)
  bool rhs_transposed = false;
  bool has_host_sizes = false;
  bool equal_groups = false;     // host sizes known and all equal
  int64_t max_group = 0;         // host sizes known: largest group
  int num_sms = 132;
  // Which strategies can run this shape (bit i = Strategy i).
  unsigned eligible = 0;
};

struct Choice {
  Strategy strategy = Strategy::kLtLoop;
  int sm90_tile_m = 128;  // 64 or 128 when strategy == kSm90
  int sm90_tile_n = 256;  // 256, or 128 with tile_m 128
  int sm90_cluster = 1;   // 2: block pairs share rhs tiles (128x256 tiles only)
  int lt_streams = 0;     // kLtLoop: streams to spread the groups over (0: all side streams)
};

Choice ChooseSm90(const ShapeInfo& s);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_
