#include "kernels/gemm_scale_layout.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace {

struct Quantized {
  HostTensor data, scales;
};

// The CPU reference's rowwise quantize of x [m, k] (F32) in `mode`.
Quantized Quantize(const std::vector<float>& x, int64_t m, int64_t k, const std::vector<int64_t>& sizes,
                   ScalingMode mode) {
  GroupedQuantizeArgs a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.m = m;
  a.k = k;
  a.group_sizes = sizes.data();
  a.num_groups = static_cast<int64_t>(sizes.size());
  a.mode = mode;
  a.rowwise = true;
  auto layout = GetQuantizeLayout(a);
  EXPECT_TRUE(layout.ok()) << layout.status();
  Quantized q;
  q.data = *ZerosTensor(DType::kF8E4M3, {m, k});
  q.scales = *ZerosTensor(mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32, {layout->rowwise_scale_elems});
  std::vector<float> amax(sizes.size());
  a.rowwise_data = q.data.data<uint8_t>();
  a.rowwise_scale_inv = q.scales.data<char>();
  a.amax = amax.data();
  EXPECT_TRUE(cpu::GroupedQuantize(a).ok());
  return q;
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Dequantizing with the GEMM layout's scale of each element gives x back
// within E4M3's rounding (relative 2^-4, and half a subnormal step, 2^-10
// of the scale, near zero): the scales landed on the right rows and blocks.
TEST(GemmScaleLayoutTest, Block1x128ScalesDequantizeTheirRows) {
  const int64_t m = 100, k = 384;
  const std::vector<int64_t> sizes = {37, 0, 50};  // 13 padding rows
  const std::vector<float> x = Random(m * k, 1);
  Quantized q = Quantize(x, m, k, sizes, ScalingMode::kBlock1x128);
  auto gemm = GemmScalesFromQuantize(ScalingMode::kBlock1x128, q.scales, m, k, sizes);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  ASSERT_EQ(gemm->shape, (std::vector<int64_t>{m, k / 128}));
  for (int64_t r = 0; r < 87; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float s = gemm->data<float>()[r * (k / 128) + c / 128];
      const float back = Fp8ToFloat(q.data.data<uint8_t>()[r * k + c], Fp8Format::kE4M3) * s;
      ASSERT_NEAR(back, x[r * k + c], std::fabs(x[r * k + c]) * 0.07f + s * 0.002f) << r << "," << c;
    }
  }
  for (int64_t r = 87; r < m; ++r) EXPECT_EQ(gemm->data<float>()[r * 3], 0.f);  // padding rows
  auto back = QuantizeScalesFromGemm(ScalingMode::kBlock1x128, *gemm, m, k, sizes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes, q.scales.bytes);
}

TEST(GemmScaleLayoutTest, Block128x128WeightsRoundTrip) {
  const int64_t g = 3, n = 256, k = 384;
  const std::vector<int64_t> sizes(g, n);
  const std::vector<float> w = Random(g * n * k, 2);
  Quantized q = Quantize(w, g * n, k, sizes, ScalingMode::kBlock128x128);
  auto gemm = GemmScalesFromQuantize(ScalingMode::kBlock128x128, q.scales, g * n, k, sizes);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  ASSERT_EQ(gemm->shape, (std::vector<int64_t>{g, n / 128, k / 128}));
  for (int64_t e = 0; e < g; ++e) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < k; c += 7) {
        const int64_t row = e * n + r;
        const float s = gemm->data<float>()[(e * (n / 128) + r / 128) * (k / 128) + c / 128];
        const float back = Fp8ToFloat(q.data.data<uint8_t>()[row * k + c], Fp8Format::kE4M3) * s;
        ASSERT_NEAR(back, w[row * k + c], std::fabs(w[row * k + c]) * 0.07f + s * 0.002f);
      }
    }
  }
  auto back = QuantizeScalesFromGemm(ScalingMode::kBlock128x128, *gemm, g * n, k, sizes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes, q.scales.bytes);
}

TEST(GemmScaleLayoutTest, Mxfp8AndTensorScalingRoundTrip) {
  const int64_t m = 70, k = 96;
  const std::vector<int64_t> sizes = {33, 30};
  const std::vector<float> x = Random(m * k, 3);
  for (ScalingMode mode : {ScalingMode::kMxfp8, ScalingMode::kCurrent}) {
    Quantized q = Quantize(x, m, k, sizes, mode);
    auto gemm = GemmScalesFromQuantize(mode, q.scales, m, k, sizes);
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    const std::vector<int64_t> want = mode == ScalingMode::kMxfp8 ? std::vector<int64_t>{m, k / 32}
                                                                    : std::vector<int64_t>{2};
    EXPECT_EQ(gemm->shape, want);
    auto back = QuantizeScalesFromGemm(mode, *gemm, m, k, sizes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->bytes, q.scales.bytes) << ScalingModeName(mode);
  }
}

TEST(GemmScaleLayoutTest, RefusesScalesThatDoNotFit) {
  const std::vector<int64_t> sizes = {64, 64};
  HostTensor wrong = *ZerosTensor(DType::kF32, {5});
  auto s = GemmScalesFromQuantize(ScalingMode::kBlock1x128, wrong, 128, 256, sizes);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("scale_inv"), std::string::npos);
  HostTensor gemm = *ZerosTensor(DType::kF32, {128, 2});
  EXPECT_EQ(QuantizeScalesFromGemm(ScalingMode::kBlock1x128, gemm, 128, 200, sizes).status().code(),
            absl::StatusCode::kInvalidArgument);  // k not a multiple of 128
  EXPECT_EQ(QuantizeScalesFromGemm(ScalingMode::kBlock128x128, gemm, 128, 256, {64, 64}).status().code(),
            absl::StatusCode::kInvalidArgument);  // weight groups not multiples of 128
}

}  // namespace
}  // namespace shardgemm
