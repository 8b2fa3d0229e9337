// The planner's internals shared by its per-op rules (plan_ragged_m.cc,
// plan_ragged_k.cc, plan_quantize.cc) and the finalization every plan goes
// through (plan_common.cc). Not part of the planner's API: planner.h is.
#ifndef SHARDGEMM_PLANNER_PLANNER_INTERNAL_H_
#define SHARDGEMM_PLANNER_PLANNER_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {
namespace internal {

using Axes = std::vector<std::string>;

constexpr int64_t kMaxDim = int64_t{1} << 40;

// Keeps bytes = elements x 8 B x 4096 peers inside int64.
constexpr int64_t kMaxNumel = int64_t{1} << 46;

// a * b clamped to INT64_MAX (both non-negative); FLOPs of huge requests.
int64_t SatMul(int64_t a, int64_t b);

absl::Status Invalid(absl::string_view msg);

bool Contains(const Axes& axes, absl::string_view a);

Axes Without(const Axes& axes, const Axes& remove);

size_t CommonPrefix(const Axes& a, const Axes& b);

std::string Quoted(const Axes& axes);

std::string ShapeText(const std::vector<int64_t>& shape);

std::string BytesText(int64_t bytes);

int64_t CeilDiv(int64_t a, int64_t b);

int64_t Numel(const std::vector<int64_t>& shape);

std::vector<int64_t> LocalOf(const Mesh& mesh, const std::vector<int64_t>& shape,
                             const PartitionSpec& spec);

bool IsDataRole(Role r);

// Why an input axis is dropped, for warnings and collective reasons.
struct Drop {
  std::string tensor;
  int dim;
  std::string axis;
  std::string why;
};

// An operand with its validated input spec and the compute spec a strategy
// wants for it.
struct Operand {
  std::string name;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  PartitionSpec input;
  PartitionSpec target;
};

// One way of running the op: compute specs for every operand, the spec the
// local op gives its outputs and the axes its partial sums run over.
struct Strategy {
  std::string label;
  std::vector<Operand> operands;
  std::vector<Drop> drops;
  std::vector<std::string> notes;
  // Outputs: name, dtype, global shape, local-op spec, final spec.
  std::vector<PlanOutput> outputs;
  Axes reduced;               // partial-sum axes of outputs[0]
  Axes within_max_axes;       // quantize shared scales: all_reduce_max on "amax"
};

struct Context {
  const PlanRequest& req;
  const Mesh& mesh;
  bool te;
};

// ---------------------------------------------------------------------------
// Validation of operands.
absl::Status CheckShape(absl::string_view name, const std::vector<int64_t>& shape,
                        size_t rank_lo, size_t rank_hi);

absl::Status CheckDType(absl::string_view name, DType dtype, std::initializer_list<DType> allowed);

// Finds each named operand once; rejects unknown, duplicate and missing ones.
absl::Status CollectOperands(const PlanRequest& req, const std::vector<std::string>& required,
                             const std::vector<std::string>& optional,
                             std::vector<const OperandRequest*>* found);

absl::StatusOr<Operand> MakeOperand(const Mesh& mesh, const OperandRequest& req);

// te mode keeps only dp/fsdp/ep axes (rule 1); the rest are dropped with a
// warning. Rows cannot be gathered (each row shard is its own ragged array),
// so a non-data axis on rows is an error there.
absl::StatusOr<Axes> KeepTeAxes(const Context& ctx, const Operand& op, int dim, bool is_rows,
                                std::vector<Drop>* drops);

// Records why input axis `a` of op's `dim` is dropped (first reason wins).
void AddDrop(const Operand& op, int dim, const std::string& a, absl::string_view why,
             std::vector<Drop>* drops);

// Records every input axis of op's `dim` that is not in `kept`.
void AddDrops(const Operand& op, int dim, const Axes& kept, absl::string_view why,
              std::vector<Drop>* drops);

// Row axes: group_sizes must be split exactly like the rows it describes.
absl::Status CheckGroupSizesLikeRows(const Operand& gs, const Axes& rows,
                                     absl::string_view rows_name);

// ---------------------------------------------------------------------------
// Emitting collectives.

// Moves `tensor` from `from` to `to`: all-gathers first (dims in order; the
// part of an entry after its common prefix with the target), then slices.
// Gathering before slicing keeps every intermediate spec free of repeated
// axes even when an axis moves between dimensions.
void EmitReshard(const Mesh& mesh, Phase phase, const std::string& tensor, DType dtype,
                 const std::vector<int64_t>& shape, const PartitionSpec& from,
                 const PartitionSpec& to, const std::vector<Drop>& drops,
                 std::vector<Collective>* out);

// Takes an output from the local op's spec `raw`, partial over `reduced`, to
// `target`. te mode all-reduces and then slices; the default mode
// reduce-scatters wherever the target splits a dim over a reduced axis.
void EmitOutput(const Mesh& mesh, bool te, const std::string& tensor, DType dtype,
                const std::vector<int64_t>& shape, const PartitionSpec& raw, const Axes& reduced,
                const PartitionSpec& target, std::vector<Collective>* out);

// ---------------------------------------------------------------------------
// Turning a strategy into a plan.
struct Common {
  Axes row_axes;
  Axes expert_axes;
  int64_t num_groups = 0;
  int64_t local_groups = 0;
  std::string rule;
};

absl::StatusOr<Plan> Finalize(const Context& ctx, const Common& common, const Strategy& st,
                              bool with_workers);

// Evaluates the candidate strategies; te mode has exactly one. Picks the
// fewest bytes moved (ties: the earlier candidate) and explains the choice.
absl::StatusOr<Plan> Choose(const Context& ctx, const Common& common,
                            std::vector<Strategy> candidates);

DType GemmOutDType(const PlanRequest& req, DType lhs);

absl::Status CheckOutSpec(const PlanRequest& req, const Mesh& mesh, absl::string_view name,
                          const std::vector<int64_t>& shape, PartitionSpec* spec);

// Expert axes: the ep axis when it splits the rows (then group_sizes lists
// each row shard's own experts, as DESIGN.md's EP layout).
Axes ExpertAxes(const Mesh& mesh, const Axes& rows);

absl::Status CheckGroupCount(const Mesh& mesh, const Operand& gs, const Axes& rows,
                             int64_t local_groups, absl::string_view what);

// ---------------------------------------------------------------------------
// FP8 inputs: their scale_inv operands.
//
// Tensor scaling (current/delayed) has one scale per group: lhs_scale_inv
// is laid out like group_sizes (what grouped quantize produces), rhs's per
// expert [G]. MXFP8 (32, E8M0) and block scaling (128, f32) have block
// scales along the contracting dim (ragged M: lhs [M, K/B], rhs
// [G, K/B, N] or, block scaling's 128x128 weight blocks, [G, K/B, N/128];
// transposed rhs swaps the last two) or along the rows (ragged K:
// [M/B, K] and [M/B, N]). Scales follow their data operand's compute spec
// dimension by dimension, so a shard of data always has whole blocks and
// exactly the scales the unsharded op would use.
int64_t BlockOf(ScalingMode mode);

bool IsBlockScaling(ScalingMode mode);

absl::Status CheckScaleOperand(const OperandRequest* op, absl::string_view name,
                               const std::vector<int64_t>& want, DType dtype,
                               absl::string_view layout);

// Rows cannot be regathered, so a scale operand's row dim is split exactly
// like the rows it scales.
absl::Status CheckRowsLike(const Operand& op, const Axes& rows);

int FindOperand(const std::vector<Operand>& ops, absl::string_view name);

// The per-op rules.
absl::StatusOr<Plan> PlanRaggedM(const Context& ctx);
absl::StatusOr<Plan> PlanRaggedK(const Context& ctx);
absl::StatusOr<Plan> PlanQuantize(const Context& ctx);

}  // namespace internal
}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_PLANNER_INTERNAL_H_
