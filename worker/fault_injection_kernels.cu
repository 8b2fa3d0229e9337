#include "worker/fault_injection_kernels.h"

#include <cstdint>

namespace shardgemm {
namespace {

__global__ void DoNothingKernel() {}

__global__ void WriteThroughKernel(volatile int* where) { *where = 1; }

}  // namespace

cudaError_t LaunchWithInvalidConfiguration(cudaStream_t stream) {
  cudaDeviceProp prop;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) return e;
  // Twice the threads a block may have: the runtime refuses the launch.
  DoNothingKernel<<<1, 2 * prop.maxThreadsPerBlock, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream) {
  // Low addresses are never mapped on the device.
  WriteThroughKernel<<<1, 1, 0, stream>>>(reinterpret_cast<volatile int*>(uintptr_t{64}));
  return cudaGetLastError();
}

}  // namespace shardgemm
