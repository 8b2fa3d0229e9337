#include "kernels/cpu/fp8_grouped_gemm.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/cpu/grouped_gemm_internal.h"
#include "kernels/cpu/quantize.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cpu {
namespace {

using internal::GemmKernel;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

enum class Recipe { kTensor, kMxfp8, kBlock };

const char* RecipeName(Recipe r) {
  switch (r) {
    case Recipe::kTensor:
      return "tensor";
    case Recipe::kMxfp8:
      return "mxfp8";
    case Recipe::kBlock:
      return "block";
  }
  return "?";
}

Fp8Format FormatOf(DType d) { return d == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }

// Runs `body` once per GEMM micro-kernel family this CPU supports, telling it
// whether the family accumulates with FMA (the naive loop must do the same to
// match bit for bit: a fused multiply-add rounds once, a multiply then an add
// twice).
template <typename F>
void ForEachKernel(F body) {
  for (GemmKernel k : {GemmKernel::kPortable, GemmKernel::kAvx2, GemmKernel::kAvx512}) {
    if (!internal::SetGemmKernelForTesting(k)) continue;
    SCOPED_TRACE(internal::ActiveGemmKernelName());
    body(k != GemmKernel::kPortable);
  }
  internal::SetGemmKernelForTesting(GemmKernel::kAuto);
}

// One FP8 grouped GEMM problem with its own buffers. The scale buffers are
// laid out as the header's contract says; the lookups below restate that
// contract independently of the library.
struct Problem {
  Recipe recipe = Recipe::kTensor;
  bool ragged_k = false;
  bool transposed = false;
  DType lhs_dtype = DType::kF8E4M3, rhs_dtype = DType::kF8E4M3;
  DType out_dtype = DType::kF32, bias_dtype = DType::kInvalid;
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> sizes;
  std::vector<uint8_t> lhs, rhs;
  std::vector<float> lhs_sf, rhs_sf;    // float scales (tensor, block)
  std::vector<uint8_t> lhs_s8, rhs_s8;  // E8M0 codes (mxfp8)
  std::vector<float> bias;              // [G, N] values, exactly representable in bias_dtype
  std::vector<uint8_t> bias_bytes;

  int64_t G() const { return static_cast<int64_t>(sizes.size()); }
  int64_t Used() const { return std::accumulate(sizes.begin(), sizes.end(), int64_t{0}); }
  int64_t Offset(int64_t g) const {
    return std::accumulate(sizes.begin(), sizes.begin() + g, int64_t{0});
  }
  bool e8m0() const { return recipe == Recipe::kMxfp8; }
  int64_t Block() const { return recipe == Recipe::kMxfp8 ? 32 : 128; }

  ScalingMode LhsMode() const {
    switch (recipe) {
      case Recipe::kTensor:
        return ScalingMode::kCurrent;
      case Recipe::kMxfp8:
        return ScalingMode::kMxfp8;
      case Recipe::kBlock:
        return ScalingMode::kBlock1x128;
    }
    return ScalingMode::kCurrent;
  }
  ScalingMode RhsMode() const {
    switch (recipe) {
      case Recipe::kTensor:
        return ScalingMode::kDelayed;  // the two tensor modes mix freely
      case Recipe::kMxfp8:
        return ScalingMode::kMxfp8;
      case Recipe::kBlock:
        return ragged_k ? ScalingMode::kBlock1x128 : ScalingMode::kBlock128x128;
    }
    return ScalingMode::kCurrent;
  }

  // Scale element counts, per the contract.
  int64_t LhsScaleCount() const {
    if (recipe == Recipe::kTensor) return G();
    return ragged_k ? (m / Block()) * k : m * (k / Block());
  }
  int64_t RhsScaleCount() const {
    if (recipe == Recipe::kTensor) return G();
    if (ragged_k) return (m / Block()) * n;
    if (recipe == Recipe::kMxfp8) return G() * (k / 32) * n;
    return G() * (k / 128) * (n / 128);
  }

  float ScaleAt(const std::vector<float>& f, const std::vector<uint8_t>& u, int64_t i) const {
    return e8m0() ? E8M0ToFloat(u[i]) : f[i];
  }
  // lhs element (r, c) of group g.
  float LhsScale(int64_t r, int64_t c, int64_t g) const {
    if (recipe == Recipe::kTensor) return lhs_sf[g];
    const int64_t b = Block();
    return ScaleAt(lhs_sf, lhs_s8, ragged_k ? (r / b) * k + c : r * (k / b) + c / b);
  }
  // Ragged M: rhs element (g, kk, j) (whatever its storage order).
  float RhsScaleM(int64_t g, int64_t kk, int64_t j) const {
    switch (recipe) {
      case Recipe::kTensor:
        return rhs_sf[g];
      case Recipe::kMxfp8:
        return E8M0ToFloat(transposed ? rhs_s8[(g * n + j) * (k / 32) + kk / 32]
                                      : rhs_s8[(g * (k / 32) + kk / 32) * n + j]);
      case Recipe::kBlock:
        return transposed ? rhs_sf[(g * (n / 128) + j / 128) * (k / 128) + kk / 128]
                          : rhs_sf[(g * (k / 128) + kk / 128) * (n / 128) + j / 128];
    }
    return 0;
  }
  // Ragged K: rhs element (r, j) of group g.
  float RhsScaleK(int64_t r, int64_t j, int64_t g) const {
    if (recipe == Recipe::kTensor) return rhs_sf[g];
    return ScaleAt(rhs_sf, rhs_s8, (r / Block()) * n + j);
  }
  float Lhs(int64_t r, int64_t c, int64_t g) const {
    return Fp8ToFloat(lhs[r * k + c], FormatOf(lhs_dtype)) * LhsScale(r, c, g);
  }
  float RhsM(int64_t g, int64_t kk, int64_t j) const {
    const uint8_t q = transposed ? rhs[(g * n + j) * k + kk] : rhs[(g * k + kk) * n + j];
    return Fp8ToFloat(q, FormatOf(rhs_dtype)) * RhsScaleM(g, kk, j);
  }
  float RhsK(int64_t r, int64_t j, int64_t g) const {
    return Fp8ToFloat(rhs[r * n + j], FormatOf(rhs_dtype)) * RhsScaleK(r, j, g);
  }

  int64_t OutCount() const { return ragged_k ? G() * k * n : m * n; }

  Fp8GroupedGemmArgs Args(void* out) const {
    Fp8GroupedGemmArgs a;
    a.ragged_k = ragged_k;
    a.lhs_dtype = lhs_dtype;
    a.rhs_dtype = rhs_dtype;
    a.lhs = lhs.data();
    a.rhs = rhs.data();
    a.lhs_mode = LhsMode();
    a.rhs_mode = RhsMode();
    a.lhs_scale_inv = e8m0() ? static_cast<const void*>(lhs_s8.data()) : lhs_sf.data();
    a.rhs_scale_inv = e8m0() ? static_cast<const void*>(rhs_s8.data()) : rhs_sf.data();
    a.m = m;
    a.k = k;
    a.n = n;
    a.num_groups = G();
    a.group_sizes = sizes.data();
    a.rhs_transposed = transposed;
    a.bias_dtype = bias_dtype;
    a.bias = bias_dtype == DType::kInvalid ? nullptr : bias_bytes.data();
    a.out_dtype = out_dtype;
    a.out = out;
    return a;
  }
};

// A random FP8 byte that is a finite number (no NaN, no E5M2 Inf).
uint8_t RandomFp8(DType dtype, std::mt19937& rng) {
  for (;;) {
    const uint8_t q = static_cast<uint8_t>(rng() & 0xff);
    if (!std::isfinite(Fp8ToFloat(q, FormatOf(dtype)))) continue;
    return q;
  }
}

// Positive scales: half powers of two, half not.
float RandomScale(std::mt19937& rng) {
  if (rng() & 1) return std::ldexp(1.0f, static_cast<int>(rng() % 10) - 6);
  return std::uniform_real_distribution<float>(0.05f, 3.0f)(rng);
}

uint8_t RandomE8M0(std::mt19937& rng) { return static_cast<uint8_t>(127 - 6 + rng() % 10); }

constexpr uint8_t kFp8Nan = 0x7f;  // NaN in both E4M3 and E5M2

Problem MakeProblem(Recipe recipe, bool ragged_k, bool transposed, int64_t m, int64_t k, int64_t n,
                    std::vector<int64_t> sizes, uint32_t seed, DType lhs_dtype = DType::kF8E4M3,
                    DType rhs_dtype = DType::kF8E4M3) {
  std::mt19937 rng(seed);
  Problem p;
  p.recipe = recipe;
  p.ragged_k = ragged_k;
  p.transposed = transposed;
  p.lhs_dtype = lhs_dtype;
  p.rhs_dtype = rhs_dtype;
  p.m = m;
  p.k = k;
  p.n = n;
  p.sizes = std::move(sizes);
  p.lhs.resize(m * k);
  for (auto& q : p.lhs) q = RandomFp8(lhs_dtype, rng);
  p.rhs.resize(ragged_k ? m * n : p.G() * k * n);
  for (auto& q : p.rhs) q = RandomFp8(rhs_dtype, rng);
  if (p.e8m0()) {
    p.lhs_s8.resize(p.LhsScaleCount());
    for (auto& s : p.lhs_s8) s = RandomE8M0(rng);
    p.rhs_s8.resize(p.RhsScaleCount());
    for (auto& s : p.rhs_s8) s = RandomE8M0(rng);
  } else {
    p.lhs_sf.resize(p.LhsScaleCount());
    for (auto& s : p.lhs_sf) s = RandomScale(rng);
    p.rhs_sf.resize(p.RhsScaleCount());
    for (auto& s : p.rhs_sf) s = RandomScale(rng);
  }
  // Rows past sum(group_sizes) must not be read: NaN data, and NaN scales
  // wherever a scale covers only such rows.
  const int64_t used = p.Used();
  for (int64_t i = used * k; i < m * k; ++i) p.lhs[i] = kFp8Nan;
  if (ragged_k) {
    for (int64_t i = used * n; i < m * n; ++i) p.rhs[i] = kFp8Nan;
  }
  if (recipe != Recipe::kTensor) {
    const int64_t rows_per_scale_row = ragged_k ? p.Block() : 1;
    const int64_t lhs_w = ragged_k ? k : k / p.Block();
    const int64_t first = (used + rows_per_scale_row - 1) / rows_per_scale_row;
    for (int64_t i = first * lhs_w; i < p.LhsScaleCount(); ++i) {
      if (p.e8m0()) {
        p.lhs_s8[i] = kE8M0Nan;
      } else {
        p.lhs_sf[i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    if (ragged_k) {
      for (int64_t i = first * n; i < p.RhsScaleCount(); ++i) {
        if (p.e8m0()) {
          p.rhs_s8[i] = kE8M0Nan;
        } else {
          p.rhs_sf[i] = std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
  }
  return p;
}

void AddBias(Problem& p, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 4.f);
  p.bias_dtype = dtype;
  p.bias.resize(p.G() * p.n);
  p.bias_bytes.resize(p.bias.size() * DTypeSize(dtype) + 1);
  for (size_t i = 0; i < p.bias.size(); ++i) {
    const float v = dist(rng);
    if (dtype == DType::kF32) {
      p.bias[i] = v;
      std::memcpy(&p.bias_bytes[i * 4], &v, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBF16(v) : FloatToF16(v);
      p.bias[i] = dtype == DType::kBF16 ? BF16ToFloat(h) : F16ToFloat(h);
      std::memcpy(&p.bias_bytes[i * 2], &h, 2);
    }
  }
}

// acc + a * b as the GEMM's micro-kernel family computes it.
float Step(float acc, float a, float b, bool fma) {
  if (fma) return std::fma(a, b, acc);
  volatile float prod = a * b;  // no contraction
  return acc + prod;
}

// The naive reference in FP32: dequantize each element (fp8 value times its
// scale), accumulate from +0 in increasing contracting order, add the bias.
// Returns the FP32 values before rounding to out_dtype.
std::vector<float> Naive(const Problem& p, bool fma) {
  std::vector<float> out(p.OutCount(), 0.f);
  for (int64_t g = 0; g < p.G(); ++g) {
    const int64_t off = p.Offset(g), mg = p.sizes[g];
    if (!p.ragged_k) {
      for (int64_t i = off; i < off + mg; ++i) {
        for (int64_t j = 0; j < p.n; ++j) {
          float acc = 0.f;
          for (int64_t kk = 0; kk < p.k; ++kk) acc = Step(acc, p.Lhs(i, kk, g), p.RhsM(g, kk, j), fma);
          if (p.bias_dtype != DType::kInvalid) acc = acc + p.bias[g * p.n + j];
          out[i * p.n + j] = acc;
        }
      }
    } else {
      for (int64_t i = 0; i < p.k; ++i) {
        for (int64_t j = 0; j < p.n; ++j) {
          float acc = 0.f;
          for (int64_t r = off; r < off + mg; ++r) acc = Step(acc, p.Lhs(r, i, g), p.RhsK(r, j, g), fma);
          out[(g * p.k + i) * p.n + j] = acc;
        }
      }
    }
  }
  return out;
}

// Runs the op into an output prefilled with NaN (so unwritten elements show)
// and returns the output decoded to float.
std::vector<float> RunOp(const Problem& p, int threads = 0) {
  const int64_t count = p.OutCount();
  const int esize = DTypeSize(p.out_dtype);
  std::vector<uint8_t> out(count * esize + 1, 0xff);  // 0xff..: NaN in f32, bf16 and f16
  const absl::Status s = Fp8GroupedGemm(p.Args(out.data()), threads);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i) {
    if (p.out_dtype == DType::kF32) {
      std::memcpy(&v[i], &out[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &out[i * 2], 2);
      v[i] = p.out_dtype == DType::kBF16 ? BF16ToFloat(h) : F16ToFloat(h);
    }
  }
  return v;
}

float RoundTo(DType d, float v) {
  if (d == DType::kBF16) return BF16ToFloat(FloatToBF16(v));
  if (d == DType::kF16) return F16ToFloat(FloatToF16(v));
  return v;
}

// Bit-for-bit equality of float vectors (so -0 != +0 and NaN == same NaN).
void ExpectBitEqual(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (FloatBits(got[i]) != FloatBits(want[i]) && ++bad <= 5) {
      ADD_FAILURE() << "element " << i << ": got " << got[i] << " want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0);
}

std::string Name(const Problem& p) {
  return std::string(RecipeName(p.recipe)) + (p.ragged_k ? " ragged K" : " ragged M") +
         (p.transposed ? " rhs^T " : " ") + std::string(DTypeName(p.lhs_dtype)) + "x" +
         std::string(DTypeName(p.rhs_dtype)) + "->" + std::string(DTypeName(p.out_dtype));
}

// ---------------------------------------------------------------------------
// 1. Every recipe against the naive loop, bit for bit. Both accumulate in
// FP32 from +0 in increasing contracting order with the same FMA-or-not step,
// so there is no rounding difference to allow for.

struct Shape {
  int64_t m, k, n;
  std::vector<int64_t> sizes;
};

// Shapes that satisfy each recipe's divisibility, with an empty group and
// padding rows past sum(group_sizes); group sizes that do not align to the
// ragged-K scale blocks (a block may span two groups).
Shape RaggedMShape(Recipe r) {
  if (r == Recipe::kBlock) return {45, 256, 128, {10, 0, 25}};
  return {45, 96, 40, {10, 0, 25}};
}
Shape RaggedKShape(Recipe r) {
  if (r == Recipe::kBlock) return {384, 20, 12, {100, 0, 190}};
  if (r == Recipe::kMxfp8) return {96, 24, 40, {40, 0, 33}};
  return {70, 24, 40, {30, 0, 25}};
}

TEST(Fp8GroupedGemm, RaggedMMatchesNaiveLoopBitwise) {
  ForEachKernel([](bool fma) {
    uint32_t seed = 1;
    for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
      for (bool t : {false, true}) {
        for (auto [ld, rd] : {std::pair{DType::kF8E4M3, DType::kF8E4M3},
                              std::pair{DType::kF8E5M2, DType::kF8E4M3},
                              std::pair{DType::kF8E4M3, DType::kF8E5M2}}) {
          const Shape s = RaggedMShape(r);
          const Problem p = MakeProblem(r, false, t, s.m, s.k, s.n, s.sizes, seed++, ld, rd);
          SCOPED_TRACE(Name(p));
          ExpectBitEqual(RunOp(p, 2), Naive(p, fma));
        }
      }
    }
  });
}

TEST(Fp8GroupedGemm, RaggedKMatchesNaiveLoopBitwise) {
  ForEachKernel([](bool fma) {
    uint32_t seed = 100;
    for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
      for (auto [ld, rd] : {std::pair{DType::kF8E4M3, DType::kF8E4M3},
                            std::pair{DType::kF8E4M3, DType::kF8E5M2}}) {
        const Shape s = RaggedKShape(r);
        const Problem p = MakeProblem(r, true, false, s.m, s.k, s.n, s.sizes, seed++, ld, rd);
        SCOPED_TRACE(Name(p));
        ExpectBitEqual(RunOp(p, 2), Naive(p, fma));
      }
    }
  });
}

// Bias (any float dtype, added in FP32 after accumulation) and 16-bit outputs
// (one rounding of the FP32 result).
TEST(Fp8GroupedGemm, BiasAndHalfPrecisionOutputs) {
  ForEachKernel([](bool fma) {
    uint32_t seed = 200;
    for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
      for (DType bias : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
          const Shape s = RaggedMShape(r);
          Problem p = MakeProblem(r, false, true, s.m, s.k, s.n, s.sizes, seed++);
          // Small scales keep the products within F16's range.
          for (auto& v : p.lhs_sf) v *= 0.0625f;
          for (auto& v : p.lhs_s8) v = v == kE8M0Nan ? v : v - 4;
          AddBias(p, bias, seed++);
          p.out_dtype = out;
          SCOPED_TRACE(Name(p) + " bias " + std::string(DTypeName(bias)));
          std::vector<float> want = Naive(p, fma);
          for (float& v : want) v = RoundTo(out, v);
          ExpectBitEqual(RunOp(p), want);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------
// 2. Group edge cases.

TEST(Fp8GroupedGemm, PaddingRowsAreZeroAndNeverRead) {
  // MakeProblem puts NaN data (and NaN scales where a scale covers only
  // padding) past sum(group_sizes); the outputs there must be +0.
  for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
    const Shape s = RaggedMShape(r);
    const Problem p = MakeProblem(r, false, false, s.m, s.k, s.n, s.sizes, 300);
    SCOPED_TRACE(Name(p));
    const std::vector<float> got = RunOp(p);
    for (int64_t i = p.Used() * p.n; i < p.m * p.n; ++i) {
      ASSERT_EQ(FloatBits(got[i]), 0u) << "padding element " << i;
    }
    for (int64_t i = 0; i < p.Used() * p.n; ++i) ASSERT_FALSE(std::isnan(got[i])) << i;
  }
}

TEST(Fp8GroupedGemm, EmptyGroups) {
  for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
    // Ragged M, every group empty: all of out is zero rows.
    {
      const Shape s = RaggedMShape(r);
      const Problem p = MakeProblem(r, false, false, s.m, s.k, s.n, {0, 0, 0}, 310);
      SCOPED_TRACE(Name(p));
      for (float v : RunOp(p)) ASSERT_EQ(FloatBits(v), 0u);
    }
    // Ragged K: an empty group's [K, N] block is zeros, the others are not.
    {
      const Shape s = RaggedKShape(r);
      const Problem p = MakeProblem(r, true, false, s.m, s.k, s.n, s.sizes, 320);
      SCOPED_TRACE(Name(p));
      ASSERT_EQ(p.sizes[1], 0);
      const std::vector<float> got = RunOp(p);
      const int64_t kn = p.k * p.n;
      for (int64_t i = kn; i < 2 * kn; ++i) ASSERT_EQ(FloatBits(got[i]), 0u) << i;
      int64_t nonzero = 0;
      for (int64_t i = 0; i < kn; ++i) nonzero += got[i] != 0.f;
      EXPECT_GT(nonzero, kn / 2);
    }
    // No groups at all.
    {
      const Shape s = RaggedKShape(r);
      const Problem p = MakeProblem(r, true, false, s.m, s.k, s.n, {}, 330);
      EXPECT_TRUE(RunOp(p).empty());
    }
  }
}

// E8M0 code 0xFF is NaN: the block it scales is NaN, nothing else is.
TEST(Fp8GroupedGemm, E8M0NanScaleGivesNan) {
  Problem p = MakeProblem(Recipe::kMxfp8, false, false, 8, 64, 16, {3, 5}, 340);
  p.lhs_s8[4 * (64 / 32) + 1] = kE8M0Nan;  // row 4, k in [32, 64)
  const std::vector<float> got = RunOp(p);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(std::isnan(got[i * 16 + j]), i == 4) << i << "," << j;
  }
}

// ---------------------------------------------------------------------------
// 3. Shards: groups [g0, g1) computed alone (their rows, their experts and the
// matching scale slices) give the same bits as the full op.

template <typename T>
std::vector<T> Slice(const std::vector<T>& v, int64_t first, int64_t count) {
  return std::vector<T>(v.begin() + first, v.begin() + first + count);
}

Problem ShardOf(const Problem& p, int64_t g0, int64_t g1) {
  Problem s = p;
  const int64_t r0 = p.Offset(g0), r1 = p.Offset(g1), rows = r1 - r0;
  s.sizes = Slice(p.sizes, g0, g1 - g0);
  s.m = rows;
  s.lhs = Slice(p.lhs, r0 * p.k, rows * p.k);
  if (p.bias_dtype != DType::kInvalid) {
    s.bias = Slice(p.bias, g0 * p.n, (g1 - g0) * p.n);
    const int e = DTypeSize(p.bias_dtype);
    s.bias_bytes = Slice(p.bias_bytes, g0 * p.n * e, (g1 - g0) * p.n * e);
  }
  // Scale slices: (first, count) in elements.
  int64_t lf, lc, rf, rc;
  if (p.recipe == Recipe::kTensor) {
    lf = rf = g0;
    lc = rc = g1 - g0;
  } else if (!p.ragged_k) {
    const int64_t w = p.k / p.Block();
    lf = r0 * w, lc = rows * w;
    const int64_t per_expert = p.RhsScaleCount() / p.G();
    rf = g0 * per_expert, rc = (g1 - g0) * per_expert;
  } else {
    const int64_t b = p.Block();  // shards start and end on block rows
    EXPECT_EQ(r0 % b, 0);
    EXPECT_EQ(rows % b, 0);
    lf = r0 / b * p.k, lc = rows / b * p.k;
    rf = r0 / b * p.n, rc = rows / b * p.n;
  }
  if (p.e8m0()) {
    s.lhs_s8 = Slice(p.lhs_s8, lf, lc);
    s.rhs_s8 = Slice(p.rhs_s8, rf, rc);
  } else {
    s.lhs_sf = Slice(p.lhs_sf, lf, lc);
    s.rhs_sf = Slice(p.rhs_sf, rf, rc);
  }
  if (p.ragged_k) {
    s.rhs = Slice(p.rhs, r0 * p.n, rows * p.n);
  } else {
    s.rhs = Slice(p.rhs, g0 * p.k * p.n, (g1 - g0) * p.k * p.n);
  }
  return s;
}

TEST(Fp8GroupedGemm, ShardOfGroupsIsBitExact) {
  uint32_t seed = 400;
  for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
    for (bool t : {false, true}) {
      const int64_t k = r == Recipe::kBlock ? 256 : 96, n = r == Recipe::kBlock ? 128 : 48;
      Problem p = MakeProblem(r, false, t, 70, k, n, {12, 20, 0, 31}, seed++);
      AddBias(p, DType::kBF16, seed++);
      SCOPED_TRACE(Name(p));
      const std::vector<float> full = RunOp(p, 2);
      const Problem s = ShardOf(p, 1, 3);
      const std::vector<float> part = RunOp(s, 1);
      const std::vector<float> want(full.begin() + p.Offset(1) * n, full.begin() + p.Offset(3) * n);
      ExpectBitEqual(part, want);
    }
    // Ragged K: group boundaries of the shard on scale-block rows.
    const int64_t b = r == Recipe::kBlock ? 128 : 32;
    Problem p = MakeProblem(r, true, false, 6 * b, 20, 24, {b, 2 * b, 0, b + 5}, seed++);
    SCOPED_TRACE(Name(p));
    const std::vector<float> full = RunOp(p, 2);
    const Problem s = ShardOf(p, 1, 3);
    const std::vector<float> part = RunOp(s, 1);
    const int64_t kn = p.k * p.n;
    ExpectBitEqual(part, std::vector<float>(full.begin() + kn, full.begin() + 3 * kn));
  }
}

// ---------------------------------------------------------------------------
// 4. With GroupedQuantize's own outputs.

struct Quantized {
  std::vector<uint8_t> data, col_data;
  std::vector<uint8_t> scale, col_scale;  // raw bytes
  QuantizeLayout layout;
};

Quantized Quantize(const std::vector<float>& x, int64_t m, int64_t k, const std::vector<int64_t>& sizes,
                   ScalingMode mode, bool colwise = false) {
  GroupedQuantizeArgs a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.m = m;
  a.k = k;
  a.group_sizes = sizes.data();
  a.num_groups = static_cast<int64_t>(sizes.size());
  a.mode = mode;
  a.format = Fp8Format::kE4M3;
  a.rowwise = !colwise;
  a.colwise = colwise;
  Quantized q;
  auto l = GetQuantizeLayout(a);
  EXPECT_TRUE(l.ok()) << l.status();
  q.layout = *l;
  std::vector<float> amax(sizes.size());
  q.data.resize(m * k);
  q.scale.resize((colwise ? l->colwise_scale_elems : l->rowwise_scale_elems) * l->scale_bytes + 4);
  (colwise ? a.colwise_data : a.rowwise_data) = q.data.data();
  (colwise ? a.colwise_scale_inv : a.rowwise_scale_inv) = q.scale.data();
  a.amax = amax.data();
  const absl::Status s = GroupedQuantize(a);
  EXPECT_TRUE(s.ok()) << s;
  return q;
}

std::vector<float> RandomNormal(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double RelativeFrobenius(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    ref += double(want[i]) * want[i];
  }
  return std::sqrt(err / ref);
}

// Numerics sanity: E4M3 with per-group current scaling (3 mantissa bits:
// about 2.5% RMS error per element, ~3.5% per product) stays within 5%
// relative Frobenius error of the F32 GEMM on the unquantized data.
TEST(Fp8GroupedGemm, CurrentScalingIsCloseToF32Gemm) {
  const int64_t M = 80, K = 128, N = 48;
  const std::vector<int64_t> sizes = {30, 0, 40};
  const int64_t G = 3;
  for (int ragged_k = 0; ragged_k < 2; ++ragged_k) {
    for (bool t : {false, true}) {
      if (ragged_k && t) continue;
      SCOPED_TRACE(ragged_k ? "ragged K" : t ? "ragged M rhs^T" : "ragged M");
      const std::vector<float> lhs = RandomNormal(M * K, 500);
      // Ragged M: per-expert scales are quantize's per-group scales of the
      // weights as [G*K, N] (or [G*N, K]) with every group one expert.
      const int64_t rhs_rows = ragged_k ? M : G * (t ? N : K), rhs_cols = ragged_k ? N : (t ? K : N);
      const std::vector<int64_t> rhs_sizes = ragged_k ? sizes : std::vector<int64_t>(G, rhs_rows / G);
      std::vector<float> rhs = RandomNormal(rhs_rows * rhs_cols, 501);
      for (float& v : rhs) v *= 3.f;  // different ranges per operand
      const Quantized ql = Quantize(lhs, M, K, sizes, ScalingMode::kCurrent);
      const Quantized qr = Quantize(rhs, rhs_rows, rhs_cols, rhs_sizes, ScalingMode::kCurrent);
      Fp8GroupedGemmArgs a;
      a.ragged_k = ragged_k;
      a.lhs_dtype = a.rhs_dtype = DType::kF8E4M3;
      a.lhs = ql.data.data();
      a.rhs = qr.data.data();
      a.lhs_scale_inv = ql.scale.data();
      a.rhs_scale_inv = qr.scale.data();
      a.m = M, a.k = K, a.n = N, a.num_groups = G;
      a.group_sizes = sizes.data();
      a.rhs_transposed = t;
      a.out_dtype = DType::kF32;
      const int64_t out_count = ragged_k ? G * K * N : M * N;
      std::vector<float> got(out_count), want(out_count);
      a.out = got.data();
      ASSERT_TRUE(Fp8GroupedGemm(a).ok());
      GroupedGemmArgs f;
      f.lhs_dtype = f.rhs_dtype = f.out_dtype = DType::kF32;
      f.lhs = lhs.data(), f.rhs = rhs.data(), f.out = want.data();
      f.m = M, f.k = K, f.n = N, f.num_groups = G, f.group_sizes = sizes.data();
      f.rhs_transposed = t;
      ASSERT_TRUE((ragged_k ? GroupedGemmRaggedK(f) : GroupedGemmRaggedM(f)).ok());
      const double err = RelativeFrobenius(got, want);
      EXPECT_LT(err, 0.05);
      EXPECT_GT(err, 0.005);  // it did quantize
    }
  }
}

// The MXFP8 and block layouts are GroupedQuantize's blocks, unpadded: its
// outputs, repacked into the contract, give bit for bit the F32 GEMM of
// GroupedDequantize's values (ragged M: activations rowwise, weights [G, N, K]
// rowwise; ragged K: colwise, with group sizes on block boundaries, where
// quantize's per-group blocks and the contract's global ones coincide).
TEST(Fp8GroupedGemm, MatchesGemmOfGroupedDequantize) {
  for (Recipe r : {Recipe::kMxfp8, Recipe::kBlock}) {
    for (int ragged_k = 0; ragged_k < 2; ++ragged_k) {
      SCOPED_TRACE(std::string(RecipeName(r)) + (ragged_k ? " ragged K" : " ragged M"));
      const bool mx = r == Recipe::kMxfp8;
      const int64_t b = mx ? 32 : 128;
      const ScalingMode lhs_mode = mx ? ScalingMode::kMxfp8 : ScalingMode::kBlock1x128;
      const ScalingMode rhs_mode =
          mx ? ScalingMode::kMxfp8 : ragged_k ? ScalingMode::kBlock1x128 : ScalingMode::kBlock128x128;
      const int64_t K = ragged_k ? 64 : 256, N = ragged_k ? 32 : 128;
      const std::vector<int64_t> sizes =
          ragged_k ? std::vector<int64_t>{b, 0, 2 * b} : std::vector<int64_t>{13, 0, 30};
      const int64_t G = 3, M = ragged_k ? 4 * b : 50;
      const int64_t rhs_rows = ragged_k ? M : G * N, rhs_cols = ragged_k ? N : K;
      const std::vector<int64_t> rhs_sizes = ragged_k ? sizes : std::vector<int64_t>(G, N);
      const std::vector<float> lhs = RandomNormal(M * K, 600);
      const std::vector<float> rhs = RandomNormal(rhs_rows * rhs_cols, 601);
      const bool col = ragged_k;
      const Quantized ql = Quantize(lhs, M, K, sizes, lhs_mode, col);
      const Quantized qr = Quantize(rhs, rhs_rows, rhs_cols, rhs_sizes, rhs_mode, col);

      // Dequantized F32 operands (quantize's own inverse).
      auto dequantize = [&](const Quantized& q, ScalingMode mode, int64_t rows, int64_t cols,
                            const std::vector<int64_t>& gs) {
        std::vector<float> out(rows * cols);
        GroupedDequantizeArgs d;
        d.data = q.data.data();
        d.scale_inv = q.scale.data();
        d.colwise = col;
        d.mode = mode;
        d.m = rows, d.k = cols;
        d.group_sizes = gs.data(), d.num_groups = static_cast<int64_t>(gs.size());
        d.out = out.data();
        EXPECT_TRUE(GroupedDequantize(d).ok());
        return out;
      };
      const std::vector<float> lhs32 = dequantize(ql, lhs_mode, M, K, sizes);
      const std::vector<float> rhs32 = dequantize(qr, rhs_mode, rhs_rows, rhs_cols, rhs_sizes);

      // Repack quantize's outputs into the contract's layouts.
      auto repack_rows = [&](const Quantized& q, ScalingMode mode, int64_t rows, int64_t cols,
                             const std::vector<int64_t>& gs, const std::vector<int64_t>& shape,
                             std::vector<uint8_t>* data, std::vector<uint8_t>* scale) {
        const QuantizeLayout& l = q.layout;
        const int64_t sb = l.scale_bytes;
        data->assign(rows * cols, 0);
        const int64_t scale_count =
            std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
        std::vector<uint8_t>& s = *scale;
        s.assign(scale_count * sb + 1, 0);
        for (size_t g = 0; g < gs.size(); ++g) {
          const int64_t off = l.row_offset[g], mg = gs[g];
          const int64_t so = (col ? l.colwise_scale_offset : l.rowwise_scale_offset)[g];
          const int64_t ld = (col ? l.colwise_scale_cols : l.rowwise_scale_cols)[g];
          for (int64_t i = 0; i < mg; ++i) {
            for (int64_t c = 0; c < cols; ++c) {
              // Colwise non-MX data is per group [cols, m_g]; MX colwise is [rows, cols].
              const bool tr = col && mode != ScalingMode::kMxfp8;
              (*data)[(off + i) * cols + c] = q.data[tr ? off * cols + c * mg + i : (off + i) * cols + c];
              int64_t src, dst;
              if (col) {  // contract [rows/b, cols]; quantize [ceil(m_g/b), ld] per group
                src = so + (i / b) * ld + c;
                dst = ((off + i) / b) * cols + c;
              } else if (mode == ScalingMode::kMxfp8) {  // [rows, cols/32]; quantize [.., ld]
                src = so + i * ld + c / 32;
                dst = (off + i) * (cols / 32) + c / 32;
              } else if (mode == ScalingMode::kBlock1x128) {  // [rows, cols/128]; quantize [cols/128, ld]
                src = so + (c / 128) * ld + i;
                dst = (off + i) * (cols / 128) + c / 128;
              } else {  // 128x128 weights: [G, N/128, K/128]; quantize per group [N/128, ld]
                src = so + (i / 128) * ld + c / 128;
                dst = (off + i) / 128 * (cols / 128) + c / 128;
              }
              ASSERT_LT(dst, scale_count);
              std::memcpy(&s[dst * sb], &q.scale[src * sb], sb);
            }
          }
        }
      };
      Fp8GroupedGemmArgs a;
      a.ragged_k = ragged_k;
      a.lhs_dtype = a.rhs_dtype = DType::kF8E4M3;
      a.lhs_mode = lhs_mode, a.rhs_mode = rhs_mode;
      a.m = M, a.k = K, a.n = N, a.num_groups = G, a.group_sizes = sizes.data();
      a.rhs_transposed = !ragged_k;
      a.out_dtype = DType::kF32;
      // Every scale quantize wrote lands inside the contract's scale tensors.
      std::vector<uint8_t> ld8, ls, rd8, rs;
      repack_rows(ql, lhs_mode, M, K, sizes, Fp8LhsScaleShape(a), &ld8, &ls);
      repack_rows(qr, rhs_mode, rhs_rows, rhs_cols, rhs_sizes, Fp8RhsScaleShape(a), &rd8, &rs);
      a.lhs = ld8.data(), a.rhs = rd8.data();
      a.lhs_scale_inv = ls.data(), a.rhs_scale_inv = rs.data();
      const int64_t out_count = ragged_k ? G * K * N : M * N;
      std::vector<float> got(out_count), want(out_count);
      a.out = got.data();
      const absl::Status st = Fp8GroupedGemm(a);
      ASSERT_TRUE(st.ok()) << st;
      GroupedGemmArgs f;
      f.lhs_dtype = f.rhs_dtype = f.out_dtype = DType::kF32;
      f.lhs = lhs32.data(), f.rhs = rhs32.data(), f.out = want.data();
      f.m = M, f.k = K, f.n = N, f.num_groups = G, f.group_sizes = sizes.data();
      f.rhs_transposed = !ragged_k;
      ASSERT_TRUE((ragged_k ? GroupedGemmRaggedK(f) : GroupedGemmRaggedM(f)).ok());
      ExpectBitEqual(got, want);
    }
  }
}

// ---------------------------------------------------------------------------
// 5. Scale shapes and bad input.

TEST(Fp8GroupedGemm, ScaleShapes) {
  Fp8GroupedGemmArgs a;
  a.m = 256, a.k = 512, a.n = 384, a.num_groups = 4;
  // Ragged M.
  a.lhs_mode = ScalingMode::kCurrent, a.rhs_mode = ScalingMode::kDelayed;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(4));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4));
  a.lhs_mode = a.rhs_mode = ScalingMode::kMxfp8;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(256, 16));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4, 16, 384));
  a.rhs_transposed = true;
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4, 384, 16));
  a.lhs_mode = ScalingMode::kBlock1x128, a.rhs_mode = ScalingMode::kBlock128x128;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(256, 4));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4, 3, 4));
  a.rhs_transposed = false;
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4, 4, 3));
  // Ragged K.
  a.ragged_k = true;
  a.lhs_mode = a.rhs_mode = ScalingMode::kDelayed;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(4));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(4));
  a.lhs_mode = a.rhs_mode = ScalingMode::kMxfp8;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(8, 512));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(8, 384));
  a.lhs_mode = a.rhs_mode = ScalingMode::kBlock1x128;
  EXPECT_THAT(Fp8LhsScaleShape(a), ElementsAre(2, 512));
  EXPECT_THAT(Fp8RhsScaleShape(a), ElementsAre(2, 384));
  // Not a recipe: no shape.
  a.rhs_mode = ScalingMode::kBlock128x128;
  EXPECT_TRUE(Fp8LhsScaleShape(a).empty());
  EXPECT_TRUE(Fp8RhsScaleShape(a).empty());
}

