#include "kernels/cpu/grouped_gemm.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grouped_gemm_internal.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cpu {
namespace {

using internal::GemmKernel;
using ::testing::HasSubstr;

// A tensor stored in `dtype`, with its exact FP32 values alongside.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<float> values;  // exact values of the stored elements
  std::vector<uint8_t> bytes;
  const void* data() const { return bytes.data(); }
  void* mutable_data() { return bytes.data(); }
};

void Store(DType dtype, float v, void* dst, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(dst)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(dst)[i] = FloatToBF16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(dst)[i] = FloatToF16(v);
      break;
    default:
      FAIL() << "bad dtype";
  }
}

float Load(DType dtype, const void* src, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(src)[i];
    case DType::kBF16:
      return BF16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(src)[i]);
    default:
      return std::nanf("");
  }
}

Tensor Random(DType dtype, int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  Tensor t;
  t.dtype = dtype;
  t.values.resize(n);
  t.bytes.resize(n * DTypeSize(dtype) + 1);  // +1: never a null data() for n == 0
  for (int64_t i = 0; i < n; ++i) {
    Store(dtype, dist(rng), t.bytes.data(), i);
    t.values[i] = Load(dtype, t.bytes.data(), i);
  }
  return t;
}

// Output buffer filled with NaNs, so elements the kernel fails to write show up.
Tensor Output(DType dtype, int64_t n) {
  Tensor t;
  t.dtype = dtype;
  t.bytes.resize(n * DTypeSize(dtype) + 1);
  for (int64_t i = 0; i < n; ++i) Store(dtype, std::nanf(""), t.bytes.data(), i);
  return t;
}

std::vector<float> Decode(const Tensor& t, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = Load(t.dtype, t.data(), i);
  return v;
}

// Puts NaN into rows [from, m) of a row-major [m, cols] tensor (rows the
// kernels must not read).
void PoisonRows(Tensor& t, int64_t from, int64_t m, int64_t cols) {
  for (int64_t i = from * cols; i < m * cols; ++i) {
    Store(t.dtype, std::nanf(""), t.mutable_data(), i);
    t.values[i] = 0.f;  // the reference ignores these rows anyway
  }
}

double OutEps(DType d) {
  switch (d) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);  // half an ulp, relative
    case DType::kF16:
      return std::ldexp(1.0, -11);
    default:
      return 0.0;
  }
}

// Tolerance for one element: FP32 accumulation over `depth` terms. Rounding
// errors of a sequential sum of random-sign terms grow like sqrt(depth) * eps
// times sum |a*b|; we allow 4 * sqrt(depth + 1) * 2^-24 * sum|a*b| (about 4x
// the typical growth, far below the worst case depth * eps), plus one
// rounding to the output dtype and a tiny absolute term for F16 subnormals.
double Tolerance(double sum_abs, double ref, int64_t depth, DType out) {
  return 4.0 * std::sqrt(static_cast<double>(depth) + 1.0) * std::ldexp(1.0, -24) * sum_abs +
         OutEps(out) * std::fabs(ref) * 1.0001 + 1e-7;
}

struct Case {
  DType lhs = DType::kF32, rhs = DType::kF32, out = DType::kF32, bias = DType::kInvalid;
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> sizes;
  bool transposed = false;
  int threads = 0;
};

std::string Name(const Case& c) {
  std::string s = std::string(DTypeName(c.lhs)) + "x" + std::string(DTypeName(c.rhs)) + "->" +
                  std::string(DTypeName(c.out));
  if (c.bias != DType::kInvalid) s += "+bias(" + std::string(DTypeName(c.bias)) + ")";
  if (c.transposed) s += " T";
  s += " m=" + std::to_string(c.m) + " k=" + std::to_string(c.k) + " n=" + std::to_string(c.n) +
       " G=" + std::to_string(c.sizes.size()) + " threads=" + std::to_string(c.threads);
  return s;
}

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), 0LL); }

// Runs ragged-M and checks it against a double-precision reference.
void CheckRaggedM(const Case& c, uint32_t seed = 1) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(seed);
  const int64_t G = c.sizes.size(), M = c.m, K = c.k, N = c.n;
  const int64_t used = Sum(c.sizes);
  Tensor lhs = Random(c.lhs, M * K, rng);
  PoisonRows(lhs, used, M, K);  // padding rows must not be read
  Tensor rhs = Random(c.rhs, G * K * N, rng);
  Tensor bias;
  if (c.bias != DType::kInvalid) bias = Random(c.bias, G * N, rng);
  Tensor out = Output(c.out, M * N);
  GroupedGemmArgs a;
  a.lhs_dtype = c.lhs;
  a.rhs_dtype = c.rhs;
  a.out_dtype = c.out;
  a.bias_dtype = c.bias;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.bias = c.bias != DType::kInvalid ? bias.data() : nullptr;
  a.out = out.mutable_data();
  a.m = M;
  a.k = K;
  a.n = N;
  a.num_groups = G;
  a.group_sizes = c.sizes.data();
  a.rhs_transposed = c.transposed;
  if (c.transposed) {
    // rhs values were generated as [G, K, N]; lay them out as [G, N, K].
    Tensor t = rhs;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t p = 0; p < K; ++p)
        for (int64_t j = 0; j < N; ++j)
          std::memcpy(t.bytes.data() + ((g * N + j) * K + p) * DTypeSize(c.rhs),
                      rhs.bytes.data() + ((g * K + p) * N + j) * DTypeSize(c.rhs),
                      DTypeSize(c.rhs));
    t.values = rhs.values;
    rhs = t;
    a.rhs = rhs.data();
  }
  ASSERT_TRUE(GroupedGemmRaggedM(a, c.threads).ok());
  const std::vector<float> got = Decode(out, M * N);
  int64_t row = 0, bad = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = row; i < row + c.sizes[g]; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0, sum_abs = 0;
        for (int64_t p = 0; p < K; ++p) {
          const double prod =
              double(lhs.values[i * K + p]) * double(rhs.values[(g * K + p) * N + j]);
          ref += prod;
          sum_abs += std::fabs(prod);
        }
        if (c.bias != DType::kInvalid) {
          ref += bias.values[g * N + j];
          sum_abs += std::fabs(bias.values[g * N + j]);
        }
        const double err = std::fabs(got[i * N + j] - ref);
        if (!(err <= Tolerance(sum_abs, ref, K, c.out)) && ++bad <= 5) {
          ADD_FAILURE() << "row " << i << " col " << j << ": got " << got[i * N + j]
                        << " want " << ref << " (tol " << Tolerance(sum_abs, ref, K, c.out)
                        << ")";
        }
      }
    }
    row += c.sizes[g];
  }
  for (int64_t i = used * N; i < M * N; ++i) {
    // Padding rows are +0 exactly.
    if (!(got[i] == 0.f && !std::signbit(got[i])) && ++bad <= 5) {
      ADD_FAILURE() << "padding element " << i << " is " << got[i];
    }
  }
  EXPECT_EQ(bad, 0);
}

void CheckRaggedK(const Case& c, uint32_t seed = 2) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(seed);
  const int64_t G = c.sizes.size(), M = c.m, K = c.k, N = c.n;
  const int64_t used = Sum(c.sizes);
  Tensor lhs = Random(c.lhs, M * K, rng);
  Tensor rhs = Random(c.rhs, M * N, rng);
  PoisonRows(lhs, used, M, K);  // rows past the sum must be ignored
  PoisonRows(rhs, used, M, N);
  Tensor out = Output(c.out, G * K * N);
  GroupedGemmArgs a;
  a.lhs_dtype = c.lhs;
  a.rhs_dtype = c.rhs;
  a.out_dtype = c.out;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.out = out.mutable_data();
  a.m = M;
  a.k = K;
  a.n = N;
  a.num_groups = G;
  a.group_sizes = c.sizes.data();
  ASSERT_TRUE(GroupedGemmRaggedK(a, c.threads).ok());
  const std::vector<float> got = Decode(out, G * K * N);
  int64_t row = 0, bad = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t mg = c.sizes[g];
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0, sum_abs = 0;
        for (int64_t p = row; p < row + mg; ++p) {
          const double prod = double(lhs.values[p * K + i]) * double(rhs.values[p * N + j]);
          ref += prod;
          sum_abs += std::fabs(prod);
        }
        const float v = got[(g * K + i) * N + j];
        const double err = std::fabs(v - ref);
        bool ok = err <= Tolerance(sum_abs, ref, mg, c.out);
        if (mg == 0) ok = v == 0.f && !std::signbit(v);  // empty group: +0 exactly
        if (!ok && ++bad <= 5) {
          ADD_FAILURE() << "group " << g << " (" << i << ", " << j << "): got " << v
                        << " want " << ref;
        }
      }
    }
    row += mg;
  }
  EXPECT_EQ(bad, 0);
}

// Runs `body` once per micro-kernel family this CPU supports.
template <typename F>
void ForEachKernel(F body) {
  for (GemmKernel k : {GemmKernel::kPortable, GemmKernel::kAvx2, GemmKernel::kAvx512}) {
    if (!internal::SetGemmKernelForTesting(k)) continue;
    SCOPED_TRACE(internal::ActiveGemmKernelName());
    body();
  }
  internal::SetGemmKernelForTesting(GemmKernel::kAuto);
}

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(GroupedGemmRaggedM, AllDtypeCombos) {
  ForEachKernel([] {
    for (DType l : kTypes)
      for (DType r : kTypes)
        for (DType o : kTypes) {
          Case c;
          c.lhs = l;
          c.rhs = r;
          c.out = o;
          c.m = 40;
          c.k = 37;
          c.n = 45;
          c.sizes = {5, 0, 17, 11};  // 7 padding rows
          CheckRaggedM(c);
        }
  });
}

TEST(GroupedGemmRaggedM, TransposedRhs) {
  ForEachKernel([] {
    for (DType r : kTypes) {
      Case c;
      c.rhs = r;
      c.lhs = DType::kBF16;
      c.out = DType::kF32;
      c.m = 70;
      c.k = 300;  // > one K block, not a multiple
      c.n = 50;
      c.sizes = {33, 30};
      c.transposed = true;
      CheckRaggedM(c);
    }
  });
}

TEST(GroupedGemmRaggedM, Bias) {
  ForEachKernel([] {
    for (DType b : kTypes)
      for (bool t : {false, true}) {
        Case c;
        c.lhs = DType::kF32;
        c.rhs = DType::kBF16;
        c.out = DType::kBF16;
        c.bias = b;
        c.m = 30;
        c.k = 20;
        c.n = 35;
        c.sizes = {10, 0, 19};
        c.transposed = t;
        CheckRaggedM(c);
      }
  });
}

TEST(GroupedGemmRaggedM, ShapesAndThreads) {
  ForEachKernel([] {
    struct S {
      int64_t m, k, n;
      std::vector<int64_t> sizes;
    } shapes[] = {
        {1, 1, 1, {1}},                   // G=1, scalars
        {13, 1, 3, {13}},                 // K=1
        {600, 515, 257, {600}},           // G=1, many row blocks, K and N ragged
        {300, 700, 90, {1, 150, 2, 97}},  // tiny groups next to large ones
        {50, 0, 20, {20, 30}},            // K=0: out = 0
        {20, 10, 33, {}},                 // no groups: all padding
        {20, 10, 33, {0, 0, 0}},          // all groups empty
        {0, 10, 33, {0}},                 // m=0
        {20, 10, 0, {10, 5}},             // n=0
    };
    for (const S& s : shapes)
      for (int threads : {1, 2, 3}) {
        Case c;
        c.lhs = DType::kF32;
        c.rhs = DType::kF32;
        c.out = DType::kF32;
        c.m = s.m;
        c.k = s.k;
        c.n = s.n;
        c.sizes = s.sizes;
        c.threads = threads;
        c.bias = DType::kF32;
        CheckRaggedM(c);
      }
  });
}

TEST(GroupedGemmRaggedK, AllDtypeCombos) {
  ForEachKernel([] {
    for (DType l : kTypes)
      for (DType r : kTypes)
        for (DType o : kTypes) {
          Case c;
          c.lhs = l;
          c.rhs = r;
          c.out = o;
          c.m = 50;
          c.k = 19;
          c.n = 37;
          c.sizes = {7, 0, 30, 6};  // group 1 empty, 7 rows past the sum
          CheckRaggedK(c);
        }
  });
}

TEST(GroupedGemmRaggedK, ShapesAndThreads) {
  ForEachKernel([] {
    struct S {
      int64_t m, k, n;
      std::vector<int64_t> sizes;
    } shapes[] = {
        {1, 1, 1, {1}},
        {600, 130, 70, {600}},       // long contracting dim (> 2 blocks), G=1
        {520, 45, 300, {0, 517, 3}}, // empty group, N > tile width
        {10, 8, 8, {0, 0}},          // all empty: zeros
        {0, 8, 8, {0, 0}},           // m=0: zeros
        {10, 0, 8, {5, 5}},          // k=0
        {10, 8, 0, {5, 5}},          // n=0
    };
    for (const S& s : shapes)
      for (int threads : {1, 2, 3}) {
        Case c;
        c.lhs = DType::kBF16;
        c.rhs = DType::kF32;
        c.out = DType::kF32;
        c.m = s.m;
        c.k = s.k;
        c.n = s.n;
        c.sizes = s.sizes;
        c.threads = threads;
        CheckRaggedK(c);
      }
  });
}

