// FP8 grouped-GEMM benchmark over the presets (anchors/presets.json format,
// the same presets as grouped_gemm_bench).
//
//   fp8_grouped_gemm_bench --presets presets.json [--iters 20] [--warmup 5] [--json out.jsonl]
//                          [--round N] [--main-only]
//
// Then the same for block scaling (1x128 lhs x 128x128 rhs FP32 block
// scales, promoted per 128-K block): ours against cuBLASLt's block-scaled
// per-group loop.
//
// Per preset (balanced groups, as the peer script): FP8 E4M3 x E4M3 with
// per-group (tensor) scales, BF16 out, FP32 accumulation with promotion (no
// FAST_ACCUM, as torch._scaled_grouped_mm's default). Timed, each as one
// figure: "ours" = Fp8GroupedGemm given the device group sizes (our sm90
// kernel, the tile ChooseSm90Fp8 picks), "lt" = Fp8GroupedGemm without them
// (one cuBLASLt call per group). Without --main-only also every tile
// configuration of our kernel launched directly, and both routes with fast
// accumulation. Check column: ours against lt over the whole output, max
// |ours - lt| / max |lt| and the count of wrong values (|ours - lt| > |lt| / 64
// + rms(lt) / 128, i.e. several bf16 ulps); each other configuration is
// compared the same way on sampled rows.
// TFLOP/s = 2 * rows * K * N / time; time = CUDA events around `iters`
// back-to-back calls after `warmup` calls, as the peer script.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/bench_presets.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/sm90_fp8_grouped_gemm.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"
#include "nlohmann/json.hpp"

namespace shardgemm {
namespace cuda {
namespace {

// Random E4M3 codes of magnitude below 2 (bit 6 clear: no NaN), either sign.
void FillFp8(std::vector<uint8_t>& v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    x += 0x9E3779B97F4A7C15ull;  // splitmix64
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    z &= 0xBFBFBFBFBFBFBFBFull;
    std::memcpy(&v[i], &z, 8);
  }
  for (; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 37) & 0x3f);
}

float Bf16(uint16_t h) { return Bf16BitsToFloat(h); }

struct Compare {
  double max_rel = 0;  // max |a - b| / max |b|
  int64_t wrong = 0, checked = 0;
};

// a, b: bf16 [rows, n] (rows listed), b the reference.
Compare CompareRows(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t n) {
  Compare c;
  double max_b = 0, sq = 0;
  for (uint16_t v : b) {
    const double x = Bf16(v);
    max_b = std::max(max_b, std::fabs(x));
    sq += x * x;
  }
  const double rms = b.empty() ? 0 : std::sqrt(sq / b.size());
  double max_d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = Bf16(a[i]), y = Bf16(b[i]);
    const double d = std::fabs(x - y);
    if (!(d <= std::fabs(y) / 64 + rms / 128)) ++c.wrong;
    if (d > max_d || std::isnan(d)) max_d = std::isnan(d) ? INFINITY : d;
  }
  c.checked = static_cast<int64_t>(a.size());
  c.max_rel = max_b > 0 ? max_d / max_b : max_d;
  (void)n;
  return c;
}

