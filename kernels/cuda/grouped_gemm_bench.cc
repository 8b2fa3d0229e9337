// Grouped-GEMM benchmark over the presets (anchors/presets.json format).
//
//   grouped_gemm_bench --presets presets.json [--iters 20] [--warmup 5] [--json out.jsonl]
//                      [--only-auto] [--round N]
//
// Per preset and variant, one result line like nccl-tests: our TFLOP/s (the
// strategy kAuto picks, timed once, first), that strategy, every strategy's
// TFLOP/s (- where it cannot run the shape), and the sampled check against
// the naive reference (relative L2 error of auto's output; "ok" when every
// strategy passed); then the cuBLASLt algorithm auto ran and how it was
// tuned. --only-auto times auto alone (the later rounds of
// tools/gpu/run_gemm_bench.sh); --round tags the JSON lines.
// Variants: rhs [G,N,K] (as the peer script), rhs [G,K,N], unbalanced group
// sizes (same rows, [G,N,K]), and device-only group sizes ([G,N,K]).
// BF16 in and out; TFLOP/s = 2 * rows * K * N / time; time = CUDA events
// around `iters` back-to-back calls after `warmup` calls, as the peer script.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/bench_presets.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm_check.h"
#include "kernels/cuda/gemm_testing.h"
#include "kernels/cuda/grouped_gemm.h"
#include "nlohmann/json.hpp"

namespace shardgemm {
namespace cuda {
namespace {

std::vector<int64_t> Unbalanced(int64_t g, int64_t total, uint64_t seed) {
  // Skewed routing: weights 0.25..4 (log-uniform), same total rows.
  std::mt19937_64 rng(seed);
  std::vector<double> w(g);
  double sum = 0;
  for (auto& x : w) {
    x = std::exp((static_cast<double>(rng() % 10000) / 10000.0 - 0.5) * 2.77);
    sum += x;
  }
  std::vector<int64_t> s(g);
  int64_t used = 0;
  for (int64_t i = 0; i < g; ++i) {
    s[i] = static_cast<int64_t>(w[i] / sum * total);
    used += s[i];
  }
  for (int64_t i = 0; used < total; i = (i + 1) % g, ++used) ++s[i];
  return s;
}

// The layouts every preset is run in: rhs [G,N,K] or [G,K,N], equal or
// skewed group sizes, group sizes on the host or only on the device.
struct Variant {
  std::string name;
  bool transposed;
  bool host;
  std::vector<int64_t> sizes;
};
std::vector<Variant> Variants(const Preset& p) {
  const std::vector<int64_t> equal(p.g, p.m);
  return {{"[G,N,K]", true, true, equal},
          {"[G,K,N]", false, true, equal},
          {"unbalanced", true, true, Unbalanced(p.g, p.g * p.m, 77 + p.g)},
          {"dev-sizes", true, false, equal}};
}

// One preset's operands in device memory (random BF16), freed on scope exit.
struct PresetBuffers {
  void *lhs = nullptr, *rhs = nullptr, *out = nullptr, *sizes_dev = nullptr;
  PresetBuffers(const Preset& p, uint64_t lhs_seed, uint64_t rhs_seed, cudaStream_t s) {
    const int64_t M = p.g * p.m;
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&lhs, M * p.k * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&rhs, p.g * p.k * p.n * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&out, M * p.n * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&sizes_dev, p.g * 8));
    SHARDGEMM_CHECK_CUDA(testing::FillRandom(lhs, CuDType::kBF16, M * p.k, lhs_seed, 1.f, s));
    SHARDGEMM_CHECK_CUDA(testing::FillRandom(rhs, CuDType::kBF16, p.g * p.k * p.n, rhs_seed, 1.f, s));
  }
  ~PresetBuffers() {
    for (void* b : {lhs, rhs, out, sizes_dev}) cudaFree(b);
  }
  PresetBuffers(const PresetBuffers&) = delete;

