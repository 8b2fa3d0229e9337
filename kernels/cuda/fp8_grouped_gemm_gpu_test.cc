// GPU tests of our sm90 FP8 grouped GEMM (sm90_fp8_grouped_gemm.h) and of
// Fp8GroupedGemm's dispatch to it: every tile configuration against a host
// reference (FP8 decoded exactly, times the group's two scales, summed in
// double), and ours against the cuBLASLt per-group loop. On a machine without
// a GPU, or with a GPU that is not sm_90, every test skips itself.
//
// Tolerances, per element, with S = scale_l[g] * scale_r[g] * sum_k |a_k b_k|
// (the size of the terms) and ref the exact result:
//   |out - ref| <= r_out |ref| + r_acc S
// r_out: the output rounding (bf16 2^-8, f16 2^-10, f32 2^-20: one ulp, twice
// the round-to-nearest bound). r_acc: the tensor cores' FP8 accumulation,
// which keeps fewer bits than FP32 (about 13-14 bits of mantissa):
// with promotion every 128-K block is added into FP32, so 2^-10; without it
// (fast accumulation) errors grow with the K/32 wgmma steps: (K/32) 2^-12.
// A layout or indexing bug gives errors of order |ref| ~ S / sqrt(K), well
// above both. Padding rows must be exactly zero (the output is poisoned with
// NaN first, so unwritten elements fail too).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/sm90_fp8_grouped_gemm.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda {
namespace {

struct Buf {
  void* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t bytes) : n(bytes > 0 ? bytes : 16) { EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess); }
  ~Buf() { cudaFree(p); }
  void Up(const void* h, size_t bytes) { EXPECT_EQ(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), cudaSuccess); }
  Buf(const Buf&) = delete;
};

std::string* g_skip = nullptr;

class Fp8GroupedGemmGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      g_skip = new std::string(e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device");
      cudaGetLastError();
      return;
    }
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    if (major != 9 || minor != 0) {
      g_skip = new std::string(absl::StrCat("device is sm_", major, minor, ", the kernel is sm_90a only"));
      return;
    }
    cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, 0);
    ASSERT_EQ(cublasLtCreate(&lt_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaMalloc(&ws_, kWs), cudaSuccess);
  }
  static void TearDownTestSuite() {
    if (lt_) cublasLtDestroy(lt_);
    if (ws_) cudaFree(ws_);
    lt_ = nullptr;
    ws_ = nullptr;
  }
  void SetUp() override {
    if (g_skip != nullptr) GTEST_SKIP() << "skipped: " << *g_skip;
  }
  static constexpr size_t kWs = 32 << 20;
  static int num_sms_;
  static cublasLtHandle_t lt_;
  static void* ws_;
};
int Fp8GroupedGemmGpuTest::num_sms_ = 0;
cublasLtHandle_t Fp8GroupedGemmGpuTest::lt_ = nullptr;
void* Fp8GroupedGemmGpuTest::ws_ = nullptr;

// Random FP8 codes of magnitude below 4 (no NaN / Inf), either sign.
std::vector<uint8_t> RandomFp8(size_t n, Fp8Format f, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  const uint32_t lim = f == Fp8Format::kE4M3 ? 0x48 : 0x44;  // 4.0 in each format
  for (auto& x : v) {
    const uint64_t r = rng();
    x = static_cast<uint8_t>(((r >> 8) & 0x80) | (r % lim));
  }
  return v;
}

struct Case {
  std::string name;
  std::vector<int64_t> sizes;
  int64_t pad = 0;  // rows of lhs past sum(sizes)
  int64_t k = 0, n = 0;
  Fp8Format lf = Fp8Format::kE4M3, rf = Fp8Format::kE4M3;
  DType out = DType::kBF16;
  bool block = false;  // 1x128 (lhs) x 128x128 (rhs) block scales instead of per-group ones
};

