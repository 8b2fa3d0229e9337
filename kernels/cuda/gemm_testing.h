// Test and benchmark helpers on the device: random fill, a naive FP32
// reference for sampled rows / entries, and a gather to FP32. Slow and
// simple on purpose: the reference that the fast paths are checked against.
#ifndef SHARDGEMM_KERNELS_CUDA_GEMM_TESTING_H_
#define SHARDGEMM_KERNELS_CUDA_GEMM_TESTING_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cu_dtype.h"

namespace shardgemm {
namespace cuda {
namespace testing {

// p[i] = uniform in [-scale, scale), from a hash of (seed, i).
cudaError_t FillRandom(void* p, CuDType t, int64_t n, uint64_t seed, float scale, cudaStream_t s);
// Fills bytes with 0xFF (NaN in f32/bf16/f16): catches unwritten outputs.
cudaError_t Poison(void* p, int64_t bytes, cudaStream_t s);

// Ragged M: ref[r, c] = sum_k lhs[rows[r], k] * rhs[groups[r]](k, c) (+ bias[groups[r], c])
// for r < num_rows and every c < n. rows/groups are device arrays.
cudaError_t ReferenceRowsRaggedM(const void* lhs, const void* rhs, bool rhs_transposed, const void* bias,
                                 CuDType bias_dtype, CuDType in, int64_t k, int64_t n, const int64_t* rows,
                                 const int64_t* groups, int64_t num_rows, float* ref, cudaStream_t s);
// Ragged K: entries[4i..4i+3] = (row_begin, rows, kk, nn);
// ref[i] = sum_{r in group} lhs[r, kk] * rhs[r, nn]. lhs [*, k], rhs [*, n].
cudaError_t ReferenceEntriesRaggedK(const void* lhs, const void* rhs, CuDType in, int64_t k, int64_t n,
                                    const int64_t* entries, int64_t num, float* ref, cudaStream_t s);
// dst[i] = float(src[idx[i]]).
cudaError_t GatherAsFloat(const void* src, CuDType t, const int64_t* idx, int64_t num, float* dst, cudaStream_t s);

}  // namespace testing
}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_GEMM_TESTING_H_