  // The variant's arguments; its group sizes are uploaded (and synchronized).
  DeviceGroupedGemmArgs Args(const Preset& p, const Variant& v, cudaStream_t s) const {
    SHARDGEMM_CHECK_CUDA(cudaMemcpyAsync(sizes_dev, v.sizes.data(), p.g * 8, cudaMemcpyHostToDevice, s));
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    DeviceGroupedGemmArgs a;
    a.lhs = lhs, a.rhs = rhs, a.out = out;
    a.m = p.g * p.m, a.k = p.k, a.n = p.n, a.num_groups = p.g;
    a.rhs_transposed = v.transposed;
    a.group_sizes_device = static_cast<const int64_t*>(sizes_dev);
    a.group_sizes_host = v.host ? v.sizes.data() : nullptr;
    return a;
  }
};

const Strategy kStrategies[] = {Strategy::kLtLoop, Strategy::kLtLoopGraph, Strategy::kLtBatched,
                                Strategy::kGroupedBatched, Strategy::kSm90};

int Main(int argc, char** argv) {
  std::string presets_path = "presets.json", json_path;
  int iters = 20, warmup = 5, round = 1;
  bool only_auto = false, latency = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--presets") presets_path = next();
    else if (a == "--iters") iters = std::atoi(next().c_str());
    else if (a == "--warmup") warmup = std::atoi(next().c_str());
    else if (a == "--json") json_path = next();
    else if (a == "--only-auto") only_auto = true;
    else if (a == "--latency") latency = true;
    else if (a == "--round") round = std::atoi(next().c_str());
    else if (a == "--local") continue;  // the GPU of this machine (the only mode for now)
    else {
      std::fprintf(stderr,
                   "usage: %s [--local] --presets PATH [--iters N] [--warmup N] [--json OUT] [--only-auto] [--round N]"
                   " [--latency]\n",
                   argv[0]);
      return 1;
    }
  }
  // Installed as bin/shardgemm-bench: find the anchors beside the checkout.
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

