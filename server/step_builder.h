// Builds a request's steps, one per rank, from its plan: the program every
// worker interprets (worker/executor.h). No gRPC, no I/O.
#ifndef SHARDGEMM_SERVER_STEP_BUILDER_H_
#define SHARDGEMM_SERVER_STEP_BUILDER_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"
#include "planner/planner.h"
#include "proto/plan_codec.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

// A GEMM operand: resident (meta.resident_shard set: the step names the
// shard and declares its local dtype and shape), in shared memory, staged
// (meta.staged_tickets: each rank's step names its ticket) or inline
// (`tensor`, the decoded global tensor; each rank gets its block of it).
struct GemmOperand {
  TensorMeta meta;
  const HostTensor* tensor = nullptr;
};

struct GemmStepsRequest {
  const planner::Plan* plan = nullptr;
  const planner::Mesh* mesh = nullptr;
  v1::GroupedGemmRequest::Ragged ragged = v1::GroupedGemmRequest::RAGGED_M;
  bool rhs_transposed = false;
  std::vector<int64_t> group_sizes;  // the request's, all entries
  // "lhs", "rhs" and, when present, "bias", "lhs_scale_inv", "rhs_scale_inv".
  absl::flat_hash_map<std::string, GemmOperand> operands;
  v1::ScalingMode scaling = v1::SCALING_UNSPECIFIED;  // of FP8 operands
  // Set: the workers quantize lhs to this FP8 dtype before the GEMM (no
  // lhs_scale_inv operand is sent, and its collectives are dropped).
  DType quantize_lhs_to = DType::kInvalid;
};

// The GEMM step of every rank: its block (or shard) of each operand, its
// group sizes, whether it adds the bias, the plan's collectives (typed), and
// whether the mesh agrees on the step (a mesh of more than one worker and a
// step with collectives).
absl::StatusOr<std::vector<v1::Step>> BuildGemmSteps(const GemmStepsRequest& request);

struct QuantizeStepsRequest {
  const planner::Plan* plan = nullptr;
  const planner::Mesh* mesh = nullptr;
  GemmOperand x;                     // resident or inline, as a GEMM operand
  std::vector<int64_t> group_sizes;  // the request's, all entries
  std::vector<float> scales;         // delayed scaling: one per group_sizes entry; else empty
  DType out_dtype = DType::kF8E4M3;
  v1::ScalingMode scaling = v1::CURRENT;
  bool rowwise = true, colwise = false, block_2d = false;
  int flatten_axis = 1;  // resolved, >= 1
};

// The grouped quantize step of every rank: its block (or shard) of x, its
// groups' sizes (and delayed scales), the mode and layouts, the plan's
// collectives (typed, the amax's within the quantize included).
absl::StatusOr<std::vector<v1::Step>> BuildQuantizeSteps(const QuantizeStepsRequest& request);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_STEP_BUILDER_H_
