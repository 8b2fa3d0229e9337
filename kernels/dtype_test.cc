#include "kernels/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kI64), 8);
  EXPECT_EQ(DTypeSize(DType::kInvalid), 0);
  EXPECT_EQ(*DTypeFromName("f8e4m3"), DType::kF8E4M3);
  EXPECT_FALSE(DTypeFromName("f7").has_value());
}

TEST(DTypeTest, BF16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  // 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: the even one (1.0) wins.
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(std::nanf("")))));
}

TEST(DTypeTest, F16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    uint16_t half = static_cast<uint16_t>(h);
    float f = F16ToFloat(half);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
      continue;
    }
    EXPECT_EQ(FloatToF16(f), half) << "half 0x" << std::hex << h;
  }
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // rounds up to Inf
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToF16(std::ldexp(1.5f, -25)), 0x0001);
}

}  // namespace
}  // namespace shardgemm
