// What a worker's device can compute. The CPU backend runs the reference
// kernels in kernels/cpu; the CUDA backend runs kernels/cuda and cuBLASLt.
#ifndef SHARDGEMM_WORKER_BACKEND_H_
#define SHARDGEMM_WORKER_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

struct LocalGemm {
  bool ragged_k = false;
  const HostTensor* lhs = nullptr;
  const HostTensor* rhs = nullptr;
  // Set when rhs is a resident shard (immutable while referenced): a device
  // backend may keep its copy on the device and reuse it while the shard lives.
  std::shared_ptr<const HostTensor> resident_rhs;
  const HostTensor* bias = nullptr;  // may be null
  std::vector<int64_t> group_sizes;  // this worker's local groups
  bool rhs_transposed = false;
  DType out_dtype = DType::kF32;
};

// Per-group (tensor) scaling of x [m, k] grouped by rows. With `scales`
// (delayed scaling) the given per-group scales are used; otherwise each
// group's scale comes from its amax (current scaling).
struct LocalQuantize {
  const HostTensor* x = nullptr;  // flattened to [m, k]
  int64_t m = 0, k = 0;
  std::vector<int64_t> group_sizes;
  DType out_dtype = DType::kF8E4M3;
  bool rowwise = true, colwise = false;
  const std::vector<float>* scales = nullptr;
};
struct QuantizeOutputs {
  HostTensor rowwise_data, colwise_data;  // [m, k] bytes each when asked for
  HostTensor scale_inv, amax;             // [num_groups] F32
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string Name() const = 0;    // "cpu" or "cuda"
  virtual std::string Device() const = 0;  // human-readable device description
  virtual absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& gemm) = 0;
  virtual absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) = 0;
};

std::unique_ptr<Backend> MakeCpuBackend(int num_threads);

// `requested` is "auto", "cpu" or "cuda". "auto" picks CUDA where a GPU is
// present and otherwise falls back to the CPU, writing why to `note`.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& requested, int device,
                                                     int cpu_threads, std::string* note);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_BACKEND_H_
