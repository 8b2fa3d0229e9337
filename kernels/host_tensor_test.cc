#include "kernels/host_tensor.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(HostTensorTest, CheckedNumElementsRejectsNegativeAndOverflow) {
  EXPECT_EQ(*CheckedNumElements({2, 3, 4}, 4, "x"), 24);
  auto neg = CheckedNumElements({2, -1}, 4, "lhs");
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(neg.status().message().find("lhs.shape[1]"), std::string::npos);
  auto big = CheckedNumElements({1LL << 40, 1LL << 30}, 2, "rhs");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostTensorTest, SliceAndInsertRoundTrip) {
  auto t = *ZerosTensor(DType::kF32, {4, 6});
  for (int i = 0; i < 24; ++i) t.data<float>()[i] = static_cast<float>(i);
  HostTensor block = SliceBlock(t, {2, 3}, {2, 3});
  ASSERT_EQ(block.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(block.data<float>()[0], 15.0f);
  EXPECT_EQ(block.data<float>()[5], 23.0f);
  auto dst = *ZerosTensor(DType::kF32, {4, 6});
  InsertBlock(block, {2, 3}, &dst);
  EXPECT_EQ(dst.data<float>()[15], 15.0f);
  EXPECT_EQ(dst.data<float>()[14], 0.0f);
}

TEST(HostTensorTest, ConvertFloatTensor) {
  auto t = *ZerosTensor(DType::kF32, {3});
  t.data<float>()[0] = 1.5f;
  t.data<float>()[1] = -2.0f;
  auto b = *ConvertFloatTensor(t, DType::kBF16);
  EXPECT_EQ(b.NumBytes(), 6);
  EXPECT_EQ(LoadAsFloat(b, 0), 1.5f);
  EXPECT_EQ(LoadAsFloat(b, 1), -2.0f);
  EXPECT_FALSE(ConvertFloatTensor(t, DType::kI32).ok());
}

}  // namespace
}  // namespace shardgemm
