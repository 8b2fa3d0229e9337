#include "worker/timed_collectives.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

// Collectives that take `delay` and fail when told to.
class SlowCollectives : public Collectives {
 public:
  absl::Duration delay = absl::Milliseconds(20);
  absl::Status next = absl::OkStatus();

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int, const std::vector<std::string>&) override {
    absl::SleepFor(delay);
    if (!next.ok()) return next;
    return local;
  }
  absl::Status AllReduce(HostTensor*, ReduceOp, const std::vector<std::string>&) override {
    absl::SleepFor(delay);
    return next;
  }
  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int, const std::vector<std::string>&) override {
    absl::SleepFor(delay);
    if (!next.ok()) return next;
    return t;
  }
  absl::Status Agree(const absl::Status& local, const std::vector<std::string>&) override {
    absl::SleepFor(delay);
    return next.ok() ? local : next;
  }
};

TEST(TimedCollectivesTest, AddsTheTimeOfEveryCallAndCountsFailures) {
  auto inner = std::make_unique<SlowCollectives>();
  SlowCollectives* slow = inner.get();
  TimedCollectives timed(std::move(inner));
  HostTensor t;
  ASSERT_TRUE(timed.AllGather(t, 0, {"ep"}).ok());
  ASSERT_TRUE(timed.AllReduce(&t, ReduceOp::kSum, {"ep"}).ok());
  EXPECT_GE(timed.elapsed(), absl::Milliseconds(40));
  EXPECT_LT(timed.elapsed(), absl::Seconds(5));
  EXPECT_EQ(timed.failures(), 0);

  slow->next = absl::UnavailableError("peer gone");
  EXPECT_FALSE(timed.ReduceScatter(t, 0, {"ep"}).ok());
  EXPECT_FALSE(timed.AllReduce(&t, ReduceOp::kMax, {"ep"}).ok());
  EXPECT_EQ(timed.failures(), 2);
  EXPECT_GE(timed.elapsed(), absl::Milliseconds(80));
}

TEST(TimedCollectivesTest, AnAgreementReportingAPeersFailureIsNotACollectiveFailure) {
  auto inner = std::make_unique<SlowCollectives>();
  inner->delay = absl::ZeroDuration();
  SlowCollectives* slow = inner.get();
  TimedCollectives timed(std::move(inner));
  // This worker's own error comes back, as does a peer's ABORTED: the agreement worked.
  EXPECT_EQ(timed.Agree(absl::UnavailableError("local budget"), {"ep"}).code(), absl::StatusCode::kUnavailable);
  slow->next = absl::AbortedError("another worker failed");
  EXPECT_EQ(timed.Agree(absl::OkStatus(), {"ep"}).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(timed.failures(), 0);
  slow->next = absl::DeadlineExceededError("no peer answered");
  EXPECT_EQ(timed.Agree(absl::OkStatus(), {"ep"}).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(timed.failures(), 1);
}

}  // namespace
}  // namespace shardgemm