// Host data of a case and the exact reference.
struct Problem {
  Case c;
  int64_t m = 0, used = 0;
  std::vector<uint8_t> lhs, rhs;
  std::vector<float> sl, sr;
  std::vector<double> ref, mag;  // [used, n]: exact result and S (see the top)
  explicit Problem(const Case& cs, uint64_t seed) : c(cs) {
    for (int64_t s : c.sizes) used += s;
    m = used + c.pad;
    const int64_t G = c.sizes.size();
    lhs = RandomFp8(m * c.k, c.lf, seed);
    rhs = RandomFp8(G * c.n * c.k, c.rf, seed + 1);
    std::mt19937 rng(seed + 2);
    auto rnd_scale = [&] { return std::ldexp(1.0f + (rng() % 1000) / 1000.0f, static_cast<int>(rng() % 5) - 3); };
    const int64_t kbc = (c.k + 127) / 128, kb4 = (kbc + 3) / 4 * 4, nbc = (c.n + 127) / 128;
    std::vector<int64_t> loff(G + 1, 0);  // GroupedQuantize's 1x128 layout: per group [kbc][roundup(m_g, 4)]
    for (int64_t g = 0; g < G; ++g) loff[g + 1] = loff[g] + kbc * ((c.sizes[g] + 3) / 4 * 4);
    if (c.block) {
      for (int64_t i = 0; i < loff[G]; ++i) sl.push_back(rnd_scale());
      for (int64_t i = 0; i < G * nbc * kb4; ++i) sr.push_back(rnd_scale());
    } else {
      for (int64_t g = 0; g < G; ++g) {
        sl.push_back(rnd_scale());
        sr.push_back(rnd_scale());
      }
    }
    std::vector<float> lf(lhs.size()), rf(rhs.size());
    for (size_t i = 0; i < lhs.size(); ++i) lf[i] = Fp8ToFloat(lhs[i], c.lf);
    for (size_t i = 0; i < rhs.size(); ++i) rf[i] = Fp8ToFloat(rhs[i], c.rf);
    ref.assign(used * c.n, 0.0);
    mag.assign(used * c.n, 0.0);
    int64_t row = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t ld = (c.sizes[g] + 3) / 4 * 4;
      for (int64_t r = row; r < row + c.sizes[g]; ++r) {
        const float* a = &lf[r * c.k];
        for (int64_t j = 0; j < c.n; ++j) {
          const float* b = &rf[(g * c.n + j) * c.k];
          double acc = 0, ab = 0;
          for (int64_t kb = 0; kb < kbc; ++kb) {
            const double s = c.block ? static_cast<double>(sl[loff[g] + kb * ld + (r - row)]) *
                                           sr[(g * nbc + j / 128) * kb4 + kb]
                                     : static_cast<double>(sl[g]) * sr[g];
            double blk = 0, blk_abs = 0;
            for (int64_t q = kb * 128; q < std::min(c.k, kb * 128 + 128); ++q) {
              const double t = static_cast<double>(a[q]) * b[q];
              blk += t;
              blk_abs += std::fabs(t);
            }
            acc += blk * s;
            ab += blk_abs * std::fabs(s);
          }
          ref[r * c.n + j] = acc;
          mag[r * c.n + j] = ab;
        }
      }
      row += c.sizes[g];
    }
  }
};

double ToDouble(const std::vector<uint8_t>& out, DType t, int64_t i) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, &out[i * 4], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &out[i * 2], 2);
  return t == DType::kBF16 ? Bf16BitsToFloat(h) : F16BitsToFloat(h);
}

struct Check {
  int64_t wrong = 0, bad_padding = 0;
  double max_err_rel_mag = 0;  // max |out - ref| / S
  double rel_l2 = 0;
  std::string first_wrong;
};

