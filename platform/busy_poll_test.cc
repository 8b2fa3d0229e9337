#include "platform/busy_poll.h"

#include <memory>
#include <utility>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

// Polls `done` until true or `limit` passes.
template <typename F>
bool Eventually(F done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + limit;
  while (absl::Now() < until) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return done();
}

TEST(BusyPollerTest, OffStartsNoThreadAndActivitiesAreNoOps) {
  BusyPoller poller({absl::ZeroDuration(), 4});
  EXPECT_FALSE(poller.on());
  EXPECT_EQ(poller.spinners(), 0);
  { BusyPoller::Activity a = poller.Busy(); }
  BusyPoller::Activity none = BusyPoller::BusyIfOn(nullptr);
  EXPECT_EQ(poller.spin_rounds(), 0);
}

TEST(BusyPollerTest, SpinsWhileBusyAndStopsAfterTheLinger) {
  BusyPoller poller({absl::Milliseconds(20), 1});
  ASSERT_TRUE(poller.on());
  ASSERT_EQ(poller.spinners(), 1);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(poller.spin_rounds(), 0) << "spun with no work in flight";
  {
    BusyPoller::Activity a = poller.Busy();
    const int64_t before = poller.spin_rounds();
    // The spinner is at idle priority: on a loaded machine it waits for a free moment.
    EXPECT_TRUE(Eventually([&] { return poller.spin_rounds() > before; }));
  }
  // After the linger it sleeps: the count stops growing.
  absl::SleepFor(absl::Milliseconds(100));
  const int64_t settled = poller.spin_rounds();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(poller.spin_rounds(), settled);
  // And wakes for the next work.
  BusyPoller::Activity again = poller.Busy();
  EXPECT_TRUE(Eventually([&] { return poller.spin_rounds() > settled; }));
}

TEST(BusyPollerTest, SpinsUntilTheLastOfOverlappingActivitiesEnds) {
  BusyPoller poller({absl::Milliseconds(10), 1});
  BusyPoller::Activity first = poller.Busy();
  BusyPoller::Activity second = poller.Busy();
  first = BusyPoller::Activity();  // released by the move
  absl::SleepFor(absl::Milliseconds(50));  // past the linger; `second` still holds
  const int64_t before = poller.spin_rounds();
  EXPECT_TRUE(Eventually([&] { return poller.spin_rounds() > before; }));
  BusyPoller::Activity moved = std::move(second);
  const int64_t later = poller.spin_rounds();
  EXPECT_TRUE(Eventually([&] { return poller.spin_rounds() > later; }));
}

TEST(BusyPollerTest, DestructionWhileBusyJoinsTheSpinners) {
  auto poller = std::make_unique<BusyPoller>(BusyPoller::Options{absl::Seconds(60), 2});
  {
    BusyPoller::Activity a = poller->Busy();
    EXPECT_TRUE(Eventually([&] { return poller->spin_rounds() > 0; }));
  }
  const absl::Time start = absl::Now();
  poller.reset();  // within its minute of linger
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace shardgemm::platform
