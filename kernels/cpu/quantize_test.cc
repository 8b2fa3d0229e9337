#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

// Owns the buffers of one quantize call.
struct Quantized {
  GroupedQuantizeArgs args;
  QuantizeLayout layout;
  std::vector<uint8_t> row, col;
  std::vector<uint8_t> row_scale, col_scale;  // raw bytes
  std::vector<float> amax;
  std::vector<float> scale;
};

std::vector<uint16_t> RandomBf16(int64_t n, uint32_t seed, float stddev = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& e : v) e = FloatToBf16Bits(dist(rng) * std::exp2(static_cast<float>(rng() % 7) - 3.0f));
  return v;
}

Quantized RunQuantize(const void* x, DType dt, int64_t m, int64_t k, const std::vector<int64_t>& gs, ScalingMode mode,
              Fp8Format fmt, bool rowwise, bool colwise, std::vector<float> delayed_scale = {}) {
  Quantized q;
  GroupedQuantizeArgs& a = q.args;
  a.x = x, a.x_dtype = dt, a.m = m, a.k = k;
  a.group_sizes = gs.data(), a.num_groups = static_cast<int64_t>(gs.size());
  a.mode = mode, a.format = fmt, a.rowwise = rowwise, a.colwise = colwise;
  auto l = GetQuantizeLayout(a);
  EXPECT_TRUE(l.ok()) << l.status();
  q.layout = *l;
  q.row.assign(static_cast<size_t>(m * k), 0xaa);
  q.col.assign(static_cast<size_t>(m * k), 0xaa);
  q.row_scale.assign(static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes), 0xaa);
  q.col_scale.assign(static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes), 0xaa);
  q.amax.assign(gs.size(), -1.0f);
  q.scale = delayed_scale;
  a.rowwise_data = rowwise ? q.row.data() : nullptr;
  a.colwise_data = colwise ? q.col.data() : nullptr;
  a.rowwise_scale_inv = rowwise ? q.row_scale.data() : nullptr;
  a.colwise_scale_inv = colwise ? q.col_scale.data() : nullptr;
  a.amax = q.amax.data();
  a.scale = q.scale.empty() ? nullptr : q.scale.data();
  absl::Status s = cpu::GroupedQuantize(a);
  EXPECT_TRUE(s.ok()) << s;
  return q;
}

