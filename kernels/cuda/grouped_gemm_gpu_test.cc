// GPU tests of the grouped GEMM: every strategy against the naive device
// reference (itself checked against a CPU double reference) on every preset
// and on edge cases. On a machine without a GPU every test skips itself.
//   tools/gpu/run_gpu_tests.sh   (on the H200)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/cuda/gemm_check.h"
#include "kernels/cuda/gemm_testing.h"
#include "kernels/cuda/grouped_gemm.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cuda {
namespace {

using testing::CheckResult;

struct Buf {
  void* p = nullptr;
  explicit Buf(int64_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes > 0 ? bytes : 16), cudaSuccess); }
  ~Buf() { cudaFree(p); }
};

class GroupedGemmGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      no_gpu_reason_ = new std::string(e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device");
      cudaGetLastError();
      return;
    }
    auto r = GroupedGemmRunner::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    runner_ = r->release();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  static void TearDownTestSuite() {
    delete runner_;
    runner_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  void SetUp() override {
    if (no_gpu_reason_ != nullptr) GTEST_SKIP() << "no GPU here: " << *no_gpu_reason_;
  }

  static GroupedGemmRunner* runner_;
  static cudaStream_t stream_;
  static std::string* no_gpu_reason_;
};
GroupedGemmRunner* GroupedGemmGpuTest::runner_ = nullptr;
cudaStream_t GroupedGemmGpuTest::stream_ = nullptr;
std::string* GroupedGemmGpuTest::no_gpu_reason_ = nullptr;

struct Case {
  std::string name;
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> sizes;
  bool transposed = true;
  DType in = DType::kBF16, out = DType::kBF16, bias = DType::kInvalid;
};

const Strategy kAll[] = {Strategy::kAuto, Strategy::kLtLoop, Strategy::kLtLoopGraph, Strategy::kLtBatched,
                         Strategy::kGroupedBatched, Strategy::kSm90};

// Runs every strategy that supports the case (host sizes given), plus auto
// and sm90 with device-only sizes. Returns how many runs were checked.
int RunRaggedM(GroupedGemmRunner* runner, cudaStream_t s, const Case& c, uint64_t seed, int max_rows = 96) {
  const int64_t g = c.sizes.size();
  const int64_t es_in = DTypeSize(c.in), es_out = DTypeSize(c.out);
  Buf lhs(c.m * c.k * es_in), rhs(g * c.k * c.n * es_in), out(c.m * c.n * es_out), sizes(g * 8),
      bias(g * c.n * 4);
  EXPECT_EQ(testing::FillRandom(lhs.p, ToCu(c.in), c.m * c.k, seed, 1.f, s), cudaSuccess);
  EXPECT_EQ(testing::FillRandom(rhs.p, ToCu(c.in), g * c.k * c.n, seed + 1, 1.f, s), cudaSuccess);
  if (c.bias != DType::kInvalid) {
    EXPECT_EQ(testing::FillRandom(bias.p, ToCu(c.bias), g * c.n, seed + 2, 4.f, s), cudaSuccess);
  }
  EXPECT_EQ(cudaMemcpyAsync(sizes.p, c.sizes.data(), g * 8, cudaMemcpyHostToDevice, s), cudaSuccess);
  DeviceGroupedGemmArgs a;
  a.in_dtype = c.in;
  a.out_dtype = c.out;
  a.bias_dtype = c.bias;
  a.lhs = lhs.p;
  a.rhs = rhs.p;
  a.bias = c.bias != DType::kInvalid ? bias.p : nullptr;
  a.out = out.p;
  a.m = c.m;
  a.k = c.k;
  a.n = c.n;
  a.num_groups = g;
  a.rhs_transposed = c.transposed;
  a.group_sizes_device = static_cast<const int64_t*>(sizes.p);
  int runs = 0;
  for (int host = 1; host >= 0; --host) {
    a.group_sizes_host = host ? c.sizes.data() : nullptr;
    for (Strategy st : kAll) {
      if (!host && st != Strategy::kAuto && st != Strategy::kSm90 && st != Strategy::kLtLoop) continue;
      a.strategy = st;
      if (!runner->Supports(a, false, st).ok()) continue;
      // The sm90 kernel: the heuristic's tile, then each tile shape forced.
      std::vector<std::tuple<int, int, int>> tiles = {{0, 0, 0}};
      if (st == Strategy::kSm90 && host)
        tiles = {{0, 0, 0}, {128, 256, 1}, {128, 256, 2}, {128, 128, 1}, {64, 256, 1}};
      for (auto [tm, tn, cl] : tiles) {
        a.sm90_tile_m = tm;
        a.sm90_tile_n = tn;
        a.sm90_cluster = cl;
        const std::string what = absl::StrCat(
            c.name, " strategy=", StrategyName(st), " host_sizes=", host,
            tm ? absl::StrCat(" tile=", tm, "x", tn, " cluster=", cl) : "",
            st == Strategy::kAuto ? absl::StrCat(" (auto picks ", StrategyName(runner->Choose(a, false)), ")")
                                  : "");
        // A shape's first call may tune (timing candidates writes the output
        // many times): the checked call is the next, on a poisoned output.
        absl::Status status = runner->RaggedM(a, s);
        if (status.ok()) {
          EXPECT_EQ(testing::Poison(out.p, c.m * c.n * es_out, s), cudaSuccess);
          status = runner->RaggedM(a, s);
        }
        EXPECT_TRUE(status.ok()) << what << ": " << status;
        if (!status.ok()) continue;
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess) << what;
        CheckResult r = testing::CheckRaggedM(a, c.sizes, max_rows, seed + 7, s);
        EXPECT_TRUE(r.Ok(testing::Tolerance(c.out))) << what << ": " << r.ToString();
        ++runs;
      }
      a.sm90_tile_m = a.sm90_tile_n = a.sm90_cluster = 0;
    }
  }
  return runs;
}

