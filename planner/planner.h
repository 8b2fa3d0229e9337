// The partition planner: from a sharded grouped-op request (mesh, global
// shapes, partition specs) to what each worker computes locally and the
// collectives that connect the pieces. See docs/sharding.md for the rules.
//
// Execution model of a Plan (the coordinator, the workers and
// simulator.h all follow it):
//   1. each worker takes its shard of every operand per `input_spec`;
//   2. it applies the kBefore collectives in order (all_gather along a dim
//      over axes; slice = keep its own piece, no communication), after which
//      every operand has its `compute_spec`;
//   3. it runs the local op on its local pieces, with the per-shard
//      semantics of DESIGN.md (each row shard its own ragged array;
//      `WorkerPlan` says which group_sizes entries and experts it uses,
//      and whether it adds the bias: only one worker per partial-sum group);
//      a grouped quantize applies the kWithin collectives (amax) between its
//      amax pass and its cast pass;
//   4. it applies the kAfter collectives on the outputs, in order, after
//      which "out" has `out_spec`.
#ifndef SHARDGEMM_PLANNER_PLANNER_H_
#define SHARDGEMM_PLANNER_PLANNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/optional.h"
#include "kernels/dtype.h"
#include "planner/mesh.h"
#include "planner/spec.h"

namespace shardgemm {
namespace planner {

enum class OpKind {
  kGroupedGemmRaggedM,  // lhs [M,K], rhs [G,K,N] ([G,N,K] transposed), gs, bias [G,N] -> [M,N]
  kGroupedGemmRaggedK,  // lhs [M,K], rhs [M,N], gs -> [G,K,N] (wgrad)
  kGroupedQuantize,     // x [M,...], gs -> FP8 data, scale_inv, amax
};
enum class ScalingMode { kCurrent, kDelayed, kMxfp8, kBlock };
// kTe reproduces Transformer Engine's rules; kDefault goes beyond them.
enum class CompatMode { kDefault, kTe };

struct OpAttrs {
  bool rhs_transposed = false;  // ragged M: rhs is [G, N, K]
  bool has_bias = false;        // ragged M only
  // Grouped quantize: dims [0, flatten_axis) are rows, the rest columns.
  // Negative counts from the end (-1: the last dim is the only column dim).
  int flatten_axis = -1;
  // Grouped quantize's scaling, and the layout of FP8 GEMM inputs' scales.
  ScalingMode scaling_mode = ScalingMode::kCurrent;
  // Grouped quantize: one amax/scale per group across the row shards that
  // split the group's rows (all_reduce_max), instead of one per shard.
  bool shared_scales = false;
  bool rowwise = true;   // grouped quantize: produce rowwise data
  bool colwise = false;  // grouped quantize: produce colwise data
  // GEMM: f32/bf16/f16 (kInvalid: lhs dtype, or bf16 for FP8 inputs).
  // Quantize: f8e4m3/f8e5m2 (kInvalid: f8e4m3).
  DType out_dtype = DType::kInvalid;
};

struct OperandRequest {
  // GEMMs: "lhs", "rhs", "group_sizes", optional "bias" (ragged M), and for
  // FP8 lhs/rhs optionally the pair "lhs_scale_inv", "rhs_scale_inv"
  // (layouts set by attrs.scaling_mode; see docs/sharding.md; without them
  // the plan covers the data only). Quantize: "x", "group_sizes".
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kInvalid;
  PartitionSpec spec;  // padded with None to the rank
};

// A field added here (or to OpAttrs, OperandRequest, Mesh) goes into
// PlanRequestKey too: plans are cached under it.
struct PlanRequest {
  Mesh mesh;
  OpKind op = OpKind::kGroupedGemmRaggedM;
  OpAttrs attrs;
  std::vector<OperandRequest> operands;
  // Spec the caller wants for the (primary) output; absent: the planner's.
  absl::optional<PartitionSpec> out_spec;
  CompatMode compat = CompatMode::kDefault;
};

enum class Phase { kBefore, kWithin, kAfter };
enum class CollectiveKind { kAllGather, kAllReduceSum, kAllReduceMax, kReduceScatter, kSlice };

struct Collective {
  Phase phase = Phase::kBefore;
  CollectiveKind kind = CollectiveKind::kAllGather;
  std::string tensor;  // operand name, or an output name ("out", "amax")
  int dim = -1;        // gather/scatter/slice dimension; -1 for all-reduce
  // Mesh axes the collective runs over. A worker's peers differ from it only
  // on these axes; pieces are ordered first axis major. all_gather and
  // slice/reduce_scatter remove/append these axes at the minor end of the
  // dimension's entry.
  std::vector<std::string> axes;
  int64_t bytes_per_worker = 0;  // bytes each worker sends (ring algorithms)
  std::string reason;            // why the plan has it
};

struct PlanOperand {
  std::string name;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> global_shape;
  PartitionSpec input_spec;    // as given, padded to the rank
  PartitionSpec compute_spec;  // what the local op sees
  std::vector<int64_t> input_local_shape;
  std::vector<int64_t> local_shape;  // under compute_spec
};

// An output of the op ("out" for the GEMMs; "data", "colwise_data",
// "scale_inv", "colwise_scale_inv", "amax" for grouped quantize). Quantize
// shapes: data and colwise_data have x's shape (any transposition is the
// kernel's business); tensor scaling gives scale_inv and amax one f32 per
// local group, laid out like group_sizes; MXFP8/block give unpadded
// scale_inv [M, K/B] (rowwise) and colwise_scale_inv [M/B, K], M and K
// being x flattened at flatten_axis.
struct PlanOutput {
  std::string name;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> global_shape;
  PartitionSpec local_op_spec;  // as the local op produces it
  PartitionSpec spec;           // after the kAfter collectives
  std::vector<int64_t> local_op_shape;
  std::vector<int64_t> local_shape;
};

struct WorkerPlan {
  int64_t rank = 0;
  std::vector<int64_t> coords;  // one per mesh axis
  // Local (compute) shape of every operand, in Plan::operands order.
  std::vector<std::vector<int64_t>> local_shapes;
  int64_t local_group_count = 0;
  // group_sizes entries [begin, end) of the global array this worker's rows use.
  int64_t group_sizes_begin = 0;
  int64_t group_sizes_end = 0;
  // Global group (expert) index of local group 0.
  int64_t first_group = 0;
  // Ragged M with bias and partial sums: only the worker at coordinate 0 of
  // every reduced axis adds the bias, so the sum adds it once.
  bool apply_bias = false;
};

struct PlanWarning {
  std::string tensor;
  int dim = -1;
  std::string axis;
  std::string text;  // e.g. "rhs dim 2: axis 'tp' dropped (...): rhs is all-gathered along tp"
};

struct Plan {
  OpKind op = OpKind::kGroupedGemmRaggedM;
  CompatMode compat = CompatMode::kDefault;
  Mesh mesh;
  std::string rule;  // einsum-like, e.g. "m k, g k n, g -> m n"
  std::vector<PlanOperand> operands;
  std::vector<PlanOutput> outputs;  // outputs[0] is the primary output
  std::vector<Collective> collectives;  // in execution order
  std::vector<WorkerPlan> workers;      // by rank
  // Primary output (copies of outputs[0] for convenience).
  std::vector<int64_t> out_shape;
  PartitionSpec out_spec;
  std::vector<int64_t> local_out_shape;
  DType out_dtype = DType::kInvalid;
  // Axes over which the local results are partial sums (GEMM).
  std::vector<std::string> reduced_axes;
  // Axes whose coordinates pick the worker's experts (ep), and those that
  // split the rows (the group_sizes layout).
  std::vector<std::string> expert_axes;
  std::vector<std::string> row_axes;
  int64_t num_groups = 0;         // G
  int64_t local_group_count = 0;  // groups per row shard
  int64_t flops_per_worker = 0;
  int64_t bytes_per_worker = 0;  // sum over collectives
  std::vector<PlanWarning> warnings;
  std::string strategy_note;
};

absl::StatusOr<Plan> MakePlan(const PlanRequest& request);

// A text naming everything MakePlan reads of `request`: two requests with
// the same key get the same plan (MakePlan is a pure function of them), so
// a caller may keep plans under it.
std::string PlanRequestKey(const PlanRequest& request);

// The plan's operand named `name` ("lhs", "x", ...); null when it has none.
const PlanOperand* FindPlanOperand(const Plan& plan, absl::string_view name);

// Grouped quantize's flatten axis for an x of `rank`: negative counts from
// the end (-1: the last dim is the only column dim); the result is in
// [1, rank), else INVALID_ARGUMENT naming the field.
absl::StatusOr<int> ResolveFlattenAxis(int flatten_axis, int rank);

// Readable table: operands (global/local shape, input/compute spec), the
// outputs, the collectives in order, then warnings and the strategy note.
std::string FormatPlanText(const Plan& plan);

absl::string_view OpKindName(OpKind op);  // "grouped_gemm_ragged_m", ...
absl::string_view CollectiveKindName(CollectiveKind kind);  // "all_gather", ...
absl::string_view PhaseName(Phase phase);                   // "before", ...
absl::string_view ScalingModeName(ScalingMode mode);        // "current", ...
absl::string_view CompatModeName(CompatMode mode);          // "default", "te"

// One line for a log: the op, its rule, its collectives in order and the
// output's spec, e.g. "grouped_gemm_ragged_m m k, g k n, g -> m n;
// before all_gather(rhs, dim 1, fsdp); out ((fsdp, ep), None)".
std::string PlanSummary(const Plan& plan);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_PLANNER_H_
