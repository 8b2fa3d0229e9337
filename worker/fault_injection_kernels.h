// The kernels of --fault_injection's device faults (worker/fault_injection.h):
// real launches whose errors come from the CUDA runtime. CUDA build only.
#ifndef SHARDGEMM_WORKER_FAULT_INJECTION_KERNELS_H_
#define SHARDGEMM_WORKER_FAULT_INJECTION_KERNELS_H_

#include <cuda_runtime_api.h>

namespace shardgemm {

// Launches an empty kernel on `stream` with a grid of no blocks: returns the
// runtime's refusal, not sticky, cleared from the runtime's last error (CUDA
// 13.0 on the H200 answers cudaErrorInvalidValue, "invalid argument", for
// every invalid launch configuration; older runtimes
// cudaErrorInvalidConfiguration).
cudaError_t LaunchWithInvalidConfiguration(cudaStream_t stream);

// Launches a kernel on `stream` that writes through an address no
// allocation owns: the launch succeeds, and the stream's next
// synchronisation reports cudaErrorIllegalAddress, a sticky error after
// which the process's CUDA context cannot be used again.
cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_FAULT_INJECTION_KERNELS_H_
