// Between grouped quantize's per-group scale layouts (kernels/cpu/quantize.h:
// padded per group, the scaled dimension innermost for 1x128, as cuBLASLt
// takes them) and the FP8 GEMM's unpadded row-major layouts (the service's
// contract, GroupedGemmRequest.lhs_scale_inv / rhs_scale_inv):
//   per-group tensor scaling: float[G] both ways (no change);
//   kBlock1x128 rowwise (activations [M, K]): per group [ceil(K/128),
//     roundup(m_g, 4)]  <->  [M, K/128];
//   kBlock128x128 rowwise (weights [G, N, K] as [G*N, K], m_g = N): per group
//     [ceil(N/128), roundup(ceil(K/128), 4)]  <->  [G, N/128, K/128];
//   kMxfp8 rowwise (E8M0): per group [roundup(m_g, 128), roundup(K/32, 4)]
//     <->  [M, K/32].
// Rows past sum(group_sizes) have scale 0 in the GEMM layout.
#ifndef SHARDGEMM_KERNELS_GEMM_SCALE_LAYOUT_H_
#define SHARDGEMM_KERNELS_GEMM_SCALE_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/quantize.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

// The quantize's rowwise scales of x [m, k] grouped by `group_sizes`, in
// `mode`, laid out as the FP8 GEMM takes them. For kBlock128x128 the result
// is [G, m_g/128, k/128] (every group of the same size, a multiple of 128).
// INVALID_ARGUMENT when the sizes do not fit the mode or the scales' length.
absl::StatusOr<HostTensor> GemmScalesFromQuantize(ScalingMode mode, const HostTensor& quantize_scales, int64_t m,
                                                  int64_t k, const std::vector<int64_t>& group_sizes);

// The reverse: the GEMM layout's scales in the quantize's padded per-group
// layout (what kernels/cuda's Fp8GroupedGemm takes). Padding entries are 0.
absl::StatusOr<HostTensor> QuantizeScalesFromGemm(ScalingMode mode, const HostTensor& gemm_scales, int64_t m,
                                                  int64_t k, const std::vector<int64_t>& group_sizes);

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_GEMM_SCALE_LAYOUT_H_
