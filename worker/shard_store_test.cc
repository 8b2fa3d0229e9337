#include "worker/shard_store.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

HostTensor Bytes(int64_t n) { return *ZerosTensor(DType::kF32, {n / 4}); }

TEST(ShardStoreTest, BudgetRefusesAndKeepsWhatIsHeld) {
  ShardStore store(1000);
  ASSERT_TRUE(store.Put("a", Bytes(600)).ok());
  absl::Status s = store.Put("b", Bytes(600));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Get("a").ok());
  EXPECT_EQ(store.used_bytes(), 600);
  // Replacing a shard counts only the difference.
  EXPECT_TRUE(store.Put("a", Bytes(800)).ok());
  EXPECT_EQ(store.used_bytes(), 800);
}

TEST(ShardStoreTest, ReservationsCountAgainstTheBudget) {
  ShardStore store(1000);
  ASSERT_TRUE(store.Reserve(700).ok());
  EXPECT_EQ(store.Put("a", Bytes(400)).code(), absl::StatusCode::kResourceExhausted);
  store.Release(700);
  EXPECT_TRUE(store.Put("a", Bytes(400)).ok());
  EXPECT_EQ(store.Reserve(700).code(), absl::StatusCode::kResourceExhausted);
}

TEST(ShardStoreTest, DeleteAndMissing) {
  ShardStore store(1000);
  EXPECT_EQ(store.Get("x").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store.Put("x", Bytes(40)).ok());
  auto held = *store.Get("x");
  EXPECT_TRUE(store.Delete("x").ok());
  EXPECT_EQ(held->NumBytes(), 40);  // a running step keeps its input
  EXPECT_EQ(store.used_bytes(), 0);
  EXPECT_EQ(store.Delete("x").code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardgemm
