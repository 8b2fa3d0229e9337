#include "server/rendezvous_store.h"

#include <thread>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(RendezvousStoreTest, GetWaitsForSet) {
  RendezvousStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store.Set("a", "1");
    store.Set("b", "2");
  });
  auto v = store.Get({"a", "b"}, absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<std::string>{"1", "2"}));
}

TEST(RendezvousStoreTest, TimeoutNamesTheMissingKey) {
  RendezvousStore store;
  store.Set("a", "1");
  auto v = store.Get({"a", "zz"}, absl::Milliseconds(20));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("'zz'"), std::string::npos);
}

}  // namespace
}  // namespace shardgemm
