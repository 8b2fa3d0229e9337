#include "worker/backend.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace shardgemm {

namespace {

// True when a CUDA device is usable. With no GPU (or no driver) the runtime
// reports e.g. "CUDA driver version is insufficient": that means "no GPU
// here", not a failure.
bool CudaDevicePresent(int device, std::string* why_not) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *why_not = cudaGetErrorString(err);
    return false;
  }
  if (device >= count) {
    *why_not = absl::StrCat("device ", device, " requested but ", count, " present");
    return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<Backend> MakeCudaBackend(int device, std::string* error);  // cuda_backend.cc

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& requested, int device,
                                                     int cpu_threads, std::string* note) {
  if (requested == "cpu") return MakeCpuBackend(cpu_threads);
  if (requested != "auto" && requested != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cpu or cuda, got '", requested, "'"));
  }
  std::string why_not;
  if (CudaDevicePresent(device, &why_not)) {
    std::string error;
    std::unique_ptr<Backend> cuda = MakeCudaBackend(device, &error);
    if (cuda != nullptr) return cuda;
    why_not = error;
  }
  if (requested == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("CUDA backend unavailable: ", why_not));
  }
  *note = absl::StrCat("no usable GPU (", why_not, "): falling back to the CPU backend");
  return MakeCpuBackend(cpu_threads);
}

}  // namespace shardgemm
