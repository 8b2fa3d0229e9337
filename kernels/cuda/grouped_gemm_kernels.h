// Small helper kernels of the grouped-GEMM runner (plain C++ header).
#ifndef SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_KERNELS_H_
#define SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cu_dtype.h"

namespace shardgemm {
namespace cuda {

// out[rows of g, :] += bias[g, :] for a ragged-M output [m, n]; group sizes
// read on the device. Rows past the groups are left alone.
constexpr int64_t kBiasAddMaxGroups = 6000;  // 48 KB of shared memory
cudaError_t LaunchBiasAddRaggedM(void* out, CuDType out_dtype, const void* bias, CuDType bias_dtype,
                                 const int64_t* group_sizes, int64_t num_groups, int64_t m, int64_t n,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_KERNELS_H_
