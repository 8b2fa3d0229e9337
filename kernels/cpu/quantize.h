// Grouped quantization to FP8: the CPU reference. The CUDA kernels
// (kernels/cuda/quantize.h) take the same arguments and produce the same
// bytes; both use the conversions of kernels/fp8.h.
//
// x [M, K] (row-major; BF16, F16 or F32) has its rows grouped contiguously by
// group_sizes[G] (host int64; sum <= M; rows past the sum are padding). Group
// g has m_g = group_sizes[g] rows starting at row off_g = sum_{h<g} m_h.
//
// Scaling modes (docs/quantization.md has the full definitions):
//   kCurrent      per-group amax -> scale = fp8_max / amax (ScaleFromAmax)
//   kDelayed      per-group scale given; amax returned
//   kMxfp8        32-element blocks along K (rowwise) / along M within each
//                 group (colwise), E8M0 scales (OCP MX v1.0 by default)
//   kBlock1x128   1x128 blocks along K (rowwise) / 128x1 along M within each
//                 group (colwise), FP32 scales: activations
//   kBlock128x128 128x128 blocks, rows blocked from each group's first row,
//                 FP32 scales: weights ([G, N, K] as [G*N, K], m_g = N)
//
// Output layouts (all row-major; "per group" blocks are concatenated in group
// order, block g starting at the offset QuantizeLayout gives):
//   rowwise_data   [M, K] uint8 FP8, like x. Padding rows are 0.
//   colwise_data   kMxfp8: [M, K] like x (scales run along M instead).
//                  other modes: per group the transpose [K, m_g], at element
//                  offset off_g * K (what the ragged-K wgrad GEMM and
//                  cuBLASLt's TN layout want). The tail [sum*K, M*K) is 0.
//   scale_inv      (float unless noted; padding entries are 0)
//     kCurrent/kDelayed: rowwise and colwise float[G] (the same values),
//       1 / scale.
//     kMxfp8 (uint8 E8M0):
//       rowwise per group [roundup(m_g, 128), roundup(K/32, 4)]
//       colwise per group [roundup(ceil(m_g/32), 4), roundup(K, 128)]
//       i.e. padded to cuBLASLt's 128x4 tiles (rowwise) and 4x128 (colwise),
//       not swizzled (Transformer Engine's "compact, padded" layout).
//     kBlock1x128 (GEMM-ready, as cuBLASLt's VEC128_32F and TE's
//       Float8BlockScaling take them: the scaled dimension M is innermost):
//       rowwise per group [ceil(K/128), roundup(m_g, 4)]
//       colwise per group [ceil(m_g/128), roundup(K, 4)]
//     kBlock128x128:
//       rowwise per group [ceil(m_g/128), roundup(ceil(K/128), 4)]
//       colwise per group [ceil(K/128), roundup(ceil(m_g/128), 4)]
//   amax           float[G]: max |x| over the group's rows, NaN-propagating.
//                  Required for kCurrent/kDelayed, optional otherwise.
#ifndef SHARDGEMM_KERNELS_CPU_QUANTIZE_H_
#define SHARDGEMM_KERNELS_CPU_QUANTIZE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"

namespace shardgemm {

enum class ScalingMode : int {
  kCurrent = 0,
  kDelayed = 1,
  kMxfp8 = 2,
  kBlock1x128 = 3,
  kBlock128x128 = 4,
};
const char* ScalingModeName(ScalingMode mode);  // "current", "delayed", "mxfp8", ...

struct GroupedQuantizeArgs {
  // Input.
  const void* x = nullptr;  // [m, k]
  DType x_dtype = DType::kBF16;  // kBF16, kF16 or kF32
  int64_t m = 0;
  int64_t k = 0;
  const int64_t* group_sizes = nullptr;  // host, [num_groups]
  int64_t num_groups = 0;

  ScalingMode mode = ScalingMode::kCurrent;
  Fp8Format format = Fp8Format::kE4M3;
  bool rowwise = true;
  bool colwise = false;
  // kDelayed: the per-group scales, [num_groups] (host memory for the CPU,
  // device memory for CUDA).
  const float* scale = nullptr;
  // kCurrent / block modes: round scales down to powers of two.
  bool pow2_scales = false;
  MxScaleRecipe mx_recipe = MxScaleRecipe::kOcp;

