// Internal hooks of the CPU grouped GEMM, for tests and benchmarks only.
#ifndef SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_INTERNAL_H_
#define SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_INTERNAL_H_

namespace shardgemm {
namespace cpu {
namespace internal {

// Micro-kernel families. kAuto picks the best the CPU supports (AVX-512F+FMA,
// then AVX2+FMA, then portable). The environment variable
// SHARDGEMM_CPU_GEMM_KERNEL=portable|avx2|avx512 overrides kAuto.
enum class GemmKernel { kAuto, kPortable, kAvx2, kAvx512 };

// Forces a kernel family for subsequent calls (process-wide). Returns false
// (and changes nothing) if the CPU cannot run it.
bool SetGemmKernelForTesting(GemmKernel kernel);
// The family the next call will use ("portable", "avx2", "avx512").
const char* ActiveGemmKernelName();

}  // namespace internal
}  // namespace cpu
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_INTERNAL_H_