// ---------------------------------------------------------------------------
// Determinism: the documented summation order, and bit-exact shards.

// The documented order: acc = +0; acc = fma(a_p, b_p, acc) for p = 0..K-1
// (FMA kernels) or acc = acc + a_p * b_p (portable kernel).
float SequentialDot(const float* a, int64_t as, const float* b, int64_t bs, int64_t depth,
                    bool fma) {
  float acc = 0.f;
  for (int64_t p = 0; p < depth; ++p) {
    if (fma) {
      acc = std::fma(a[p * as], b[p * bs], acc);
    } else {
      volatile float prod = a[p * as] * b[p * bs];  // no contraction
      acc = acc + prod;
    }
  }
  return acc;
}

TEST(GroupedGemmDeterminism, MatchesDocumentedSummationOrder) {
  ForEachKernel([] {
    const bool fma = std::string(internal::ActiveGemmKernelName()) != "portable";
    std::mt19937 rng(7);
    const int64_t M = 40, K = 700, N = 70;
    const std::vector<int64_t> sizes = {13, 27};
    Tensor lhs = Random(DType::kBF16, M * K, rng);
    Tensor rhs = Random(DType::kF32, 2 * K * N, rng);
    Tensor out = Output(DType::kF32, M * N);
    GroupedGemmArgs a;
    a.lhs_dtype = DType::kBF16;
    a.rhs_dtype = DType::kF32;
    a.out_dtype = DType::kF32;
    a.lhs = lhs.data();
    a.rhs = rhs.data();
    a.out = out.mutable_data();
    a.m = M;
    a.k = K;
    a.n = N;
    a.num_groups = 2;
    a.group_sizes = sizes.data();
    ASSERT_TRUE(GroupedGemmRaggedM(a, 2).ok());
    const std::vector<float> got = Decode(out, M * N);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t g = i < 13 ? 0 : 1;
      for (int64_t j = 0; j < N; ++j) {
        const float want =
            SequentialDot(&lhs.values[i * K], 1, &rhs.values[g * K * N + j], N, K, fma);
        ASSERT_EQ(got[i * N + j], want) << i << "," << j;
      }
    }
    // Ragged-K: the contracting index is the group's row.
    Tensor lhs2 = Random(DType::kF32, M * 9, rng);
    Tensor rhs2 = Random(DType::kF16, M * N, rng);
    Tensor out2 = Output(DType::kF32, 2 * 9 * N);
    GroupedGemmArgs b;
    b.lhs_dtype = DType::kF32;
    b.rhs_dtype = DType::kF16;
    b.out_dtype = DType::kF32;
    b.lhs = lhs2.data();
    b.rhs = rhs2.data();
    b.out = out2.mutable_data();
    b.m = M;
    b.k = 9;
    b.n = N;
    b.num_groups = 2;
    b.group_sizes = sizes.data();
    ASSERT_TRUE(GroupedGemmRaggedK(b, 2).ok());
    const std::vector<float> got2 = Decode(out2, 2 * 9 * N);
    for (int64_t g = 0; g < 2; ++g) {
      const int64_t r0 = g == 0 ? 0 : 13;
      for (int64_t i = 0; i < 9; ++i)
        for (int64_t j = 0; j < N; ++j) {
          const float want = SequentialDot(&lhs2.values[r0 * 9 + i], 9,
                                           &rhs2.values[r0 * N + j], N, sizes[g], fma);
          ASSERT_EQ(got2[(g * 9 + i) * N + j], want) << g << ":" << i << "," << j;
        }
    }
  });
}

// Bitwise comparison of two byte buffers of float data.
void ExpectBitEqual(const void* x, const void* y, size_t bytes, const std::string& what) {
  EXPECT_EQ(std::memcmp(x, y, bytes), 0) << what;
}