  auto runner_or = GroupedGemmRunner::Create();
  if (!runner_or.ok()) {
    std::fprintf(stderr, "runner: %s\n", std::string(runner_or.status().message()).c_str());
    return 2;
  }
  GroupedGemmRunner& runner = **runner_or;
  RunnerOptions one_stream;
  one_stream.side_streams = 1;
  auto runner1_or = GroupedGemmRunner::Create(one_stream);
  if (!runner1_or.ok()) return 2;
  GroupedGemmRunner& runner1 = **runner1_or;
  cudaStream_t s;
  SHARDGEMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e0));
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e1));
  cudaDeviceProp prop;
  SHARDGEMM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device: %s, %d SMs; BF16 in/out, FP32 accumulate; %d warmup + %d timed calls; round %d%s\n",
              prop.name, prop.multiProcessorCount, warmup, iters, round, only_auto ? " (auto only)" : "");
  std::printf("# %-18s %4s %5s %5s %6s %-10s %8s  %-15s %8s %8s %8s %8s %8s  %9s %9s %s\n", "preset", "G", "m", "K",
              "N", "variant", "ours", "strategy", "lt_loop", "lt_graph", "lt_batch", "grp_bat", "sm90", "max_err",
              "rel_l2", "check");
  std::printf("# %-18s %4s %5s %5s %6s %-10s %8s  %-15s %8s %8s %8s %8s %8s  %9s\n", "", "", "", "", "", "",
              "TFLOP/s", "", "TFLOP/s", "TFLOP/s", "TFLOP/s", "TFLOP/s", "TFLOP/s", "");
  std::printf("# max_err: max |ours - ref| / max |ref| over the sampled rows (auto's output), rel_l2: ||ours - ref|| /"
              " ||ref||; check: every strategy within tolerance\n");
  int failures = 0;
  uint64_t seed = 1;
  // Tune first: auto's first call of a shape times cuBLASLt candidates (up
  // to ~0.5 s of back-to-back GEMMs), a one-time cost the runner caches. Do
  // it for every shape before any timing. It also brings the GPU to its
  // working clocks, as tools/gpu/warm_then_run.py does for the peer script:
  // an idle H200 sits at 345 MHz and ramps up over the first calls.
  for (const Preset& p : presets) {
    PresetBuffers b(p, 999, 998, s);
    for (const Variant& v : Variants(p)) {
      DeviceGroupedGemmArgs a = b.Args(p, v, s);
      a.strategy = Strategy::kAuto;
      (void)runner.RaggedM(a, s);
      SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    }
  }
  if (latency) {
    // What a service sees: one call on an idle stream, then its sync. The
    // host's part (the runner's call returning: cuBLASLt's or our launch)
    // and the whole (to the sync's return), p50 / p90 over `iters` calls,
    // per strategy and sm90 variant. Throughput figures hide the host's part.
    std::printf("# latency: one call at a time on an idle stream, %d calls, us p50 / p90: host = the call's return,"
                " whole = its sync's return\n", iters);
    std::printf("# %-18s %-22s %17s %17s  %s\n", "preset", "strategy", "host p50/p90", "whole p50/p90", "ran");
    for (const Preset& p : presets) {
      PresetBuffers b(p, seed, seed + 1, s);
      seed += 2;
      const Variant v = Variants(p).front();
      DeviceGroupedGemmArgs a = b.Args(p, v, s);
      struct Way {
        const char* name;
        Strategy strategy;
        int tile_n, cluster;
      };
      const Way ways[] = {{"auto", Strategy::kAuto, 0, 0},         {"lt_loop", Strategy::kLtLoop, 0, 0},
                          {"lt_batched", Strategy::kLtBatched, 0, 0}, {"sm90", Strategy::kSm90, 0, 0},
                          {"sm90 128x256", Strategy::kSm90, 256, 1},  {"sm90 128x256 2x1", Strategy::kSm90, 256, 2}};
      for (const Way& w : ways) {
        a.strategy = w.strategy;
        a.sm90_tile_n = w.tile_n;
        a.sm90_cluster = w.cluster;
        if (!runner.Supports(a, false, w.strategy).ok()) continue;
        bool ok = true;
        for (int i = 0; i < warmup && ok; ++i) {
          ok = runner.RaggedM(a, s).ok();
          SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
        }
        if (!ok) continue;
        std::vector<double> host, whole;
        for (int i = 0; i < iters; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          (void)runner.RaggedM(a, s);
          const auto t1 = std::chrono::steady_clock::now();
          SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
          const auto t2 = std::chrono::steady_clock::now();
          host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          whole.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
        }
        auto pct = [](std::vector<double> x, double q) {
          std::sort(x.begin(), x.end());
          return x[static_cast<size_t>(q * (x.size() - 1))];
        };
        const RunInfo info = runner.LastRun();
        std::printf("  %-18s %-22s %8.1f %8.1f %8.1f %8.1f  %s%s%s\n", p.name.c_str(), w.name, pct(host, 0.5),
                    pct(host, 0.9), pct(whole, 0.5), pct(whole, 0.9), std::string(StrategyName(info.strategy)).c_str(),
                    info.detail.empty() ? "" : ": ", info.detail.c_str());
        std::fflush(stdout);
      }
    }
    return 0;
  }
  for (const Preset& p : presets) {
    const uint64_t lhs_seed = seed++, rhs_seed = seed++;
    PresetBuffers b(p, lhs_seed, rhs_seed, s);
    for (const Variant& v : Variants(p)) {
      DeviceGroupedGemmArgs a = b.Args(p, v, s);
      int64_t rows = 0;
      for (int64_t x : v.sizes) rows += x;
      const double flops = 2.0 * rows * p.k * p.n;
      std::map<Strategy, double> tf;
      std::map<Strategy, testing::CheckResult> checks;
      std::map<std::string, std::string> algos;  // what each timed strategy ran (LastRun)
      bool all_ok = true;
      std::string errors;
      auto measure = [&](Strategy st, GroupedGemmRunner& runner, int tile_n, int cluster = 0,
                         const char* label = nullptr) -> double {
        a.strategy = st;
        a.sm90_tile_n = tile_n;
        a.sm90_cluster = cluster;
        if (!runner.Supports(a, false, st).ok()) return -1;
        // The first call of a shape may tune (timing candidates writes the
        // output many times), so the checked call is the second, on a
        // poisoned output: what the chosen algorithm alone wrote.
        absl::Status status = runner.RaggedM(a, s);
        if (status.ok()) {
          SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
          SHARDGEMM_CHECK_CUDA(testing::Poison(b.out, p.g * p.m * p.n * 2, s));
          status = runner.RaggedM(a, s);
        }
        if (!status.ok()) {
          errors += absl::StrCat(" ", StrategyName(st), ": ", status.message());
          all_ok = false;
          return -2;
        }
        SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
        testing::CheckResult c = testing::CheckRaggedM(a, v.sizes, 32, seed++, s);
        checks[st] = c;
        if (!c.Ok(testing::Tolerance(DType::kBF16))) {
          all_ok = false;
          errors += absl::StrCat(" ", StrategyName(st), " check failed: ", c.ToString());
        }
        for (int i = 0; i < warmup; ++i) (void)runner.RaggedM(a, s);
        SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
        SHARDGEMM_CHECK_CUDA(cudaEventRecord(e0, s));
        for (int i = 0; i < iters; ++i) (void)runner.RaggedM(a, s);
        SHARDGEMM_CHECK_CUDA(cudaEventRecord(e1, s));
        SHARDGEMM_CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        SHARDGEMM_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        const RunInfo info = runner.LastRun();
        algos[label != nullptr ? std::string(label) : std::string(StrategyName(st))] =
            absl::StrCat(StrategyName(info.strategy), info.detail.empty() ? "" : ": ", info.detail);
        return flops / (ms / iters * 1e-3) / 1e12;
      };
      // Ours (auto) first, in the same position as the peer's figure, and
      // timed once: one figure per round on each side (run_gemm_bench.sh
      // interleaves three rounds and takes each side's median). Its first
      // call tunes (cuBLASLt algorithms, and lt_loop against lt_batched).
      const double ours = measure(Strategy::kAuto, runner, 0);
      const RunInfo ran = runner.LastRun();
      const Strategy chosen = ran.strategy;
      std::map<std::string, double> extra;
      if (!only_auto) {
        for (Strategy st : kStrategies) {
          if (!v.host && st != Strategy::kSm90 && st != Strategy::kLtLoop) continue;  // the rest need host sizes
          tf[st] = measure(st, runner, 0);
        }
        extra["lt_loop_1stream"] = measure(Strategy::kLtLoop, runner1, 0, 0, "lt_loop_1stream");
        extra["sm90_n128"] = measure(Strategy::kSm90, runner, 128, 0, "sm90_n128");
        extra["sm90_n256"] = measure(Strategy::kSm90, runner, 256, 1, "sm90_n256");
        extra["sm90_n256_cluster2"] = measure(Strategy::kSm90, runner, 256, 2, "sm90_n256_cluster2");
        // Auto again at the end, for the drift within a run (not in the ratio).
        extra["auto_first"] = ours;
        extra["auto_last"] = measure(Strategy::kAuto, runner, 0, 0, "auto_last");
      }
      auto col = [&](Strategy st) -> std::string {
        auto it = tf.find(st);
        if (it == tf.end() || it->second < 0) return std::string("-");
        return absl::StrFormat("%.1f", it->second);
      };
      const double rel = checks.count(Strategy::kAuto) ? checks[Strategy::kAuto].rel_l2 : -1;
      const double max_err = checks.count(Strategy::kAuto)
                                 ? checks[Strategy::kAuto].max_abs / std::max(checks[Strategy::kAuto].max_ref, 1e-30)
                                 : -1;
      if (!all_ok) ++failures;
      std::printf("  %-18s %4lld %5lld %5lld %6lld %-10s %8.1f  %-15s %8s %8s %8s %8s %8s  %9.2e %9.2e %s%s\n",
                  p.name.c_str(), static_cast<long long>(p.g), static_cast<long long>(p.m),
                  static_cast<long long>(p.k), static_cast<long long>(p.n), v.name.c_str(), ours,
                  std::string(StrategyName(chosen)).c_str(), col(Strategy::kLtLoop).c_str(),
                  col(Strategy::kLtLoopGraph).c_str(), col(Strategy::kLtBatched).c_str(),
                  col(Strategy::kGroupedBatched).c_str(), col(Strategy::kSm90).c_str(), max_err, rel,
                  all_ok ? "ok" : "FAIL", errors.c_str());
      if (!only_auto)
        std::printf("  %-18s %4s %5s %5s %6s %-10s   more: lt_loop 1 stream %.1f, sm90 128x128 %.1f, sm90 128x256 %.1f,"
                    " sm90 128x256 2x1 cluster %.1f, auto again %.1f\n", "", "", "", "", "", "",
                    extra["lt_loop_1stream"], extra["sm90_n128"], extra["sm90_n256"], extra["sm90_n256_cluster2"],
                    extra["auto_last"]);
      std::printf("  %-18s %4s %5s %5s %6s %-10s   auto ran %s%s%s\n", "", "", "", "", "", "",
                  std::string(StrategyName(chosen)).c_str(), ran.detail.empty() ? "" : ": ", ran.detail.c_str());
      std::fflush(stdout);
      if (jf) {
        nlohmann::json j;
        j["preset"] = p.name;
        j["variant"] = v.name;
        j["round"] = round;
        j["only_auto"] = only_auto;
        j["ours_tflops"] = ours;
        j["strategy"] = std::string(StrategyName(chosen));
        j["algo"] = ran.detail;
        for (auto& [name, d] : algos) j["algos"][name] = d;
        for (auto& [st, t] : tf) j["strategies"][std::string(StrategyName(st))] = t;
        for (auto& [name, t] : extra) j["strategies"][name] = t;
        j["sizes"] = v.sizes;
        j["k"] = p.k;
        j["n"] = p.n;
        j["rel_err"] = rel;
        j["max_err"] = max_err;
        j["ok"] = all_ok;
        std::fprintf(jf, "%s\n", j.dump().c_str());
        std::fflush(jf);
      }
    }
  }
  if (jf) std::fclose(jf);
  std::printf("# %s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
  return failures ? 3 : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm

int main(int argc, char** argv) { return shardgemm::cuda::Main(argc, argv); }
