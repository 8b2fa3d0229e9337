// What a build of the worker brings for accelerators. The GPU build links
// device_runtime_cuda.cc (the CUDA backend and NCCL collectives); the CPU-only
// build (the CPU container image: no CUDA libraries to load) links
// device_runtime_none.cc, which reports that no device can be used.
#ifndef SHARDGEMM_WORKER_DEVICE_RUNTIME_H_
#define SHARDGEMM_WORKER_DEVICE_RUNTIME_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "worker/backend.h"
#include "worker/collectives.h"
#include "worker/fault_injection.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardgemm {

// True when `device` can run the device backend; otherwise `why_not` says
// why (no GPU, no driver, a build without CUDA).
bool DeviceUsable(int device, std::string* why_not);

// The device backend on `device`, or nullptr with `error` set. `faults`
// (null: none; must outlive the backend) is --fault_injection's: it fails
// the kernel launches its plan names.
std::unique_ptr<Backend> MakeDeviceBackend(int device, FaultInjector* faults, std::string* error);

// The device backend's collectives (NCCL), rendezvous through the
// coordinator's store (over `coordinator`, a channel with this worker's
// credentials) under `prefix`; nullptr where the build has none.
std::unique_ptr<Collectives> MakeDeviceCollectives(const MeshPosition& position, int device,
                                                   std::shared_ptr<grpc::Channel> coordinator,
                                                   const std::string& prefix,
                                                   std::chrono::milliseconds timeout);

// --fault_injection's NCCL fault on `device` (worker/fault_injection.h): an
// NCCL all-reduce whose datatype is none of NCCL's, on a one-rank
// communicator of its own (so with any mesh, one worker's too); returns
// NCCL's refusal (ncclInvalidArgument and ncclGetLastError's text).
// nullptr where the build has no NCCL.
std::function<absl::Status()> MakeDeviceNcclFault(int device);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_DEVICE_RUNTIME_H_