  // Outputs, allocated by the caller with the sizes QuantizeLayout gives.
  uint8_t* rowwise_data = nullptr;
  uint8_t* colwise_data = nullptr;
  void* rowwise_scale_inv = nullptr;  // float*, or uint8_t* (E8M0) for kMxfp8
  void* colwise_scale_inv = nullptr;
  float* amax = nullptr;  // [num_groups]
};

// Sizes (in elements) and per-group offsets of the outputs.
struct QuantizeLayout {
  int64_t data_elems = 0;  // rowwise and colwise data: m * k bytes each
  int64_t rowwise_scale_elems = 0;
  int64_t colwise_scale_elems = 0;
  int scale_bytes = 4;  // 1 for kMxfp8 (E8M0), else 4 (float)
  std::vector<int64_t> row_offset;            // [G+1] first row of each group
  std::vector<int64_t> rowwise_scale_offset;  // [G+1] element offsets
  std::vector<int64_t> colwise_scale_offset;  // [G+1]
  // Per group g: rowwise scale block [rowwise_scale_rows(g), rowwise_scale_cols(g)], etc.
  std::vector<int64_t> rowwise_scale_rows, rowwise_scale_cols;
  std::vector<int64_t> colwise_scale_rows, colwise_scale_cols;
};

// Higher-rank inputs: x with shape `dims` (row-major) is quantized as the
// matrix [prod(dims[:flatten_axis]), prod(dims[flatten_axis:])]; the group
// sizes count rows of that matrix. flatten_axis may be negative (counted from
// the end, as in Transformer Engine: -1 keeps the last dimension as K).
// Returns {m, k}; InvalidArgument names `flatten_axis` or `dims`.
absl::StatusOr<std::pair<int64_t, int64_t>> FlattenToMatrix(const std::vector<int64_t>& dims, int flatten_axis);

// Validates the shape fields (x_dtype, m, k, group sizes, mode constraints)
// and computes the layout. Output pointers are not looked at.
absl::StatusOr<QuantizeLayout> GetQuantizeLayout(const GroupedQuantizeArgs& args);

// Checks every field, pointers included; InvalidArgument names the field.
absl::Status ValidateGroupedQuantizeArgs(const GroupedQuantizeArgs& args);

namespace cpu {

// The reference grouped quantize (see the layouts above).
absl::Status GroupedQuantize(const GroupedQuantizeArgs& args);

}  // namespace cpu

struct GroupedDequantizeArgs {
  // What GroupedQuantize wrote: the rowwise or the colwise data with its scales.
  const uint8_t* data = nullptr;
  const void* scale_inv = nullptr;
  bool colwise = false;  // data/scale_inv are the colwise outputs
  ScalingMode mode = ScalingMode::kCurrent;
  Fp8Format format = Fp8Format::kE4M3;
  int64_t m = 0;
  int64_t k = 0;
  const int64_t* group_sizes = nullptr;
  int64_t num_groups = 0;
  // Output [m, k] row-major (colwise data is transposed back), padding rows 0.
  void* out = nullptr;
  DType out_dtype = DType::kF32;  // kF32, kBF16 or kF16
};

namespace cpu {

// out = fp8_to_float(q) * scale_inv (tensor / FP32 block scales) or
// fp8_to_float(q) * 2^(e-127) (E8M0; NaN scale -> NaN), rounded to out_dtype.
absl::Status GroupedDequantize(const GroupedDequantizeArgs& args);

// Reference for the FP8 grouped GEMM (ragged M, rhs transposed): dequantizes
// lhs ([M, K], rowwise) and rhs ([G*N, K] quantized with group sizes all N,
// rowwise) to FP32 and returns out [M, N] in FP32,
// out[rows of g] = lhs[rows of g] @ rhs[g]^T; padding rows are 0.
// lhs.group_sizes defines the groups; rhs's must be num_groups x N.
absl::StatusOr<std::vector<float>> DequantizeGroupedGemmReference(const GroupedDequantizeArgs& lhs,
                                                                  const GroupedDequantizeArgs& rhs,
                                                                  int64_t n);

}  // namespace cpu
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CPU_QUANTIZE_H_
