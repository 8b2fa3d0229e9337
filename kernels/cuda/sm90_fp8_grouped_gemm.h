// Our own Hopper FP8 grouped GEMM (ragged M, per-group tensor scales): one
// persistent launch for all groups, derived from the BF16 kernel
// (sm90_grouped_gemm.h): TMA loads into a multi-stage shared-memory ring
// (128-byte swizzle, BK = 128 FP8 = one swizzle row), wgmma m64nNk32 on two
// consumer warpgroups, a producer warp, group offsets computed on the device
// from the device group sizes (no host copy). sm_90a only.
//
//   out[rows of g] = (lhs[rows of g] @ rhs[g]^T) * lhs_scale_inv[g] * rhs_scale_inv[g]
// or, with block_scaling, 1x128 (lhs) x 128x128 (rhs) block scales (below).
//
// lhs [m, k] FP8, rhs [g, n, k] FP8 (K-major: FP8 wgmma takes K-major A and B
// only), scales device float [g]. Rows past sum(group_sizes) are zeroed.
//
// Accumulation: with `promote` (the default) each 128-wide K block is
// accumulated by the tensor cores in a fresh accumulator and then added into
// FP32 registers, as cuBLASLt (without FAST_ACCUM) and CUTLASS's non-fast-accum
// FP8 kernels do: the tensor cores' FP8 accumulator keeps fewer bits than
// FP32, which over a long K adds up. Without it (FAST_ACCUM), the tensor cores
// accumulate all of K; only the 128x256 tile takes that.
//
// This header is plain C++ (no absl, no CUDA kernels) so that fp8_gemm.cc can
// include it; the kernel lives in sm90_fp8_grouped_gemm.cu.
#ifndef SHARDGEMM_KERNELS_CUDA_SM90_FP8_GROUPED_GEMM_H_
#define SHARDGEMM_KERNELS_CUDA_SM90_FP8_GROUPED_GEMM_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cu_dtype.h"

namespace shardgemm {
namespace cuda {

// The values are shardgemm::Fp8Format's (kernels/fp8.h).
enum class Sm90Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

struct Sm90Fp8GroupedGemmParams {
  Sm90Fp8Format lhs_format = Sm90Fp8Format::kE4M3;
  Sm90Fp8Format rhs_format = Sm90Fp8Format::kE4M3;  // E5M2 x E5M2 is refused
  CuDType out_dtype = CuDType::kBF16;               // kBF16, kF16 or kF32
  const void* lhs = nullptr;                        // [m, k] FP8
  const void* rhs = nullptr;                        // [g, n, k] FP8
  const float* lhs_scale_inv = nullptr;             // device, [num_groups]
  const float* rhs_scale_inv = nullptr;             // device, [num_groups]
  void* out = nullptr;                              // [m, n]; rows past sum(group_sizes) are zeroed
  const int64_t* group_sizes = nullptr;             // device, [num_groups]
  int64_t m = 0, k = 0, n = 0, num_groups = 0;
  // Tile (rows x columns of out per block): 128x256, 128x192, 128x128 or 64x256.
  int tile_m = 128, tile_n = 128;
  bool promote = true;  // FP32 accumulation per 128-K block; false (fast accumulation) with 128x256 only
  // Epilogue by TMA store (128x256 and 128x192 tiles): each consumer stages
  // its scaled 16-bit sub-tile in shared memory and leaves it to the copy
  // engine, going on with the next tile at once; the staging area costs ring
  // stages. Applies where the output is bf16 / f16 with n % 8 == 0 and to
  // sub-tiles whose rows are all the group's; elsewhere the direct stores.
  bool tma_store = true;
  // Block scaling instead of per-group scales (DeepGEMM's recipe): lhs 1x128
  // and rhs 128x128 FP32 scale_inv blocks in GroupedQuantize's layouts, and
  // the FP32 accumulators promoted per 128-K block with each block's scales:
  //   out[r, c] = sum_kb (lhs[r, kb] . rhs[g][c, kb]) * ls[r, kb] * rs[g][c / 128, kb]
  // lhs_scale_inv: per group g (in order) a [ceil(k/128)][roundup(rows_g, 4)]
  //   block (row r's scale of K block kb at kb * roundup(rows_g, 4) + r);
  // rhs_scale_inv: per group a [ceil(n/128)][roundup(ceil(k/128), 4)] block.
  // Tiles 128x256, 128x128 or 64x256; promote must be set.
  bool block_scaling = false;
};

// Largest number of groups the kernel takes (group offsets live in shared memory).
constexpr int kSm90Fp8MaxGroups = 1024;

// Null when the kernel can run these params, else why not (static string).
const char* Sm90Fp8GroupedGemmUnsupportedReason(const Sm90Fp8GroupedGemmParams& p);

// Launches the kernel on `stream` over `num_sms` persistent blocks. Returns
// the CUDA error of the launch (cudaSuccess when enqueued); unsupported
// params or a tensor-map encoding failure are cudaErrorInvalidValue with
// `*detail` set. The caller makes sure the device is sm_90.
cudaError_t LaunchSm90Fp8GroupedGemm(const Sm90Fp8GroupedGemmParams& p, int num_sms, cudaStream_t stream,
                                     const char** detail);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_SM90_FP8_GROUPED_GEMM_H_