// A shard of ragged-M: a sub-range of rows of one group, computed as its own
// call (different M, different group position, a subset of columns, other
// thread counts) must equal the corresponding part of the full GEMM bit for bit.
TEST(GroupedGemmDeterminism, RaggedMShardsAreBitExact) {
  ForEachKernel([] {
    std::mt19937 rng(11);
    const int64_t M = 260, K = 530, N = 300, G = 3;
    const std::vector<int64_t> sizes = {100, 37, 120};  // 3 padding rows
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      Tensor lhs = Random(DType::kBF16, M * K, rng);
      Tensor rhs = Random(DType::kBF16, G * K * N, rng);
      Tensor bias = Random(DType::kF32, G * N, rng);
      const int64_t os = DTypeSize(out_dtype);
      GroupedGemmArgs full;
      full.lhs_dtype = DType::kBF16;
      full.rhs_dtype = DType::kBF16;
      full.out_dtype = out_dtype;
      full.bias_dtype = DType::kF32;
      full.lhs = lhs.data();
      full.rhs = rhs.data();
      full.bias = bias.data();
      full.m = M;
      full.k = K;
      full.n = N;
      full.num_groups = G;
      full.group_sizes = sizes.data();
      Tensor ref = Output(out_dtype, M * N);
      full.out = ref.mutable_data();
      ASSERT_TRUE(GroupedGemmRaggedM(full, 1).ok());
      for (int threads : {2, 3, 5}) {
        Tensor o = Output(out_dtype, M * N);
        GroupedGemmArgs a = full;
        a.out = o.mutable_data();
        ASSERT_TRUE(GroupedGemmRaggedM(a, threads).ok());
        ExpectBitEqual(o.data(), ref.data(), M * N * os, "threads=" + std::to_string(threads));
      }
      // Rows 50..140 span groups 0 (rows 50..99), 1 (100..136) and 2 (137..139);
      // as a shard they are groups {50, 37, 3} of an M=97 call (plus 4 padding
      // rows at the end), and group 0 there is a different row count.
      {
        const int64_t r0 = 50, rows = 90;
        const std::vector<int64_t> shard_sizes = {50, 37, 3};
        GroupedGemmArgs a = full;
        a.lhs = lhs.bytes.data() + r0 * K * 2;
        a.m = rows + 4;
        std::vector<uint8_t> lhs_pad(a.m * K * 2, 0xff);  // NaN padding rows
        std::memcpy(lhs_pad.data(), a.lhs, rows * K * 2);
        a.lhs = lhs_pad.data();
        a.group_sizes = shard_sizes.data();
        for (int threads : {1, 2}) {
          Tensor o = Output(out_dtype, a.m * N);
          a.out = o.mutable_data();
          ASSERT_TRUE(GroupedGemmRaggedM(a, threads).ok());
          ExpectBitEqual(o.data(), ref.bytes.data() + r0 * N * os, rows * N * os,
                         "row shard, threads=" + std::to_string(threads));
        }
      }
      // Group 2 alone, as group 0 of a G=1 call, on a column shard [70, 231).
      {
        const int64_t j0 = 70, nc = 161, r0 = 137;
        std::vector<uint8_t> rhs_shard(K * nc * 2), bias_shard(nc * 4);
        for (int64_t p = 0; p < K; ++p)
          std::memcpy(rhs_shard.data() + p * nc * 2,
                      rhs.bytes.data() + ((2 * K + p) * N + j0) * 2, nc * 2);
        std::memcpy(bias_shard.data(), bias.bytes.data() + (2 * N + j0) * 4, nc * 4);
        const std::vector<int64_t> one = {120};
        GroupedGemmArgs a = full;
        a.lhs = lhs.bytes.data() + r0 * K * 2;
        a.rhs = rhs_shard.data();
        a.bias = bias_shard.data();
        a.m = 120;
        a.n = nc;
        a.num_groups = 1;
        a.group_sizes = one.data();
        for (int threads : {1, 2, 4}) {
          Tensor o = Output(out_dtype, 120 * nc);
          a.out = o.mutable_data();
          ASSERT_TRUE(GroupedGemmRaggedM(a, threads).ok());
          for (int64_t i = 0; i < 120; ++i)
            ExpectBitEqual(o.bytes.data() + i * nc * os,
                           ref.bytes.data() + ((r0 + i) * N + j0) * os, nc * os,
                           "column shard row " + std::to_string(i));
        }
      }
      // The same GEMM with rhs transposed is bit-identical too.
      {
        std::vector<uint8_t> rhs_t(G * K * N * 2);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t p = 0; p < K; ++p)
            for (int64_t j = 0; j < N; ++j)
              std::memcpy(rhs_t.data() + ((g * N + j) * K + p) * 2,
                          rhs.bytes.data() + ((g * K + p) * N + j) * 2, 2);
        GroupedGemmArgs a = full;
        a.rhs = rhs_t.data();
        a.rhs_transposed = true;
        Tensor o = Output(out_dtype, M * N);
        a.out = o.mutable_data();
        ASSERT_TRUE(GroupedGemmRaggedM(a, 2).ok());
        ExpectBitEqual(o.data(), ref.data(), M * N * os, "transposed rhs");
      }
    }
  });
}

