#include "platform/elastic_thread_pool.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

TEST(ElasticThreadPool, TasksThatBlockDoNotHoldUpTheOnesAfterThem) {
  ElasticThreadPool pool(16);
  absl::Notification release;
  std::atomic<int> started{0};
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(pool.Run([&] {
      started.fetch_add(1);
      release.WaitForNotification();
    }).ok());
  }
  // Each blocked task has a thread of its own: all eight start.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (started.load() < 8 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(started.load(), 8);
  EXPECT_EQ(pool.busy(), 8);
  // One more, which waits for none of them, runs at once.
  absl::Notification ran;
  ASSERT_TRUE(pool.Run([&] { ran.Notify(); }).ok());
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  release.Notify();
}

TEST(ElasticThreadPool, IdleThreadsAreReused) {
  ElasticThreadPool pool(16);
  for (int i = 0; i < 50; ++i) {
    absl::Notification done;
    ASSERT_TRUE(pool.Run([&] { done.Notify(); }).ok());
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    // The thread may not count as idle yet when the notification is seen.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (pool.busy() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Microseconds(100));
  }
  EXPECT_EQ(pool.threads(), 1);
}

TEST(ElasticThreadPool, PastItsThreadsATaskIsRefusedNotQueued) {
  ElasticThreadPool pool(2);
  absl::Notification release;
  ASSERT_TRUE(pool.Run([&] { release.WaitForNotification(); }).ok());
  ASSERT_TRUE(pool.Run([&] { release.WaitForNotification(); }).ok());
  bool third_ran = false;
  absl::Status s = pool.Run([&] { third_ran = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("all 2 threads"), absl::string_view::npos) << s;
  release.Notify();
  EXPECT_FALSE(third_ran);
}

TEST(ElasticThreadPool, DestructionRunsWhatWasGivenThenJoins) {
  std::atomic<int> ran{0};
  {
    ElasticThreadPool pool(4);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(pool.Run([&] {
        absl::SleepFor(absl::Milliseconds(20));
        ran.fetch_add(1);
      }).ok());
    }
  }
  EXPECT_EQ(ran.load(), 4);
}

}  // namespace
}  // namespace shardgemm::platform
