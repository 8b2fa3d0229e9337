// Element-type codes as the .cu files see them. cuda.bzl's nvcc genrule sees
// only this package's headers, so the .cu files cannot include
// kernels/dtype.h; the values are shardgemm::DType's (grouped_gemm.cc checks
// that with static_asserts) and callers convert with ToCu().
#ifndef SHARDGEMM_KERNELS_CUDA_CU_DTYPE_H_
#define SHARDGEMM_KERNELS_CUDA_CU_DTYPE_H_

namespace shardgemm {
namespace cuda {

enum class CuDType : int { kInvalid = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

template <typename T>
constexpr CuDType ToCu(T dtype) {
  return static_cast<CuDType>(static_cast<int>(dtype));
}

inline int CuDTypeSize(CuDType t) { return t == CuDType::kF32 ? 4 : (t == CuDType::kInvalid ? 0 : 2); }

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_CU_DTYPE_H_