// Ragged-K shards: a group computed alone at another position, a subset of
// the K rows of out (a column slice of lhs) and of its N columns, other
// thread counts: all bit-identical.
TEST(GroupedGemmDeterminism, RaggedKShardsAreBitExact) {
  ForEachKernel([] {
    std::mt19937 rng(13);
    const int64_t M = 700, K = 150, N = 90, G = 3;
    const std::vector<int64_t> sizes = {300, 0, 390};  // 10 rows ignored
    Tensor lhs = Random(DType::kF16, M * K, rng);
    Tensor rhs = Random(DType::kBF16, M * N, rng);
    GroupedGemmArgs full;
    full.lhs_dtype = DType::kF16;
    full.rhs_dtype = DType::kBF16;
    full.out_dtype = DType::kF32;
    full.lhs = lhs.data();
    full.rhs = rhs.data();
    full.m = M;
    full.k = K;
    full.n = N;
    full.num_groups = G;
    full.group_sizes = sizes.data();
    Tensor ref = Output(DType::kF32, G * K * N);
    full.out = ref.mutable_data();
    ASSERT_TRUE(GroupedGemmRaggedK(full, 1).ok());
    for (int threads : {2, 3}) {
      Tensor o = Output(DType::kF32, G * K * N);
      GroupedGemmArgs a = full;
      a.out = o.mutable_data();
      ASSERT_TRUE(GroupedGemmRaggedK(a, threads).ok());
      ExpectBitEqual(o.data(), ref.data(), G * K * N * 4, "threads=" + std::to_string(threads));
    }
    // Group 2 (rows 300..689) as the only group, columns k in [40, 117) of
    // lhs and n in [5, 66) of rhs.
    const int64_t r0 = 300, mg = 390, k0 = 40, kc = 77, n0 = 5, nc = 61;
    std::vector<uint16_t> l(mg * kc), r(mg * nc);
    for (int64_t p = 0; p < mg; ++p) {
      std::memcpy(&l[p * kc], lhs.bytes.data() + ((r0 + p) * K + k0) * 2, kc * 2);
      std::memcpy(&r[p * nc], rhs.bytes.data() + ((r0 + p) * N + n0) * 2, nc * 2);
    }
    const std::vector<int64_t> one = {mg};
    GroupedGemmArgs a = full;
    a.lhs = l.data();
    a.rhs = r.data();
    a.m = mg;
    a.k = kc;
    a.n = nc;
    a.num_groups = 1;
    a.group_sizes = one.data();
    for (int threads : {1, 2}) {
      std::vector<float> o(kc * nc);
      a.out = o.data();
      ASSERT_TRUE(GroupedGemmRaggedK(a, threads).ok());
      for (int64_t i = 0; i < kc; ++i)
        ExpectBitEqual(&o[i * nc], ref.bytes.data() + ((2 * K + k0 + i) * N + n0) * 4, nc * 4,
                       "shard row " + std::to_string(i));
    }
  });
}

// AVX2 and AVX-512 kernels both use one FMA per step in the same order.
TEST(GroupedGemmDeterminism, FmaKernelsAgreeBitwise) {
  if (!internal::SetGemmKernelForTesting(GemmKernel::kAvx2) ||
      !internal::SetGemmKernelForTesting(GemmKernel::kAvx512)) {
    GTEST_SKIP() << "needs AVX2 and AVX-512";
  }
  std::mt19937 rng(17);
  const int64_t M = 100, K = 333, N = 77;
  const std::vector<int64_t> sizes = {60, 40};
  Tensor lhs = Random(DType::kF32, M * K, rng);
  Tensor rhs = Random(DType::kF32, 2 * K * N, rng);
  std::vector<float> o1(M * N), o2(M * N);
  GroupedGemmArgs a;
  a.lhs_dtype = a.rhs_dtype = a.out_dtype = DType::kF32;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.m = M;
  a.k = K;
  a.n = N;
  a.num_groups = 2;
  a.group_sizes = sizes.data();
  internal::SetGemmKernelForTesting(GemmKernel::kAvx2);
  a.out = o1.data();
  ASSERT_TRUE(GroupedGemmRaggedM(a).ok());
  internal::SetGemmKernelForTesting(GemmKernel::kAvx512);
  a.out = o2.data();
  ASSERT_TRUE(GroupedGemmRaggedM(a).ok());
  internal::SetGemmKernelForTesting(GemmKernel::kAuto);
  ExpectBitEqual(o1.data(), o2.data(), M * N * 4, "avx2 vs avx512");
}

