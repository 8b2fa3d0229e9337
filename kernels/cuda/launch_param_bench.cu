// A launch's cost as a function of its parameter bytes: chains of the same
// near-empty kernel (each block reads one table entry, as the quantize
// kernels read their group tables) captured in a CUDA graph (device time)
// and launched eagerly (host time included), serial and as programmatic
// dependent launches. It is why the quantize launches pass small parameter
// structs where they can (docs/performance/quantize.md, eleventh session).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/cuda/launch_param_bench.h"

namespace shardgemm {
namespace {

#define LPB_CHECK(x)                                                                        \
  do {                                                                                      \
    const cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

template <int N>
struct Params {
  float* out;
  int n;
  int32_t table[N];
};

// How a kernel reads its table: not at all (the bytes alone), at a fixed
// index (an immediate constant-bank operand), or at an index known only at
// run time (an indexed constant load, as the quantize kernels' group lookups).
enum Read { kNoRead = 0, kFixedIndex = 1, kRuntimeIndex = 2 };

template <int N, bool kDependent, int kRead>
__global__ void __launch_bounds__(256) TableReadKernel(const __grid_constant__ Params<N> p) {
  if (kDependent) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  // The stores never happen; the tests keep the reads.
  if (kRead == kRuntimeIndex) {
    const int i = static_cast<int>((blockIdx.x * 7u + threadIdx.x) % static_cast<unsigned>(p.n));
    if (p.table[i] < 0) p.out[0] = 1.0f;
  } else if (kRead == kFixedIndex) {
    if (p.table[N - 1] + static_cast<int>(threadIdx.x) < 0) p.out[0] = 1.0f;
  } else if (p.n + static_cast<int>(threadIdx.x) < 0) {
    p.out[0] = 1.0f;
  }
}

constexpr int kChain = 20;    // launches per graph
constexpr int kGraphs = 10;   // graph launches timed per repetition
constexpr int kRepeats = 5;   // best of

template <int N, bool kDependent, int kRead>
int Measure(cudaStream_t s, int blocks) {
  Params<N> p{};
  LPB_CHECK(cudaMalloc(&p.out, sizeof(float)));
  p.n = N;
  for (int i = 0; i < N; ++i) p.table[i] = i;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cfg.attrs = kDependent ? &attr : nullptr;
  cfg.numAttrs = kDependent ? 1 : 0;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LPB_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kChain; ++i) LPB_CHECK(cudaLaunchKernelEx(&cfg, TableReadKernel<N, kDependent, kRead>, p));
  LPB_CHECK(cudaStreamEndCapture(s, &graph));
  LPB_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  LPB_CHECK(cudaEventCreate(&start));
  LPB_CHECK(cudaEventCreate(&stop));
  float graph_ms = 1e30f;
  for (int r = 0; r < kRepeats; ++r) {
    LPB_CHECK(cudaGraphLaunch(exec, s));  // warm
    LPB_CHECK(cudaEventRecord(start, s));
    for (int j = 0; j < kGraphs; ++j) LPB_CHECK(cudaGraphLaunch(exec, s));
    LPB_CHECK(cudaEventRecord(stop, s));
    LPB_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    LPB_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ms < graph_ms) graph_ms = ms;
  }
  LPB_CHECK(cudaEventRecord(start, s));
  for (int j = 0; j < kGraphs * kChain; ++j) LPB_CHECK(cudaLaunchKernelEx(&cfg, TableReadKernel<N, kDependent, kRead>, p));
  LPB_CHECK(cudaEventRecord(stop, s));
  LPB_CHECK(cudaEventSynchronize(stop));
  float eager_ms = 0;
  LPB_CHECK(cudaEventElapsedTime(&eager_ms, start, stop));
  const double launches = double{kGraphs} * kChain;
  static const char* const kReadNames[] = {"none", "fixed", "runtime"};
  std::printf("%8zu %6d %-9s %-7s %10.2f %10.2f\n", sizeof(Params<N>), blocks, kDependent ? "dependent" : "serial",
              kReadNames[kRead], graph_ms * 1e3 / launches, eager_ms * 1e3 / launches);
  LPB_CHECK(cudaEventDestroy(start));
  LPB_CHECK(cudaEventDestroy(stop));
  LPB_CHECK(cudaGraphExecDestroy(exec));
  LPB_CHECK(cudaGraphDestroy(graph));
  LPB_CHECK(cudaFree(p.out));
  return 0;
}

template <int N>
int MeasureAll(cudaStream_t s, int blocks) {
  if (Measure<N, false, kRuntimeIndex>(s, blocks) != 0) return 1;
  if (Measure<N, true, kNoRead>(s, blocks) != 0) return 1;
  if (Measure<N, true, kFixedIndex>(s, blocks) != 0) return 1;
  return Measure<N, true, kRuntimeIndex>(s, blocks);
}

}  // namespace

int RunLaunchParamBench() {
  cudaStream_t s;
  LPB_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0;
  LPB_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("# launch cost by parameter bytes: %d launches per graph, best of %d\n", kChain, kRepeats);
  std::printf("%8s %6s %-9s %-7s %10s %10s\n", "bytes", "blocks", "launch", "read", "graph_us", "eager_us");
  for (const int blocks : {1, 2 * sms}) {
    // 16 B up to the 32 KB limit; 6160 entries is QuantizeParams' 25 KB.
    if (MeasureAll<2>(s, blocks) || MeasureAll<64>(s, blocks) || MeasureAll<256>(s, blocks) ||
        MeasureAll<600>(s, blocks) || MeasureAll<1000>(s, blocks) || MeasureAll<2050>(s, blocks) ||
        MeasureAll<6160>(s, blocks) || MeasureAll<8150>(s, blocks)) {
      return 1;
    }
  }
  LPB_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace shardgemm
