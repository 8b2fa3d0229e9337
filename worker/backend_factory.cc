#include "worker/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "worker/device_runtime.h"

namespace shardgemm {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& requested, int device,
                                                     int cpu_threads, std::string* note, FaultInjector* faults) {
  if (requested == "cpu") return MakeCpuBackend(cpu_threads);
  if (requested != "auto" && requested != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cpu or cuda, got '", requested, "'"));
  }
  std::string why_not;
  if (DeviceUsable(device, &why_not)) {
    std::string error;
    std::unique_ptr<Backend> cuda = MakeDeviceBackend(device, faults, &error);
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