// ---------------------------------------------------------------------------
// Invalid arguments.

struct Valid {
  std::vector<float> lhs = std::vector<float>(8 * 4, 1.f);
  std::vector<float> rhs_m = std::vector<float>(2 * 4 * 3, 1.f);
  std::vector<float> rhs_k = std::vector<float>(8 * 3, 1.f);
  std::vector<float> bias = std::vector<float>(2 * 3, 1.f);
  std::vector<float> out = std::vector<float>(8 * 4 * 3, 0.f);
  std::vector<int64_t> sizes = {3, 4};
  GroupedGemmArgs Args(bool ragged_k) {
    GroupedGemmArgs a;
    a.lhs_dtype = a.rhs_dtype = a.out_dtype = DType::kF32;
    a.lhs = lhs.data();
    a.rhs = ragged_k ? rhs_k.data() : rhs_m.data();
    if (!ragged_k) {
      a.bias_dtype = DType::kF32;
      a.bias = bias.data();
    }
    a.out = out.data();
    a.m = 8;
    a.k = 4;
    a.n = 3;
    a.num_groups = 2;
    a.group_sizes = sizes.data();
    return a;
  }
};

void ExpectInvalid(const GroupedGemmArgs& a, bool ragged_k, const std::string& field) {
  SCOPED_TRACE(field + (ragged_k ? " (ragged-K)" : " (ragged-M)"));
  const absl::Status v = ValidateGroupedGemmArgs(a, ragged_k);
  EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument) << v;
  EXPECT_THAT(std::string(v.message()), HasSubstr(field));
  const absl::Status r = ragged_k ? GroupedGemmRaggedK(a) : GroupedGemmRaggedM(a);
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument) << r;
  EXPECT_THAT(std::string(r.message()), HasSubstr(field));
}

