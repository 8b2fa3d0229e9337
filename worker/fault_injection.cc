#include "worker/fault_injection.h"

#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardgemm {

std::string FaultPlan::ToString() const {
  std::vector<std::string> parts;
  if (kernel_launch > 0) parts.push_back(absl::StrCat("kernel_launch:", kernel_launch));
  if (illegal_address > 0) parts.push_back(absl::StrCat("illegal_address:", illegal_address));
  if (nccl > 0) parts.push_back(absl::StrCat("nccl:", nccl));
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<FaultPlan> ParseFaultPlan(absl::string_view spec) {
  FaultPlan plan;
  if (spec.empty()) return plan;
  auto bad = [](absl::string_view entry, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--fault_injection: '", entry, "': ", why));
  };
  for (absl::string_view entry : absl::StrSplit(spec, ',')) {
    const std::vector<absl::string_view> kv = absl::StrSplit(entry, absl::MaxSplits(':', 1));
    if (kv.size() != 2) return bad(entry, "expected KIND:N (kernel_launch:N, illegal_address:N or nccl:N)");
    int64_t* slot = nullptr;
    if (kv[0] == "kernel_launch") {
      slot = &plan.kernel_launch;
    } else if (kv[0] == "illegal_address") {
      slot = &plan.illegal_address;
    } else if (kv[0] == "nccl") {
      slot = &plan.nccl;
    } else {
      return bad(entry, absl::StrCat("unknown fault '", kv[0], "' (kernel_launch, illegal_address or nccl)"));
    }
    int64_t n = 0;
    if (!absl::SimpleAtoi(kv[1], &n) || n < 1) return bad(entry, "N must be a positive integer (1: the first)");
    if (*slot != 0) return bad(entry, absl::StrCat("'", kv[0], "' is given twice"));
    *slot = n;
  }
  if (plan.kernel_launch != 0 && plan.kernel_launch == plan.illegal_address) {
    return absl::InvalidArgumentError(absl::StrCat("--fault_injection: kernel_launch and illegal_address name the "
                                                   "same launch (",
                                                   plan.kernel_launch, ")"));
  }
  return plan;
}

FaultInjector::LaunchFault FaultInjector::NextKernelLaunch() {
  const int64_t n = launches_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n == plan_.kernel_launch) return LaunchFault::kInvalidConfiguration;
  if (n == plan_.illegal_address) return LaunchFault::kIllegalAddress;
  return LaunchFault::kNone;
}

bool FaultInjector::NextCollective() {
  return collectives_.fetch_add(1, std::memory_order_relaxed) + 1 == plan_.nccl;
}

namespace {

class FaultyCollectives final : public Collectives {
 public:
  FaultyCollectives(std::unique_ptr<Collectives> inner, MeshPosition position, FaultInjector* faults,
                    std::function<absl::Status()> nccl_fault)
      : inner_(std::move(inner)), position_(std::move(position)), faults_(faults),
        nccl_fault_(std::move(nccl_fault)) {}

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override {
    return Faulted("all_gather", axes, inner_->AllGather(local, dim, axes));
  }
  absl::Status AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) override {
    return Faulted("all_reduce", axes, inner_->AllReduce(t, op, axes));
  }
  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                           const std::vector<std::string>& axes) override {
    return Faulted("reduce_scatter", axes, inner_->ReduceScatter(t, dim, axes));
  }
  bool SupportsDeviceAllGather() const override { return inner_->SupportsDeviceAllGather(); }
  absl::Status AllGatherDevice(const void* send, void* recv, const std::vector<int64_t>& local_shape, DType dtype,
                               int dim, const std::vector<std::string>& axes, void* stream) override {
    return Faulted("device all_gather", axes,
                   inner_->AllGatherDevice(send, recv, local_shape, dtype, dim, axes, stream));
  }
  absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) override {
    return inner_->Agree(local, axes);
  }
  void BeginStep(uint64_t sequence, uint64_t epoch) override { inner_->BeginStep(sequence, epoch); }
  void Revoke(uint64_t epoch, const std::string& why) override { inner_->Revoke(epoch, why); }

 private:
  // `result` of the call, or the injected fault's error when this call takes it.
  template <typename R>
  R Faulted(absl::string_view op, const std::vector<std::string>& axes, R result) {
    if (!faults_->NextCollective()) return result;
    absl::Status fault = nccl_fault_();
    if (fault.ok()) fault = absl::InternalError("the injected NCCL call did not fail");
    const absl::StatusOr<int64_t> index = position_.GroupIndex(axes), size = position_.GroupSize(axes);
    return absl::Status(fault.code(),
                        absl::StrCat(op, " over (", absl::StrJoin(axes, ","), "), member ", index.value_or(-1),
                                     " of ", size.value_or(-1), ": ", fault.message(),
                                     " [--fault_injection nccl:", faults_->plan().nccl, "]"));
  }

  std::unique_ptr<Collectives> inner_;
  const MeshPosition position_;
  FaultInjector* faults_;
  std::function<absl::Status()> nccl_fault_;
};

}  // namespace

std::unique_ptr<Collectives> WithCollectiveFault(std::unique_ptr<Collectives> inner, const MeshPosition& position,
                                                 FaultInjector* faults, std::function<absl::Status()> nccl_fault) {
  return std::make_unique<FaultyCollectives>(std::move(inner), position, faults, std::move(nccl_fault));
}

}  // namespace shardgemm
