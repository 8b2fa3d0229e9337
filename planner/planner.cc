#include "planner/planner.h"

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
#include "planner/planner_internal.h"

namespace shardgemm {
namespace planner {

using internal::BytesText;
using internal::Context;
using internal::Invalid;
using internal::PlanQuantize;
using internal::PlanRaggedK;
using internal::PlanRaggedM;
using internal::ShapeText;

absl::StatusOr<int> ResolveFlattenAxis(int flatten_axis, int rank) {
  const int fa = flatten_axis < 0 ? flatten_axis + rank : flatten_axis;
  if (rank < 2 || fa < 1 || fa >= rank) {
    return Invalid(absl::StrCat("flatten_axis: ", flatten_axis, " for x of rank ", rank,
                                " must leave at least one row and one column dim (1..", rank - 1,
                                " or -1..-", rank - 1, ")"));
  }
  return fa;
}

absl::string_view OpKindName(OpKind op) {
  switch (op) {
    case OpKind::kGroupedGemmRaggedM: return "grouped_gemm_ragged_m";
    case OpKind::kGroupedGemmRaggedK: return "grouped_gemm_ragged_k";
    case OpKind::kGroupedQuantize: return "grouped_quantize";
  }
  return "unknown";
}

absl::string_view CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kAllReduceSum: return "all_reduce_sum";
    case CollectiveKind::kAllReduceMax: return "all_reduce_max";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kSlice: return "slice";
  }
  return "unknown";
}

absl::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kBefore: return "before";
    case Phase::kWithin: return "within";
    case Phase::kAfter: return "after";
  }
  return "unknown";
}

std::string PlanSummary(const Plan& plan) {
  std::string out = absl::StrCat(OpKindName(plan.op), " ", plan.rule);
  for (const Collective& c : plan.collectives) {
    absl::StrAppend(&out, "; ", PhaseName(c.phase), " ", CollectiveKindName(c.kind), "(", c.tensor);
    if (c.dim >= 0) absl::StrAppend(&out, ", dim ", c.dim);
    absl::StrAppend(&out, ", ", absl::StrJoin(c.axes, "+"), ")");
  }
  absl::StrAppend(&out, "; out ", FormatPartitionSpec(plan.out_spec));
  return out;
}

absl::string_view ScalingModeName(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kCurrent: return "current";
    case ScalingMode::kDelayed: return "delayed";
    case ScalingMode::kMxfp8: return "mxfp8";
    case ScalingMode::kBlock: return "block";
  }
  return "unknown";
}

absl::string_view CompatModeName(CompatMode mode) {
  return mode == CompatMode::kTe ? "te" : "default";
}

