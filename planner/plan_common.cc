// Helpers of every rule, and the finalization of a strategy into a plan.
#include "planner/planner_internal.h"

namespace shardgemm {
namespace planner {
namespace internal {

int64_t SatMul(int64_t a, int64_t b) {
  if (a != 0 && b > INT64_MAX / a) return INT64_MAX;
  return a * b;
}

absl::Status Invalid(absl::string_view msg) { return absl::InvalidArgumentError(msg); }

bool Contains(const Axes& axes, absl::string_view a) {
  return std::find(axes.begin(), axes.end(), a) != axes.end();
}

Axes Without(const Axes& axes, const Axes& remove) {
  Axes out;
  for (const std::string& a : axes) {
    if (!Contains(remove, a)) out.push_back(a);
  }
  return out;
}

size_t CommonPrefix(const Axes& a, const Axes& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

std::string Quoted(const Axes& axes) {
  return absl::StrJoin(axes, ", ", [](std::string* out, const std::string& a) {
    absl::StrAppend(out, "'", a, "'");
  });
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  if (shape.empty()) return "[]";
  return absl::StrCat("[", absl::StrJoin(shape, "x"), "]");
}

std::string BytesText(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", bytes / 1048576.0);
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.2f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> LocalOf(const Mesh& mesh, const std::vector<int64_t>& shape,
                             const PartitionSpec& spec) {
  std::vector<int64_t> local = shape;
  for (size_t d = 0; d < spec.dims.size() && d < local.size(); ++d) {
    local[d] /= AxesProduct(mesh, spec.dims[d]);
  }
  return local;
}

bool IsDataRole(Role r) { return r == Role::kDp || r == Role::kFsdp || r == Role::kEp; }

absl::Status CheckShape(absl::string_view name, const std::vector<int64_t>& shape,
                        size_t rank_lo, size_t rank_hi) {
  if (shape.size() < rank_lo || shape.size() > rank_hi) {
    return Invalid(absl::StrCat(name, ": rank ", shape.size(), ", expected ",
                                rank_lo == rank_hi ? absl::StrCat(rank_lo)
                                                   : absl::StrCat(rank_lo, " to ", rank_hi),
                                " (shape ", ShapeText(shape), ")"));
  }
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 1 || shape[d] > kMaxDim) {
      return Invalid(absl::StrCat(name, " dim ", d, ": size ", shape[d], " must be in [1, 2^40]"));
    }
    if (numel > kMaxNumel / shape[d]) {
      return Invalid(absl::StrCat(name, ": shape ", ShapeText(shape), " has more than 2^46 elements"));
    }
    numel *= shape[d];
  }
  return absl::OkStatus();
}

absl::Status CheckDType(absl::string_view name, DType dtype, std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (d == dtype) return absl::OkStatus();
  }
  std::vector<std::string> names;
  for (DType d : allowed) names.emplace_back(DTypeName(d));
  return Invalid(absl::StrCat(name, ": dtype ", DTypeName(dtype), " not allowed (expected one of ",
                              absl::StrJoin(names, ", "), ")"));
}

absl::Status CollectOperands(const PlanRequest& req, const std::vector<std::string>& required,
                             const std::vector<std::string>& optional,
                             std::vector<const OperandRequest*>* found) {
  std::vector<std::string> names = required;
  names.insert(names.end(), optional.begin(), optional.end());
  found->assign(names.size(), nullptr);
  if (req.operands.size() > 16) return Invalid("operands: more than 16 given");
  for (const OperandRequest& op : req.operands) {
    auto it = std::find(names.begin(), names.end(), op.name);
    if (it == names.end()) {
      return Invalid(absl::StrCat("operands: unknown operand '", absl::CEscape(op.name), "' for ",
                                  OpKindName(req.op), " (expected ", absl::StrJoin(names, ", "),
                                  ")"));
    }
    size_t i = it - names.begin();
    if ((*found)[i] != nullptr) {
      return Invalid(absl::StrCat("operands: '", op.name, "' given twice"));
    }
    (*found)[i] = &op;
  }
  for (size_t i = 0; i < required.size(); ++i) {
    if ((*found)[i] == nullptr) {
      return Invalid(absl::StrCat("operands: '", required[i], "' is required for ",
                                  OpKindName(req.op)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Operand> MakeOperand(const Mesh& mesh, const OperandRequest& req) {
  Operand op;
  op.name = req.name;
  op.dtype = req.dtype;
  op.shape = req.shape;
  absl::Status s = ValidatePartitionSpec(op.name, op.shape, req.spec, mesh);
  if (!s.ok()) return s;
  op.input = PadSpec(req.spec, op.shape.size());
  op.target = op.input;
  return op;
}

absl::StatusOr<Axes> KeepTeAxes(const Context& ctx, const Operand& op, int dim, bool is_rows,
                                std::vector<Drop>* drops) {
  const Axes& axes = op.input.dims[dim];
  if (!ctx.te) return axes;
  Axes kept;
  for (const std::string& a : axes) {
    Role role = RoleOf(ctx.mesh, a);
    if (IsDataRole(role)) {
      kept.push_back(a);
      continue;
    }
    if (is_rows) {
      return Invalid(absl::StrCat(
          op.name, " dim ", dim, ": axis '", a, "' (role ", RoleName(role),
          ") splits the grouped rows; te mode keeps only dp/fsdp/ep axes and rows cannot be "
          "all-gathered (each row shard is its own ragged array)"));
    }
    drops->push_back({op.name, dim, a,
                      absl::StrCat("role ", RoleName(role), ", not a dp/fsdp/ep axis in te mode")});
  }
  return kept;
}

void AddDrop(const Operand& op, int dim, const std::string& a, absl::string_view why,
             std::vector<Drop>* drops) {
  for (const Drop& d : *drops) {
    if (d.tensor == op.name && d.dim == dim && d.axis == a) return;
  }
  drops->push_back({op.name, dim, a, std::string(why)});
}

void AddDrops(const Operand& op, int dim, const Axes& kept, absl::string_view why,
              std::vector<Drop>* drops) {
  for (const std::string& a : op.input.dims[dim]) {
    if (!Contains(kept, a)) AddDrop(op, dim, a, why, drops);
  }
}

absl::Status CheckGroupSizesLikeRows(const Operand& gs, const Axes& rows,
                                     absl::string_view rows_name) {
  if (gs.input.dims[0] != rows) {
    return Invalid(absl::StrCat(
        "group_sizes: spec ", FormatPartitionSpec(gs.input), " must split its entries like ",
        rows_name, " rows (", FormatAxes(rows),
        "): each row shard is its own ragged array with its own group sizes",
        rows.empty() && gs.input.dims[0].empty() ? "" :
        "; for EP split the rows over ep too, e.g. ((dp, fsdp, ep), None) with group_sizes "
        "((dp, fsdp, ep),)"));
  }
  return absl::OkStatus();
}

void EmitReshard(const Mesh& mesh, Phase phase, const std::string& tensor, DType dtype,
                 const std::vector<int64_t>& shape, const PartitionSpec& from,
                 const PartitionSpec& to, const std::vector<Drop>& drops,
                 std::vector<Collective>* out) {
  PartitionSpec cur = from;
  const int64_t esize = DTypeSize(dtype);
  auto slice = [&](size_t d, absl::string_view why) {
    Collective c;
    c.phase = phase;
    c.kind = CollectiveKind::kSlice;
    c.tensor = tensor;
    c.dim = static_cast<int>(d);
    c.axes.assign(to.dims[d].begin() + cur.dims[d].size(), to.dims[d].end());
    c.reason = absl::StrCat("compute spec splits ", tensor, " dim ", d, " over ",
                            FormatAxes(to.dims[d]), " (", why, ")");
    out->push_back(std::move(c));
    cur.dims[d] = to.dims[d];
  };
  // Slices that only append axes the tensor does not use yet go first: they
  // are free and shrink what the gathers move.
  for (size_t d = 0; d < shape.size(); ++d) {
    if (CommonPrefix(cur.dims[d], to.dims[d]) != cur.dims[d].size() ||
        cur.dims[d].size() == to.dims[d].size()) {
      continue;
    }
    bool fresh = true;
    for (size_t a = cur.dims[d].size(); a < to.dims[d].size(); ++a) {
      for (const Axes& dim : cur.dims) fresh &= !Contains(dim, to.dims[d][a]);
    }
    if (fresh) slice(d, "no communication; before the gathers so they move less");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    size_t keep = CommonPrefix(cur.dims[d], to.dims[d]);
    if (keep == cur.dims[d].size()) continue;
    Axes gathered(cur.dims[d].begin() + keep, cur.dims[d].end());
    Collective c;
    c.phase = phase;
    c.kind = CollectiveKind::kAllGather;
    c.tensor = tensor;
    c.dim = static_cast<int>(d);
    c.axes = gathered;
    c.bytes_per_worker =
        (AxesProduct(mesh, gathered) - 1) * Numel(LocalOf(mesh, shape, cur)) * esize;
    std::vector<std::string> why;
    for (const std::string& a : gathered) {
      bool found = false;
      for (const Drop& dr : drops) {
        if (dr.tensor == tensor && dr.dim == static_cast<int>(d) && dr.axis == a) {
          why.push_back(absl::StrCat(a, ": ", dr.why));
          found = true;
        }
      }
      if (!found) why.push_back(absl::StrCat(a, ": regathered to reorder the nested entry"));
    }
    c.reason = absl::StrJoin(why, "; ");
    out->push_back(std::move(c));
    cur.dims[d].resize(keep);
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (cur.dims[d].size() != to.dims[d].size()) slice(d, "no communication");
  }
}

void EmitOutput(const Mesh& mesh, bool te, const std::string& tensor, DType dtype,
                const std::vector<int64_t>& shape, const PartitionSpec& raw, const Axes& reduced,
                const PartitionSpec& target, std::vector<Collective>* out) {
  PartitionSpec cur = raw;
  // Partial sums stay FP32 until the output is complete (one rounding, at
  // the end), so every collective on them moves FP32 whatever the output dtype.
  const int64_t esize = reduced.empty() ? DTypeSize(dtype) : DTypeSize(DType::kF32);
  auto local_bytes = [&]() { return Numel(LocalOf(mesh, shape, cur)) * esize; };
  for (size_t d = 0; d < shape.size(); ++d) {
    size_t keep = CommonPrefix(cur.dims[d], target.dims[d]);
    if (keep == cur.dims[d].size()) continue;
    Collective c;
    c.phase = Phase::kAfter;
    c.kind = CollectiveKind::kAllGather;
    c.tensor = tensor;
    c.dim = static_cast<int>(d);
    c.axes.assign(cur.dims[d].begin() + keep, cur.dims[d].end());
    c.bytes_per_worker = (AxesProduct(mesh, c.axes) - 1) * local_bytes();
    c.reason = absl::StrCat("requested ", tensor, " spec leaves dim ", d, " less split");
    out->push_back(std::move(c));
    cur.dims[d].resize(keep);
  }
  Axes pending = reduced;
  auto all_reduce = [&](const Axes& axes, absl::string_view why) {
    if (axes.empty()) return;
    Collective c;
    c.phase = Phase::kAfter;
    c.kind = CollectiveKind::kAllReduceSum;
    c.tensor = tensor;
    c.axes = axes;
    int64_t p = AxesProduct(mesh, axes);
    c.bytes_per_worker = 2 * (p - 1) * local_bytes() / p;
    c.reason = std::string(why);
    out->push_back(std::move(c));
  };
  if (te) {
    all_reduce(pending, "partial sums over contracting-dim axes (psum)");
    pending.clear();
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    size_t i = cur.dims[d].size();
    const Axes& want = target.dims[d];
    while (i < want.size()) {
      bool scatter = Contains(pending, want[i]);
      size_t j = i;
      while (j < want.size() && Contains(pending, want[j]) == scatter) ++j;
      Collective c;
      c.phase = Phase::kAfter;
      c.tensor = tensor;
      c.dim = static_cast<int>(d);
      c.axes.assign(want.begin() + i, want.begin() + j);
      if (scatter) {
        c.kind = CollectiveKind::kReduceScatter;
        int64_t p = AxesProduct(mesh, c.axes);
        c.bytes_per_worker = (p - 1) * local_bytes() / p;
        c.reason = absl::StrCat("partial sums reduce-scattered onto the requested split of dim ", d);
        pending = Without(pending, c.axes);
      } else {
        c.kind = CollectiveKind::kSlice;
        c.reason = absl::StrCat("requested spec splits dim ", d, " over ", FormatAxes(c.axes),
                                " (no communication)");
      }
      cur.dims[d].insert(cur.dims[d].end(), c.axes.begin(), c.axes.end());
      out->push_back(std::move(c));
      i = j;
    }
  }
  all_reduce(pending, "partial sums over contracting-dim axes (psum)");
}

absl::StatusOr<Plan> Finalize(const Context& ctx, const Common& common, const Strategy& st,
                              bool with_workers) {
  const Mesh& mesh = ctx.mesh;
  Plan plan;
  plan.op = ctx.req.op;
  plan.compat = ctx.req.compat;
  plan.rule = common.rule;
  plan.row_axes = common.row_axes;
  plan.expert_axes = common.expert_axes;
  plan.num_groups = common.num_groups;
  plan.local_group_count = common.local_groups;
  plan.reduced_axes = st.reduced;
  for (const Operand& op : st.operands) {
    absl::Status s = ValidatePartitionSpec(op.name, op.shape, op.target, mesh);
    if (!s.ok()) return s;
    PlanOperand po;
    po.name = op.name;
    po.dtype = op.dtype;
    po.global_shape = op.shape;
    po.input_spec = op.input;
    po.compute_spec = op.target;
    po.input_local_shape = LocalOf(mesh, op.shape, op.input);
    po.local_shape = LocalOf(mesh, op.shape, op.target);
    plan.operands.push_back(std::move(po));
    EmitReshard(mesh, Phase::kBefore, op.name, op.dtype, op.shape, op.input, op.target, st.drops,
                &plan.collectives);
  }
  for (const Drop& d : st.drops) {
    int64_t bytes = 0;
    for (const Collective& c : plan.collectives) {
      if (c.kind == CollectiveKind::kAllGather && c.tensor == d.tensor && c.dim == d.dim &&
          Contains(c.axes, d.axis)) {
        bytes = c.bytes_per_worker;
      }
    }
    PlanWarning w;
    w.tensor = d.tensor;
    w.dim = d.dim;
    w.axis = d.axis;
    w.text = absl::StrCat(d.tensor, " dim ", d.dim, ": axis '", d.axis, "' dropped (", d.why,
                          "): ", d.tensor, " is all-gathered along ", d.axis, " (",
                          BytesText(bytes), " per worker)");
    plan.warnings.push_back(std::move(w));
  }
  if (!st.within_max_axes.empty()) {
    for (const PlanOutput& o : st.outputs) {
      if (o.name != "amax") continue;
      Collective c;
      c.phase = Phase::kWithin;
      c.kind = CollectiveKind::kAllReduceMax;
      c.tensor = "amax";
      c.axes = st.within_max_axes;
      int64_t p = AxesProduct(mesh, c.axes);
      c.bytes_per_worker = 2 * (p - 1) * Numel(LocalOf(mesh, o.global_shape, o.local_op_spec)) *
                           DTypeSize(o.dtype) / p;
      c.reason = "shared scales: per-group amax over the row shards that split each group";
      plan.collectives.push_back(std::move(c));
    }
  }
  for (size_t i = 0; i < st.outputs.size(); ++i) {
    PlanOutput o = st.outputs[i];
    absl::Status s = CheckShape(o.name, o.global_shape, 1, 8);
    if (!s.ok()) return s;
    s = ValidatePartitionSpec(o.name, o.global_shape, o.spec, mesh);
    if (!s.ok()) return s;
    o.local_op_shape = LocalOf(mesh, o.global_shape, o.local_op_spec);
    o.local_shape = LocalOf(mesh, o.global_shape, o.spec);
    EmitOutput(mesh, ctx.te, o.name, o.dtype, o.global_shape, o.local_op_spec,
               i == 0 ? st.reduced : Axes{}, o.spec, &plan.collectives);
    plan.outputs.push_back(std::move(o));
  }
  const PlanOutput& primary = plan.outputs[0];
  plan.out_shape = primary.global_shape;
  plan.out_spec = primary.spec;
  plan.local_out_shape = primary.local_shape;
  plan.out_dtype = primary.dtype;
  for (const Collective& c : plan.collectives) plan.bytes_per_worker += c.bytes_per_worker;

  // FLOPs: 2 M K N per worker for the GEMMs (an upper bound: padding rows
  // are not multiplied); one pass over the elements for quantize.
  const std::vector<int64_t>& l = plan.operands[0].local_shape;
  if (ctx.req.op == OpKind::kGroupedQuantize) {
    plan.flops_per_worker = Numel(l) * ((ctx.req.attrs.rowwise ? 1 : 0) + (ctx.req.attrs.colwise ? 1 : 0));
  } else {
    const std::vector<int64_t>& r = plan.operands[1].local_shape;
    int64_t n = ctx.req.op == OpKind::kGroupedGemmRaggedK ? r[1]
                : ctx.req.attrs.rhs_transposed           ? r[1]
                                                         : r[2];
    plan.flops_per_worker = SatMul(SatMul(2 * l[0], l[1]), n);
  }

  std::vector<std::string> notes = st.notes;
  if (!st.label.empty()) notes.insert(notes.begin(), absl::StrCat("chosen: ", st.label));
  plan.strategy_note = absl::StrJoin(notes, "\n");
  plan.mesh = mesh;
  if (!with_workers) return plan;

  const int64_t n = NumWorkers(mesh);
  plan.workers.reserve(n);
  for (int64_t rank = 0; rank < n; ++rank) {
    WorkerPlan w;
    w.rank = rank;
    w.coords = *RankToCoords(mesh, rank);
    for (const PlanOperand& op : plan.operands) w.local_shapes.push_back(op.local_shape);
    w.local_group_count = common.local_groups;
    int64_t row_shard = BlockIndex(mesh, common.row_axes, w.coords);
    w.group_sizes_begin = row_shard * common.local_groups;
    w.group_sizes_end = w.group_sizes_begin + common.local_groups;
    w.first_group = BlockIndex(mesh, common.expert_axes, w.coords) * common.local_groups;
    if (ctx.req.op == OpKind::kGroupedGemmRaggedM && ctx.req.attrs.has_bias) {
      w.apply_bias = true;
      for (const std::string& a : st.reduced) {
        if (w.coords[AxisIndex(mesh, a)] != 0) w.apply_bias = false;
      }
    }
    plan.workers.push_back(std::move(w));
  }
  return plan;
}

absl::StatusOr<Plan> Choose(const Context& ctx, const Common& common,
                            std::vector<Strategy> candidates) {
  absl::optional<Plan> best;
  absl::Status first_error = absl::OkStatus();
  std::vector<std::string> tried;
  size_t best_index = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    absl::StatusOr<Plan> plan = Finalize(ctx, common, candidates[i], /*with_workers=*/false);
    if (!plan.ok()) {
      if (first_error.ok()) first_error = plan.status();
      tried.push_back(absl::StrCat("  - ", candidates[i].label, ": not possible (",
                                   plan.status().message(), ")"));
      continue;
    }
    tried.push_back(absl::StrCat("  - ", candidates[i].label, ": ",
                                 BytesText(plan->bytes_per_worker), " per worker, ",
                                 plan->flops_per_worker, " flops per worker"));
    // Fewest bytes; on a tie the fewer FLOPs (e.g. a split K computes less).
    if (!best.has_value() || plan->bytes_per_worker < best->bytes_per_worker ||
        (plan->bytes_per_worker == best->bytes_per_worker &&
         plan->flops_per_worker < best->flops_per_worker)) {
      best = std::move(*plan);
      best_index = i;
    }
  }
  if (!best.has_value()) return first_error;
  absl::StatusOr<Plan> plan = Finalize(ctx, common, candidates[best_index], /*with_workers=*/true);
  if (!plan.ok()) return plan.status();
  if (candidates.size() > 1) {
    plan->strategy_note = absl::StrCat(
        plan->strategy_note, "\nchosen by bytes moved per worker (then flops) among:\n",
        absl::StrJoin(tried, "\n"));
  }
  return plan;
}

DType GemmOutDType(const PlanRequest& req, DType lhs) {
  if (req.attrs.out_dtype != DType::kInvalid) return req.attrs.out_dtype;
  return IsFloat8(lhs) ? DType::kBF16 : lhs;
}

absl::Status CheckOutSpec(const PlanRequest& req, const Mesh& mesh, absl::string_view name,
                          const std::vector<int64_t>& shape, PartitionSpec* spec) {
  if (!req.out_spec.has_value()) return absl::OkStatus();
  absl::Status s = ValidatePartitionSpec(absl::StrCat("requested ", name, " spec"), shape,
                                         *req.out_spec, mesh);
  if (!s.ok()) return s;
  *spec = PadSpec(*req.out_spec, shape.size());
  return absl::OkStatus();
}

Axes ExpertAxes(const Mesh& mesh, const Axes& rows) {
  if (!mesh.roles.ep.empty() && Contains(rows, mesh.roles.ep)) return {mesh.roles.ep};
  return {};
}

absl::Status CheckGroupCount(const Mesh& mesh, const Operand& gs, const Axes& rows,
                             int64_t local_groups, absl::string_view what) {
  const int64_t shards = AxesProduct(mesh, rows);
  if (gs.shape[0] != shards * local_groups) {
    return Invalid(absl::StrCat("group_sizes: ", gs.shape[0], " entries, expected ", shards,
                                " row shard(s) x ", local_groups, " ", what, " = ",
                                shards * local_groups));
  }
  return absl::OkStatus();
}

int64_t BlockOf(ScalingMode mode) { return mode == ScalingMode::kMxfp8 ? 32 : 128; }

bool IsBlockScaling(ScalingMode mode) {
  return mode == ScalingMode::kMxfp8 || mode == ScalingMode::kBlock;
}

absl::Status CheckScaleOperand(const OperandRequest* op, absl::string_view name,
                               const std::vector<int64_t>& want, DType dtype,
                               absl::string_view layout) {
  if (op == nullptr) {
    return Invalid(absl::StrCat(name, ": FP8 inputs need their scale_inv operand (", layout, ")"));
  }
  if (op->shape != want) {
    return Invalid(absl::StrCat(name, ": shape ", ShapeText(op->shape), ", expected ",
                                ShapeText(want), " (", layout, ")"));
  }
  return CheckDType(name, op->dtype, {dtype});
}

absl::Status CheckRowsLike(const Operand& op, const Axes& rows) {
  if (op.input.dims[0] != rows) {
    return Invalid(absl::StrCat(op.name, " dim 0: split over ", FormatAxes(op.input.dims[0]),
                                ", must be split like the rows it scales (", FormatAxes(rows),
                                ")"));
  }
  return absl::OkStatus();
}

int FindOperand(const std::vector<Operand>& ops, absl::string_view name) {
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace internal
}  // namespace planner
}  // namespace shardgemm
