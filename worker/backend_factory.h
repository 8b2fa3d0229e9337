// Picks the worker's backend from its --backend flag.
#ifndef SHARDGEMM_WORKER_BACKEND_FACTORY_H_
#define SHARDGEMM_WORKER_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/backend.h"
#include "worker/fault_injection.h"

namespace shardgemm {

// `requested` is "auto", "cpu" or "cuda". "auto" picks the device backend
// where a device is usable and otherwise falls back to the CPU, writing why
// to `note`; "cuda" without a usable device is FAILED_PRECONDITION.
// `faults` (may be null) goes to the device backend (MakeDeviceBackend).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& requested, int device,
                                                     int cpu_threads, std::string* note,
                                                     FaultInjector* faults = nullptr);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_BACKEND_FACTORY_H_