// A stop asked between tiles ends the call with CANCELLED before the rest
// of the tiles run; one that never says so changes nothing.
TEST(GroupedGemmStop, StopsBetweenTilesAndOtherwiseChangesNothing) {
  const int64_t m = 512, k = 256, n = 512;
  std::vector<float> lhs(m * k, 1.0f), rhs(4 * k * n, 0.5f), out(m * n, -1.0f);
  std::vector<int64_t> sizes = {128, 128, 128, 128};
  GroupedGemmArgs a;
  a.lhs_dtype = a.rhs_dtype = a.out_dtype = DType::kF32;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.out = out.data();
  a.m = m;
  a.k = k;
  a.n = n;
  a.num_groups = 4;
  a.group_sizes = sizes.data();
  std::atomic<int> asked{0};
  a.stop = [&] { return ++asked > 2; };
  absl::Status s = GroupedGemmRaggedM(a, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(asked.load(), 3);  // two tiles ran, the third was not started
  EXPECT_EQ(out.back(), -1.0f) << "the last tile ran";
  a.stop = [] { return false; };
  ASSERT_TRUE(GroupedGemmRaggedM(a, 2).ok());
  for (float v : out) ASSERT_EQ(v, 0.5f * k);
  // Inside a tile too: one tile of 96 rows, 1024 deep, is asked before each
  // 256-deep block after the first, and stops without storing anything.
  std::vector<float> deep_lhs(96 * 1024, 1.0f), deep_rhs(1024 * 64, 1.0f), deep_out(96 * 64, -1.0f);
  std::vector<int64_t> deep_sizes = {96};
  GroupedGemmArgs d;
  d.lhs_dtype = d.rhs_dtype = d.out_dtype = DType::kF32;
  d.lhs = deep_lhs.data();
  d.rhs = deep_rhs.data();
  d.out = deep_out.data();
  d.m = 96;
  d.k = 1024;
  d.n = 64;
  d.num_groups = 1;
  d.group_sizes = deep_sizes.data();
  std::atomic<int> deep_asked{0};
  d.stop = [&] { return ++deep_asked > 2; };  // the tile's check, then the first block boundary
  EXPECT_EQ(GroupedGemmRaggedM(d, 1).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(deep_asked.load(), 3);
  for (float v : deep_out) ASSERT_EQ(v, -1.0f);
  d.stop = nullptr;
  ASSERT_TRUE(GroupedGemmRaggedM(d, 1).ok());
  for (float v : deep_out) ASSERT_EQ(v, 1024.0f);
  std::vector<float> wgrad(4 * k * n);  // ragged K: rhs [m, n], out [groups, k, n]
  a.out = wgrad.data();
  a.stop = [] { return true; };
  EXPECT_EQ(GroupedGemmRaggedK(a, 2).code(), absl::StatusCode::kCancelled);
}

TEST(GroupedGemmValidation, ValidArgsPass) {
  Valid v;
  EXPECT_TRUE(ValidateGroupedGemmArgs(v.Args(false), false).ok());
  EXPECT_TRUE(ValidateGroupedGemmArgs(v.Args(true), true).ok());
  EXPECT_TRUE(GroupedGemmRaggedM(v.Args(false)).ok());
  EXPECT_TRUE(GroupedGemmRaggedK(v.Args(true)).ok());
  // Zero sizes with null pointers are fine.
  GroupedGemmArgs a;
  a.lhs_dtype = a.rhs_dtype = a.out_dtype = DType::kBF16;
  EXPECT_TRUE(GroupedGemmRaggedM(a).ok());
  EXPECT_TRUE(GroupedGemmRaggedK(a).ok());
}

TEST(GroupedGemmValidation, InvalidArgsNameTheField) {
  for (bool rk : {false, true}) {
    Valid v;
    GroupedGemmArgs a;
    a = v.Args(rk); a.lhs_dtype = DType::kF8E4M3; ExpectInvalid(a, rk, "lhs_dtype");
    a = v.Args(rk); a.rhs_dtype = DType::kInvalid; ExpectInvalid(a, rk, "rhs_dtype");
    a = v.Args(rk); a.out_dtype = DType::kI32; ExpectInvalid(a, rk, "out_dtype");
    a = v.Args(rk); a.m = -1; ExpectInvalid(a, rk, "m:");
    a = v.Args(rk); a.k = -2; ExpectInvalid(a, rk, "k:");
    a = v.Args(rk); a.n = -3; ExpectInvalid(a, rk, "n:");
    a = v.Args(rk); a.num_groups = -1; ExpectInvalid(a, rk, "num_groups");
    a = v.Args(rk); a.group_sizes = nullptr; ExpectInvalid(a, rk, "group_sizes");
    std::vector<int64_t> neg = {3, -1};
    a = v.Args(rk); a.group_sizes = neg.data(); ExpectInvalid(a, rk, "group_sizes[1]");
    std::vector<int64_t> big = {5, 4};
    a = v.Args(rk); a.group_sizes = big.data(); ExpectInvalid(a, rk, "group_sizes");
    std::vector<int64_t> huge = {std::numeric_limits<int64_t>::max(), 1};
    a = v.Args(rk); a.group_sizes = huge.data(); ExpectInvalid(a, rk, "group_sizes");
    a = v.Args(rk); a.lhs = nullptr; ExpectInvalid(a, rk, "lhs");
    a = v.Args(rk); a.rhs = nullptr; ExpectInvalid(a, rk, "rhs");
    a = v.Args(rk); a.out = nullptr; ExpectInvalid(a, rk, "out");
    a = v.Args(rk); a.m = int64_t{1} << 40; a.k = int64_t{1} << 40;
    ExpectInvalid(a, rk, "lhs (m * k)");
    a = v.Args(rk); a.n = int64_t{1} << 62; ExpectInvalid(a, rk, "overflows");
  }
  Valid v;
  GroupedGemmArgs a;
  a = v.Args(false); a.bias = nullptr; ExpectInvalid(a, false, "bias");
  a = v.Args(false); a.bias_dtype = DType::kF8E5M2; ExpectInvalid(a, false, "bias_dtype");
  a = v.Args(false); a.bias_dtype = DType::kInvalid; ExpectInvalid(a, false, "bias_dtype");
  a = v.Args(false); a.k = int64_t{1} << 31; a.n = int64_t{1} << 31;  // 2 * 2^31 * 2^31
  ExpectInvalid(a, false, "rhs (num_groups * k * n)");
  a = v.Args(true); a.bias = v.bias.data(); a.bias_dtype = DType::kF32;
  ExpectInvalid(a, true, "bias");
  a = v.Args(true); a.rhs_transposed = true; ExpectInvalid(a, true, "rhs_transposed");
}

}  // namespace
}  // namespace cpu
}  // namespace shardgemm