std::vector<float> Dequant(const Quantized& q, bool colwise, const std::vector<uint8_t>* data_override = nullptr) {
  GroupedDequantizeArgs d;
  d.data = data_override ? data_override->data() : (colwise ? q.col.data() : q.row.data());
  d.scale_inv = colwise ? q.col_scale.data() : q.row_scale.data();
  d.colwise = colwise;
  d.mode = q.args.mode, d.format = q.args.format;
  d.m = q.args.m, d.k = q.args.k, d.group_sizes = q.args.group_sizes, d.num_groups = q.args.num_groups;
  std::vector<float> out(static_cast<size_t>(d.m * d.k), -7.0f);
  d.out = out.data(), d.out_dtype = DType::kF32;
  absl::Status s = cpu::GroupedDequantize(d);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Every element dequantizes to within the format's rounding error of x, the
// only extra error being the OCP MX clip at +-max.
void ExpectCloseToInput(const Quantized& q, const std::vector<float>& x, bool colwise) {
  const Fp8Format fmt = q.args.format;
  const bool e4 = fmt == Fp8Format::kE4M3;
  const int mbits = e4 ? 3 : 2;
  const float sub_step = e4 ? std::ldexp(1.0f, -9) : std::ldexp(1.0f, -16);
  const float fmax = Fp8Max(fmt);
  std::vector<uint8_t> ones(static_cast<size_t>(q.args.m * q.args.k), e4 ? 0x38 : 0x3c);  // 1.0
  std::vector<float> deq = Dequant(q, colwise);
  std::vector<float> s = Dequant(q, colwise, &ones);  // each element's scale_inv
  const int64_t used = q.layout.row_offset.back() * q.args.k;
  for (int64_t i = 0; i < used; ++i) {
    const float xi = x[i];
    const float tol = std::ldexp(std::fabs(xi), -(mbits + 1)) + sub_step / 2 * s[i] +
                      std::max(0.0f, std::fabs(xi) - fmax * s[i]) + 1e-6f * std::fabs(xi);
    ASSERT_LE(std::fabs(deq[i] - xi), tol) << "i=" << i << " x=" << xi << " deq=" << deq[i] << " s=" << s[i]
                                           << " mode=" << ScalingModeName(q.args.mode) << " colwise=" << colwise;
  }
  for (int64_t i = used; i < q.args.m * q.args.k; ++i) ASSERT_EQ(deq[i], 0.0f);
}

std::vector<float> ToFloat(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16BitsToFloat(v[i]);
  return f;
}

TEST(QuantizeValidationTest, NamesTheField) {
  std::vector<uint16_t> x(64 * 64);
  std::vector<uint8_t> d(64 * 64);
  std::vector<float> s(4), amax(4);
  std::vector<int64_t> gs = {16, 16, 16, 16};
  GroupedQuantizeArgs a;
  a.x = x.data(), a.m = 64, a.k = 64, a.group_sizes = gs.data(), a.num_groups = 4;
  a.rowwise_data = d.data(), a.rowwise_scale_inv = s.data(), a.amax = amax.data();
  EXPECT_TRUE(cpu::GroupedQuantize(a).ok());
  auto expect = [&](GroupedQuantizeArgs b, const std::string& field) {
    absl::Status st = cpu::GroupedQuantize(b);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(std::string(st.message()), HasSubstr(field));
  };
  GroupedQuantizeArgs b = a;
  b.x_dtype = DType::kI32;
  expect(b, "x_dtype");
  b = a, b.k = 0;
  expect(b, "k");
  b = a, b.m = -1;
  expect(b, "m");
  std::vector<int64_t> bad = {16, -1, 16, 16};
  b = a, b.group_sizes = bad.data();
  expect(b, "group_sizes[1]");
  std::vector<int64_t> over = {32, 32, 1, 0};
  b = a, b.group_sizes = over.data();
  expect(b, "group_sizes");
  b = a, b.group_sizes = nullptr;
  expect(b, "group_sizes");
  b = a, b.rowwise_data = nullptr;
  expect(b, "rowwise_data");
  b = a, b.colwise = true;
  expect(b, "colwise_data");
  b = a, b.amax = nullptr;
  expect(b, "amax");
  b = a, b.mode = ScalingMode::kDelayed;
  expect(b, "scale");
  b = a, b.mode = ScalingMode::kMxfp8, b.k = 48;
  expect(b, "k");
  b = a, b.rowwise = false;
  expect(b, "rowwise/colwise");
  b = a, b.x = nullptr;
  expect(b, "x");
  b = a, b.rowwise_scale_inv = nullptr;
  expect(b, "rowwise_scale_inv");
}

// Tensors with no elements may come as null pointers: MXFP8 with every group
// empty has no scale entries, and its rows past the groups are zeroed.
TEST(QuantizeValidationTest, EmptyTensorsMayBeNull) {
  std::vector<int64_t> gs = {0, 0};
  std::vector<uint16_t> x(3 * 64, 0x3f80);  // 1.0 in bf16
  std::vector<uint8_t> row(3 * 64, 0x5a), col(3 * 64, 0x5a);
  GroupedQuantizeArgs a;
  a.x = x.data(), a.x_dtype = DType::kBF16, a.m = 3, a.k = 64, a.group_sizes = gs.data(), a.num_groups = 2;
  a.mode = ScalingMode::kMxfp8, a.rowwise = true, a.colwise = true;
  a.rowwise_data = row.data(), a.colwise_data = col.data();
  absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(a);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->rowwise_scale_elems, 0);
  EXPECT_EQ(l->colwise_scale_elems, 0);
  ASSERT_TRUE(cpu::GroupedQuantize(a).ok());
  EXPECT_EQ(std::count(row.begin(), row.end(), 0), 3 * 64);
  EXPECT_EQ(std::count(col.begin(), col.end(), 0), 3 * 64);
  // So may dequantize's scales.
  GroupedDequantizeArgs d;
  std::vector<float> out(3 * 64, 7.0f);
  d.data = row.data(), d.m = 3, d.k = 64, d.group_sizes = gs.data(), d.num_groups = 2;
  d.mode = ScalingMode::kMxfp8, d.out_dtype = DType::kF32, d.out = out.data();
  ASSERT_TRUE(cpu::GroupedDequantize(d).ok());
  EXPECT_EQ(std::count(out.begin(), out.end(), 0.0f), 3 * 64);
  // With rows, a null data pointer is still an error.
  a.rowwise_data = nullptr;
  EXPECT_THAT(std::string(ValidateGroupedQuantizeArgs(a).message()), HasSubstr("rowwise_data"));
}

