#include "worker/fault_injection_kernels.h"

#include <cstdint>

namespace shardgemm {
namespace {

__global__ void DoNothingKernel() {}

__global__ void WriteThroughKernel(volatile int* where) { *where = 1; }

}  // namespace

cudaError_t LaunchWithInvalidConfiguration(cudaStream_t stream) {
  // A grid of no blocks (the launch of a kernel sized by an empty tensor).
  DoNothingKernel<<<0, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream) {
  // Low addresses are never mapped on the device.
  WriteThroughKernel<<<1, 1, 0, stream>>>(reinterpret_cast<volatile int*>(uintptr_t{64}));
  return cudaGetLastError();
}

}  // namespace shardgemm
