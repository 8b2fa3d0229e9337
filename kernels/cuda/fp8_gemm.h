// FP8 grouped GEMM (ragged M, rhs transposed) over grouped quantize's outputs,
// through cuBLASLt FP8 matmul, one call per non-empty group:
//   out[rows of g] = dequant(lhs)[rows of g] @ dequant(rhs[g])^T
// lhs: the rowwise output of GroupedQuantize on x [M, K] with group_sizes.
// rhs: the rowwise output of GroupedQuantize on w [G, N, K] viewed as
//      [G*N, K] with every group size N (the transposed-rhs layout).
// On Hopper cuBLASLt FP8 takes only the TN layout: in its column-major terms
// A = rhs[g] (K x N, transposed), B = lhs[g] (K x m_g), D = out[g]^T (N x m_g).
//
// Scaling modes (lhs_mode, rhs_mode):
//   tensor (kCurrent / kDelayed, either side): per-group scale_inv pointers as
//     cuBLASLt's A/B scale pointers (SCALAR_32F);
//   (kBlock1x128, kBlock128x128): cuBLASLt's VEC128_32F (B) and
//     BLK128x128_32F (A) block scales;
//   kMxfp8: UnimplementedError (cuBLASLt's VEC32_UE8M0 needs Blackwell).
// Tensor x tensor or block_1x128 x block_128x128 scales with
// device_group_sizes given: our persistent sm90
// FP8 kernel (sm90_fp8_grouped_gemm.h), one launch for all groups, when it
// can run the params on this device (ChooseSm90Fp8 in heuristics_sm90.h picks
// its tile and promotion); else the cuBLASLt loop. stats->ours says which.
// Anything cuBLASLt has no kernel for is an UnimplementedError naming the mode.
// Scales are copied to 256-byte-aligned slots (stream-ordered scratch) before
// the calls; a group whose row count cuBLASLt refuses runs padded to a
// multiple of 16 rows in scratch. Enqueued on `stream`, no synchronization.
#ifndef SHARDGEMM_KERNELS_CUDA_FP8_GEMM_H_
#define SHARDGEMM_KERNELS_CUDA_FP8_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/quantize.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda {

// How the groups ran (for tests and benchmarks).
struct Fp8GemmStats {
  int64_t direct_groups = 0;  // one cuBLASLt call on the group's own rows
  int64_t padded_groups = 0;  // cuBLASLt refused m_g; ran padded to a multiple of 16 in scratch
  bool ours = false;          // our sm90 FP8 kernel ran (one launch; no cuBLASLt calls)
  int ours_tile_m = 0, ours_tile_n = 0;  // its tile
  bool ours_promote = false;             // its FP32 promotion per 128-K block
  bool ours_tma_store = false;           // its TMA-store epilogue
  bool ours_block_scaling = false;       // it ran 1x128 x 128x128 block scales
};

struct Fp8GroupedGemmArgs {
  const uint8_t* lhs = nullptr;  // [m, k] FP8, device
  const void* lhs_scale_inv = nullptr;
  ScalingMode lhs_mode = ScalingMode::kCurrent;
  Fp8Format lhs_format = Fp8Format::kE4M3;
  const uint8_t* rhs = nullptr;  // [num_groups * n, k] FP8, device
  const void* rhs_scale_inv = nullptr;
  ScalingMode rhs_mode = ScalingMode::kCurrent;
  Fp8Format rhs_format = Fp8Format::kE4M3;
  int64_t m = 0, n = 0, k = 0;
  const int64_t* group_sizes = nullptr;  // host, [num_groups] (may be null when our kernel runs)
  int64_t num_groups = 0;
  // Optional device copy of group_sizes: lets tensor x tensor scaling run our
  // sm90 kernel, which reads the sizes (and the [num_groups] float scales) on
  // the device. Null: always the cuBLASLt loop.
  const int64_t* device_group_sizes = nullptr;
  void* out = nullptr;  // [m, n] device; padding rows are zeroed
  DType out_dtype = DType::kBF16;  // kBF16, kF16 or kF32
  bool fast_accum = false;  // CUBLASLT_MATMUL_DESC_FAST_ACCUM
  void* workspace = nullptr;  // cuBLASLt workspace (32 MiB is plenty)
  size_t workspace_bytes = 0;
  Fp8GemmStats* stats = nullptr;  // optional
};

absl::Status Fp8GroupedGemm(const Fp8GroupedGemmArgs& args, cublasLtHandle_t handle, cudaStream_t stream);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_FP8_GEMM_H_