std::vector<uint16_t> Download(const void* p, int64_t elems) {
  std::vector<uint16_t> h(static_cast<size_t>(elems));
  SHARDGEMM_CHECK_CUDA(cudaMemcpy(h.data(), p, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}
// Every `step`-th row of a bf16 [rows, n] matrix.
std::vector<uint16_t> DownloadRows(const void* p, int64_t rows, int64_t n, int64_t step) {
  const int64_t k = (rows + step - 1) / step;
  std::vector<uint16_t> h(static_cast<size_t>(k * n));
  SHARDGEMM_CHECK_CUDA(
      cudaMemcpy2D(h.data(), n * 2, p, step * n * 2, n * 2, static_cast<size_t>(k), cudaMemcpyDeviceToHost));
  return h;
}

int Main(int argc, char** argv) {
  std::string presets_path = "presets.json", json_path;
  int iters = 20, warmup = 5, round = 1;
  bool main_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--presets") presets_path = next();
    else if (a == "--iters") iters = std::atoi(next().c_str());
    else if (a == "--warmup") warmup = std::atoi(next().c_str());
    else if (a == "--json") json_path = next();
    else if (a == "--round") round = std::atoi(next().c_str());
    else if (a == "--main-only") main_only = true;
    else {
      std::fprintf(stderr, "usage: %s --presets PATH [--iters N] [--warmup N] [--json OUT] [--round N] [--main-only]\n",
                   argv[0]);
      return 1;
    }
  }
  if (presets_path == "presets.json" && !std::ifstream(presets_path)) {
    presets_path = "../shared/anchors/presets.json";
  }
  auto loaded = LoadPresets(presets_path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  const std::vector<Preset> presets = *std::move(loaded);
  FILE* jf = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");

  cudaStream_t s;
  SHARDGEMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e0));
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e1));
  cudaDeviceProp prop;
  SHARDGEMM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasLtCreate failed\n");
    return 2;
  }
  const size_t ws_bytes = 32 << 20;
  void* ws = nullptr;
  SHARDGEMM_CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  std::printf("# device: %s, %d SMs; FP8 E4M3 x E4M3, per-group scales, BF16 out, FP32 promotion; %d warmup + %d"
              " timed calls; round %d%s\n",
              prop.name, prop.multiProcessorCount, warmup, iters, round, main_only ? " (main only)" : "");
  std::printf("# %-18s %4s %5s %5s %6s %8s %-14s %8s %6s  %9s %8s %s\n", "preset", "G", "m", "K", "N", "ours",
              "(tile)", "lt_loop", "ratio", "max_rel", "wrong", "check");
  std::printf("# %-18s %4s %5s %5s %6s %8s %-14s %8s %6s\n", "", "", "", "", "", "TFLOP/s", "", "TFLOP/s", "");
  int failures = 0;
  uint64_t seed = 1;
  for (const bool block : {false, true}) {
  if (block) {
    std::printf("# block scaling: 1x128 (lhs) x 128x128 (rhs) FP32 scales in GroupedQuantize's layouts, promoted per"
                " 128-K block; ratio: ours / the cuBLASLt block-scaled loop\n");
  }
  for (const Preset& p : presets) {
    const int64_t M = p.g * p.m;
    std::vector<uint8_t> hl(static_cast<size_t>(M * p.k)), hr(static_cast<size_t>(p.g * p.n * p.k));
    FillFp8(hl, seed++);
    FillFp8(hr, seed++);
    const int64_t kbc = (p.k + 127) / 128, kb4 = (kbc + 3) / 4 * 4, nbc = (p.n + 127) / 128;
    std::vector<float> sl(block ? p.g * kbc * ((p.m + 3) / 4 * 4) : p.g), sr(block ? p.g * nbc * kb4 : p.g);
    for (size_t i = 0; i < sl.size(); ++i) sl[i] = 0.5f + 0.03f * static_cast<float>((i * 7) % 37);
    for (size_t i = 0; i < sr.size(); ++i) sr[i] = 2.0f - 0.02f * static_cast<float>((i * 11) % 41);
    const std::vector<int64_t> sizes(p.g, p.m);
    void *lhs, *rhs, *out_ours, *out_lt, *out_var, *dsl, *dsr, *dsizes;
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&lhs, hl.size()));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&rhs, hr.size()));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&out_ours, M * p.n * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&out_lt, M * p.n * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&out_var, M * p.n * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&dsl, sl.size() * 4));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&dsr, sr.size() * 4));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&dsizes, p.g * 8));
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(lhs, hl.data(), hl.size(), cudaMemcpyHostToDevice));
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(rhs, hr.data(), hr.size(), cudaMemcpyHostToDevice));
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(dsl, sl.data(), sl.size() * 4, cudaMemcpyHostToDevice));
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(dsr, sr.data(), sr.size() * 4, cudaMemcpyHostToDevice));
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(dsizes, sizes.data(), p.g * 8, cudaMemcpyHostToDevice));
    const double flops = 2.0 * M * p.k * p.n;

    Fp8GroupedGemmArgs a;
    a.lhs = static_cast<const uint8_t*>(lhs), a.lhs_scale_inv = dsl;
    a.rhs = static_cast<const uint8_t*>(rhs), a.rhs_scale_inv = dsr;
    a.m = M, a.n = p.n, a.k = p.k, a.group_sizes = sizes.data(), a.num_groups = p.g;
    a.out_dtype = DType::kBF16, a.workspace = ws, a.workspace_bytes = ws_bytes;
    if (block) a.lhs_mode = ScalingMode::kBlock1x128, a.rhs_mode = ScalingMode::kBlock128x128;
    std::string errors;
    // Times `fn` (one call = one grouped GEMM); -1 when its first call failed.
    auto timed = [&](const std::string& what, const std::function<absl::Status()>& fn) -> double {
      absl::Status st = fn();
      if (!st.ok()) {
        errors += absl::StrCat(" ", what, ": ", st.message());
        return -1;
      }
      for (int i = 1; i < warmup; ++i) (void)fn();
      SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
      SHARDGEMM_CHECK_CUDA(cudaEventRecord(e0, s));
      for (int i = 0; i < iters; ++i) (void)fn();
      SHARDGEMM_CHECK_CUDA(cudaEventRecord(e1, s));
      SHARDGEMM_CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      SHARDGEMM_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      return flops / (ms / iters * 1e-3) / 1e12;
    };
    auto via_dispatch = [&](void* out, bool device_sizes, bool fast, Fp8GemmStats* stats) {
      return [&, out, device_sizes, fast, stats]() {
        Fp8GroupedGemmArgs b = a;
        b.out = out;
        b.device_group_sizes = device_sizes ? static_cast<const int64_t*>(dsizes) : nullptr;
        b.fast_accum = fast;
        b.stats = stats;
        return Fp8GroupedGemm(b, lt, s);
      };
    };
    Fp8GemmStats ours_stats;
    const double ours = timed("ours", via_dispatch(out_ours, true, false, &ours_stats));
    const double lt_loop = timed("lt_loop", via_dispatch(out_lt, false, false, nullptr));
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    const std::string tile = ours_stats.ours ? absl::StrCat(ours_stats.ours_tile_m, "x", ours_stats.ours_tile_n,
                                                            ours_stats.ours_promote ? "" : " fast",
                                                            ours_stats.ours_tma_store ? " tma" : "")
                                             : std::string("(cuBLASLt)");
    const std::vector<uint16_t> ref = Download(out_lt, M * p.n);
    const Compare main_check = CompareRows(Download(out_ours, M * p.n), ref, p.n);
    bool ok = ours > 0 && lt_loop > 0 && main_check.wrong == 0 && ours_stats.ours;

    std::map<std::string, double> var_tflops;
    std::map<std::string, Compare> var_checks;
    if (!main_only) {
      const int64_t step = std::max<int64_t>(1, M / 512);
      std::vector<uint16_t> ref_rows = DownloadRows(out_lt, M, p.n, step);
      struct Cfg {
        const char* name;
        int tm, tn;
        bool promote, tma;
      };
      const Cfg cfgs[] = {{"sm90_128x256", 128, 256, true, true},
                          {"sm90_128x256_direct", 128, 256, true, false},
                          {"sm90_128x192", 128, 192, true, true},
                          {"sm90_128x192_direct", 128, 192, true, false},
                          {"sm90_128x128", 128, 128, true, true},
                          {"sm90_64x256", 64, 256, true, true},
                          {"sm90_128x256_fast", 128, 256, false, true},
                          {"sm90_128x256_fast_direct", 128, 256, false, false}};
      for (const Cfg& c : cfgs) {
        if (block && (c.tn == 192 || !c.promote || !c.tma)) continue;
        Sm90Fp8GroupedGemmParams k;
        k.block_scaling = block;
        k.out_dtype = CuDType::kBF16;
        k.lhs = lhs, k.rhs = rhs, k.out = out_var;
        k.lhs_scale_inv = static_cast<const float*>(dsl), k.rhs_scale_inv = static_cast<const float*>(dsr);
        k.group_sizes = static_cast<const int64_t*>(dsizes);
        k.m = M, k.k = p.k, k.n = p.n, k.num_groups = p.g;
        k.tile_m = c.tm, k.tile_n = c.tn, k.promote = c.promote, k.tma_store = c.tma;
        SHARDGEMM_CHECK_CUDA(cudaMemset(out_var, 0xff, M * p.n * 2));
        var_tflops[c.name] = timed(c.name, [&]() -> absl::Status {
          const char* detail = "";
          cudaError_t e = LaunchSm90Fp8GroupedGemm(k, prop.multiProcessorCount, s, &detail);
          return e == cudaSuccess ? absl::OkStatus() : CudaStatus(e, detail);
        });
        SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
        var_checks[c.name] = CompareRows(DownloadRows(out_var, M, p.n, step), ref_rows, p.n);
        if (var_checks[c.name].wrong > 0 && c.promote) ok = false;
      }
      if (!block) {
        var_tflops["lt_loop_fast"] = timed("lt_loop_fast", via_dispatch(out_var, false, true, nullptr));
        SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
        var_checks["lt_loop_fast"] = CompareRows(DownloadRows(out_var, M, p.n, step), ref_rows, p.n);
      }
    }
    if (!ok) ++failures;
    std::printf("  %-18s %4lld %5lld %5lld %6lld %8.1f %-14s %8.1f %6.3f  %9.2e %8lld %s%s\n", p.name.c_str(),
                static_cast<long long>(p.g), static_cast<long long>(p.m), static_cast<long long>(p.k),
                static_cast<long long>(p.n), ours, tile.c_str(), lt_loop, lt_loop > 0 ? ours / lt_loop : 0.0,
                main_check.max_rel, static_cast<long long>(main_check.wrong), ok ? "ok" : "FAIL", errors.c_str());
    if (!main_only) {
      std::string line;
      for (auto& [name, t] : var_tflops)
        line += absl::StrCat(" ", name, " ", static_cast<int>(t * 10) / 10.0, " (max_rel ",
                             static_cast<float>(var_checks[name].max_rel), ", wrong ", var_checks[name].wrong, ");");
      std::printf("  %-18s   more:%s\n", "", line.c_str());
    }
    std::fflush(stdout);
    if (jf) {
      nlohmann::json j;
      j["preset"] = p.name;
      j["mode"] = block ? "block" : "tensor";
      j["round"] = round;
      j["ours_tflops"] = ours;
      j["ours_tile"] = tile;
      j["lt_loop_tflops"] = lt_loop;
      j["max_rel_err_vs_lt"] = main_check.max_rel;
      j["wrong_vs_lt"] = main_check.wrong;
      j["checked"] = main_check.checked;
      for (auto& [name, t] : var_tflops) {
        j["variants"][name]["tflops"] = t;
        j["variants"][name]["max_rel_err_vs_lt"] = var_checks[name].max_rel;
        j["variants"][name]["wrong_vs_lt"] = var_checks[name].wrong;
      }
      j["ok"] = ok;
      std::fprintf(jf, "%s\n", j.dump().c_str());
      std::fflush(jf);
    }
    for (void* b : {lhs, rhs, out_ours, out_lt, out_var, dsl, dsr, dsizes}) cudaFree(b);
  }
  }
  if (jf) std::fclose(jf);
  cudaFree(ws);
  cublasLtDestroy(lt);
  std::printf("# %s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
  return failures ? 3 : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm

int main(int argc, char** argv) { return shardgemm::cuda::Main(argc, argv); }
