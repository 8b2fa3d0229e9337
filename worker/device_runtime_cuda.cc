#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/device_runtime.h"
#include "worker/nccl_collectives.h"
#include "worker/nccl_status.h"

namespace shardgemm {

std::unique_ptr<Backend> MakeCudaBackend(int device, FaultInjector* faults, std::string* error);  // cuda_backend.cc

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

std::unique_ptr<Backend> MakeDeviceBackend(int device, FaultInjector* faults, std::string* error) {
  return MakeCudaBackend(device, faults, error);
}

std::unique_ptr<Collectives> MakeDeviceCollectives(const MeshPosition& position, int device,
                                                   std::shared_ptr<grpc::Channel> coordinator,
                                                   const std::string& prefix,
                                                   std::chrono::milliseconds timeout) {
  return MakeNcclCollectives(position, device, CoordinatorIdExchange(std::move(coordinator), prefix, timeout),
                             timeout);
}

std::function<absl::Status()> MakeDeviceNcclFault(int device) {
  return [device]() -> absl::Status {
    cudaSetDevice(device);
    ncclComm_t comm = nullptr;
    int devices[1] = {device};
    if (auto s = NcclStatus(ncclCommInitAll(&comm, 1, devices), "ncclCommInitAll (the fault's one-rank communicator)");
        !s.ok()) {
      return s;
    }
    void* buffer = nullptr;
    absl::Status s = CudaStatus(cudaMalloc(&buffer, 256), "the fault's buffer");
    if (s.ok()) {
      // Every argument valid but the datatype: NCCL's argument check refuses
      // the call before anything is enqueued.
      s = NcclStatus(ncclAllReduce(buffer, buffer, 1, static_cast<ncclDataType_t>(1000), ncclSum, comm, nullptr),
                     "ncclAllReduce");
    }
    if (buffer != nullptr) cudaFree(buffer);
    ncclCommDestroy(comm);
    return s;
  };
}

}  // namespace shardgemm
