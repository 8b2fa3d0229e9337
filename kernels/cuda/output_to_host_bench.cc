// Where a returned output should be written: the grouped GEMM into device
// memory and then copied to pinned host memory (what a worker does today for
// an output held for a fetch), against the GEMM writing its output straight
// into mapped pinned host memory (the SMs' stores cross PCIe while the GEMM
// runs).
//
//   output_to_host_bench --presets presets.json [--iters 20] [--warmup 3] [--only NAME]
//
// One line per preset and way (the median of `iters` calls, each timed
// alone with CUDA events): the local GEMM into device memory, the pinned
// device-to-host copy of its output, the two back to back, and the GEMM into
// mapped host memory; GB/s is the output's bytes over the time; `wrong`
// counts the bytes of the host-written output that differ from the
// device-written one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/bench_presets.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm_testing.h"
#include "kernels/cuda/grouped_gemm.h"

namespace shardgemm {
namespace cuda {
namespace {

float MedianMs(cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1, int warmup, int iters,
               const std::function<void()>& call) {
  for (int i = 0; i < warmup; ++i) call();
  SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    SHARDGEMM_CHECK_CUDA(cudaEventRecord(e0, s));
    call();
    SHARDGEMM_CHECK_CUDA(cudaEventRecord(e1, s));
    SHARDGEMM_CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    SHARDGEMM_CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Main(int argc, char** argv) {
  std::string presets_path = "presets.json", only;
  int iters = 20, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--presets") {
      presets_path = next();
    } else if (a == "--iters") {
      iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--warmup") {
      warmup = std::max(0, std::atoi(next().c_str()));
    } else if (a == "--only") {
      only = next();
    } else {
      std::fprintf(stderr, "usage: %s --presets PATH [--iters N] [--warmup N] [--only NAME]\n", argv[0]);
      return 2;
    }
  }
  auto loaded = LoadPresets(presets_path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return 2;
  }
  const std::vector<Preset> presets = *std::move(loaded);
  auto runner_or = GroupedGemmRunner::Create();
  if (!runner_or.ok()) {
    std::fprintf(stderr, "runner: %s\n", std::string(runner_or.status().message()).c_str());
    return 2;
  }
  GroupedGemmRunner& runner = **runner_or;
  cudaStream_t s;
  SHARDGEMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e0));
  SHARDGEMM_CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("# BF16 grouped GEMM, rhs [G,N,K]; µs medians of %d calls after %d; GB/s = output bytes / time\n", iters,
              warmup);
  std::printf("%-18s %10s %12s %10s %12s %12s %10s %8s %8s\n", "preset", "out_MiB", "gemm_dev_us", "d2h_us",
              "dev+d2h_us", "gemm_host_us", "host_GB/s", "ratio", "wrong");
  for (const Preset& p : presets) {
    if (!only.empty() && p.name != only) continue;
    const int64_t m = p.g * p.m;
    const int64_t out_bytes = m * p.n * 2;
    void *lhs, *rhs, *out_dev;
    int64_t* sizes_dev;
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&lhs, m * p.k * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&rhs, p.g * p.n * p.k * 2));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&out_dev, out_bytes));
    SHARDGEMM_CHECK_CUDA(cudaMalloc(&sizes_dev, p.g * 8));
    std::vector<int64_t> sizes(p.g, p.m);
    SHARDGEMM_CHECK_CUDA(cudaMemcpy(sizes_dev, sizes.data(), p.g * 8, cudaMemcpyHostToDevice));
    SHARDGEMM_CHECK_CUDA(testing::FillRandom(lhs, CuDType::kBF16, m * p.k, 1, 1.0f, s));
    SHARDGEMM_CHECK_CUDA(testing::FillRandom(rhs, CuDType::kBF16, p.g * p.n * p.k, 2, 1.0f, s));
    // Host memory as a worker's staging memory has it: allocated, then registered.
    char* host = static_cast<char*>(std::aligned_alloc(4096, (out_bytes + 4095) / 4096 * 4096));
    std::memset(host, 0, out_bytes);
    SHARDGEMM_CHECK_CUDA(cudaHostRegister(host, out_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    void* host_dev = nullptr;
    SHARDGEMM_CHECK_CUDA(cudaHostGetDevicePointer(&host_dev, host, 0));
    std::vector<char> check(out_bytes);

    DeviceGroupedGemmArgs a;
    a.lhs = lhs;
    a.rhs = rhs;
    a.m = m;
    a.k = p.k;
    a.n = p.n;
    a.num_groups = p.g;
    a.rhs_transposed = true;
    a.group_sizes_device = sizes_dev;
    a.group_sizes_host = sizes.data();
    auto gemm_to = [&](void* out) {
      DeviceGroupedGemmArgs b = a;
      b.out = out;
      absl::Status st = runner.RaggedM(b, s);
      if (!st.ok()) {
        std::fprintf(stderr, "%s: %s\n", p.name.c_str(), std::string(st.message()).c_str());
        std::exit(1);
      }
    };
    auto d2h = [&] { SHARDGEMM_CHECK_CUDA(cudaMemcpyAsync(host, out_dev, out_bytes, cudaMemcpyDeviceToHost, s)); };
    const float dev_ms = MedianMs(s, e0, e1, warmup, iters, [&] { gemm_to(out_dev); });
    const float d2h_ms = MedianMs(s, e0, e1, warmup, iters, d2h);
    const float both_ms = MedianMs(s, e0, e1, warmup, iters, [&] {
      gemm_to(out_dev);
      d2h();
    });
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    std::memcpy(check.data(), host, out_bytes);  // the device-written output, copied
    std::memset(host, 0xff, out_bytes);
    const float host_ms = MedianMs(s, e0, e1, warmup, iters, [&] { gemm_to(host_dev); });
    SHARDGEMM_CHECK_CUDA(cudaStreamSynchronize(s));
    int64_t wrong = 0;
    for (int64_t i = 0; i < out_bytes; ++i) wrong += host[i] != check[i];
    std::printf("%-18s %10.1f %12.1f %10.1f %12.1f %12.1f %10.1f %8.3f %8lld\n", p.name.c_str(),
                out_bytes / 1048576.0, dev_ms * 1e3, d2h_ms * 1e3, both_ms * 1e3, host_ms * 1e3,
                out_bytes / (host_ms * 1e6), host_ms / both_ms, static_cast<long long>(wrong));
    std::fflush(stdout);
    SHARDGEMM_CHECK_CUDA(cudaHostUnregister(host));
    std::free(host);
    cudaFree(lhs);
    cudaFree(rhs);
    cudaFree(out_dev);
    cudaFree(sizes_dev);
  }
  return 0;
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm

int main(int argc, char** argv) { return shardgemm::cuda::Main(argc, argv); }
