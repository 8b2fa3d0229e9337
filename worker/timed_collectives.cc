#include "worker/timed_collectives.h"

#include "absl/time/clock.h"

namespace shardgemm {

namespace {
bool Failed(const absl::Status& s) { return !s.ok(); }
template <typename T>
bool Failed(const absl::StatusOr<T>& s) { return !s.ok(); }
}  // namespace

template <typename F>
auto TimedCollectives::Timed(F&& f) {
  const absl::Time start = absl::Now();
  auto result = f();
  elapsed_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  if (Failed(result)) failures_.fetch_add(1, std::memory_order_relaxed);
  return result;
}

absl::StatusOr<HostTensor> TimedCollectives::AllGather(const HostTensor& local, int dim,
                                                       const std::vector<std::string>& axes) {
  return Timed([&] { return inner_->AllGather(local, dim, axes); });
}

absl::Status TimedCollectives::AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) {
  return Timed([&] { return inner_->AllReduce(t, op, axes); });
}

absl::StatusOr<HostTensor> TimedCollectives::ReduceScatter(const HostTensor& t, int dim,
                                                           const std::vector<std::string>& axes) {
  return Timed([&] { return inner_->ReduceScatter(t, dim, axes); });
}

absl::Status TimedCollectives::AllGatherDevice(const void* send, void* recv,
                                               const std::vector<int64_t>& local_shape, DType dtype, int dim,
                                               const std::vector<std::string>& axes, void* stream) {
  return Timed([&] { return inner_->AllGatherDevice(send, recv, local_shape, dtype, dim, axes, stream); });
}

// An agreement that reports a peer's failure (ABORTED, or the local error
// passed in) is the collective working, not failing: only a transport
// failure counts, which Agree reports as UNAVAILABLE or DEADLINE_EXCEEDED.
absl::Status TimedCollectives::Agree(const absl::Status& local, const std::vector<std::string>& axes) {
  const absl::Time start = absl::Now();
  absl::Status s = inner_->Agree(local, axes);
  elapsed_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  if (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded) {
    if (s != local) failures_.fetch_add(1, std::memory_order_relaxed);
  }
  return s;
}

}  // namespace shardgemm