Check Compare(const Problem& p, const std::vector<uint8_t>& out, bool promote) {
  const double r_out = p.c.out == DType::kBF16 ? std::ldexp(1.0, -8)
                       : p.c.out == DType::kF16 ? std::ldexp(1.0, -10)
                                                : std::ldexp(1.0, -20);
  const double r_acc = promote ? std::ldexp(1.0, -10) : (p.c.k + 31) / 32 * std::ldexp(1.0, -12);
  Check ch;
  double e2 = 0, r2 = 0;
  for (int64_t i = 0; i < p.used * p.c.n; ++i) {
    const double got = ToDouble(out, p.c.out, i), want = p.ref[i];
    const double err = std::fabs(got - want);
    if (!(err <= r_out * std::fabs(want) + r_acc * p.mag[i])) {
      if (ch.wrong++ == 0)
        ch.first_wrong = absl::StrCat("row ", i / p.c.n, " col ", i % p.c.n, ": got ", got, " want ", want);
    }
    if (p.mag[i] > 0) ch.max_err_rel_mag = std::max(ch.max_err_rel_mag, err / p.mag[i]);
    e2 += (got - want) * (got - want);
    r2 += want * want;
  }
  const int es = DTypeSize(p.c.out);
  for (int64_t i = p.used * p.c.n * es; i < p.m * p.c.n * es; ++i) ch.bad_padding += out[i] != 0;
  ch.rel_l2 = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  return ch;
}

// Device copies of a problem.
struct DevProblem {
  Buf lhs, rhs, sl, sr, sizes, out;
  DevProblem(const Problem& p)
      : lhs(p.lhs.size()), rhs(p.rhs.size()), sl(p.sl.size() * 4), sr(p.sr.size() * 4), sizes(p.c.sizes.size() * 8),
        out(p.m * p.c.n * DTypeSize(p.c.out)) {
    lhs.Up(p.lhs.data(), p.lhs.size());
    rhs.Up(p.rhs.data(), p.rhs.size());
    sl.Up(p.sl.data(), p.sl.size() * 4);
    sr.Up(p.sr.data(), p.sr.size() * 4);
    sizes.Up(p.c.sizes.data(), p.c.sizes.size() * 8);
  }
  std::vector<uint8_t> Download(const Problem& p) {
    std::vector<uint8_t> h(p.m * p.c.n * DTypeSize(p.c.out));
    EXPECT_EQ(cudaMemcpy(h.data(), out.p, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  void Poison() { EXPECT_EQ(cudaMemset(out.p, 0xff, out.n), cudaSuccess); }
};

Sm90Fp8GroupedGemmParams Params(const Problem& p, DevProblem& d) {
  Sm90Fp8GroupedGemmParams k;
  k.lhs_format = p.c.lf == Fp8Format::kE4M3 ? Sm90Fp8Format::kE4M3 : Sm90Fp8Format::kE5M2;
  k.rhs_format = p.c.rf == Fp8Format::kE4M3 ? Sm90Fp8Format::kE4M3 : Sm90Fp8Format::kE5M2;
  k.out_dtype = ToCu(p.c.out);
  k.lhs = d.lhs.p, k.rhs = d.rhs.p, k.out = d.out.p;
  k.lhs_scale_inv = static_cast<const float*>(d.sl.p);
  k.rhs_scale_inv = static_cast<const float*>(d.sr.p);
  k.group_sizes = static_cast<const int64_t*>(d.sizes.p);
  k.m = p.m, k.k = p.c.k, k.n = p.c.n, k.num_groups = p.c.sizes.size();
  k.block_scaling = p.c.block;
  return k;
}

struct TileConfig {
  int tm, tn;
  bool promote, tma_store;
};
const TileConfig kConfigs[] = {{128, 256, true, true},  {128, 256, true, false}, {128, 192, true, true},
                               {128, 192, true, false}, {128, 128, true, true},  {128, 128, true, false},
                               {64, 256, true, true},   {64, 256, true, false},  {128, 256, false, true},
                               {128, 256, false, false}};

// Every tile configuration of the kernel on one case.
void RunAllConfigs(const Case& c, int num_sms, uint64_t seed) {
  Problem p(c, seed);
  DevProblem d(p);
  for (const TileConfig& t : kConfigs) {
    if (c.block && (!t.promote || t.tn == 192)) continue;  // block scales: promoted, 128-column scale blocks
    Sm90Fp8GroupedGemmParams k = Params(p, d);
    k.tile_m = t.tm, k.tile_n = t.tn, k.promote = t.promote, k.tma_store = t.tma_store;
    ASSERT_EQ(Sm90Fp8GroupedGemmUnsupportedReason(k), nullptr);
    d.Poison();
    const char* detail = "";
    ASSERT_EQ(LaunchSm90Fp8GroupedGemm(k, num_sms, nullptr, &detail), cudaSuccess) << detail;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Check ch = Compare(p, d.Download(p), t.promote);
    std::printf("  %-28s %s%s x %s -> %-4s tile %dx%d%s%s: rel_l2 %.2e, max |err|/S %.2e, wrong %lld\n",
                c.name.c_str(), c.block ? "block-scaled " : "", Fp8FormatName(c.lf), Fp8FormatName(c.rf), std::string(DTypeName(c.out)).c_str(), t.tm,
                t.tn, t.promote ? " promoted" : " fast-accum", t.tma_store ? " tma-store" : "", ch.rel_l2,
                ch.max_err_rel_mag,
                static_cast<long long>(ch.wrong));
    EXPECT_EQ(ch.wrong, 0) << c.name << " tile " << t.tm << "x" << t.tn << " promote " << t.promote << " tma "
                           << t.tma_store << ": "
                           << ch.first_wrong;
    EXPECT_EQ(ch.bad_padding, 0) << c.name << ": padding bytes not zero";
  }
}

TEST_F(Fp8GroupedGemmGpuTest, RaggedGroupsAllOutputs) {
  for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
    Case c{"ragged (empty, odd sizes)", {100, 0, 257, 31, 128}, 5, 512, 384};
    c.out = out;
    RunAllConfigs(c, num_sms_, 11);
  }
}

TEST_F(Fp8GroupedGemmGpuTest, E4M3xE5M2AllOutputs) {
  for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
    Case c{"e4m3 x e5m2", {100, 0, 257, 31, 128}, 5, 512, 384};
    c.rf = Fp8Format::kE5M2;
    c.out = out;
    RunAllConfigs(c, num_sms_, 12);
  }
}

TEST_F(Fp8GroupedGemmGpuTest, E5M2xE4M3) {
  Case c{"e5m2 x e4m3", {64, 200, 3}, 0, 256, 256};
  c.lf = Fp8Format::kE5M2;
  RunAllConfigs(c, num_sms_, 13);
}

TEST_F(Fp8GroupedGemmGpuTest, OneGroupRowsNotATileMultiple) {
  Case c{"one group, m 1000, k 1024", {1000}, 0, 1024, 256};
  RunAllConfigs(c, num_sms_, 14);
}

TEST_F(Fp8GroupedGemmGpuTest, ManySmallGroups) {
  std::mt19937 rng(5);
  std::vector<int64_t> sizes(40);
  for (auto& s : sizes) s = rng() % 4 == 0 ? 0 : rng() % 70;
  Case c{"40 groups of 0..69 rows", sizes, 17, 256, 128};
  RunAllConfigs(c, num_sms_, 15);
}

TEST_F(Fp8GroupedGemmGpuTest, KTailAndNarrowN) {
  // K not a multiple of 128 (TMA zero fill), N not a multiple of 8 or of the tile.
  Case c{"k 208, n 100", {90, 130}, 3, 208, 100};
  RunAllConfigs(c, num_sms_, 16);
  Case f{"k 208, n 100, f32", {90, 130}, 3, 208, 100};
  f.out = DType::kF32;
  RunAllConfigs(f, num_sms_, 17);
}

TEST_F(Fp8GroupedGemmGpuTest, AllGroupsEmptyZeroesEverything) {
  Case c{"all groups empty", {0, 0, 0}, 50, 128, 256};
  RunAllConfigs(c, num_sms_, 18);
}

TEST_F(Fp8GroupedGemmGpuTest, RefusesE5M2xE5M2) {
  Sm90Fp8GroupedGemmParams k;
  k.lhs_format = k.rhs_format = Sm90Fp8Format::kE5M2;
  EXPECT_NE(Sm90Fp8GroupedGemmUnsupportedReason(k), nullptr);
  Fp8GroupedGemmArgs a;
  a.lhs_format = a.rhs_format = Fp8Format::kE5M2;
  a.m = 16, a.n = 64, a.k = 64, a.num_groups = 1;
  int64_t one = 16;
  a.group_sizes = &one;
  absl::Status s = Fp8GroupedGemm(a, lt_, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// Fp8GroupedGemm with device sizes (ours) against the same call without (the
// cuBLASLt loop), both against the reference, and against each other.
void OursVsLt(const Case& c, bool fast_accum, cublasLtHandle_t lt, void* ws, size_t ws_bytes, uint64_t seed) {
  Problem p(c, seed);
  DevProblem d(p);
  Fp8GroupedGemmArgs a;
  a.lhs = static_cast<const uint8_t*>(d.lhs.p), a.lhs_scale_inv = d.sl.p, a.lhs_format = c.lf;
  a.rhs = static_cast<const uint8_t*>(d.rhs.p), a.rhs_scale_inv = d.sr.p, a.rhs_format = c.rf;
  a.m = p.m, a.n = c.n, a.k = c.k, a.group_sizes = c.sizes.data(), a.num_groups = c.sizes.size();
  a.out = d.out.p, a.out_dtype = c.out, a.fast_accum = fast_accum, a.workspace = ws, a.workspace_bytes = ws_bytes;
  if (c.block) a.lhs_mode = ScalingMode::kBlock1x128, a.rhs_mode = ScalingMode::kBlock128x128;
  std::vector<uint8_t> outs[2];
  bool lt_ok = true;
  for (int ours = 0; ours < 2; ++ours) {
    Fp8GemmStats st;
    a.stats = &st;
    a.device_group_sizes = ours ? static_cast<const int64_t*>(d.sizes.p) : nullptr;
    d.Poison();
    absl::Status s = Fp8GroupedGemm(a, lt, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(st.ours, ours == 1);
    if (ours) EXPECT_EQ(st.direct_groups + st.padded_groups, 0);
    if (ours) EXPECT_EQ(st.ours_promote, !fast_accum || c.block);
    if (ours) EXPECT_EQ(st.ours_block_scaling, c.block);
    outs[ours] = d.Download(p);
    Check ch = Compare(p, outs[ours], !fast_accum);
    std::printf("  %-28s %s%s: rel_l2 vs ref %.2e, max |err|/S %.2e, wrong %lld%s\n", c.name.c_str(),
                ours ? "ours" : "cuBLASLt", fast_accum ? " (fast accum)" : "", ch.rel_l2, ch.max_err_rel_mag,
                static_cast<long long>(ch.wrong),
                ours ? absl::StrCat(", tile ", st.ours_tile_m, "x", st.ours_tile_n).c_str() : "");
    if (!ours && c.block) {  // cuBLASLt's block-scaled path is a comparison here, not under test
      lt_ok = ch.wrong == 0;
      if (!lt_ok) std::printf("  (cuBLASLt's block-scaled output is off the reference: %s)\n", ch.first_wrong.c_str());
    } else {
      EXPECT_EQ(ch.wrong, 0) << (ours ? "ours: " : "cuBLASLt: ") << ch.first_wrong;
    }
    EXPECT_EQ(ch.bad_padding, 0);
  }
  if (!lt_ok) return;
  // Ours against cuBLASLt, element by element: within the sum of both tolerances.
  const double r_out = c.out == DType::kBF16 ? std::ldexp(1.0, -8) : c.out == DType::kF16 ? std::ldexp(1.0, -10)
                                                                                           : std::ldexp(1.0, -20);
  const double r_acc = fast_accum ? (c.k + 31) / 32 * std::ldexp(1.0, -12) : std::ldexp(1.0, -10);
  int64_t wrong = 0;
  for (int64_t i = 0; i < p.used * c.n; ++i) {
    const double x = ToDouble(outs[1], c.out, i), y = ToDouble(outs[0], c.out, i);
    if (!(std::fabs(x - y) <= 2 * (r_out * std::fabs(p.ref[i]) + r_acc * p.mag[i]))) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "ours and cuBLASLt differ beyond the tolerances";
}

TEST_F(Fp8GroupedGemmGpuTest, OursMatchesCublasLt) {
  Case c{"dispatch bf16", {100, 0, 257, 31, 128}, 5, 512, 384};
  OursVsLt(c, false, lt_, ws_, kWs, 21);
  Case e{"dispatch e4m3 x e5m2 f32", {300, 64, 0, 77}, 8, 1024, 256};
  e.rf = Fp8Format::kE5M2;
  e.out = DType::kF32;
  OursVsLt(e, false, lt_, ws_, kWs, 22);
  Case f{"dispatch f16 fast accum", {512, 512, 384}, 0, 768, 512};
  f.out = DType::kF16;
  OursVsLt(f, true, lt_, ws_, kWs, 23);
  Case s{"dispatch decode", std::vector<int64_t>(24, 40), 0, 512, 512};
  OursVsLt(s, false, lt_, ws_, kWs, 24);
}

TEST_F(Fp8GroupedGemmGpuTest, BlockScalingAllConfigs) {
  for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
    Case c{"block, ragged", {100, 0, 257, 31, 128}, 5, 512, 384};
    c.out = out;
    c.block = true;
    RunAllConfigs(c, num_sms_, 41);
  }
  Case e{"block, e4m3 x e5m2, k 208 n 200", {90, 130, 1}, 3, 208, 200};
  e.rf = Fp8Format::kE5M2;
  e.block = true;
  RunAllConfigs(e, num_sms_, 42);
  std::mt19937 rng(6);
  std::vector<int64_t> sizes(40);
  for (auto& x : sizes) x = rng() % 4 == 0 ? 0 : rng() % 70;
  Case m{"block, 40 groups", sizes, 9, 384, 256};
  m.block = true;
  RunAllConfigs(m, num_sms_, 43);
}

TEST_F(Fp8GroupedGemmGpuTest, BlockScalingOursMatchesCublasLt) {
  Case c{"dispatch block bf16", {256, 0, 384, 128}, 5, 1024, 512};
  c.block = true;
  OursVsLt(c, false, lt_, ws_, kWs, 51);
}

TEST_F(Fp8GroupedGemmGpuTest, NoDeviceSizesRunsCublasLt) {
  Case c{"no device sizes", {64, 64}, 0, 128, 128};
  Problem p(c, 31);
  DevProblem d(p);
  Fp8GroupedGemmArgs a;
  a.lhs = static_cast<const uint8_t*>(d.lhs.p), a.lhs_scale_inv = d.sl.p;
  a.rhs = static_cast<const uint8_t*>(d.rhs.p), a.rhs_scale_inv = d.sr.p;
  a.m = p.m, a.n = c.n, a.k = c.k, a.group_sizes = c.sizes.data(), a.num_groups = 2;
  a.out = d.out.p, a.workspace = ws_, a.workspace_bytes = kWs;
  Fp8GemmStats st;
  a.stats = &st;
  ASSERT_TRUE(Fp8GroupedGemm(a, lt_, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_FALSE(st.ours);
  EXPECT_EQ(st.direct_groups + st.padded_groups, 2);
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm
