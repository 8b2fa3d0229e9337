// The tiled quantize kernels for launches of at most kSmallGpuGroups groups
// (QuantizeParamsT<kSmallGpuGroups>; quantize_tiled.cuh), in a translation
// unit of their own so that nvcc compiles them beside quantize.cu's.
#include <cuda_runtime.h>

#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/cuda/quantize_tiled.cuh"

namespace shardgemm {
namespace cuda_internal {

cudaError_t LaunchGroupedQuantizeSmall(const QuantizeParamsT<kSmallGpuGroups>& p, cudaStream_t stream) {
  return LaunchQuantizeP(p, stream);
}

}  // namespace cuda_internal
}  // namespace shardgemm
