#include "client/output_checker.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

// A 2x4 F32 block: the local op's answer.
HostTensor Want() {
  HostTensor t;
  t.dtype = DType::kF32;
  t.shape = {2, 4};
  t.bytes.resize(8 * sizeof(float));
  for (int i = 0; i < 8; ++i) t.data<float>()[i] = 1.0f + static_cast<float>(i);
  return t;
}

// The service's output: the block `copies` times (once per row shard).
std::string Output(const HostTensor& block, int copies) {
  std::string out;
  for (int c = 0; c < copies; ++c) out += block.bytes;
  return out;
}

void SetFloat(std::string* bytes, int i, float v) { std::memcpy(&(*bytes)[i * sizeof(float)], &v, sizeof v); }

class OutputCheckerTest : public ::testing::Test {
 protected:
  HostTensor want_ = Want();
  OutputChecker checker_{Want(), DType::kF32, 2 * 32};
};

TEST_F(OutputCheckerTest, AcceptsTheRightOutputAndOneWithinTolerance) {
  EXPECT_EQ(checker_.SetReference(Output(want_, 2)).substr(0, 2), "ok");
  std::string close = Output(want_, 2);
  SetFloat(&close, 11, 4.0f * (1 + 5e-5f));  // 8 is the largest value: 2.5e-5 relative, within 1e-4
  EXPECT_TRUE(checker_.Matches(close));
  EXPECT_TRUE(checker_.Matches(Output(want_, 2)));
}

TEST_F(OutputCheckerTest, CatchesAWrongValue) {
  ASSERT_EQ(checker_.SetReference(Output(want_, 2)).substr(0, 2), "ok");
  std::string wrong = Output(want_, 2);
  SetFloat(&wrong, 13, 6.5f);  // 6 in the second block
  EXPECT_FALSE(checker_.Matches(wrong));
  OutputChecker fresh(Want(), DType::kF32, 64);
  EXPECT_EQ(fresh.SetReference(wrong).substr(0, 4), "FAIL");
}

TEST_F(OutputCheckerTest, CatchesANaN) {
  ASSERT_EQ(checker_.SetReference(Output(want_, 2)).substr(0, 2), "ok");
  std::string nan = Output(want_, 2);
  SetFloat(&nan, 3, std::numeric_limits<float>::quiet_NaN());
  EXPECT_FALSE(checker_.Matches(nan));
  // The bench's poison: every byte 0xff, a NaN in F32 and BF16 alike.
  EXPECT_FALSE(checker_.Matches(std::string(64, '\xff')));
  OutputChecker fresh(Want(), DType::kF32, 64);
  EXPECT_EQ(fresh.SetReference(nan).substr(0, 4), "FAIL");
  EXPECT_TRUE(std::isinf(RelativeError(HostTensor{DType::kF32, {2, 4}, std::string(32, '\xff')}, want_)));
}

TEST_F(OutputCheckerTest, CatchesAShortOrLongOutput) {
  ASSERT_EQ(checker_.SetReference(Output(want_, 2)).substr(0, 2), "ok");
  EXPECT_FALSE(checker_.Matches(Output(want_, 1)));
  EXPECT_FALSE(checker_.Matches(Output(want_, 2).substr(0, 60)));
  EXPECT_FALSE(checker_.Matches(Output(want_, 3)));
  OutputChecker fresh(Want(), DType::kF32, 64);
  EXPECT_EQ(fresh.SetReference(Output(want_, 1)), "FAIL 32 bytes, want 64");
}

TEST(OutputCheckerBf16Test, ToleratesBf16Rounding) {
  HostTensor want = *ConvertFloatTensor(Want(), DType::kBF16);
  OutputChecker checker(want, DType::kBF16, want.NumBytes());
  HostTensor off = *ConvertFloatTensor(Want(), DType::kF32);
  off.data<float>()[7] = 8.0f * (1 + 4e-3f);  // within 1e-2 of the largest
  HostTensor off16 = *ConvertFloatTensor(off, DType::kBF16);
  EXPECT_EQ(checker.SetReference(off16.bytes).substr(0, 2), "ok");
  off.data<float>()[7] = 8.5f;  // 6e-2: not
  EXPECT_FALSE(checker.Matches(ConvertFloatTensor(off, DType::kBF16)->bytes));
}

}  // namespace
}  // namespace shardgemm