TEST(QuantizeLayoutTest, FlattenHigherRank) {
  auto mk = FlattenToMatrix({4, 8, 2, 64}, -1);
  ASSERT_TRUE(mk.ok());
  EXPECT_EQ(mk->first, 64);
  EXPECT_EQ(mk->second, 64);
  mk = FlattenToMatrix({4, 8, 2, 64}, 2);
  ASSERT_TRUE(mk.ok());
  EXPECT_EQ(mk->first, 32);
  EXPECT_EQ(mk->second, 128);
  EXPECT_EQ(FlattenToMatrix({4, 8}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(FlattenToMatrix({4}, -1).status().message()), HasSubstr("flatten_axis"));
  EXPECT_THAT(std::string(FlattenToMatrix({4, -2}, 1).status().message()), HasSubstr("dims[1]"));
}

TEST(QuantizeLayoutTest, PaddedScaleShapes) {
  std::vector<int64_t> gs = {130, 0, 33};
  GroupedQuantizeArgs a;
  a.m = 200, a.k = 96, a.group_sizes = gs.data(), a.num_groups = 3;
  a.mode = ScalingMode::kMxfp8;
  QuantizeLayout l = *GetQuantizeLayout(a);
  EXPECT_EQ(l.scale_bytes, 1);
  EXPECT_EQ(l.rowwise_scale_rows[0], 256);
  EXPECT_EQ(l.rowwise_scale_cols[0], 4);  // 96/32 = 3 -> 4
  EXPECT_EQ(l.rowwise_scale_rows[1], 0);
  EXPECT_EQ(l.rowwise_scale_offset[3], 256 * 4 + 0 + 128 * 4);
  EXPECT_EQ(l.colwise_scale_rows[0], 8);  // ceil(130/32) = 5 -> 8
  EXPECT_EQ(l.colwise_scale_cols[0], 128);
  EXPECT_EQ(l.colwise_scale_rows[2], 4);  // ceil(33/32) = 2 -> 4
  a.mode = ScalingMode::kBlock1x128;
  l = *GetQuantizeLayout(a);
  EXPECT_EQ(l.rowwise_scale_rows[0], 1);
  EXPECT_EQ(l.rowwise_scale_cols[0], 132);
  EXPECT_EQ(l.colwise_scale_rows[0], 2);
  EXPECT_EQ(l.colwise_scale_cols[0], 96);
  a.mode = ScalingMode::kBlock128x128;
  l = *GetQuantizeLayout(a);
  EXPECT_EQ(l.rowwise_scale_rows[0], 2);
  EXPECT_EQ(l.rowwise_scale_cols[0], 4);
  EXPECT_EQ(l.colwise_scale_rows[0], 1);
  EXPECT_EQ(l.colwise_scale_cols[0], 4);
  a.mode = ScalingMode::kCurrent;
  l = *GetQuantizeLayout(a);
  EXPECT_EQ(l.rowwise_scale_elems, 3);
}

TEST(QuantizeTest, CurrentScalingKnownValues) {
  // Group 0: amax 2 -> scale 224; group 1 empty; group 2 all zeros; group 3 all equal; 1 padding row.
  const int64_t k = 4;
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 0.25f,  //
                          0.0f, 0.0f, 0.0f, 0.0f,    //
                          -3.0f, -3.0f, -3.0f, -3.0f, //
                          9.0f, 9.0f, 9.0f, 9.0f};
  std::vector<int64_t> gs = {1, 0, 1, 1};
  Quantized q = RunQuantize(x.data(), DType::kF32, 4, k, gs, ScalingMode::kCurrent, Fp8Format::kE4M3, true, true);
  EXPECT_EQ(q.amax, (std::vector<float>{2.0f, 0.0f, 0.0f, 3.0f}));
  const float* rs = reinterpret_cast<const float*>(q.row_scale.data());
  EXPECT_EQ(rs[0], 1.0f / 224.0f);
  EXPECT_EQ(rs[1], 1.0f);  // empty group: scale 1
  EXPECT_EQ(rs[2], 1.0f);  // zero group: scale 1
  EXPECT_EQ(rs[3], 1.0f / (448.0f / 3.0f));
  EXPECT_EQ(q.row[0], FloatToE4M3(224.0f));
  EXPECT_EQ(q.row[1], 0xfe);  // -448
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(q.row[4 + c], 0x00);
    EXPECT_EQ(q.row[8 + c], 0xfe);  // all equal -> all at -max
    EXPECT_EQ(q.row[12 + c], 0x00);  // padding row
  }
  // Colwise: per group [K, m_g]; with m_g = 1 it is the same bytes.
  for (int i = 0; i < 12; ++i) EXPECT_EQ(q.col[i], q.row[i]);
}

