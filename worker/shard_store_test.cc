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

class FakeDeviceBuffer : public DeviceBuffer {
 public:
  explicit FakeDeviceBuffer(int64_t bytes) : bytes_(bytes) {}
  void* data() const override { return nullptr; }
  int64_t bytes() const override { return bytes_; }

 private:
  int64_t bytes_;
};

Shard OnDevice(int64_t bytes) {
  Shard s;
  s.dtype = DType::kI32;
  s.shape = {bytes / 4};
  s.device = std::make_shared<FakeDeviceBuffer>(bytes);
  return s;
}

TEST(ShardStoreTest, DeviceShardsCountAgainstTheDeviceBudget) {
  ShardStore store(/*budget_bytes=*/100, /*device_budget_bytes=*/1000);
  ASSERT_TRUE(store.Put("out", OnDevice(800)).ok());
  EXPECT_EQ(store.used_bytes(), 0);  // no host bytes
  EXPECT_EQ(store.device_used_bytes(), 800);
  absl::Status s = store.Put("more", OnDevice(400));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("device memory budget"), std::string::npos) << s;
  EXPECT_NE(s.message().find("400"), std::string::npos) << s;
  // Nothing already held is lost; a replacement counts the bytes it frees.
  EXPECT_TRUE(store.Get("out").ok());
  EXPECT_TRUE(store.Put("out", OnDevice(900)).ok());
  EXPECT_EQ(store.device_used_bytes(), 900);
  EXPECT_TRUE(store.Delete("out").ok());
  EXPECT_EQ(store.device_used_bytes(), 0);
}

TEST(ShardStoreTest, NoDeviceBudgetRefusesDeviceShards) {
  ShardStore store(1000);  // a CPU worker
  EXPECT_EQ(store.Put("out", OnDevice(8)).code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace shardgemm