int RunRaggedK(GroupedGemmRunner* runner, cudaStream_t s, const Case& c, uint64_t seed) {
  const int64_t g = c.sizes.size();
  const int64_t es_in = DTypeSize(c.in), es_out = DTypeSize(c.out);
  Buf lhs(c.m * c.k * es_in), rhs(c.m * c.n * es_in), out(g * c.k * c.n * es_out), sizes(g * 8);
  EXPECT_EQ(testing::FillRandom(lhs.p, ToCu(c.in), c.m * c.k, seed, 1.f, s), cudaSuccess);
  EXPECT_EQ(testing::FillRandom(rhs.p, ToCu(c.in), c.m * c.n, seed + 1, 1.f, s), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(sizes.p, c.sizes.data(), g * 8, cudaMemcpyHostToDevice, s), cudaSuccess);
  DeviceGroupedGemmArgs a;
  a.in_dtype = c.in;
  a.out_dtype = c.out;
  a.lhs = lhs.p;
  a.rhs = rhs.p;
  a.out = out.p;
  a.m = c.m;
  a.k = c.k;
  a.n = c.n;
  a.num_groups = g;
  a.group_sizes_device = static_cast<const int64_t*>(sizes.p);
  int runs = 0;
  for (int host = 1; host >= 0; --host) {
    a.group_sizes_host = host ? c.sizes.data() : nullptr;
    for (Strategy st : kAll) {
      if (!host && st != Strategy::kAuto) continue;
      a.strategy = st;
      if (!runner->Supports(a, true, st).ok()) continue;
      const std::string what = absl::StrCat(c.name, " ragged-K strategy=", StrategyName(st), " host_sizes=", host);
      absl::Status status = runner->RaggedK(a, s);  // may tune: check the next call
      if (status.ok()) {
        EXPECT_EQ(testing::Poison(out.p, g * c.k * c.n * es_out, s), cudaSuccess);
        status = runner->RaggedK(a, s);
      }
      EXPECT_TRUE(status.ok()) << what << ": " << status;
      if (!status.ok()) continue;
      EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess) << what;
      CheckResult r = testing::CheckRaggedK(a, c.sizes, 2048, seed + 9, s);
      // Empty groups must be zero: the sampled entries of such groups have ref 0.
      EXPECT_TRUE(r.Ok(testing::Tolerance(c.out))) << what << ": " << r.ToString();
      ++runs;
    }
  }
  return runs;
}

std::vector<int64_t> Equal(int64_t g, int64_t m) { return std::vector<int64_t>(g, m); }

std::vector<int64_t> RandomSizes(int64_t g, int64_t total, uint64_t seed, double empty_fraction) {
  std::mt19937_64 rng(seed);
  std::vector<double> w(g);
  double sum = 0;
  for (auto& x : w) {
    x = (rng() % 1000) / 1000.0 < empty_fraction ? 0.0 : 0.1 + (rng() % 1000) / 100.0;
    sum += x;
  }
  std::vector<int64_t> s(g, 0);
  int64_t used = 0;
  for (int64_t i = 0; i < g; ++i) {
    s[i] = sum > 0 ? static_cast<int64_t>(w[i] / sum * total) : 0;
    used += s[i];
  }
  for (int64_t i = 0; used < total && g > 0; i = (i + 1) % g)
    if (w[i] > 0 || sum == 0) { ++s[i]; ++used; }
  return s;
}