TEST(QuantizeTest, DelayedScalingReturnsAmax) {
  std::vector<float> x = {1.0f, -5.0f, 1000.0f, 0.0f};
  std::vector<int64_t> gs = {1, 1};
  Quantized q = RunQuantize(x.data(), DType::kF32, 2, 2, gs, ScalingMode::kDelayed, Fp8Format::kE4M3, true, false,
                    {2.0f, 1.0f});
  EXPECT_EQ(q.amax, (std::vector<float>{5.0f, 1000.0f}));
  const float* rs = reinterpret_cast<const float*>(q.row_scale.data());
  EXPECT_EQ(rs[0], 0.5f);
  EXPECT_EQ(q.row[0], FloatToE4M3(2.0f));
  EXPECT_EQ(q.row[1], FloatToE4M3(-10.0f));
  EXPECT_EQ(q.row[2], 0x7e);  // 1000 saturates at 448
}

TEST(QuantizeTest, NanPropagatesToAmax) {
  std::vector<float> x = {1.0f, std::nanf(""), -std::numeric_limits<float>::infinity(), 2.0f};
  std::vector<int64_t> gs = {1, 1};
  Quantized q = RunQuantize(x.data(), DType::kF32, 2, 2, gs, ScalingMode::kCurrent, Fp8Format::kE5M2, true, false);
  EXPECT_TRUE(std::isnan(q.amax[0]));
  EXPECT_TRUE(std::isinf(q.amax[1]));
  const float* rs = reinterpret_cast<const float*>(q.row_scale.data());
  EXPECT_EQ(rs[0], 1.0f);
  EXPECT_EQ(q.row[1], 0x7e);  // NaN stays NaN
  EXPECT_EQ(q.row[2], 0xfb);  // -Inf saturates
}

TEST(QuantizeTest, Mxfp8BlockScalesAndNan) {
  const int64_t k = 64;
  std::vector<float> x(2 * k, 1.0f);
  x[5] = 3.0f;          // block (0,0): amax 3 -> floor(log2 3) = 1 -> 1 - 8 = -7
  x[40] = std::nanf("");  // block (0,1): NaN scale
  std::vector<int64_t> gs = {2};
  Quantized q = RunQuantize(x.data(), DType::kF32, 2, k, gs, ScalingMode::kMxfp8, Fp8Format::kE4M3, true, true);
  EXPECT_EQ(q.row_scale[0], 127 - 7);
  EXPECT_EQ(q.row_scale[1], 0xff);
  EXPECT_EQ(q.row_scale[2], 0);  // padding column (64/32 = 2 -> 4)
  EXPECT_EQ(q.row_scale[4], 127 - 8);  // row 1, block 0: amax 1
  EXPECT_EQ(q.row[5], FloatToE4M3(384.0f));
  for (int c = 32; c < 64; ++c) EXPECT_EQ(q.row[c], 0x7f);
  // Colwise: 2 rows, one (partial) 32-row block per column.
  EXPECT_EQ(q.col_scale[5], 127 - 7);
  EXPECT_EQ(q.col_scale[6], 127 - 8);
  EXPECT_EQ(q.col_scale[40], 0xff);
  EXPECT_EQ(q.col[k + 40], 0x7f);  // row 1 of a NaN column block
  EXPECT_EQ(q.col_scale[128], 0);  // padding row of the scale block
}

struct ModeCase {
  ScalingMode mode;
  Fp8Format fmt;
  DType dtype;
};

class QuantizeRoundTripTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(QuantizeRoundTripTest, DequantizesCloseToInput) {
  const ModeCase p = GetParam();
  const int64_t k = p.mode == ScalingMode::kMxfp8 ? 160 : 200;
  const std::vector<int64_t> gs = {37, 0, 130, 1, 64, 0};
  const int64_t m = 37 + 130 + 1 + 64 + 5;
  std::vector<uint16_t> xb = RandomBf16(m * k, 11);
  std::vector<float> x = ToFloat(xb);
  std::vector<float> scales = {2.0f, 1.0f, 8.0f, 0.5f, 16.0f, 1.0f};
  std::vector<uint16_t> x16(xb.size());
  for (size_t i = 0; i < xb.size(); ++i) x16[i] = FloatToF16Bits(x[i]);
  const void* src = p.dtype == DType::kBF16 ? static_cast<const void*>(xb.data())
                    : p.dtype == DType::kF16 ? static_cast<const void*>(x16.data())
                                              : static_cast<const void*>(x.data());
  if (p.dtype == DType::kF16) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = F16BitsToFloat(x16[i]);
  }
  Quantized q = RunQuantize(src, p.dtype, m, k, gs, p.mode, p.fmt, true, true,
                    p.mode == ScalingMode::kDelayed ? scales : std::vector<float>{});
  ExpectCloseToInput(q, x, false);
  ExpectCloseToInput(q, x, true);
  // Per-group amax equals max |x| over the group.
  int64_t off = 0;
  for (size_t g = 0; g < gs.size(); ++g) {
    float want = 0;
    for (int64_t i = off * k; i < (off + gs[g]) * k; ++i) want = std::max(want, std::fabs(x[i]));
    EXPECT_EQ(q.amax[g], want) << g;
    off += gs[g];
  }
  // Where rowwise and colwise share scales, their data is the same bytes, transposed per group.
  if (p.mode == ScalingMode::kCurrent || p.mode == ScalingMode::kDelayed || p.mode == ScalingMode::kBlock128x128) {
    EXPECT_EQ(Dequant(q, false), Dequant(q, true));
  }
}

std::vector<ModeCase> AllCases() {
  std::vector<ModeCase> v;
  for (ScalingMode m : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8, ScalingMode::kBlock1x128,
                        ScalingMode::kBlock128x128}) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (DType d : {DType::kBF16, DType::kF16, DType::kF32}) v.push_back({m, f, d});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllModes, QuantizeRoundTripTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return std::string(ScalingModeName(i.param.mode)) + "_" + Fp8FormatName(i.param.fmt) +
                                  "_" + std::string(DTypeName(i.param.dtype));
                         });

TEST(QuantizeTest, NvidiaMxRecipeNeverClips) {
  const int64_t k = 32;
  std::vector<float> x(k, 1.0f);
  x[0] = 511.0f;
  std::vector<int64_t> gs = {1};
  Quantized q;
  {
    GroupedQuantizeArgs a;
    a.x = x.data(), a.x_dtype = DType::kF32, a.m = 1, a.k = k, a.group_sizes = gs.data(), a.num_groups = 1;
    a.mode = ScalingMode::kMxfp8, a.mx_recipe = MxScaleRecipe::kNvidiaRoundUp;
    std::vector<uint8_t> d(k), s(128 * 4);
    a.rowwise_data = d.data(), a.rowwise_scale_inv = s.data();
    ASSERT_TRUE(cpu::GroupedQuantize(a).ok());
    EXPECT_EQ(s[0], 127 + 1);  // 511/448 -> 2^1
    EXPECT_EQ(d[0], FloatToE4M3(255.5f));
  }
}

TEST(QuantizeTest, GemmReferenceMatchesBf16) {
  const int64_t k = 256, n = 48;
  const std::vector<int64_t> gs = {20, 0, 45};
  const int64_t m = 70;
  std::vector<uint16_t> xb = RandomBf16(m * k, 3, 1.0f), wb = RandomBf16(3 * n * k, 4, 1.0f);
  std::vector<float> x = ToFloat(xb), w = ToFloat(wb);
  const std::vector<int64_t> wgs(3, n);
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kBlock1x128, ScalingMode::kMxfp8}) {
    Quantized qx = RunQuantize(xb.data(), DType::kBF16, m, k, gs, mode, Fp8Format::kE4M3, true, false);
    Quantized qw = RunQuantize(wb.data(), DType::kBF16, 3 * n, k, wgs,
                       mode == ScalingMode::kBlock1x128 ? ScalingMode::kBlock128x128 : mode, Fp8Format::kE4M3, true,
                       false);
    auto deq_args = [](const Quantized& q) {
      GroupedDequantizeArgs d;
      d.data = q.row.data(), d.scale_inv = q.row_scale.data(), d.mode = q.args.mode, d.format = q.args.format;
      d.m = q.args.m, d.k = q.args.k, d.group_sizes = q.args.group_sizes, d.num_groups = q.args.num_groups;
      return d;
    };
    auto out = cpu::DequantizeGroupedGemmReference(deq_args(qx), deq_args(qw), n);
    ASSERT_TRUE(out.ok()) << out.status();
    double err = 0, ref = 0;
    int64_t off = 0;
    for (int64_t g = 0; g < 3; ++g) {
      for (int64_t r = off; r < off + gs[g]; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(x[r * k + c]) * w[(g * n + j) * k + c];
          err += (acc - (*out)[r * n + j]) * (acc - (*out)[r * n + j]);
          ref += acc * acc;
        }
      }
      off += gs[g];
    }
    for (int64_t i = off * n; i < m * n; ++i) EXPECT_EQ((*out)[i], 0.0f);
    EXPECT_LT(std::sqrt(err / ref), 0.06) << ScalingModeName(mode);
  }
}

}  // namespace
}  // namespace shardgemm
