// What a worker's device can compute. The CPU backend runs the reference
// kernels in kernels/cpu; the CUDA backend runs kernels/cuda and cuBLASLt.
#ifndef SHARDGEMM_WORKER_BACKEND_H_
#define SHARDGEMM_WORKER_BACKEND_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/quantize.h"
#include "kernels/host_tensor.h"
#include "platform/shared_memory.h"
#include "worker/collectives.h"
#include "worker/shard.h"
#include "worker/staging_memory.h"

namespace shardgemm {

struct LocalGemm {
  // Asked between pieces of work (empty: never): true once the step was
  // cancelled or expired; a backend that can stops and answers CANCELLED.
  std::function<bool()> stop;
  bool ragged_k = false;
  const HostTensor* lhs = nullptr;
  const HostTensor* rhs = nullptr;
  // Set when rhs is a resident shard (immutable while referenced): a device
  // backend may keep its copy on the device and reuse it while the shard lives.
  std::shared_ptr<const HostTensor> resident_rhs;
  // Likewise for a resident lhs (activations kept on the workers between requests).
  std::shared_ptr<const HostTensor> resident_lhs;
  // Set when the operand is a shard kept in this backend's device memory:
  // `lhs` / `rhs` is then a header (dtype and shape, no bytes).
  std::shared_ptr<const DeviceBuffer> lhs_device, rhs_device;
  // GroupedGemmToShard: keep the output in device memory.
  bool keep_on_device = false;
  // With keep_on_device: the device memory the output is written into (at
  // least its bytes; a block of a client's CUDA region), which the shard then
  // views, instead of memory of the backend's own.
  std::shared_ptr<const DeviceBuffer> out_device;
  const HostTensor* bias = nullptr;  // may be null
  std::vector<int64_t> group_sizes;  // this worker's local groups
  bool rhs_transposed = false;
  DType out_dtype = DType::kF32;
  // FP8 GEMM (FP8 rhs): the operands' scales in the GEMM's layouts
  // (GroupedGemmRequest.lhs_scale_inv / rhs_scale_inv) and the kernels' modes.
  const HostTensor* lhs_scale_inv = nullptr;
  const HostTensor* rhs_scale_inv = nullptr;
  // Set when rhs_scale_inv is a resident shard (a device copy may be kept).
  std::shared_ptr<const HostTensor> resident_rhs_scale_inv;
  ScalingMode lhs_mode = ScalingMode::kCurrent;
  ScalingMode rhs_mode = ScalingMode::kCurrent;
  // Set: lhs is F32/BF16/F16, quantized by the backend to this FP8 dtype in
  // lhs_mode (kCurrent: a scale per local group; kBlock1x128) before the
  // FP8 GEMM; lhs_scale_inv is then null.
  DType quantize_lhs_to = DType::kInvalid;
  // The FSDP weight gather, handed to a backend that CanGatherOnDevice()
  // (the executor decides; ragged M only): `rhs` (and `resident_rhs`) is then
  // this worker's shard, and the GEMM runs on the members' shards gathered
  // along `dim` over `axes`, of shape `gathered_shape`, as
  // Collectives::AllGather would lay them out. A device backend gathers on
  // the device (Collectives::AllGatherDevice) straight into the GEMM's
  // operand; the gather is a collective, so every member of the group calls it.
  struct RhsGather {
    bool enabled = false;
    int dim = 0;
    std::vector<std::string> axes;
    Collectives* collectives = nullptr;
    std::vector<int64_t> gathered_shape;
    // Set when the step agrees before its collectives: the backend then calls
    // collectives->Agree exactly once, with its own status, before gathering
    // (on every path, so all workers call it).
    bool agree = false;
    std::vector<std::string> agree_axes;  // the group that agrees: the step's collectives' axes
  };
  RhsGather rhs_gather;
};

// Grouped quantize of x [m, k] grouped by rows (kernels/cpu/quantize.h).
// Per-group scaling: with `scales` (delayed scaling) the given per-group
// scales are used, otherwise each group's comes from its amax (current).
// MXFP8 and the FP8 block modes take `mode`.
struct LocalQuantize {
  const HostTensor* x = nullptr;  // flattened to [m, k]
  int64_t m = 0, k = 0;
  std::vector<int64_t> group_sizes;
  DType out_dtype = DType::kF8E4M3;
  bool rowwise = true, colwise = false;
  ScalingMode mode = ScalingMode::kCurrent;  // kCurrent, kMxfp8, kBlock1x128 or kBlock128x128
  const std::vector<float>* scales = nullptr;  // kCurrent only: makes it delayed
  bool block_scaled() const { return mode != ScalingMode::kCurrent && mode != ScalingMode::kDelayed; }
};
struct QuantizeOutputs {
  HostTensor rowwise_data, colwise_data;  // [m, k] bytes each when asked for
  // Per-group scaling: scale_inv and amax [num_groups] F32. Block modes:
  // scale_inv (rowwise) and colwise_scale_inv in the kernels' padded layout,
  // flat (E8M0 for MXFP8, else F32), as asked for; no amax.
  HostTensor scale_inv, colwise_scale_inv, amax;
};

// The kernel arguments for `q` with input `x` (host or device memory) and
// no outputs yet; group sizes stay in host memory (both kernels take them so).
GroupedQuantizeArgs QuantizeArgs(const LocalQuantize& q, const void* x);
// The host outputs `q` asks for, zero-filled, sized by the kernels' layout
// (InvalidArgument naming the field when the shape does not fit the mode).
absl::StatusOr<QuantizeOutputs> AllocateQuantizeOutputs(const LocalQuantize& q);
// Where each output lives (host or device), in QuantizeOutputs' order.
struct QuantizeBuffers {
  void* rowwise_data = nullptr;
  void* colwise_data = nullptr;
  void* scale_inv = nullptr;
  void* colwise_scale_inv = nullptr;
  void* amax = nullptr;
};
// Points the kernel's output fields at `b`.
void PointQuantizeOutputs(const LocalQuantize& q, const QuantizeBuffers& b, GroupedQuantizeArgs* a);

// Memory of a same-host client that a step reads an operand's block from or
// writes its output block into: a POSIX shared-memory object mapped in this
// process, or a CUDA allocation another process exported with
// cudaIpcGetMemHandle (Triton's system and CUDA shared-memory extensions).
struct ClientMemory {
  std::shared_ptr<const platform::SharedMemoryMapping> mapping;  // set: host memory
  std::string cuda_ipc_handle;  // set (the handle's bytes): device memory
  uint64_t region_bytes = 0;    // what was registered: nothing past it is read or written
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string Name() const = 0;    // "cpu" or "cuda"
  virtual std::string Device() const = 0;  // human-readable device description
  virtual absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& gemm) = 0;
  virtual absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) = 0;
  // Whether an FP8 GEMM of this kind runs on the host reference (which
  // dequantizes both operands to FP32 copies: the step reserves them).
  virtual bool Fp8GemmOnHost(bool ragged_k, bool rhs_transposed) const { return true; }
  // Whether GroupedGemm takes LocalGemm::rhs_gather and gathers on its device.
  virtual bool CanGatherOnDevice() const { return false; }

  // Capabilities of device residency. A backend that keeps outputs on its
  // device runs GroupedGemmToShard with keep_on_device into device memory
  // (no copy to the host) and reads device shards as operands.
  virtual bool KeepsOutputsOnDevice() const { return false; }
  // Runs `gemm` into a shard: in device memory where keep_on_device is set
  // and the backend keeps outputs there, else on the host.
  virtual absl::StatusOr<Shard> GroupedGemmToShard(const LocalGemm& gemm);
  // The host bytes of a shard (a copy from the device for a device-only
  // one). Safe to call while steps run.
  virtual absl::StatusOr<HostTensor> Download(const Shard& shard);
  // The shard's NumBytes() bytes into host memory at `dst` (pinned memory:
  // at the device's full speed). From the step's thread, as GroupedGemm.
  virtual absl::Status CopyToHost(const Shard& shard, char* dst);
  // Where the worker's staging area keeps blocks (worker/staging_memory.h):
  // host memory here; a device backend's own memory (staged GEMM operands
  // in device memory, outputs held for fetch in pinned host memory, at most
  // `pinned_output_bytes` of it, past that pageable).
  virtual absl::StatusOr<std::unique_ptr<StagingMemory>> MakeStagingMemory(int64_t pinned_output_bytes);
  // The device's memory, for the default device budget (0: no device).
  virtual int64_t DeviceMemoryBytes() const { return 0; }
  // Bytes copied host to device and back so far (a step reports its share).
  struct Transfers {
    int64_t host_to_device = 0, device_to_host = 0;
  };
  virtual Transfers TransferCounts() const { return {}; }
  // OK while the device can run work. An error (a sticky CUDA error has lost
  // the device's context for this process) is for good: the worker reports
  // itself unhealthy and exits for its supervisor to restart it.
  virtual absl::Status DeviceHealth() const { return absl::OkStatus(); }

  // Client memory. A block of it in this backend's device memory, row-major:
  // client device memory used in place where the block is one contiguous
  // run (the buffer then lives only as long as the caller needs it),
  // otherwise copied on the device; client host memory copied in (pinned
  // once per mapping where the system allows). The bytes are ready for
  // work on the backend's stream when this returns. FAILED_PRECONDITION
  // naming `field` on a backend without a device.
  virtual absl::StatusOr<std::shared_ptr<const DeviceBuffer>> BlockToDevice(const ClientMemory& memory,
                                                                          const platform::TensorBlock& block,
                                                                          absl::string_view field);
  // Writes a block (row-major) from this backend's device memory, or from
  // host memory, into client memory; done (visible to the client) when
  // this returns. FAILED_PRECONDITION for device memory on a backend
  // without a device.
  virtual absl::Status BlockFromDevice(const DeviceBuffer& source, const ClientMemory& memory,
                                       const platform::TensorBlock& block, absl::string_view field);
  virtual absl::Status BlockFromHost(const char* source, const ClientMemory& memory,
                                     const platform::TensorBlock& block, absl::string_view field);
  // Clients' memory no region names any more: the backend lets go of what
  // it keeps of it across steps (pinned registrations of these mappings,
  // opened IPC handles); returns how many handles it held open.
  virtual int ForgetClientMemory(const std::vector<std::shared_ptr<const platform::SharedMemoryMapping>>& mappings,
                                 const std::vector<std::string>& cuda_ipc_handles) {
    return 0;
  }
};

// `g` with its rhs_gather done on the host (Collectives::AllGather), run by
// `backend` on the gathered weight: for the calls a device backend keeps on
// the host (the CPU fallback, ragged K).
absl::StatusOr<HostTensor> GroupedGemmAfterHostGather(Backend* backend, const LocalGemm& g);

// The FP8 lhs of a fused quantize + GEMM (`g.quantize_lhs_to` set), made
// by `backend`'s grouped quantize on the host path: the rowwise data and its
// scales in the GEMM's layout.
struct QuantizedLhs {
  HostTensor data, scale_inv;
};
absl::StatusOr<QuantizedLhs> QuantizeLhsForGemm(Backend* backend, const LocalGemm& g);

std::unique_ptr<Backend> MakeCpuBackend(int num_threads);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_BACKEND_H_
