#include "server/rendezvous_store.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(RendezvousStoreTest, GetWaitsForSet) {
  RendezvousStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("a", "1").ok());
    ASSERT_TRUE(store.Set("b", "2").ok());
  });
  auto v = store.Get({"a", "b"}, absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<std::string>{"1", "2"}));
}

TEST(RendezvousStoreTest, TimeoutNamesTheMissingKey) {
  RendezvousStore store;
  ASSERT_TRUE(store.Set("a", "1").ok());
  auto v = store.Get({"a", "zz"}, absl::Milliseconds(20));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("'zz'"), std::string::npos);
}

TEST(RendezvousStoreTest, KeysValuesAndTheirCountAreBounded) {
  RendezvousStore store;
  EXPECT_EQ(store.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set(std::string(RendezvousStore::kMaxKeyBytes + 1, 'k'), "v").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set("k", std::string(RendezvousStore::kMaxValueBytes + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
  for (size_t i = 0; i < RendezvousStore::kMaxKeys; ++i) {
    ASSERT_TRUE(store.Set(absl::StrCat("k", i), "v").ok()) << i;
  }
  EXPECT_EQ(store.Set("one-more", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Set("k7", "replaced").ok()) << "replacing a key adds none";
  auto v = store.Get({"k7"}, absl::Milliseconds(10));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ((*v)[0], "replaced");
}

TEST(RendezvousStoreTest, ErasedKeysAreForgottenAndTheirBytesFreed) {
  RendezvousStore store;
  ASSERT_TRUE(store.Set("a", "12345").ok());
  ASSERT_TRUE(store.Set("b", "x").ok());
  EXPECT_EQ(store.num_keys(), 2u);
  EXPECT_EQ(store.num_bytes(), 1u + 5 + 1 + 1);
  store.Erase({"a", "never-set"});
  EXPECT_EQ(store.num_keys(), 1u);
  EXPECT_EQ(store.num_bytes(), 2u);
  EXPECT_EQ(store.Get({"a"}, absl::Milliseconds(10)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(RendezvousStoreTest, TotalBytesAreBounded) {
  RendezvousStore store;
  const std::string big(RendezvousStore::kMaxValueBytes, 'v');
  size_t i = 0;
  absl::Status s;
  while ((s = store.Set(absl::StrCat("k", i), big)).ok()) ++i;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_LE(i * big.size(), RendezvousStore::kMaxTotalBytes);
  EXPECT_GT((i + 1) * (big.size() + 8), RendezvousStore::kMaxTotalBytes);
}

TEST(RendezvousStoreTest, AWaitForAnOlderEpochEndsAtOnceWhenTheEpochAdvances) {
  RendezvousStore store;
  store.AdvanceEpoch(3);
  absl::Status waited;
  absl::Duration took;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waited = store.Get({"gloo/g/3/rank1"}, absl::Seconds(30), 3).status();
    took = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  store.AdvanceEpoch(4);
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("epoch 3"), absl::string_view::npos) << waited;
  EXPECT_NE(waited.message().find("epoch 4"), absl::string_view::npos) << waited;
  EXPECT_LT(took, absl::Seconds(5));
}

TEST(RendezvousStoreTest, OlderEpochsKeysAreRefusedAndForgottenNewerAndUnnumberedOnesWait) {
  RendezvousStore store;
  store.AdvanceEpoch(2);
  ASSERT_TRUE(store.Set("old", "o", 2).ok());
  ASSERT_TRUE(store.Set("next", "n", 3).ok());
  ASSERT_TRUE(store.Set("plain", "p").ok());
  store.AdvanceEpoch(3);
  EXPECT_EQ(store.epoch(), 3u);
  EXPECT_EQ(store.num_keys(), 2u);  // "old" is forgotten
  EXPECT_EQ(store.num_bytes(), 4 + 1 + 5 + 1u);
  const absl::Time start = absl::Now();
  EXPECT_EQ(store.Set("late", "l", 2).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store.Get({"old"}, absl::Seconds(30), 2).status().code(), absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // A key already set is read whatever the epoch; epoch 0 and the current one wait as before.
  EXPECT_TRUE(store.Get({"next"}, absl::Seconds(1), 2).ok());
  EXPECT_EQ(store.Get({"missing"}, absl::Milliseconds(50), 3).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(store.Get({"missing"}, absl::Milliseconds(50)).status().code(), absl::StatusCode::kDeadlineExceeded);
  store.AdvanceEpoch(1);  // the epoch only grows
  EXPECT_EQ(store.epoch(), 3u);
}

}  // namespace
}  // namespace shardgemm
