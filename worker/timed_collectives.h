// Collectives that time themselves: wraps the worker's collectives and adds
// the wall time of every call to a step's running total, and counts the calls
// that failed (for the worker's metrics and step results).
#ifndef SHARDGEMM_WORKER_TIMED_COLLECTIVES_H_
#define SHARDGEMM_WORKER_TIMED_COLLECTIVES_H_

#include <atomic>
#include <memory>

#include "absl/time/time.h"
#include "worker/collectives.h"

namespace shardgemm {

class TimedCollectives final : public Collectives {
 public:
  explicit TimedCollectives(std::unique_ptr<Collectives> inner) : inner_(std::move(inner)) {}

  // Time spent in collectives since construction (the executor reads it
  // before and after a step; one step runs at a time).
  absl::Duration elapsed() const { return absl::Nanoseconds(elapsed_ns_.load(std::memory_order_relaxed)); }
  int64_t failures() const { return failures_.load(std::memory_order_relaxed); }

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override;
  absl::Status AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) override;
  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                           const std::vector<std::string>& axes) override;
  bool SupportsDeviceAllGather() const override { return inner_->SupportsDeviceAllGather(); }
  absl::Status AllGatherDevice(const void* send, void* recv, const std::vector<int64_t>& local_shape,
                               DType dtype, int dim, const std::vector<std::string>& axes,
                               void* stream) override;
  absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) override;
  void BeginStep(uint64_t sequence, uint64_t epoch) override { inner_->BeginStep(sequence, epoch); }
  void Revoke(uint64_t epoch, const std::string& why) override { inner_->Revoke(epoch, why); }

 private:
  template <typename F>
  auto Timed(F&& f);

  std::unique_ptr<Collectives> inner_;
  std::atomic<int64_t> elapsed_ns_{0};
  std::atomic<int64_t> failures_{0};
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_TIMED_COLLECTIVES_H_
