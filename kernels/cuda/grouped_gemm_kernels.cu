#include "kernels/cuda/grouped_gemm_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace shardgemm {
namespace cuda {
namespace {

__device__ __forceinline__ float Load(const void* p, int dt, int64_t i) {
  switch (dt) {
    case static_cast<int>(CuDType::kF32): return static_cast<const float*>(p)[i];
    case static_cast<int>(CuDType::kBF16): return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case static_cast<int>(CuDType::kF16): return __half2float(static_cast<const __half*>(p)[i]);
  }
  return 0.f;
}
__device__ __forceinline__ void Store(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case static_cast<int>(CuDType::kF32): static_cast<float*>(p)[i] = v; break;
    case static_cast<int>(CuDType::kBF16): static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case static_cast<int>(CuDType::kF16): static_cast<__half*>(p)[i] = __float2half_rn(v); break;
  }
}

// Each block: serial prefix of the sizes into shared memory (a rare path:
// only when cuBLAS cannot fuse the bias), then a grid-stride walk over rows.
__global__ void BiasAddKernel(void* out, int out_dt, const void* bias, int bias_dt, const int64_t* sizes, int g,
                              int64_t m, int64_t n) {
  extern __shared__ int64_t starts[];  // [g + 1]
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int i = 0; i < g; ++i) {
      starts[i] = run;
      int64_t s = sizes[i];
      run += s < 0 ? 0 : s;
    }
    starts[g] = run;
  }
  __syncthreads();
  const int64_t rows = starts[g] < m ? starts[g] : m;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int lo = 0, hi = g - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) >> 1;
      if (starts[mid] <= r) lo = mid; else hi = mid - 1;
    }
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const int64_t i = r * n + c;
      Store(out, out_dt, i, Load(out, out_dt, i) + Load(bias, bias_dt, static_cast<int64_t>(lo) * n + c));
    }
  }
}

}  // namespace

cudaError_t LaunchBiasAddRaggedM(void* out, CuDType out_dtype, const void* bias, CuDType bias_dtype,
                                 const int64_t* group_sizes, int64_t num_groups, int64_t m, int64_t n,
                                 cudaStream_t stream) {
  if (num_groups < 1 || num_groups > kBiasAddMaxGroups) return cudaErrorInvalidValue;
  const int blocks = static_cast<int>(m < 4096 ? (m > 0 ? m : 1) : 4096);
  BiasAddKernel<<<blocks, 256, (num_groups + 1) * sizeof(int64_t), stream>>>(
      out, static_cast<int>(out_dtype), bias, static_cast<int>(bias_dtype), group_sizes,
      static_cast<int>(num_groups), m, n);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace shardgemm
