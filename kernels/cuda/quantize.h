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
  // How current scaling finds its per-group amax before converting:
  //   kTwoPass: a separate streaming amax pass over x, then the quantize pass;
  //   kFused:   one launch, each group's amax tiles a phase ahead of its
  //             quantize tiles, which re-read x from L2 (see quantize.cu);
  //   kAuto:    kTwoPass, which measured faster on every preset on the H200
  //             once the quantize pass took whole tiles without bounds checks
  //             (deepseek-v3-up's 29 MiB groups: 88% of copy against 81%;
  //             docs/performance/quantize.md). The fused pass stays for
  //             callers who want x read from HBM once.
  enum class CurrentPass { kAuto, kTwoPass, kFused };
  CurrentPass current_pass = CurrentPass::kAuto;
  // A workspace no other launch uses at the same time: QuantizeWorkspaceBytes()
  // of device memory, zeroed once (each launch leaves it fit for the next).
  // Current scaling uses one: its per-group amax is reduced there (no memset
  // of args.amax first), and its one-shot kernel (a grid barrier) and fused
  // pass (work counters) need one. The library keeps one per stream the caller
  // created (outside stream capture; ReleaseQuantizeWorkspace frees it); on
  // the default streams, or when capturing a graph, pass one here, or
  // current scaling memsets amax first and takes the tiled two-pass path.
  void* workspace = nullptr;
  // Rows per tile of the quantize pass for current, delayed and MXFP8 scaling
  // outside the fused pass: 32 (32 x 512 tiles), 64 (64 x 256), 128
  // (128 x 128), or 0 (the default: what measured faster, see
  // QuantizeTileRows in quantize.cc).
  // Block scaling and the fused pass always take 128.
  int tile_rows = 0;
  // Which kernel converts:
  //   kTiled:   the persistent kernels of quantize.cu, which stage tiles of
  //             16384 elements in shared memory (every shape and mode);
  //   kOneShot: quantize_oneshot.cu's, a block per 32 x 256 slab held in
  //             registers. Where it applies: 16-bit x, current, delayed or
  //             MXFP8 (OCP recipe) scaling, k a multiple of 256, every group a
  //             multiple of 32 rows, the hardware conversion, tile_rows 0,
  //             current_pass kAuto; current scaling also needs a workspace
  //             and at most as many slabs as the GPU holds at once (its blocks
  //             meet at a grid barrier, in a cooperative launch). Asked
  //             for elsewhere, it is an InvalidArgument naming what does not
  //             fit; a call with no rows takes the tiled kernels.
  //   kAuto:    the one-shot kernel where it applies and the input is at
  //             most two slabs per SM (one tiled tile per SM, where a tile's
  //             latency is the whole launch; docs/performance/quantize.md),
  //             else the tiled kernels; also the tiled kernels where current
  //             scaling's cooperative launch is refused at run time (fewer
  //             SMs than the device reports, as for an MPS client).
  enum class Kernel { kAuto, kTiled, kOneShot };
  Kernel kernel = Kernel::kAuto;
  // args.amax already holds a lower bound for each group (+0.0, or an
  // earlier call's amax, to keep a running max over micro-batches as
  // Transformer Engine's delayed scaling does): the tiles max-reduce into it,
  // so amax[g] becomes max(amax[g], max |x| over group g's rows) and empty
  // groups keep theirs. The max is over float bits, so the starting values
  // must be non-negative: -0.0, a negative value or NaN would stay. The
  // launch that zeroes amax first does not run (docs/performance/quantize.md
  // has what that saves). Delayed, MXFP8 and block scaling, with
  // amax given; current scaling computes its scale from this call's amax,
  // so asking there (or without amax) is an InvalidArgument.
  bool amax_accumulate = false;
};

// One launch for every mode (the tiled kernels' current scaling: a streaming
// amax pass first, or fused into the same launch when options ask), with amax
// fused where the mode has one; before it, for delayed, MXFP8 and block
// scaling, a one-block launch that zeroes amax (not when accumulating;
// current scaling reduces amax in the workspace, or memsets it first), and
// cudaMemsetAsync for block scaling's scale padding and rows past the groups.
// Each launch is its stream predecessor's programmatic dependent (PDL): it
// starts while the kernel before it drains, and reads and writes nothing
// before that kernel has finished (current scaling's quantize launch reads x
// at once: it follows the call's amax pass, which started only after all
// earlier work). So a kernel of the caller's right before this call that is
// itself a programmatic dependent must wait for its own predecessor
// (griddepcontrol.wait / cudaGridDependencySynchronize) before it completes,
// as the PDL contract asks: its completion is taken to mean that everything
// before it has finished.
absl::Status GroupedQuantize(const GroupedQuantizeArgs& args, cudaStream_t stream,
                             const GpuQuantizeOptions& options = GpuQuantizeOptions());

size_t QuantizeWorkspaceBytes();

// Frees the workspace the library keeps for `stream` (one per stream the
// caller created, allocated by the first GroupedQuantize on it without
// GpuQuantizeOptions::workspace), once the work queued on the stream has
// finished (it synchronizes the stream). Call it before destroying such a
// stream: the library cannot tell when a stream goes, so its workspace
// would stay allocated. The next call on the stream allocates a new one. A
// stream without one (never used, or the default streams): OK, nothing done;
// a stream capturing a graph: FailedPrecondition. Not while another thread
// queues a GroupedQuantize on the same stream.
absl::Status ReleaseQuantizeWorkspace(cudaStream_t stream);

// Which kernel GroupedQuantize(args, stream, options) runs, kTiled or
// kOneShot (GpuQuantizeOptions::Kernel), or the error it would return for
// the arguments or the asked-for kernel. Allocates nothing, launches nothing.
// (One exception it cannot see: where it says kOneShot for current scaling
// under kAuto and the cooperative launch is then refused at run time, the
// call takes the tiled kernels.)
absl::StatusOr<GpuQuantizeOptions::Kernel> ChosenQuantizeKernel(const GroupedQuantizeArgs& args, cudaStream_t stream,
                                                                const GpuQuantizeOptions& options = GpuQuantizeOptions());

// Same as cpu::GroupedDequantize; data, scale_inv and out in device memory.
absl::Status GroupedDequantize(const GroupedDequantizeArgs& args, cudaStream_t stream);

// Compares the kernels' hardware FP8 conversion with fp8.h's software one for
// all 2^32 float inputs (both formats); returns the number of mismatches.
absl::StatusOr<unsigned long long> ExhaustiveConversionMismatches(cudaStream_t stream);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_QUANTIZE_H_