const PlanOperand* FindPlanOperand(const Plan& plan, absl::string_view name) {
  for (const PlanOperand& op : plan.operands) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

std::string PlanRequestKey(const PlanRequest& request) {
  // Lengths before strings, so no two requests run together into one text.
  std::string key;
  auto add_text = [&key](absl::string_view t) { absl::StrAppend(&key, t.size(), ":", t, ";"); };
  auto add_int = [&key](int64_t v) { absl::StrAppend(&key, v, ";"); };
  auto add_spec = [&](const PartitionSpec& spec) {
    add_int(static_cast<int64_t>(spec.dims.size()));
    for (const auto& dim : spec.dims) {
      add_int(static_cast<int64_t>(dim.size()));
      for (const std::string& axis : dim) add_text(axis);
    }
  };
  add_int(static_cast<int64_t>(request.mesh.axes.size()));
  for (const MeshAxis& a : request.mesh.axes) {
    add_text(a.name);
    add_int(a.size);
  }
  for (const std::string* role : {&request.mesh.roles.dp, &request.mesh.roles.fsdp, &request.mesh.roles.ep,
                                  &request.mesh.roles.tp}) {
    add_text(*role);
  }
  add_int(static_cast<int64_t>(request.op));
  const OpAttrs& at = request.attrs;
  for (int64_t v : {int64_t{at.rhs_transposed}, int64_t{at.has_bias}, int64_t{at.flatten_axis},
                    static_cast<int64_t>(at.scaling_mode), int64_t{at.shared_scales}, int64_t{at.rowwise},
                    int64_t{at.colwise}, static_cast<int64_t>(at.out_dtype)}) {
    add_int(v);
  }
  add_int(static_cast<int64_t>(request.operands.size()));
  for (const OperandRequest& o : request.operands) {
    add_text(o.name);
    add_int(static_cast<int64_t>(o.dtype));
    add_int(static_cast<int64_t>(o.shape.size()));
    for (int64_t d : o.shape) add_int(d);
    add_spec(o.spec);
  }
  add_int(request.out_spec.has_value() ? 1 : 0);
  if (request.out_spec.has_value()) add_spec(*request.out_spec);
  add_int(static_cast<int64_t>(request.compat));
  return key;
}

absl::StatusOr<Plan> MakePlan(const PlanRequest& request) {
  absl::Status s = ValidateMesh(request.mesh);
  if (!s.ok()) return s;
  if (request.compat != CompatMode::kDefault && request.compat != CompatMode::kTe) {
    return Invalid("compat: unknown mode");
  }
  switch (request.attrs.scaling_mode) {
    case ScalingMode::kCurrent:
    case ScalingMode::kDelayed:
    case ScalingMode::kMxfp8:
    case ScalingMode::kBlock:
      break;
    default:
      return Invalid("attrs.scaling_mode: unknown mode");
  }
  Context ctx{request, request.mesh, request.compat == CompatMode::kTe};
  switch (request.op) {
    case OpKind::kGroupedGemmRaggedM: return PlanRaggedM(ctx);
    case OpKind::kGroupedGemmRaggedK: return PlanRaggedK(ctx);
    case OpKind::kGroupedQuantize: return PlanQuantize(ctx);
  }
  return Invalid("op: unknown operation");
}

std::string FormatPlanText(const Plan& plan) {
  std::string out;
  absl::StrAppend(&out, "op: ", OpKindName(plan.op), "   compat: ", CompatModeName(plan.compat),
                  "   rule: ", plan.rule, "\n");
  absl::StrAppend(&out, "mesh: ", FormatMesh(plan.mesh), "   roles: ", FormatRoles(plan.mesh.roles),
                  "   workers: ", NumWorkers(plan.mesh), "\n");
  absl::StrAppend(&out, "groups: ", plan.num_groups, " (", plan.local_group_count,
                  " per row shard); rows split over ", FormatAxes(plan.row_axes),
                  "; experts over ", FormatAxes(plan.expert_axes), "\n\n");
  absl::StrAppend(&out, absl::StrFormat("%-18s %-6s %-16s %-16s %-28s %-28s\n", "operand", "dtype",
                                        "global", "local", "input spec", "compute spec"));
  for (const PlanOperand& op : plan.operands) {
    absl::StrAppend(&out, absl::StrFormat("%-18s %-6s %-16s %-16s %-28s %-28s\n", op.name,
                                          DTypeName(op.dtype), ShapeText(op.global_shape),
                                          ShapeText(op.local_shape),
                                          FormatPartitionSpec(op.input_spec),
                                          FormatPartitionSpec(op.compute_spec)));
  }
  absl::StrAppend(&out, absl::StrFormat("\n%-18s %-6s %-16s %-16s %-28s %-28s\n", "output", "dtype",
                                        "global", "local", "local-op spec", "spec"));
  for (const PlanOutput& o : plan.outputs) {
    absl::StrAppend(&out, absl::StrFormat("%-18s %-6s %-16s %-16s %-28s %-28s\n", o.name,
                                          DTypeName(o.dtype), ShapeText(o.global_shape),
                                          ShapeText(o.local_shape),
                                          FormatPartitionSpec(o.local_op_spec),
                                          FormatPartitionSpec(o.spec)));
  }
  absl::StrAppend(&out, "\ncollectives (in order):\n");
  if (plan.collectives.empty()) absl::StrAppend(&out, "  (none)\n");
  for (size_t i = 0; i < plan.collectives.size(); ++i) {
    const Collective& c = plan.collectives[i];
    absl::StrAppend(&out, absl::StrFormat("  %2d. %-6s %-14s %-14s dim %-2s over %-14s %12s  %s\n",
                                          i + 1, PhaseName(c.phase), CollectiveKindName(c.kind),
                                          c.tensor, c.dim < 0 ? "-" : absl::StrCat(c.dim),
                                          FormatAxes(c.axes), BytesText(c.bytes_per_worker),
                                          c.reason));
  }
  absl::StrAppend(&out, "  total per worker: ", BytesText(plan.bytes_per_worker),
                  "; flops per worker: ", plan.flops_per_worker, "\n");
  // Workers: which group_sizes entries and experts each one uses.
  const size_t shown = std::min<size_t>(plan.workers.size(), 16);
  if (shown > 0) absl::StrAppend(&out, "\nworkers:\n");
  for (size_t i = 0; i < shown; ++i) {
    const WorkerPlan& w = plan.workers[i];
    std::vector<std::string> coords;
    for (size_t a = 0; a < w.coords.size() && a < plan.mesh.axes.size(); ++a) {
      coords.push_back(absl::StrCat(plan.mesh.axes[a].name, "=", w.coords[a]));
    }
    absl::StrAppend(&out, absl::StrFormat("  rank %-3d (%s): group_sizes [%d, %d), groups %d..%d%s\n",
                                          w.rank, absl::StrJoin(coords, ","), w.group_sizes_begin,
                                          w.group_sizes_end, w.first_group,
                                          w.first_group + w.local_group_count - 1,
                                          w.apply_bias ? ", adds bias" : ""));
  }
  if (plan.workers.size() > shown) {
    absl::StrAppend(&out, "  ... ", plan.workers.size() - shown, " more\n");
  }
  if (!plan.warnings.empty()) {
    absl::StrAppend(&out, "\nwarnings:\n");
    for (const PlanWarning& w : plan.warnings) absl::StrAppend(&out, "  ", w.text, "\n");
  }
  if (!plan.strategy_note.empty()) absl::StrAppend(&out, "\nstrategy:\n  ", absl::StrReplaceAll(plan.strategy_note, {{"\n", "\n  "}}), "\n");
  return out;
}

}  // namespace planner
}  // namespace shardgemm
