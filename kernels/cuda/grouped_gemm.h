// CUDA grouped GEMM for MoE expert layers (no gRPC here).
//
//   ragged M:  out[rows of g] = lhs[rows of g] @ rhs[g] (+ bias[g])
//              lhs [M, K], rhs [G, K, N] or [G, N, K] (rhs_transposed),
//              bias [G, N] optional, out [M, N]; rows past sum(group_sizes)
//              are zeroed.
//   ragged K:  out[g] = lhs[rows of g]^T @ rhs[rows of g]
//              lhs [M, K], rhs [M, N], out [G, K, N] (wgrad); empty groups
//              give zeros.
// Inputs BF16 or F16 (both the same), FP32 accumulation, output BF16, F16 or
// F32. Group sizes always come on the device (int64 [G]); a host copy may be
// given as well, and the cuBLAS strategies need it (without it they copy the
// sizes back with a blocking device-to-host copy; the sm90 kernel never does).
//
// A GroupedGemmRunner is made once per device: it owns the cuBLAS/cuBLASLt
// handles, the workspaces (from its DevicePool), its side streams, and caches
// per shape the strategy chosen by heuristics_sm90 and the cuBLASLt algorithms.
// It is not thread-safe: one caller at a time (the worker's stream order).
#ifndef SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_H_
#define SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/heuristics_sm90.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cuda {

struct DeviceGroupedGemmArgs {
  DType in_dtype = DType::kBF16;     // lhs and rhs
  DType out_dtype = DType::kBF16;
  DType bias_dtype = DType::kInvalid;  // kF32, kBF16 or kF16 when bias != nullptr
  const void* lhs = nullptr;         // [m, k]
  const void* rhs = nullptr;         // ragged M: [G,K,N] / [G,N,K]; ragged K: [m, n]
  const void* bias = nullptr;        // ragged M only: [G, n] or null
  void* out = nullptr;               // ragged M: [m, n]; ragged K: [G, k, n]
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  bool rhs_transposed = false;       // ragged M only: rhs is [G, N, K]
  const int64_t* group_sizes_device = nullptr;  // required, [num_groups]
  const int64_t* group_sizes_host = nullptr;    // optional copy, [num_groups]
  Strategy strategy = Strategy::kAuto;          // force one (tests, benchmark)
  int sm90_tile_m = 0, sm90_tile_n = 0;         // force the sm90 tile (0: heuristic)
  int sm90_cluster = 0;                         // force 1 or 2 blocks per cluster (0: heuristic)
};

struct RunnerOptions {
  int device = 0;
  int side_streams = 4;                        // per-group cuBLASLt calls spread over these
  int64_t lt_workspace_bytes = 32ll << 20;     // per side stream
  // Time cuBLASLt candidates once per big problem, and lt_loop against
  // lt_batched once per big equal-groups shape (the first call of the shape
  // blocks: up to ~1 s on the largest presets). heuristics_sm90.cc has the rules.
  bool autotune = true;
};

// What the last RaggedM / RaggedK call ran (the bench reports it).
struct RunInfo {
  Strategy strategy = Strategy::kAuto;
  // cuBLAS routes: the algorithm (id, tile, stages, cluster, swizzle, custom
  // option, split-K) of the largest group's call, how it was tuned, and for
  // rule 2b the two routes' timings; sm90: the tile.
  std::string detail;
};

class DevicePool;

class GroupedGemmRunner {
 public:
  static absl::StatusOr<std::unique_ptr<GroupedGemmRunner>> Create(const RunnerOptions& options = {});
  ~GroupedGemmRunner();
  GroupedGemmRunner(const GroupedGemmRunner&) = delete;
  GroupedGemmRunner& operator=(const GroupedGemmRunner&) = delete;

  // Enqueue on `stream`; returns once the work is enqueued (except the
  // blocking size copy described above). Errors carry the CUDA/cuBLAS message.
  absl::Status RaggedM(const DeviceGroupedGemmArgs& args, cudaStream_t stream);
  absl::Status RaggedK(const DeviceGroupedGemmArgs& args, cudaStream_t stream);

  // The strategy kAuto would use for these args (also cached per shape).
  Strategy Choose(const DeviceGroupedGemmArgs& args, bool ragged_k);
  // Whether `s` can run these args at all; when not, why.
  absl::Status Supports(const DeviceGroupedGemmArgs& args, bool ragged_k, Strategy s) const;

  // The last call's route and algorithm (formatted on demand).
  RunInfo LastRun() const;

  DevicePool& pool();
  int num_sms() const;

 private:
  struct Impl;
  explicit GroupedGemmRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_GROUPED_GEMM_H_
