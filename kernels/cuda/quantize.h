// Grouped quantize / dequantize on the GPU: the same arguments, outputs and
// bytes as the CPU reference in kernels/cpu/quantize.h (layouts documented
// there and in docs/quantization.md).
//
// Device memory: x, scale (delayed), every output, amax. Host memory:
// group_sizes. Work is enqueued on `stream`; nothing synchronizes.
// GPU-only limits (InvalidArgument naming the field): k a multiple of 8,
// num_groups <= 1024, m < 2^31, x 16-byte aligned, data outputs 16-byte
// aligned.
#ifndef SHARDGEMM_KERNELS_CUDA_QUANTIZE_H_
#define SHARDGEMM_KERNELS_CUDA_QUANTIZE_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/quantize.h"

namespace shardgemm {
namespace cuda {

struct GpuQuantizeOptions {
  // Use fp8.h's software conversion instead of the hardware cvt (same bits;
  // kept for checking and as a fallback).
  bool software_cvt = false;
  // Current scaling in one launch: per-group amax tiles run ahead of the
  // quantize tiles that need them, which re-read x from L2 (see quantize.cu).
  // Off by default: on the H200 it measured 10-30% slower than the separate
  // streaming amax pass (docs/performance/quantize.md).
  bool fused_current = false;
};

// One persistent launch for every mode (current scaling: a streaming amax
// pass first, or fused into the same launch when options ask), with amax
// fused where the mode has one. Plus cudaMemsetAsync for amax, scale padding
// and padding rows.
absl::Status GroupedQuantize(const GroupedQuantizeArgs& args, cudaStream_t stream,
                             const GpuQuantizeOptions& options = GpuQuantizeOptions());

// Same as cpu::GroupedDequantize; data, scale_inv and out in device memory.
absl::Status GroupedDequantize(const GroupedDequantizeArgs& args, cudaStream_t stream);

// Compares the kernels' hardware FP8 conversion with fp8.h's software one for
// all 2^32 float inputs (both formats); returns the number of mismatches.
absl::StatusOr<unsigned long long> ExhaustiveConversionMismatches(cudaStream_t stream);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_QUANTIZE_H_