TEST(Fp8GroupedGemm, ValidArgsPass) {
  for (Recipe r : {Recipe::kTensor, Recipe::kMxfp8, Recipe::kBlock}) {
    for (bool rk : {false, true}) {
      const Shape s = rk ? RaggedKShape(r) : RaggedMShape(r);
      const Problem p = MakeProblem(r, rk, false, s.m, s.k, s.n, s.sizes, 700);
      float out;
      const absl::Status st = ValidateFp8GroupedGemmArgs(p.Args(&out));
      EXPECT_TRUE(st.ok()) << Name(p) << ": " << st;
    }
  }
}

TEST(Fp8GroupedGemm, BadArgsNameTheField) {
  const Shape s = RaggedMShape(Recipe::kBlock);
  const Problem block = MakeProblem(Recipe::kBlock, false, false, s.m, s.k, s.n, s.sizes, 800);
  const Shape sm = RaggedMShape(Recipe::kMxfp8);
  const Problem mx = MakeProblem(Recipe::kMxfp8, false, false, sm.m, sm.k, sm.n, sm.sizes, 801);
  const Shape sk = RaggedKShape(Recipe::kTensor);
  const Problem rk = MakeProblem(Recipe::kTensor, true, false, sk.m, sk.k, sk.n, sk.sizes, 802);
  std::vector<float> out(1 << 16);
  const Fp8GroupedGemmArgs good = block.Args(out.data());
  ASSERT_TRUE(ValidateFp8GroupedGemmArgs(good).ok());
  struct Bad {
    const char* what;
    Fp8GroupedGemmArgs args;
    absl::StatusCode code;
    std::vector<std::string> substrs;
  };
  std::vector<Bad> cases;
  auto add = [&](const char* what, Fp8GroupedGemmArgs a, absl::StatusCode code,
                 std::vector<std::string> substrs) { cases.push_back({what, a, code, substrs}); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  {
    Fp8GroupedGemmArgs a = mx.Args(out.data());
    a.rhs_mode = ScalingMode::kBlock128x128;
    add("mode pair", a, absl::StatusCode::kUnimplemented,
        {"lhs_mode/rhs_mode", "mxfp8 x block_128x128", "not an FP8 GEMM recipe"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs_mode = ScalingMode::kCurrent;  // tensor x block
    add("tensor x block", a, absl::StatusCode::kUnimplemented, {"current x block_128x128"});
  }
  {
    Fp8GroupedGemmArgs a = rk.Args(out.data());
    a.lhs_mode = a.rhs_mode = ScalingMode::kBlock128x128;
    add("ragged K 128x128", a, absl::StatusCode::kUnimplemented, {"block_128x128 x block_128x128", "ragged K"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs_dtype = a.rhs_dtype = DType::kF8E5M2;
    add("e5m2 x e5m2", a, kInvalid, {"lhs_dtype/rhs_dtype", "f8e5m2 x f8e5m2"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs_dtype = DType::kBF16;
    add("lhs not fp8", a, kInvalid, {"lhs_dtype", "bf16"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.rhs_dtype = DType::kE8M0;
    add("rhs not fp8", a, kInvalid, {"rhs_dtype", "e8m0"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.out_dtype = DType::kF8E4M3;
    add("fp8 out", a, kInvalid, {"out_dtype", "f8e4m3"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.k = 200;  // lhs is large enough; K is simply not a multiple of 128
    add("block k", a, kInvalid, {"k: 200 is not a multiple of 128", "block_1x128"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.n = 100;
    add("block n", a, kInvalid, {"n: 100 is not a multiple of 128", "rhs block_128x128"});
  }
  {
    Fp8GroupedGemmArgs a = mx.Args(out.data());
    a.k = 80;
    add("mxfp8 k", a, kInvalid, {"k: 80 is not a multiple of 32", "mxfp8"});
  }
  {
    Fp8GroupedGemmArgs a = rk.Args(out.data());
    a.lhs_mode = a.rhs_mode = ScalingMode::kMxfp8;
    a.m = 70;
    add("ragged K mxfp8 m", a, kInvalid, {"m: 70 is not a multiple of 32"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs_scale_inv = nullptr;
    add("null lhs scale", a, kInvalid, {"lhs_scale_inv: null"});
  }
  {
    Fp8GroupedGemmArgs a = rk.Args(out.data());
    a.rhs_scale_inv = nullptr;
    add("null rhs scale", a, kInvalid, {"rhs_scale_inv: null"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs = nullptr;
    add("null lhs", a, kInvalid, {"lhs: null"});
  }
  {
    Fp8GroupedGemmArgs a = rk.Args(out.data());
    const float bias[64] = {};
    a.bias = bias;
    a.bias_dtype = DType::kF32;
    add("bias with ragged K", a, kInvalid, {"bias", "ragged-K"});
  }
  {
    Fp8GroupedGemmArgs a = rk.Args(out.data());
    a.rhs_transposed = true;
    add("transposed with ragged K", a, kInvalid, {"rhs_transposed"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.n = -128;
    add("negative n", a, kInvalid, {"n: negative"});
  }
  static const int64_t too_many[] = {40, 10};
  {
    Fp8GroupedGemmArgs a = good;
    a.group_sizes = too_many;
    a.num_groups = 2;
    add("sum > m", a, kInvalid, {"group_sizes", "exceeds m=45"});
  }
  static const int64_t negative[] = {5, -1};
  {
    Fp8GroupedGemmArgs a = good;
    a.group_sizes = negative;
    a.num_groups = 2;
    add("negative group", a, kInvalid, {"group_sizes[1]: negative"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.m = int64_t{1} << 40;
    a.k = int64_t{1} << 30;
    add("overflow", a, kInvalid, {"lhs (m * k)", "overflows"});
  }
  {
    Fp8GroupedGemmArgs a = good;
    a.lhs_mode = static_cast<ScalingMode>(9);
    add("unknown mode", a, kInvalid, {"lhs_mode: unknown scaling mode 9"});
  }
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status st = ValidateFp8GroupedGemmArgs(c.args);
    EXPECT_EQ(st.code(), c.code) << st;
    for (const std::string& sub : c.substrs) EXPECT_THAT(std::string(st.message()), HasSubstr(sub));
    // The op itself refuses the same way, writing nothing.
    EXPECT_EQ(Fp8GroupedGemm(c.args).code(), c.code);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace shardgemm
