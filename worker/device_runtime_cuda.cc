#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "worker/device_runtime.h"
#include "worker/nccl_collectives.h"

namespace shardgemm {

std::unique_ptr<Backend> MakeCudaBackend(int device, std::string* error);  // cuda_backend.cc

// With no GPU (or no driver) the runtime reports e.g. "CUDA driver version is
// insufficient": that means "no GPU here", not a failure.
bool DeviceUsable(int device, std::string* why_not) {
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

std::unique_ptr<Backend> MakeDeviceBackend(int device, std::string* error) {
  return MakeCudaBackend(device, error);
}

std::unique_ptr<Collectives> MakeDeviceCollectives(const MeshPosition& position, int device,
                                                   std::shared_ptr<grpc::Channel> coordinator,
                                                   const std::string& prefix,
                                                   std::chrono::milliseconds timeout) {
  return MakeNcclCollectives(position, device, CoordinatorIdExchange(std::move(coordinator), prefix), timeout);
}

}  // namespace shardgemm