// The naive device reference against a CPU double-precision reference.
TEST_F(GroupedGemmGpuTest, DeviceReferenceMatchesCpu) {
  const int64_t m = 40, k = 24, n = 17;
  Buf lhs(m * k * 2), rhs(2 * k * n * 2), rows(m * 8), groups(m * 8), ref(m * n * 4);
  ASSERT_EQ(testing::FillRandom(lhs.p, CuDType::kBF16, m * k, 1, 1.f, stream_), cudaSuccess);
  ASSERT_EQ(testing::FillRandom(rhs.p, CuDType::kBF16, 2 * k * n, 2, 1.f, stream_), cudaSuccess);
  std::vector<int64_t> r(m), g(m);
  for (int64_t i = 0; i < m; ++i) { r[i] = i; g[i] = i < 15 ? 0 : 1; }
  ASSERT_EQ(cudaMemcpy(rows.p, r.data(), m * 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(groups.p, g.data(), m * 8, cudaMemcpyHostToDevice), cudaSuccess);
  for (bool tr : {false, true}) {
    ASSERT_EQ(testing::ReferenceRowsRaggedM(lhs.p, rhs.p, tr, nullptr, CuDType::kInvalid, CuDType::kBF16, k, n,
                                            static_cast<int64_t*>(rows.p), static_cast<int64_t*>(groups.p), m,
                                            static_cast<float*>(ref.p), stream_),
              cudaSuccess);
    std::vector<uint16_t> hl(m * k), hr(2 * k * n);
    std::vector<float> hf(m * n);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(hl.data(), lhs.p, hl.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(hr.data(), rhs.p, hr.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(hf.data(), ref.p, hf.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t bi = tr ? (g[i] * n + c) * k + kk : (g[i] * k + kk) * n + c;
          acc += static_cast<double>(BF16ToFloat(hl[i * k + kk])) * BF16ToFloat(hr[bi]);
        }
        ASSERT_NEAR(hf[i * n + c], acc, 1e-4 * (1 + std::fabs(acc))) << i << "," << c;
      }
  }
}

// Every preset of /work/shared/anchors/presets.json, both rhs layouts.
TEST_F(GroupedGemmGpuTest, Presets) {
  struct P { const char* name; int64_t g, m, k, n; };
  const P presets[] = {{"mixtral-8x7b-up", 8, 2048, 4096, 14336}, {"deepseek-v3-up", 8, 2048, 7168, 4096},
                       {"deepseek-v3-down", 8, 2048, 2048, 7168}, {"qwen3-30b-up-ep8", 16, 512, 2048, 1536},
                       {"qwen3-30b-up", 128, 128, 2048, 1536},    {"small-decode", 64, 64, 1024, 1024}};
  uint64_t seed = 100;
  for (const P& p : presets) {
    for (bool tr : {true, false}) {
      Case c;
      c.name = absl::StrCat(p.name, tr ? " [G,N,K]" : " [G,K,N]");
      c.m = p.g * p.m;
      c.k = p.k;
      c.n = p.n;
      c.sizes = Equal(p.g, p.m);
      c.transposed = tr;
      EXPECT_GE(RunRaggedM(runner_, stream_, c, seed++, 48), 5) << c.name;
    }
    // Unbalanced routing with the same rows, transposed rhs.
    Case u;
    u.name = absl::StrCat(p.name, " unbalanced");
    u.m = p.g * p.m;
    u.k = p.k;
    u.n = p.n;
    u.sizes = RandomSizes(p.g, u.m - 3, seed++, 0.1);  // 3 padding rows
    EXPECT_GE(RunRaggedM(runner_, stream_, u, seed++, 48), 4) << u.name;
  }
}

TEST_F(GroupedGemmGpuTest, EdgeCases) {
  std::vector<Case> cases;
  auto add = [&](std::string name, int64_t m, int64_t k, int64_t n, std::vector<int64_t> sizes) {
    Case c;
    c.name = name;
    c.m = m;
    c.k = k;
    c.n = n;
    c.sizes = std::move(sizes);
    cases.push_back(c);
    return &cases.back();
  };
  add("G=1", 300, 256, 384, {300});
  add("G=1 padding", 300, 256, 384, {257});
  add("empty groups", 500, 128, 256, {0, 37, 0, 200, 1, 0, 262});
  add("all empty", 64, 128, 256, {0, 0, 0});
  add("padding rows", 1000, 192, 320, {100, 300, 0, 250});
  add("K=72 N=100", 400, 72, 100, {150, 50, 200});
  add("K=40 N=101 odd", 333, 40, 101, {100, 33, 200});
  add("K=20 (not /8)", 256, 20, 64, {128, 128});
  add("N=8 small", 256, 64, 8, {64, 192});
  add("K=3000 N=1000", 640, 3000, 1000, {128, 512});
  add("large G=1024", 1024 * 24, 128, 256, RandomSizes(1024, 1024 * 24 - 5, 11, 0.2));
  add("G=3000 (past sm90 limit)", 3000 * 8, 64, 128, Equal(3000, 8));
  add("m=1 groups", 64, 256, 512, Equal(64, 1));
  Case* b = add("bias bf16", 700, 256, 384, {100, 0, 400, 150});
  b->bias = DType::kBF16;
  b = add("bias f32 on bf16 out", 700, 256, 384, {100, 0, 400, 150});
  b->bias = DType::kF32;
  b = add("bias, [G,K,N]", 700, 256, 384, {100, 0, 400, 150});
  b->bias = DType::kBF16;
  b->transposed = false;
  b = add("f32 out", 512, 512, 256, {256, 256});
  b->out = DType::kF32;
  b = add("f32 out + f32 bias", 512, 512, 256, {256, 200});
  b->out = DType::kF32;
  b->bias = DType::kF32;
  b = add("f16 in, f16 out", 512, 512, 256, {100, 412});
  b->in = DType::kF16;
  b->out = DType::kF16;
  b = add("f16 in, f32 out, [G,K,N]", 512, 512, 256, {100, 412});
  b->in = DType::kF16;
  b->out = DType::kF32;
  b->transposed = false;
  b = add("K=0", 64, 0, 32, {32, 32});
  b->bias = DType::kBF16;
  uint64_t seed = 1000;
  const size_t base = cases.size();
  for (size_t i = 0; i < base; ++i) {  // both layouts for the plain cases
    if (!cases[i].transposed) continue;
    Case c = cases[i];
    c.transposed = false;
    c.name += " [G,K,N]";
    cases.push_back(c);
  }
  for (const Case& c : cases) EXPECT_GE(RunRaggedM(runner_, stream_, c, seed++), 1) << c.name;
}

TEST_F(GroupedGemmGpuTest, RaggedK) {
  std::vector<Case> cases;
  auto add = [&](std::string name, int64_t m, int64_t k, int64_t n, std::vector<int64_t> sizes) {
    Case c;
    c.name = name;
    c.m = m;
    c.k = k;
    c.n = n;
    c.sizes = std::move(sizes);
    cases.push_back(c);
    return &cases.back();
  };
  add("wgrad qwen3-ep8-like", 16 * 512, 2048, 1536, Equal(16, 512));
  add("wgrad deepseek-down-like", 8 * 2048, 2048, 7168, Equal(8, 2048));
  add("wgrad small-decode", 64 * 64, 1024, 1024, Equal(64, 64));
  add("wgrad empty groups + padding", 1000, 96, 200, {0, 300, 0, 500, 100});
  add("wgrad odd", 301, 33, 65, {100, 1, 200});
  add("wgrad G=1", 256, 128, 128, {256});
  add("wgrad large G", 128 * 20, 64, 128, RandomSizes(128, 128 * 20, 5, 0.2));
  Case* c = add("wgrad f32 out", 512, 256, 128, {200, 312});
  c->out = DType::kF32;
  uint64_t seed = 5000;
  for (const Case& x : cases) EXPECT_GE(RunRaggedK(runner_, stream_, x, seed++), 1) << x.name;
}

TEST_F(GroupedGemmGpuTest, InvalidArguments) {
  DeviceGroupedGemmArgs a;
  a.m = 10;
  a.k = 8;
  a.n = 8;
  a.num_groups = 2;
  std::vector<int64_t> host = {6, 6};
  Buf sizes(16), buf(1024);
  a.group_sizes_device = static_cast<const int64_t*>(sizes.p);
  a.group_sizes_host = host.data();
  a.lhs = a.rhs = buf.p;
  a.out = buf.p;
  absl::Status s = runner_->RaggedM(a, stream_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("sum to 12"), std::string::npos) << s;
  a.group_sizes_host = nullptr;
  a.in_dtype = DType::kF32;
  EXPECT_EQ(runner_->RaggedM(a, stream_).code(), absl::StatusCode::kInvalidArgument);
}

TEST(DevicePoolTest, ReusesBlocks) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no GPU here";
  }
  DevicePool pool;
  ASSERT_TRUE(pool.Reserve(1000, 2).ok());
  EXPECT_EQ(pool.cuda_mallocs(), 2);
  auto a = pool.Allocate(900);
  auto b = pool.Allocate(1024);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(pool.cuda_mallocs(), 2);
  pool.Free(*a);
  pool.Free(*b);
  EXPECT_EQ(pool.bytes_in_use(), 0);
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm
