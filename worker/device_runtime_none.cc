#include "worker/device_runtime.h"

namespace shardgemm {

bool DeviceUsable(int, std::string* why_not) {
  *why_not = "this worker was built without CUDA (the CPU-only build)";
  return false;
}

std::unique_ptr<Backend> MakeDeviceBackend(int, FaultInjector*, std::string* error) {
  *error = "this worker was built without CUDA (the CPU-only build)";
  return nullptr;
}

std::unique_ptr<Collectives> MakeDeviceCollectives(const MeshPosition&, int, std::shared_ptr<grpc::Channel>,
                                                   const std::string&, std::chrono::milliseconds) {
  return nullptr;
}

std::function<absl::Status()> MakeDeviceNcclFault(int) { return nullptr; }

}  // namespace shardgemm
