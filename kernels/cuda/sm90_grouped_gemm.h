// Our own Hopper grouped GEMM (ragged M): one persistent launch for all
// groups, TMA loads into a multi-stage shared-memory ring, wgmma on two
// consumer warpgroups, a producer warp, group offsets computed on the device
// from the device group sizes (no host copy). sm_90a only.
//
// This header is plain C++ (no absl, no CUDA kernels) so that the runner
// (grouped_gemm.cc) can include it; the kernel lives in sm90_grouped_gemm.cu.
#ifndef SHARDGEMM_KERNELS_CUDA_SM90_GROUPED_GEMM_H_
#define SHARDGEMM_KERNELS_CUDA_SM90_GROUPED_GEMM_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cu_dtype.h"

namespace shardgemm {
namespace cuda {

// Tile shapes the kernel is built for (rows of lhs per tile).
enum class Sm90TileM : int { k64 = 64, k128 = 128 };

struct Sm90GroupedGemmParams {
  CuDType in_dtype = CuDType::kBF16;   // lhs and rhs: kBF16 or kF16
  CuDType out_dtype = CuDType::kBF16;  // kBF16, kF16 or kF32
  CuDType bias_dtype = CuDType::kInvalid;  // any float type; ignored without bias
  const void* lhs = nullptr;       // [m, k]
  const void* rhs = nullptr;       // [g, n, k] (rhs_transposed) or [g, k, n]
  const void* bias = nullptr;      // [g, n] or null
  void* out = nullptr;             // [m, n]; rows past sum(group_sizes) are zeroed
  const int64_t* group_sizes = nullptr;  // device, [num_groups]
  int64_t m = 0, k = 0, n = 0, num_groups = 0;
  bool rhs_transposed = true;
  Sm90TileM tile_m = Sm90TileM::k128;
  int tile_n = 256;  // 256, or 128 (with tile_m 128 only): more, smaller tiles for mid-size problems
  int cluster = 1;   // 2 (with the 128x256 tile only): block pairs share the rhs tile by TMA multicast
};

// Largest number of groups the kernel takes (group offsets live in shared memory).
constexpr int64_t kSm90MaxGroups = 2048;

// Null when the kernel can run these params, else why not (static string).
const char* Sm90GroupedGemmUnsupportedReason(const Sm90GroupedGemmParams& p);

// Launches the kernel on `stream` over `num_sms` persistent blocks.
// Returns the CUDA error of the launch (cudaSuccess when enqueued); a
// tensor-map encoding failure is reported as cudaErrorInvalidValue with
// `*detail` set.
cudaError_t LaunchSm90GroupedGemm(const Sm90GroupedGemmParams& p, int num_sms,
                                  cudaStream_t stream, const char** detail);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_SM90_GROUPED_GEMM_H_
