// Translates between the v1 wire messages and the planner's plain structs.
#ifndef SHARDGEMM_PROTO_PLAN_CODEC_H_
#define SHARDGEMM_PROTO_PLAN_CODEC_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "proto/shardgemm.pb.h"
#include "kernels/cpu/quantize.h"
#include "planner/planner.h"

namespace shardgemm {

v1::Mesh MeshToProto(const planner::Mesh& mesh);
absl::StatusOr<planner::Mesh> MeshFromProto(const v1::Mesh& mesh);

// Shape, dtype and spec of a request tensor: inline ones carry their own,
// resident ones come from the registry.
struct TensorMeta {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::string spec;
  std::string resident_shard;  // non-empty for a resident tensor
  // Set for a tensor in a client's shared-memory region: the region's object
  // (a POSIX name or a CUDA IPC handle), the tensor's first byte there and
  // the region's registered size; each rank's block adds its place.
  std::optional<v1::SharedMemoryBlock> shared_memory;
  // Set for a staged operand (Tensor.staged): the transfer plan's id and
  // each rank's ticket for its block.
  std::string staging_id;
  std::vector<std::string> staged_tickets;
};
using TensorResolver =
    std::function<absl::StatusOr<TensorMeta>(const v1::Tensor& tensor, const std::string& field)>;

// The meta of an inline tensor, validated (dtype known, dims, data length).
absl::StatusOr<TensorMeta> InlineTensorMeta(const v1::Tensor& tensor, const std::string& field);

// A request tensor that is set (a dtype or a source), not a default message.
bool IsGiven(const v1::Tensor& tensor);
bool HasBias(const v1::GroupedGemmRequest& request);

// INVALID_ARGUMENT naming the field for an enum outside its declared values
// (proto3 keeps unknown values rather than dropping them).
absl::Status ValidateGemmEnums(const v1::GroupedGemmRequest& request);
absl::Status ValidateCompat(v1::Compat compat);

absl::StatusOr<planner::PlanRequest> GemmPlanRequest(const v1::GroupedGemmRequest& request,
                                                     const planner::Mesh& mesh,
                                                     const TensorResolver& resolve);
absl::StatusOr<planner::PlanRequest> QuantizePlanRequest(const v1::GroupedQuantizeRequest& request,
                                                         const planner::Mesh& mesh,
                                                         const TensorResolver& resolve);

void CollectiveToProto(const planner::Collective& c, v1::CollectivePlan* out);

// The kernels' scaling mode of a request's `scaling` and `block_2d` (the one
// mapping from the wire's modes): DELAYED is kDelayed, BLOCK_FP8 is 1x128
// or, with block_2d, 128x128 blocks; INVALID_ARGUMENT for a value outside
// the enum.
absl::StatusOr<ScalingMode> KernelScalingMode(v1::ScalingMode scaling, bool block_2d);

// The kernels' scaling modes of an FP8 GEMM's operands for the wire's
// `scaling`: tensor modes on both sides; BLOCK_FP8 is 1x128 lhs with
// 128x128 rhs for ragged M and 128x1 on both (kBlock1x128) for ragged K.
struct GemmScalingModes {
  ScalingMode lhs = ScalingMode::kCurrent;
  ScalingMode rhs = ScalingMode::kCurrent;
};
absl::StatusOr<GemmScalingModes> KernelGemmScalingModes(v1::ScalingMode scaling, bool ragged_k);

// The planner's operand and output names ("lhs", "out", "data", ...) as
// wire roles, and back: the one mapping between the two vocabularies.
v1::TensorRole TensorRoleFromName(absl::string_view name);
absl::string_view TensorRoleName(v1::TensorRole role);

void PlanToProto(const planner::Plan& plan, v1::Plan* out, bool with_text = true);

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_PLAN_CODEC_H_
