#include "platform/cpu_affinity.h"

#include <sched.h>

#include <thread>

#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

TEST(ParseCpuList, SinglesRangesAndListsComeBackAscendingEachOnce) {
  EXPECT_EQ(*ParseCpuList("2", "--cpus"), (std::vector<int>{2}));
  EXPECT_EQ(*ParseCpuList("2-4", "--cpus"), (std::vector<int>{2, 3, 4}));
  EXPECT_EQ(*ParseCpuList("7, 0,4-5,5", "--cpus"), (std::vector<int>{0, 4, 5, 7}));
  EXPECT_TRUE(ParseCpuList("", "--cpus")->empty());
}

TEST(ParseCpuList, BadListsNameTheFlagAndThePart) {
  for (const char* bad : {"a", "3-1", "-1", "1-", "2,,3", "1024", "0-2000", "1.5", "2 3"}) {
    auto r = ParseCpuList(bad, "--cpus");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--cpus"), absl::string_view::npos) << r.status();
  }
}

// Run in a thread of its own: the pinning is the thread's (and its children's).
TEST(PinToCpus, ThreadsStartedAfterwardsRunOnlyThere) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  std::thread([&] {
    ASSERT_TRUE(PinToCpus({allowed.back()}, "--cpus").ok());
    std::vector<int> child;
    std::thread([&] { child = AllowedCpus(); }).join();
    EXPECT_EQ(child, std::vector<int>{allowed.back()});
  }).join();
}

TEST(PinToCpus, ACpuThisProcessMayNotUseIsRefusedNamingTheFlag) {
  std::thread([] {
    absl::Status s = PinToCpus({CPU_SETSIZE - 1}, "--cpus");
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("--cpus"), absl::string_view::npos) << s;
  }).join();
}

}  // namespace
}  // namespace shardgemm::platform
