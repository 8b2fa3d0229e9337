// Where a worker's staging area (worker/staging_area.h) keeps the bytes of
// its blocks: host memory by default (MakeHostStagingMemory); on a CUDA
// worker the backend's (Backend::MakeStagingMemory,
// worker/cuda_staging_memory.h): a staged GEMM operand goes to device memory
// as its chunks arrive, an output held for fetch lies in pinned host memory.
// The worker injects one at startup; no gRPC, no CUDA here.
#ifndef SHARDGEMM_WORKER_STAGING_MEMORY_H_
#define SHARDGEMM_WORKER_STAGING_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/host_tensor.h"
#include "worker/shard.h"

namespace shardgemm {

// What a ticket stands for (Worker.ExpectStaged's StagingTicket).
struct ExpectedBlock {
  std::string tenant;
  // What the block is, for messages: "the TENSOR_LHS block", "the block of
  // tensor 'w' for rank 1".
  std::string operand;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  // A GEMM's lhs or rhs (not a put's block, a bias, scales or a quantize's
  // x): a device backend's staging memory may keep it where its GEMM reads it.
  bool gemm_operand = false;
};

// A staged block's bytes where the staging memory put them: in `host`, or,
// when `device` is set, in that device memory (`host` then empty).
struct StagedBytes {
  std::string host;
  std::shared_ptr<const DeviceBuffer> device;
};

class StagingMemory {
 public:
  virtual ~StagingMemory() = default;

  // One staged block, filled in order as its stream arrives.
  class Writer {
   public:
    // Unfinished (the stream failed or went away): its memory is freed.
    virtual ~Writer() = default;
    // The next bytes; the staging area never passes the block's size.
    virtual absl::Status Append(absl::string_view data) = 0;
    // Every byte arrived: the block, complete where it lives (a device
    // memory waits, bounded, for its copies). Called at most once.
    virtual absl::StatusOr<StagedBytes> Finish() = 0;
  };
  // Memory for `block`, of `bytes`, about to arrive. RESOURCE_EXHAUSTED
  // naming the bytes when it does not fit; nothing held is given up for it.
  virtual absl::StatusOr<std::unique_ptr<Writer>> BeginBlock(const ExpectedBlock& block, int64_t bytes) = 0;

  // Host memory for an output block held for fetch: `dtype`, `shape` and
  // `bytes.size() == bytes` set, contents unspecified (the caller writes
  // every byte). Pinned on a device backend while its pool has room, else
  // pageable; freed (or back to the pool) with its last reference.
  virtual absl::StatusOr<std::shared_ptr<HostTensor>> OutputBlock(DType dtype, const std::vector<int64_t>& shape,
                                                                  int64_t bytes) = 0;
};

// Every block in pageable host memory: the CPU backend's, and the default.
std::unique_ptr<StagingMemory> MakeHostStagingMemory();

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STAGING_MEMORY_H_
