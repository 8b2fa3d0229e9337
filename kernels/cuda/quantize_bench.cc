// Grouped quantize bandwidth on every preset's activations (BF16 x
// [groups * rows_per_group, k], the shapes of /work/shared/anchors/presets.json,
// copied below), next to a device-to-device copy of the same bytes measured in
// the same run. GB/s counts bytes read + written:
//   logical: x once + every output (data, scales, amax) once;
//   moved:   what the kernels actually move (current scaling on the tiled
//            kernels reads x twice: the amax pass, then the quantize pass,
//            or in the fused pass a re-read from L2; its one-shot kernel
//            reads x once).
// Timing: CUDA events around kIters calls captured in one CUDA graph (device
// time, no host launch overhead), and around kIters eager calls.
//   quantize_bench [--iters N] [--only PRESET,...] [--profile]
// --profile: no timing; each row's call runs once between cudaProfilerStart
// and cudaProfilerStop (after two warm-up calls), for
// `ncu --profile-from-start off`.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/quantize.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/quantize.h"

namespace shardgemm {
namespace {

struct Preset {
  const char* name;
  int64_t groups, rows_per_group, k;
};
// From /work/shared/anchors/presets.json.
const Preset kPresets[] = {
    {"mixtral-8x7b-up", 8, 2048, 4096},
    {"deepseek-v3-up", 8, 2048, 7168},
    {"deepseek-v3-down", 8, 2048, 2048},
    {"qwen3-30b-up-ep8", 16, 512, 2048},
    {"qwen3-30b-up", 128, 128, 2048},
    {"small-decode", 64, 64, 1024},
    // Not a preset: one 64 x 256 tile, the floor a launch sets (how far
    // small-decode is from its copy).
    {"one-tile", 1, 64, 256},
    // Not a preset: a decode step with few tokens per expert (64 slabs of
    // 32 x 256, where the default takes the one-shot kernel).
    {"tiny-decode", 8, 32, 2048},
};

__attribute__((unused)) void Fill(void* p, size_t bytes) { SHARDGEMM_CHECK_CUDA(cudaMemset(p, 0x3c, bytes)); }

// Mean seconds per call of fn over iters calls: graph-captured and eager.
template <typename F>
void Time(F fn, int iters, cudaStream_t s, double* graph_s, double* eager_s) {
  for (int i = 0; i < 3; ++i) fn();
  SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&a));
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&b));
  // Eager.
  SHARDGEMM_CHECK_CUDA(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) fn();
  SHARDGEMM_CHECK_CUDA(cudaEventRecord(b, s));
  SHARDGEMM_CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  SHARDGEMM_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  *eager_s = ms / 1e3 / iters;
  // Graph of iters calls.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SHARDGEMM_CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < iters; ++i) fn();
  SHARDGEMM_CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  SHARDGEMM_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  SHARDGEMM_CHECK_CUDA(cudaGraphLaunch(exec, s));  // warm
  SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    SHARDGEMM_CHECK_CUDA(cudaEventRecord(a, s));
    SHARDGEMM_CHECK_CUDA(cudaGraphLaunch(exec, s));
    SHARDGEMM_CHECK_CUDA(cudaEventRecord(b, s));
    SHARDGEMM_CHECK_CUDA(cudaEventSynchronize(b));
    SHARDGEMM_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms / 1e3 / iters);
  }
  *graph_s = best;
  SHARDGEMM_CHECK_CUDA(cudaGraphExecDestroy(exec));
  SHARDGEMM_CHECK_CUDA(cudaGraphDestroy(graph));
  SHARDGEMM_CHECK_CUDA(cudaEventDestroy(a));
  SHARDGEMM_CHECK_CUDA(cudaEventDestroy(b));
}

int Main(int argc, char** argv) {
  int iters = 20;
  bool profile = false;
  std::string only;  // comma-separated preset names; empty: all
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (arg == "--only" && i + 1 < argc) {
      only = "," + std::string(argv[++i]) + ",";
    } else if (arg == "--profile") {
      profile = true;
    } else {
      std::fprintf(stderr, "usage: quantize_bench [--iters N] [--only PRESET,...] [--profile]\n");
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop;
  SHARDGEMM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  SHARDGEMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // One profiled call of fn (--profile), else its timing.
  auto measure = [&](auto fn, int n_calls, double* graph_s, double* eager_s) {
    if (!profile) return Time(fn, n_calls, s, graph_s, eager_s);
    fn();
    fn();
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    SHARDGEMM_CHECK_CUDA(cudaProfilerStart());
    fn();
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    SHARDGEMM_CHECK_CUDA(cudaProfilerStop());
    *graph_s = *eager_s = 1.0;
  };

  // The HBM copy bandwidth: a device-to-device copy of 256 MiB each way, five
  // times the L2 (a 1 GiB cudaMemcpyAsync measured only 2.7 TB/s, warm or
  // cold, where every preset's copy of 128 MiB or more reached 4.0-4.2).
  double hbm_bw = 0;
  if (!profile) {
    const size_t bytes = size_t{256} << 20;
    void *src, *dst;
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&src, bytes));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&dst, bytes));
    Fill(src, bytes);
    double g, e;
    Time([&] { SHARDGEMM_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); }, 10, s, &g, &e);
    hbm_bw = 2.0 * bytes / g / 1e9;
    std::printf("d2d copy 256 MiB (the HBM copy): %.0f GB/s (read + write)\n\n", hbm_bw);
    SHARDGEMM_CHECK_CUDA(cudaFree(src));
    SHARDGEMM_CHECK_CUDA(cudaFree(dst));
  }

  void* workspace = nullptr;
  SHARDGEMM_CHECK_CUDA(cudaMalloc(&workspace, cuda::QuantizeWorkspaceBytes()));
  SHARDGEMM_CHECK_CUDA(cudaMemset(workspace, 0, cuda::QuantizeWorkspaceBytes()));
  // moved/cp: against the same-bytes copy of the row's preset (L2-resident
  // where the preset's bytes fit the L2); moved/HBM: against the 256 MiB
  // copy, the HBM copy bandwidth PERFORMANCE.md's target names.
  std::printf("%-18s %-26s %8s %9s %10s %10s %9s %9s %9s %9s %7s\n", "preset", "op", "M x K", "us(graph)", "GB/s logic",
              "GB/s moved", "copy GB/s", "moved/cp", "logic/cp", "moved/HBM", "us(eag)");
  int presets_run = 0;
  for (const Preset& p : kPresets) {
    if (!only.empty() && only.find("," + std::string(p.name) + ",") == std::string::npos) continue;
    ++presets_run;
    const int64_t m = p.groups * p.rows_per_group, k = p.k;
    std::vector<int64_t> gs(static_cast<size_t>(p.groups), p.rows_per_group);
    const size_t xbytes = static_cast<size_t>(m * k * 2);
    void *x, *copy_dst, *row, *col, *rs, *cs, *amax, *scale;
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&x, xbytes));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&copy_dst, xbytes));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&row, m * k));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&col, m * k));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&rs, m * k / 8 + 4096 * 1024));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&cs, m * k / 8 + 4096 * 1024));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&amax, p.groups * 4));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&scale, p.groups * 4));
    {
      // Normal-ish bf16 values: fill with a pattern through a host buffer.
      std::vector<uint16_t> h(static_cast<size_t>(m * k));
      uint32_t r = 12345;
      for (auto& v : h) {
        r = r * 1664525u + 1013904223u;
        v = static_cast<uint16_t>(0x3c00u + ((r >> 16) & 0x7ffu) + ((r >> 31) << 15));  // +-[2^-7, 2^4)
      }
      SHARDGEMM_CHECK_CUDA(cudaMemcpy(x, h.data(), xbytes, cudaMemcpyHostToDevice));
      std::vector<float> ones(static_cast<size_t>(p.groups), 100.0f);
      SHARDGEMM_CHECK_CUDA(cudaMemcpy(scale, ones.data(), p.groups * 4, cudaMemcpyHostToDevice));
    }
    double copy_g = 1.0, copy_e = 1.0;
    if (!profile) {  // (profiled: the quantize calls only)
      Time([&] { SHARDGEMM_CHECK_CUDA(cudaMemcpyAsync(copy_dst, x, xbytes, cudaMemcpyDeviceToDevice, s)); }, iters, s,
           &copy_g, &copy_e);
    }
    const double copy_bw = 2.0 * xbytes / copy_g / 1e9;
    char shape[32];
    std::snprintf(shape, sizeof(shape), "%lldx%lld", static_cast<long long>(m), static_cast<long long>(k));
    std::printf("%-18s %-26s %8s %9.1f %10s %10.0f %9.0f\n", p.name, "d2d copy (same bytes)", shape, copy_g * 1e6, "-",
                copy_bw, copy_bw);

    struct Op {
      const char* name;
      ScalingMode mode;
      bool row, col;
      cuda::GpuQuantizeOptions::CurrentPass pass = cuda::GpuQuantizeOptions::CurrentPass::kAuto;
      int tile_rows = 0;  // GpuQuantizeOptions::tile_rows
      cuda::GpuQuantizeOptions::Kernel kernel = cuda::GpuQuantizeOptions::Kernel::kAuto;
      bool amax = true;  // ask for amax (optional for MXFP8)
      bool amax_accumulate = false;  // GpuQuantizeOptions::amax_accumulate
    };
    using Kernel = cuda::GpuQuantizeOptions::Kernel;
    using Pass = cuda::GpuQuantizeOptions::CurrentPass;
    const Op ops[] = {
        {"current row+col", ScalingMode::kCurrent, true, true},
        {"mxfp8 row+col", ScalingMode::kMxfp8, true, true},
        {"current row", ScalingMode::kCurrent, true, false},
        {"delayed row+col", ScalingMode::kDelayed, true, true},
        {"mxfp8 row", ScalingMode::kMxfp8, true, false},
        {"block1x128 row+col", ScalingMode::kBlock1x128, true, true},
        {"current row+col fused", ScalingMode::kCurrent, true, true, Pass::kFused},
        // Tile shapes the default does not pick for these presets (QuantizeTileRows).
        {"current row+col 64x256", ScalingMode::kCurrent, true, true, Pass::kTwoPass, 64},
        {"delayed row+col 64x256", ScalingMode::kDelayed, true, true, Pass::kAuto, 64},
        {"mxfp8 row+col 64x256", ScalingMode::kMxfp8, true, true, Pass::kAuto, 64},
        {"mxfp8 row+col 128x128", ScalingMode::kMxfp8, true, true, Pass::kAuto, 128},
        // Each kernel forced, where the default picks the other (current
        // scaling's one-shot kernel only fits the GPU's resident blocks).
        {"current row+col tiled", ScalingMode::kCurrent, true, true, Pass::kAuto, 0, Kernel::kTiled},
        {"mxfp8 row+col tiled", ScalingMode::kMxfp8, true, true, Pass::kAuto, 0, Kernel::kTiled},
        {"delayed row+col tiled", ScalingMode::kDelayed, true, true, Pass::kAuto, 0, Kernel::kTiled},
        {"mxfp8 row+col one-shot", ScalingMode::kMxfp8, true, true, Pass::kAuto, 0, Kernel::kOneShot},
        {"delayed row+col one-shot", ScalingMode::kDelayed, true, true, Pass::kAuto, 0, Kernel::kOneShot},
        // (Only where the slabs fit the GPU at once: its blocks meet at a grid barrier.)
        {"current row+col one-shot", ScalingMode::kCurrent, true, true, Pass::kAuto, 0, Kernel::kOneShot},
        // Without the optional amax: no per-group reduction, no zeroing launch.
        {"mxfp8 row+col no amax", ScalingMode::kMxfp8, true, true, Pass::kAuto, 0, Kernel::kAuto, false},
        {"mxfp8 row+col no amax tiled", ScalingMode::kMxfp8, true, true, Pass::kAuto, 0, Kernel::kTiled, false},
        // amax max-reduced into the caller's buffer as it stands (no zeroing launch).
        {"mxfp8 row+col amax accum", ScalingMode::kMxfp8, true, true, Pass::kAuto, 0, Kernel::kAuto, true, true},
        {"delayed row+col amax accum", ScalingMode::kDelayed, true, true, Pass::kAuto, 0, Kernel::kAuto, true, true},
    };
    for (const Op& op : ops) {
      GroupedQuantizeArgs a;
      a.x = x, a.x_dtype = DType::kBF16, a.m = m, a.k = k, a.group_sizes = gs.data(), a.num_groups = p.groups;
      a.mode = op.mode, a.format = Fp8Format::kE4M3, a.rowwise = op.row, a.colwise = op.col;
      a.scale = static_cast<float*>(scale);
      a.rowwise_data = static_cast<uint8_t*>(row), a.colwise_data = static_cast<uint8_t*>(col);
      a.rowwise_scale_inv = rs, a.colwise_scale_inv = cs, a.amax = op.amax ? static_cast<float*>(amax) : nullptr;
      absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(a);
      if (!l.ok()) {
        std::printf("%s\n", l.status().ToString().c_str());
        return 1;
      }
      const double out_bytes = (op.row ? m * k + l->rowwise_scale_elems * l->scale_bytes : 0) +
                               (op.col ? m * k + l->colwise_scale_elems * l->scale_bytes : 0) +
                               (op.amax ? p.groups * 4.0 : 0.0);
      cuda::GpuQuantizeOptions opt;
      opt.current_pass = op.pass;
      opt.tile_rows = op.tile_rows;
      opt.kernel = op.kernel;
      opt.workspace = workspace;  // graph capture: the library keeps none of its own
      opt.amax_accumulate = op.amax_accumulate;
      absl::StatusOr<Kernel> chosen = cuda::ChosenQuantizeKernel(a, s, opt);
      if (!chosen.ok()) {
        if (op.kernel == Kernel::kOneShot && op.mode == ScalingMode::kCurrent) {  // too many slabs for the GPU
          std::printf("%-18s %-26s not run: %s\n", p.name, op.name, std::string(chosen.status().message()).c_str());
          continue;
        }
        std::printf("%s: %s\n", op.name, chosen.status().ToString().c_str());
        return 1;
      }
      const double logical = xbytes + out_bytes;
      const bool reads_x_twice = op.mode == ScalingMode::kCurrent && *chosen == Kernel::kTiled;
      const double moved = logical + (reads_x_twice ? xbytes : 0);
      double g, e;
      absl::Status st;
      measure(
          [&] {
            absl::Status r = cuda::GroupedQuantize(a, s, opt);
            if (!r.ok()) st = r;
          },
          iters, &g, &e);
      if (!st.ok()) {
        std::printf("%s: %s\n", op.name, st.ToString().c_str());
        return 1;
      }
      if (profile) {
        std::printf("%-18s %-26s profiled\n", p.name, op.name);
        continue;
      }
      std::printf("%-18s %-26s %8s %9.1f %10.0f %10.0f %9.0f %8.0f%% %8.0f%% %8.0f%% %7.1f\n", p.name, op.name, shape,
                  g * 1e6, logical / g / 1e9, moved / g / 1e9, copy_bw, 100.0 * moved / g / 1e9 / copy_bw,
                  100.0 * logical / g / 1e9 / copy_bw, 100.0 * moved / g / 1e9 / hbm_bw, e * 1e6);
    }
    for (void* b : {x, copy_dst, row, col, rs, cs, amax, scale}) SHARDGEMM_CHECK_CUDA(cudaFree(b));
    std::printf("\n");
  }
  SHARDGEMM_CHECK_CUDA(cudaStreamDestroy(s));
  if (presets_run == 0) {
    std::fprintf(stderr, "--only %s: no such preset\n", only.substr(1, only.size() - 2).c_str());
    return 2;
  }
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) { return shardgemm::Main(argc, argv); }
