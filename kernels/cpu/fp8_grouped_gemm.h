// CPU reference FP8 grouped GEMM (MoE expert layers): ragged M (forward /
// dgrad) and ragged K (wgrad) with FP8 operands and their scales.
//
// Numerics ("dequantize, FP32 accumulate"): every FP8 element is dequantized
// to FP32 with one multiply, fp8_to_float(byte) * scale_inv (an E8M0 scale is
// 2^(code-127), code 0xFF is NaN; a NaN byte or scale gives NaN, as
// DequantizeValue in kernels/fp8.h), then cpu::GroupedGemmRaggedM /
// cpu::GroupedGemmRaggedK run on the FP32 tensors. Accumulation order,
// determinism and bias handling are therefore exactly theirs (see
// kernels/cpu/grouped_gemm.h): a shard of the op (a subset of groups, rows or
// columns, with the matching scale slices) gives bit-identical values.
//
// Scale layouts (row-major, unpadded: the service's contract). Group g has
// rows off_g .. off_g + m_g - 1, off_g = sum_{h<g} group_sizes[h].
//   Ragged M (lhs [M, K]; rhs [G, K, N] or, rhs_transposed, [G, N, K]):
//     tensor (kCurrent / kDelayed, either mix): lhs float [G], rows of g use
//       [g]; rhs float [G], expert g uses [g].
//     MXFP8 (kMxfp8 x kMxfp8, uint8 E8M0, 32-element blocks along K):
//       lhs [M, K/32], (r, c) uses [r][c/32]; rhs [G, K/32, N], (g, kk, n)
//       uses [g][kk/32][n]; transposed [G, N, K/32], (g, n, kk) uses
//       [g][n][kk/32]. K % 32 == 0.
//     block (kBlock1x128 x kBlock128x128, float): lhs [M, K/128], (r, c) uses
//       [r][c/128]; rhs [G, K/128, N/128] or transposed [G, N/128, K/128].
//       K % 128 == 0 and N % 128 == 0.
//   Ragged K (lhs [M, K], rhs [M, N], out [G, K, N]):
//     tensor: lhs and rhs float [G], rows of g use [g].
//     MXFP8 (kMxfp8 x kMxfp8): lhs [M/32, K], (r, c) uses [r/32][c]; rhs
//       [M/32, N]. M % 32 == 0. The blocks are global rows, not restarted at
//       each group (a block may span two groups).
//     block (kBlock1x128 x kBlock1x128: 128x1 blocks along rows): lhs
//       [M/128, K], rhs [M/128, N]. M % 128 == 0.
// Rows past sum(group_sizes) are never read, nor are their scales: ragged M
// writes zero output rows for them, ragged K ignores them.
#ifndef SHARDGEMM_KERNELS_CPU_FP8_GROUPED_GEMM_H_
#define SHARDGEMM_KERNELS_CPU_FP8_GROUPED_GEMM_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/quantize.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cpu {

struct Fp8GroupedGemmArgs {
  bool ragged_k = false;
  DType lhs_dtype = DType::kInvalid;  // kF8E4M3 or kF8E5M2 (not both kF8E5M2)
  DType rhs_dtype = DType::kInvalid;
  const uint8_t* lhs = nullptr;  // ragged M: [M, K]; ragged K: [M, K]
  const uint8_t* rhs = nullptr;  // ragged M: [G, K, N] or [G, N, K] (rhs_transposed); ragged K: [M, N]
  ScalingMode lhs_mode = ScalingMode::kCurrent;
  ScalingMode rhs_mode = ScalingMode::kCurrent;
  const void* lhs_scale_inv = nullptr;  // float, or uint8 E8M0 codes for kMxfp8
  const void* rhs_scale_inv = nullptr;
  int64_t m = 0, k = 0, n = 0, num_groups = 0;
  const int64_t* group_sizes = nullptr;  // host, num_groups entries, sum <= m
  bool rhs_transposed = false;  // ragged M only
  DType bias_dtype = DType::kInvalid;  // kInvalid: no bias
  const void* bias = nullptr;   // ragged M only: [G, N]
  DType out_dtype = DType::kInvalid;  // kF32, kBF16, kF16
  void* out = nullptr;  // ragged M: [M, N] (rows past sum(group_sizes) zero); ragged K: [G, K, N]
};
// The scale_inv shape each operand must have for these args' modes and dims.
// Empty when the mode pair is not a recipe (see ValidateFp8GroupedGemmArgs).
std::vector<int64_t> Fp8LhsScaleShape(const Fp8GroupedGemmArgs& args);
std::vector<int64_t> Fp8RhsScaleShape(const Fp8GroupedGemmArgs& args);
// INVALID_ARGUMENT naming the field (dtypes, modes, K/N/M divisibility, null pointers with nonzero sizes, negative sizes, sum(group_sizes) > m, bias with ragged K, byte-size overflow); UNIMPLEMENTED for a mode pair that is not one of the recipes below.
// (The recipes are the scale layouts listed at the top of this file.)
absl::Status ValidateFp8GroupedGemmArgs(const Fp8GroupedGemmArgs& args);
// Validates, dequantizes both operands to FP32 (one FP32 copy each) and runs
// the FP32 grouped GEMM. num_threads <= 0: hardware concurrency.
absl::Status Fp8GroupedGemm(const Fp8GroupedGemmArgs& args, int num_threads = 0);

}  // namespace cpu
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CPU_FP8_GROUPED_GEMM_H_
