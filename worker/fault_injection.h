// Test-only faults on demand (the worker's --fault_injection flag, off by
// default): the Nth device kernel launch, or the Nth collective call, fails
// with a real error from the CUDA runtime or NCCL, so that the path from a
// device error to the request's status, and the worker serving the next
// request, can be checked on a GPU. This file holds the plan, the counters
// and the collectives decorator; the device actions (a launch the runtime
// refuses, a write through an invalid address, an NCCL call with an invalid
// argument) are the CUDA build's (fault_injection_cuda.h).
#ifndef SHARDGEMM_WORKER_FAULT_INJECTION_H_
#define SHARDGEMM_WORKER_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/collectives.h"

namespace shardgemm {

// Which event takes which fault; 0: never. Launches are counted over the
// CUDA backend's device ops (each grouped GEMM, FP8 GEMM or quantize it runs
// on the device, host fallbacks not counted), collective calls over the
// data collectives (all-gather, all-reduce, reduce-scatter, the device
// all-gather; agreements not counted), both from the worker's start, 1 first.
struct FaultPlan {
  // This launch is made with a grid of no blocks: the runtime refuses it
  // (cudaErrorInvalidValue on CUDA 13, not sticky).
  int64_t kernel_launch = 0;
  // This launch runs a kernel that writes through an address no allocation
  // owns (cudaErrorIllegalAddress): the CUDA context is lost for good.
  int64_t illegal_address = 0;
  // This collective call is followed by an NCCL all-reduce with an invalid
  // datatype (ncclInvalidArgument), whose error fails the call.
  int64_t nccl = 0;

  bool empty() const { return kernel_launch == 0 && illegal_address == 0 && nccl == 0; }
  // As the flag takes it: "kernel_launch:2,nccl:1" ("" when empty).
  std::string ToString() const;
};

// Parses --fault_injection: comma-separated KIND:N with KIND kernel_launch,
// illegal_address or nccl and N a positive count, each kind at most once,
// kernel_launch and illegal_address on different launches. "" is no faults.
// INVALID_ARGUMENT naming the flag and the entry otherwise.
absl::StatusOr<FaultPlan> ParseFaultPlan(absl::string_view spec);

// The plan's counters (thread-safe).
class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(plan) {}

  enum class LaunchFault { kNone, kInvalidConfiguration, kIllegalAddress };
  // Counts one device kernel launch and says which fault it takes.
  LaunchFault NextKernelLaunch();
  // Counts one collective call; true when it takes the NCCL fault.
  bool NextCollective();

  const FaultPlan& plan() const { return plan_; }

 private:
  const FaultPlan plan_;
  std::atomic<int64_t> launches_{0}, collectives_{0};
};

// `inner` with the plan's NCCL fault: the Nth collective call still runs
// (its peers are in it, and NCCL pairs calls by order alone, so skipping it
// would pair the group's next collectives wrongly), then fails with the
// status of `nccl_fault` (a real NCCL call with an invalid argument),
// named by the collective, its axes and this worker's place in the group.
// `faults` must outlive the result.
std::unique_ptr<Collectives> WithCollectiveFault(std::unique_ptr<Collectives> inner, const MeshPosition& position,
                                                 FaultInjector* faults, std::function<absl::Status()> nccl_fault);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_FAULT_INJECTION_H_
