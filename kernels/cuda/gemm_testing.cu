#include "kernels/cuda/gemm_testing.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace shardgemm {
namespace cuda {
namespace testing {
namespace {

__device__ __forceinline__ float Ld(const void* p, int t, int64_t i) {
  switch (t) {
    case static_cast<int>(CuDType::kF32): return static_cast<const float*>(p)[i];
    case static_cast<int>(CuDType::kBF16): return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case static_cast<int>(CuDType::kF16): return __half2float(static_cast<const __half*>(p)[i]);
  }
  return 0.f;
}

__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

__global__ void FillKernel(void* p, int t, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    const float u = (static_cast<float>(h >> 40) / 16777216.f) * 2.f - 1.f;
    const float v = u * scale;
    switch (t) {
      case static_cast<int>(CuDType::kF32): static_cast<float*>(p)[i] = v; break;
      case static_cast<int>(CuDType::kBF16): static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
      case static_cast<int>(CuDType::kF16): static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    }
  }
}

__global__ void RefRowsKernel(const void* lhs, const void* rhs, bool tr, const void* bias, int bias_t, int in,
                              int64_t k, int64_t n, const int64_t* rows, const int64_t* groups, float* ref) {
  const int64_t r = blockIdx.y;
  const int64_t row = rows[r], g = groups[r];
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n; c += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float a = Ld(lhs, in, row * k + kk);
      const float b = tr ? Ld(rhs, in, (g * n + c) * k + kk) : Ld(rhs, in, (g * k + kk) * n + c);
      acc = fmaf(a, b, acc);
    }
    if (bias != nullptr) acc += Ld(bias, bias_t, g * n + c);
    ref[r * n + c] = acc;
  }
}

__global__ void RefEntriesKernel(const void* lhs, const void* rhs, int in, int64_t k, int64_t n,
                                 const int64_t* e, int64_t num, float* ref) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < num; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t rb = e[4 * i], rows = e[4 * i + 1], kk = e[4 * i + 2], nn = e[4 * i + 3];
    float acc = 0.f;
    for (int64_t r = rb; r < rb + rows; ++r) acc = fmaf(Ld(lhs, in, r * k + kk), Ld(rhs, in, r * n + nn), acc);
    ref[i] = acc;
  }
}

__global__ void GatherKernel(const void* src, int t, const int64_t* idx, int64_t num, float* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < num; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = Ld(src, t, idx[i]);
}

int Blocks(int64_t n) { return static_cast<int>(n / 256 + 1 < 8192 ? n / 256 + 1 : 8192); }

}  // namespace

cudaError_t FillRandom(void* p, CuDType t, int64_t n, uint64_t seed, float scale, cudaStream_t s) {
  FillKernel<<<Blocks(n), 256, 0, s>>>(p, static_cast<int>(t), n, seed, scale);
  return cudaGetLastError();
}

cudaError_t Poison(void* p, int64_t bytes, cudaStream_t s) { return cudaMemsetAsync(p, 0xFF, bytes, s); }

cudaError_t ReferenceRowsRaggedM(const void* lhs, const void* rhs, bool rhs_transposed, const void* bias,
                                 CuDType bias_dtype, CuDType in, int64_t k, int64_t n, const int64_t* rows,
                                 const int64_t* groups, int64_t num_rows, float* ref, cudaStream_t s) {
  if (num_rows == 0) return cudaSuccess;
  dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(num_rows));
  RefRowsKernel<<<grid, 256, 0, s>>>(lhs, rhs, rhs_transposed, bias, static_cast<int>(bias_dtype),
                                     static_cast<int>(in), k, n, rows, groups, ref);
  return cudaGetLastError();
}

cudaError_t ReferenceEntriesRaggedK(const void* lhs, const void* rhs, CuDType in, int64_t k, int64_t n,
                                    const int64_t* entries, int64_t num, float* ref, cudaStream_t s) {
  if (num == 0) return cudaSuccess;
  RefEntriesKernel<<<Blocks(num), 256, 0, s>>>(lhs, rhs, static_cast<int>(in), k, n, entries, num, ref);
  return cudaGetLastError();
}

cudaError_t GatherAsFloat(const void* src, CuDType t, const int64_t* idx, int64_t num, float* dst, cudaStream_t s) {
  if (num == 0) return cudaSuccess;
  GatherKernel<<<Blocks(num), 256, 0, s>>>(src, static_cast<int>(t), idx, num, dst);
  return cudaGetLastError();
}

}  // namespace testing
}  // namespace cuda
}  // namespace shardgemm
