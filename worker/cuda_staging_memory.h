// A CUDA worker's staging memory (worker/staging_memory.h). A staged GEMM
// operand of the dtypes the device GEMM reads (BF16, F16) goes to device
// memory as its chunks arrive: its device memory is taken when the stream
// starts, each Append is copied into one of a small ring of pinned chunk
// buffers (allocated once, shared by every upload) and from there host to
// device on a stream of its own, a chunk reused once its copy's event
// completed; Finish waits for the block's last copy. Other blocks (puts,
// biases, scales, FP8 and F32 operands, which host paths read) stay in host
// memory. An output held for fetch lies in pinned host memory from a
// bounded pool (reused; past the bound, pageable). Every wait is bounded.
#ifndef SHARDGEMM_WORKER_CUDA_STAGING_MEMORY_H_
#define SHARDGEMM_WORKER_CUDA_STAGING_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/staging_memory.h"

namespace shardgemm {

struct CudaStagingOptions {
  int device = 0;
  std::string device_name;  // for messages: "cuda:0 NVIDIA H200 (sm_90)"
  // The upload ring: `chunks` pinned buffers of `chunk_bytes` each.
  int64_t chunk_bytes = int64_t{2} << 20;
  int chunks = 16;
  // Pinned host memory for outputs held for fetch, in all (--staging_pinned_mb).
  int64_t pinned_output_bytes = int64_t{512} << 20;
  // Outputs smaller than this are held in pageable memory (pinning them buys nothing).
  int64_t pinned_output_min_bytes = int64_t{64} << 10;
  // The longest wait for a chunk to come free or a block's copies to end.
  absl::Duration copy_timeout = absl::Seconds(10);
};

// Makes the memory's stream; the ring is allocated at the first device block.
absl::StatusOr<std::unique_ptr<StagingMemory>> MakeCudaStagingMemory(const CudaStagingOptions& options);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_CUDA_STAGING_MEMORY_H_
