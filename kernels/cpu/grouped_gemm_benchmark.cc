// Throughput of the CPU grouped GEMM.
//   bazel --output_base=/tmp/bazel_cpugemm run -c opt //kernels/cpu:grouped_gemm_benchmark
// Counters: GFLOP/s = 2 * M * K * N / time. Set SHARDGEMM_CPU_GEMM_KERNEL=
// portable|avx2|avx512 to pick a micro-kernel family (default: best supported).
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/cpu/grouped_gemm_internal.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cpu {
namespace {

std::vector<uint8_t> RandomBytes(DType dtype, int64_t n) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint8_t> b(n * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    if (dtype == DType::kF32) {
      reinterpret_cast<float*>(b.data())[i] = v;
    } else if (dtype == DType::kBF16) {
      reinterpret_cast<uint16_t*>(b.data())[i] = FloatToBF16(v);
    } else {
      reinterpret_cast<uint16_t*>(b.data())[i] = FloatToF16(v);
    }
  }
  return b;
}

// Args: groups, rows per group, K, N, threads, transposed.
template <DType kIn, DType kOut>
void BM_RaggedM(benchmark::State& state) {
  const int64_t G = state.range(0), mg = state.range(1), K = state.range(2), N = state.range(3);
  const int threads = static_cast<int>(state.range(4));
  const int64_t M = G * mg;
  std::vector<uint8_t> lhs = RandomBytes(kIn, M * K), rhs = RandomBytes(kIn, G * K * N);
  std::vector<uint8_t> out(M * N * DTypeSize(kOut));
  std::vector<int64_t> sizes(G, mg);
  GroupedGemmArgs a;
  a.lhs_dtype = a.rhs_dtype = kIn;
  a.out_dtype = kOut;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.out = out.data();
  a.m = M;
  a.k = K;
  a.n = N;
  a.num_groups = G;
  a.group_sizes = sizes.data();
  a.rhs_transposed = state.range(5) != 0;
  for (auto _ : state) {
    if (!GroupedGemmRaggedM(a, threads).ok()) state.SkipWithError("GroupedGemmRaggedM failed");
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * M * K * N;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(internal::ActiveGemmKernelName());
}

// Args: groups, rows per group, K, N, threads (out [G, K, N]).
template <DType kIn, DType kOut>
void BM_RaggedK(benchmark::State& state) {
  const int64_t G = state.range(0), mg = state.range(1), K = state.range(2), N = state.range(3);
  const int threads = static_cast<int>(state.range(4));
  const int64_t M = G * mg;
  std::vector<uint8_t> lhs = RandomBytes(kIn, M * K), rhs = RandomBytes(kIn, M * N);
  std::vector<uint8_t> out(G * K * N * DTypeSize(kOut));
  std::vector<int64_t> sizes(G, mg);
  GroupedGemmArgs a;
  a.lhs_dtype = a.rhs_dtype = kIn;
  a.out_dtype = kOut;
  a.lhs = lhs.data();
  a.rhs = rhs.data();
  a.out = out.data();
  a.m = M;
  a.k = K;
  a.n = N;
  a.num_groups = G;
  a.group_sizes = sizes.data();
  for (auto _ : state) {
    if (!GroupedGemmRaggedK(a, threads).ok()) state.SkipWithError("GroupedGemmRaggedK failed");
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * M * K * N;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(internal::ActiveGemmKernelName());
}

void RaggedMArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"G", "m", "K", "N", "threads", "T"});
  for (int threads : {1, 2}) b->Args({8, 256, 1024, 1024, threads, 0});
  for (int threads : {1, 2}) b->Args({8, 256, 1024, 1024, threads, 1});
  // Few rows per expert (decode-like): dominated by reading/converting rhs.
  for (int threads : {1, 2}) b->Args({64, 16, 1024, 1024, threads, 0});
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

void RaggedKArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"G", "m", "K", "N", "threads"});
  for (int threads : {1, 2}) b->Args({8, 256, 1024, 1024, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

BENCHMARK_TEMPLATE(BM_RaggedM, DType::kF32, DType::kF32)->Apply(RaggedMArgs);
BENCHMARK_TEMPLATE(BM_RaggedM, DType::kBF16, DType::kBF16)->Apply(RaggedMArgs);
BENCHMARK_TEMPLATE(BM_RaggedK, DType::kF32, DType::kF32)->Apply(RaggedKArgs);
BENCHMARK_TEMPLATE(BM_RaggedK, DType::kBF16, DType::kF32)->Apply(RaggedKArgs);

}  // namespace
}  // namespace cpu
}  // namespace shardgemm
