// A CUDA runtime result as an absl::Status, for every host library that calls
// the runtime (GEMM, quantize backend, NCCL collectives, benches).
#ifndef SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_
#define SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardgemm {

// InternalError naming `what` and the error; clears the runtime's last error
// (a non-sticky one) so the next call starts clean.
inline absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_
