// A CUDA runtime result as an absl::Status, for every host library that calls
// the runtime (GEMM, quantize backend, NCCL collectives, benches).
#ifndef SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_
#define SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

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

// For benchmarks and tools, where a failed call ends the run: prints the
// call, where it was and CUDA's message, and exits with status 2.
inline void CheckCudaOrExit(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s:%d %s: %s\n", file, line, call, cudaGetErrorString(e));
  std::exit(2);
}
#define SHARDGEMM_CHECK_CUDA(call) ::shardgemm::CheckCudaOrExit((call), #call, __FILE__, __LINE__)

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_CUDA_STATUS_H_
