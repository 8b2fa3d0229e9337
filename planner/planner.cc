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

namespace shardgemm {
namespace planner {
namespace {

using Axes = std::vector<std::string>;

constexpr int64_t kMaxDim = int64_t{1} << 40;
// Keeps bytes = elements x 8 B x 4096 peers inside int64.
constexpr int64_t kMaxNumel = int64_t{1} << 46;

// a * b clamped to INT64_MAX (both non-negative); FLOPs of huge requests.
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

// Finds each named operand once; rejects unknown, duplicate and missing ones.
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

// te mode keeps only dp/fsdp/ep axes (rule 1); the rest are dropped with a
// warning. Rows cannot be gathered (each row shard is its own ragged array),
// so a non-data axis on rows is an error there.
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

// Records why input axis `a` of op's `dim` is dropped (first reason wins).
void AddDrop(const Operand& op, int dim, const std::string& a, absl::string_view why,
             std::vector<Drop>* drops) {
  for (const Drop& d : *drops) {
    if (d.tensor == op.name && d.dim == dim && d.axis == a) return;
  }
  drops->push_back({op.name, dim, a, std::string(why)});
}

// Records every input axis of op's `dim` that is not in `kept`.
void AddDrops(const Operand& op, int dim, const Axes& kept, absl::string_view why,
              std::vector<Drop>* drops) {
  for (const std::string& a : op.input.dims[dim]) {
    if (!Contains(kept, a)) AddDrop(op, dim, a, why, drops);
  }
}

// Row axes: group_sizes must be split exactly like the rows it describes.
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

// ---------------------------------------------------------------------------
// Emitting collectives.

// Moves `tensor` from `from` to `to`: all-gathers first (dims in order; the
// part of an entry after its common prefix with the target), then slices.
// Gathering before slicing keeps every intermediate spec free of repeated
// axes even when an axis moves between dimensions.
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

// Takes an output from the local op's spec `raw`, partial over `reduced`, to
// `target`. te mode all-reduces and then slices; the default mode
// reduce-scatters wherever the target splits a dim over a reduced axis.
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

// Evaluates the candidate strategies; te mode has exactly one. Picks the
// fewest bytes moved (ties: the earlier candidate) and explains the choice.
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

// Expert axes: the ep axis when it splits the rows (then group_sizes lists
// each row shard's own experts, as DESIGN.md's EP layout).
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

// Rows cannot be regathered, so a scale operand's row dim is split exactly
// like the rows it scales.
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

// ---------------------------------------------------------------------------
// Grouped GEMM, ragged M.

absl::StatusOr<Plan> PlanRaggedM(const Context& ctx) {
  const PlanRequest& req = ctx.req;
  const Mesh& mesh = ctx.mesh;
  std::vector<const OperandRequest*> found;
  absl::Status s = CollectOperands(req, {"lhs", "rhs", "group_sizes"},
                                   {"bias", "lhs_scale_inv", "rhs_scale_inv"}, &found);
  if (!s.ok()) return s;
  // The operands by name (CollectOperands' order).
  const OperandRequest* const lhs_req = found[0];
  const OperandRequest* const rhs_req = found[1];
  const OperandRequest* const gs_req = found[2];
  const OperandRequest* const bias_req = found[3];       // optional
  const OperandRequest* const lhs_scale_req = found[4];  // optional, FP8
  const OperandRequest* const rhs_scale_req = found[5];  // optional, FP8
  if ((bias_req != nullptr) != req.attrs.has_bias) {
    return Invalid(req.attrs.has_bias ? "bias: attrs.has_bias is set but no 'bias' operand given"
                                      : "bias: 'bias' operand given but attrs.has_bias is false");
  }
  const std::initializer_list<DType> in_types = {DType::kF32, DType::kBF16, DType::kF16,
                                                 DType::kF8E4M3, DType::kF8E5M2};
  if (!(s = CheckShape("lhs", lhs_req->shape, 2, 2)).ok()) return s;
  if (!(s = CheckShape("rhs", rhs_req->shape, 3, 3)).ok()) return s;
  if (!(s = CheckShape("group_sizes", gs_req->shape, 1, 1)).ok()) return s;
  if (!(s = CheckDType("lhs", lhs_req->dtype, in_types)).ok()) return s;
  if (!(s = CheckDType("rhs", rhs_req->dtype, in_types)).ok()) return s;
  if (!(s = CheckDType("group_sizes", gs_req->dtype, {DType::kI32, DType::kI64})).ok()) return s;
  if (lhs_req->dtype == DType::kF8E5M2 && rhs_req->dtype == DType::kF8E5M2) {
    return Invalid("rhs: f8e5m2 x f8e5m2 GEMM is not supported (one side must be f8e4m3)");
  }
  if (IsFloat8(lhs_req->dtype) != IsFloat8(rhs_req->dtype)) {
    return Invalid("rhs: lhs and rhs must both be FP8 or both be 16/32-bit floats");
  }
  if (bias_req != nullptr) {
    if (!(s = CheckShape("bias", bias_req->shape, 2, 2)).ok()) return s;
    if (!(s = CheckDType("bias", bias_req->dtype, {DType::kF32, DType::kBF16, DType::kF16})).ok()) return s;
  }
  const DType out_dtype = GemmOutDType(req, lhs_req->dtype);
  if (!(s = CheckDType("attrs.out_dtype", out_dtype, {DType::kF32, DType::kBF16, DType::kF16})).ok()) return s;

  const bool tr = req.attrs.rhs_transposed;
  const int kdim = tr ? 2 : 1, ndim = tr ? 1 : 2;
  const int64_t M = lhs_req->shape[0], K = lhs_req->shape[1];
  const int64_t G = rhs_req->shape[0], N = rhs_req->shape[ndim];
  if (rhs_req->shape[kdim] != K) {
    return Invalid(absl::StrCat("rhs dim ", kdim, ": K = ", rhs_req->shape[kdim],
                                " does not match lhs K = ", K, tr ? " (rhs_transposed: [G, N, K])"
                                                                 : " (rhs is [G, K, N])"));
  }
  if (bias_req != nullptr && (bias_req->shape[0] != G || bias_req->shape[1] != N)) {
    return Invalid(absl::StrCat("bias: shape ", ShapeText(bias_req->shape), ", expected [", G,
                                "x", N, "] (G x N)"));
  }
  const bool fp8 = IsFloat8(lhs_req->dtype);
  const ScalingMode mode = req.attrs.scaling_mode;
  if (!fp8 && (lhs_scale_req != nullptr || rhs_scale_req != nullptr)) {
    return Invalid("lhs_scale_inv/rhs_scale_inv: given, but lhs and rhs are not FP8");
  }
  // FP8 scales are optional (a caller may keep them out of band), but come
  // as a pair.
  if ((lhs_scale_req == nullptr) != (rhs_scale_req == nullptr)) {
    return Invalid(absl::StrCat(lhs_scale_req == nullptr ? "lhs_scale_inv" : "rhs_scale_inv",
                                ": FP8 scale operands come in pairs (lhs_scale_inv and "
                                "rhs_scale_inv)"));
  }
  if (fp8 && lhs_scale_req != nullptr) {
    if (!IsBlockScaling(mode)) {
      if (!(s = CheckScaleOperand(lhs_scale_req, "lhs_scale_inv", gs_req->shape, DType::kF32,
                                  "tensor scaling: one f32 per group, laid out like group_sizes")).ok()) {
        return s;
      }
      if (!(s = CheckScaleOperand(rhs_scale_req, "rhs_scale_inv", {G}, DType::kF32,
                                  "tensor scaling: one f32 per expert")).ok()) {
        return s;
      }
    } else {
      const int64_t b = BlockOf(mode);
      const int64_t bn = mode == ScalingMode::kBlock ? 128 : 1;  // 128x128 weight blocks
      if (K % b != 0 || N % bn != 0) {
        return Invalid(absl::StrCat("lhs dim 1: ", ScalingModeName(mode), " needs K (", K,
                                    ") a multiple of ", b,
                                    bn > 1 ? absl::StrCat(" and N (", N, ") of ", bn) : ""));
      }
      const DType sdt = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
      const std::string n_text = bn > 1 ? "N/128" : "N";
      const std::string k_text = absl::StrCat("K/", b);
      const std::string what = absl::StrCat(
          ScalingModeName(mode), ": lhs [M, ", k_text, "], rhs ",
          tr ? absl::StrCat("[G, ", n_text, ", ", k_text, "]")
             : absl::StrCat("[G, ", k_text, ", ", n_text, "]"));
      if (!(s = CheckScaleOperand(lhs_scale_req, "lhs_scale_inv", {M, K / b}, sdt, what)).ok()) return s;
      std::vector<int64_t> rs = tr ? std::vector<int64_t>{G, N / bn, K / b}
                                   : std::vector<int64_t>{G, K / b, N / bn};
      if (!(s = CheckScaleOperand(rhs_scale_req, "rhs_scale_inv", rs, sdt, what)).ok()) return s;
    }
  }
  std::vector<Operand> ops;
  for (const OperandRequest* r : found) {
    if (r == nullptr) continue;
    absl::StatusOr<Operand> op = MakeOperand(mesh, *r);
    if (!op.ok()) return op.status();
    ops.push_back(std::move(*op));
  }
  const Operand& lhs = ops[0];
  const Operand& rhs = ops[1];
  const Operand& gs = ops[2];
  const int bias_i = FindOperand(ops, "bias");
  const int ls_i = FindOperand(ops, "lhs_scale_inv");
  const int rs_i = FindOperand(ops, "rhs_scale_inv");
  const bool has_bias = bias_i >= 0;

  std::vector<Drop> drops;
  absl::StatusOr<Axes> rows = KeepTeAxes(ctx, lhs, 0, /*is_rows=*/true, &drops);
  if (!rows.ok()) return rows.status();
  if (!(s = CheckGroupSizesLikeRows(gs, *rows, "lhs")).ok()) return s;
  if (ls_i >= 0 && !(s = CheckRowsLike(ops[ls_i], *rows)).ok()) return s;
  Common common;
  common.row_axes = *rows;
  common.expert_axes = ExpertAxes(mesh, *rows);
  const int64_t E = AxesProduct(mesh, common.expert_axes);
  if (G % E != 0) {
    return Invalid(absl::StrCat("rhs dim 0: ", G, " groups not divisible by ", E,
                                ", the size of ep axis '", mesh.roles.ep,
                                "' that splits the lhs rows and group_sizes"));
  }
  common.num_groups = G;
  common.local_groups = G / E;
  if (!(s = CheckGroupCount(mesh, gs, *rows, common.local_groups,
                            E > 1 ? "local experts (G / ep)" : "groups")).ok()) {
    return s;
  }
  common.rule = tr ? "m k, g n k, g" : "m k, g k n, g";
  if (has_bias) common.rule += ", g n";
  common.rule += " -> m n";

  absl::StatusOr<Axes> lk = KeepTeAxes(ctx, lhs, 1, false, &drops);
  if (!lk.ok()) return lk.status();
  absl::StatusOr<Axes> rk = KeepTeAxes(ctx, rhs, kdim, false, &drops);
  if (!rk.ok()) return rk.status();
  absl::StatusOr<Axes> rn = KeepTeAxes(ctx, rhs, ndim, false, &drops);
  if (!rn.ok()) return rn.status();
  absl::StatusOr<Axes> rg = KeepTeAxes(ctx, rhs, 0, false, &drops);
  if (!rg.ok()) return rg.status();
  // Rule 3 (both modes' starting point; te mode exactly): the FSDP-sharded
  // weight is gathered on every dim. The default mode may instead keep
  // fsdp on rhs's K and reduce (see the K candidates below).
  const std::string& fsdp = mesh.roles.fsdp;
  Axes rk_te = *rk, rn_te = *rn;
  if (ctx.te && !fsdp.empty()) {
    rk_te = Without(rk_te, {fsdp});
    rn_te = Without(rn_te, {fsdp});
  }

  // K candidates: which axes split the contracting dim in the compute specs
  // (the local results are then partial sums over them).
  struct KChoice {
    Axes axes;
    std::string label;
  };
  std::vector<KChoice> kchoices;
  const Axes rk_free = Without(*rk, *rows);  // an axis on lhs rows cannot also split rhs K
  if (ctx.te) {
    const Axes rk_c = Without(rk_te, *rows);
    Axes common_k(lk->begin(), lk->begin() + CommonPrefix(*lk, rk_c));
    size_t n = 0;
    while (n < common_k.size() && (RoleOf(mesh, common_k[n]) == Role::kDp ||
                                   RoleOf(mesh, common_k[n]) == Role::kFsdp)) {
      ++n;
    }
    common_k.resize(n);
    kchoices.push_back({common_k, "te rules"});
  } else {
    Axes common_k(lk->begin(), lk->begin() + CommonPrefix(*lk, rk_free));
    kchoices.push_back({common_k, common_k.empty()
                                      ? "K unsplit in the local GEMM"
                                      : absl::StrCat("K split over ", FormatAxes(common_k),
                                                     " on both operands (reduce partial output)")});
    if (*lk != common_k) {
      kchoices.push_back({*lk, absl::StrCat("K split like lhs over ", FormatAxes(*lk),
                                            ": rhs re-split to match, partial output reduced")});
    }
    if (rk_free != common_k && rk_free != *lk) {
      kchoices.push_back({rk_free, absl::StrCat("K split like rhs over ", FormatAxes(rk_free),
                                                ": lhs re-split to match, partial output reduced")});
    }
    if (!common_k.empty()) {  // (when empty, the first choice already gathers)
      kchoices.push_back({{}, "gather K on both operands (no reduction)"});
    }
  }

  PartitionSpec requested;
  bool has_requested = req.out_spec.has_value();
  if (!(s = CheckOutSpec(req, mesh, "out", {M, N}, &requested)).ok()) return s;

  std::vector<Strategy> candidates;
  for (const KChoice& kc : kchoices) {
    for (int keep_n = 1; keep_n >= 0; --keep_n) {
      if (ctx.te && keep_n == 0) continue;
      Strategy st;
      st.label = ctx.te ? "" : kc.label;
      st.drops = drops;
      st.operands = ops;
      Operand& l = st.operands[0];
      Operand& r = st.operands[1];
      l.target.dims[0] = *rows;
      l.target.dims[1] = kc.axes;
      r.target.dims[0] = common.expert_axes;
      r.target.dims[kdim] = kc.axes;
      Axes n_axes = ctx.te ? rn_te : *rn;
      n_axes = Without(n_axes, *rows);
      n_axes = Without(n_axes, kc.axes);
      n_axes = Without(n_axes, common.expert_axes);
      if (!keep_n) {
        if (n_axes.empty()) continue;  // same as keep_n
        n_axes.clear();
        st.label += "; rhs N gathered (output not split on N)";
      } else if (!ctx.te && !n_axes.empty()) {
        st.label += absl::StrCat("; rhs N split over ", FormatAxes(n_axes),
                                 " (column-parallel: output split on N)");
      }
      r.target.dims[ndim] = n_axes;
      if (has_bias) {
        st.operands[bias_i].target.dims[0] = common.expert_axes;
        st.operands[bias_i].target.dims[1] = n_axes;
      }
      if (ls_i >= 0) {
        Operand& ls = st.operands[ls_i];
        Operand& rs = st.operands[rs_i];
        if (IsBlockScaling(mode)) {
          ls.target.dims = {*rows, kc.axes};
          rs.target.dims = {common.expert_axes, {}, {}};
          rs.target.dims[kdim] = kc.axes;
          rs.target.dims[ndim] = n_axes;
        } else {
          ls.target.dims = {*rows};
          rs.target.dims = {common.expert_axes};
        }
        for (int d = 0; d < static_cast<int>(ls.input.dims.size()); ++d) {
          AddDrops(ls, d, ls.target.dims[d], "scales follow lhs", &st.drops);
        }
        for (int d = 0; d < static_cast<int>(rs.input.dims.size()); ++d) {
          AddDrops(rs, d, rs.target.dims[d], "scales follow rhs", &st.drops);
        }
      }
      // Reasons for every axis dropped from an input.
      AddDrops(l, 1, kc.axes,
               ctx.te ? "not a dp/fsdp axis shared with rhs's contracting dim (rule 4)"
                      : "contracting dim gathered by the chosen strategy",
               &st.drops);
      for (const std::string& a : rhs.input.dims[kdim]) {
        if (!Contains(kc.axes, a)) {
          AddDrop(rhs, kdim, a,
                   a == fsdp ? "FSDP weight, rule 3"
                   : Contains(*rows, a) ? "also splits lhs rows"
                                        : "contracting dim not split like lhs",
                   &st.drops);
        }
      }
      for (const std::string& a : rhs.input.dims[ndim]) {
        if (Contains(n_axes, a)) continue;
        std::string why = a == fsdp ? "FSDP weight, rule 3"
                          : Contains(*rows, a)   ? "also splits lhs rows, which the output keeps"
                          : Contains(kc.axes, a) ? "also splits the contracting dim"
                          : Contains(common.expert_axes, a) ? "is the expert axis of rhs dim 0"
                                                            : "output kept unsplit on N";
        AddDrop(rhs, ndim, a, why, &st.drops);
      }
      for (const std::string& a : rhs.input.dims[0]) {
        if (Contains(common.expert_axes, a)) continue;
        AddDrop(rhs, 0, a,
                 a == fsdp ? "FSDP weight, rule 3"
                                     : "not an expert (ep) axis of the lhs rows: every row "
                                       "shard needs all of its groups' experts",
                 &st.drops);
      }
      if (has_bias) {
        const Operand& b = ops[bias_i];
        AddDrops(b, 0, common.expert_axes, "bias follows rhs's group dim", &st.drops);
        AddDrops(b, 1, n_axes, "bias follows rhs's N dim", &st.drops);
      }
      if (!common.expert_axes.empty()) {
        if (!Contains(rhs.input.dims[0], common.expert_axes[0])) {
          st.notes.push_back(absl::StrCat(
              "rule 2 (EP): group_sizes is split over ep '", common.expert_axes[0],
              "', so rhs dim 0 is split over it too (slice, no communication); each worker "
              "keeps its ", common.local_groups, " experts"));
        } else {
          st.notes.push_back(absl::StrCat("EP: each worker keeps its ", common.local_groups,
                                          " experts (rhs dim 0 over ", common.expert_axes[0], ")"));
        }
      }
      st.reduced = kc.axes;
      if (!kc.axes.empty()) {
        st.notes.push_back(absl::StrCat(
            "contracting dim K split over ", FormatAxes(kc.axes),
            " on both operands: local results are partial sums, reduced over ", Quoted(kc.axes)));
      }
      PlanOutput out;
      out.name = "out";
      out.dtype = out_dtype;
      out.global_shape = {M, N};
      out.local_op_spec.dims = {*rows, n_axes};
      out.spec = has_requested ? requested : out.local_op_spec;
      if (has_requested && ctx.te && !kc.axes.empty()) {
        for (const auto& dim : requested.dims) {
          for (const std::string& a : dim) {
            if (Contains(kc.axes, a)) {
              st.notes.push_back(absl::StrCat(
                  "te mode: requested out split over reduced axis '", a,
                  "' is served by all_reduce_sum then slice (the default mode reduce-scatters)"));
            }
          }
        }
      }
      st.outputs.push_back(std::move(out));
      candidates.push_back(std::move(st));
    }
  }
  return Choose(ctx, common, std::move(candidates));
}

// ---------------------------------------------------------------------------
// Grouped GEMM, ragged K (wgrad).

absl::StatusOr<Plan> PlanRaggedK(const Context& ctx) {
  const PlanRequest& req = ctx.req;
  const Mesh& mesh = ctx.mesh;
  std::vector<const OperandRequest*> found;
  absl::Status s = CollectOperands(req, {"lhs", "rhs", "group_sizes"},
                                   {"lhs_scale_inv", "rhs_scale_inv"}, &found);
  if (!s.ok()) return s;
  // The operands by name (CollectOperands' order).
  const OperandRequest* const lhs_req = found[0];
  const OperandRequest* const rhs_req = found[1];
  const OperandRequest* const gs_req = found[2];
  const OperandRequest* const lhs_scale_req = found[3];  // optional, FP8
  const OperandRequest* const rhs_scale_req = found[4];  // optional, FP8
  if (req.attrs.has_bias) return Invalid("attrs.has_bias: ragged-K (wgrad) GEMM takes no bias");
  if (req.attrs.rhs_transposed) {
    return Invalid("attrs.rhs_transposed: ragged-K (wgrad) rhs is [M, N]; transposition is not supported");
  }
  const std::initializer_list<DType> in_types = {DType::kF32, DType::kBF16, DType::kF16,
                                                 DType::kF8E4M3, DType::kF8E5M2};
  if (!(s = CheckShape("lhs", lhs_req->shape, 2, 2)).ok()) return s;
  if (!(s = CheckShape("rhs", rhs_req->shape, 2, 2)).ok()) return s;
  if (!(s = CheckShape("group_sizes", gs_req->shape, 1, 1)).ok()) return s;
  if (!(s = CheckDType("lhs", lhs_req->dtype, in_types)).ok()) return s;
  if (!(s = CheckDType("rhs", rhs_req->dtype, in_types)).ok()) return s;
  if (!(s = CheckDType("group_sizes", gs_req->dtype, {DType::kI32, DType::kI64})).ok()) return s;
  if (lhs_req->dtype == DType::kF8E5M2 && rhs_req->dtype == DType::kF8E5M2) {
    return Invalid("rhs: f8e5m2 x f8e5m2 GEMM is not supported (one side must be f8e4m3)");
  }
  if (IsFloat8(lhs_req->dtype) != IsFloat8(rhs_req->dtype)) {
    return Invalid("rhs: lhs and rhs must both be FP8 or both be 16/32-bit floats");
  }
  const DType out_dtype = GemmOutDType(req, lhs_req->dtype);
  if (!(s = CheckDType("attrs.out_dtype", out_dtype, {DType::kF32, DType::kBF16, DType::kF16})).ok()) return s;
  const int64_t M = lhs_req->shape[0], K = lhs_req->shape[1], N = rhs_req->shape[1];
  if (rhs_req->shape[0] != M) {
    return Invalid(absl::StrCat("rhs dim 0: M = ", rhs_req->shape[0], " does not match lhs M = ", M,
                                " (ragged K: both operands are grouped by rows)"));
  }
  const bool fp8 = IsFloat8(lhs_req->dtype);
  const ScalingMode mode = req.attrs.scaling_mode;
  if (!fp8 && (lhs_scale_req != nullptr || rhs_scale_req != nullptr)) {
    return Invalid("lhs_scale_inv/rhs_scale_inv: given, but lhs and rhs are not FP8");
  }
  if ((lhs_scale_req == nullptr) != (rhs_scale_req == nullptr)) {
    return Invalid(absl::StrCat(lhs_scale_req == nullptr ? "lhs_scale_inv" : "rhs_scale_inv",
                                ": FP8 scale operands come in pairs (lhs_scale_inv and "
                                "rhs_scale_inv)"));
  }
  if (fp8 && lhs_scale_req != nullptr) {
    if (!IsBlockScaling(mode)) {
      const char* what = "tensor scaling: one f32 per group, laid out like group_sizes";
      if (!(s = CheckScaleOperand(lhs_scale_req, "lhs_scale_inv", gs_req->shape, DType::kF32, what)).ok()) return s;
      if (!(s = CheckScaleOperand(rhs_scale_req, "rhs_scale_inv", gs_req->shape, DType::kF32, what)).ok()) return s;
    } else {
      // Wgrad contracts over the rows: blocks run along M.
      const int64_t b = BlockOf(mode);
      if (M % b != 0) {
        return Invalid(absl::StrCat("lhs dim 0: ", ScalingModeName(mode), " wgrad needs M (", M,
                                    ") a multiple of ", b));
      }
      const DType sdt = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
      const std::string what = absl::StrCat(ScalingModeName(mode), " wgrad: lhs [M/", b,
                                            ", K], rhs [M/", b, ", N]");
      if (!(s = CheckScaleOperand(lhs_scale_req, "lhs_scale_inv", {M / b, K}, sdt, what)).ok()) return s;
      if (!(s = CheckScaleOperand(rhs_scale_req, "rhs_scale_inv", {M / b, N}, sdt, what)).ok()) return s;
    }
  }
  std::vector<Operand> ops;
  for (const OperandRequest* r : found) {
    if (r == nullptr) continue;
    absl::StatusOr<Operand> op = MakeOperand(mesh, *r);
    if (!op.ok()) return op.status();
    ops.push_back(std::move(*op));
  }
  const Operand& lhs = ops[0];
  const Operand& rhs = ops[1];
  const Operand& gs = ops[2];
  const int ls_i = FindOperand(ops, "lhs_scale_inv");
  const int rs_i = FindOperand(ops, "rhs_scale_inv");
  std::vector<Drop> drops;
  absl::StatusOr<Axes> rows = KeepTeAxes(ctx, lhs, 0, true, &drops);
  if (!rows.ok()) return rows.status();
  if (ls_i >= 0) {
    if (!(s = CheckRowsLike(ops[ls_i], *rows)).ok()) return s;
    if (!(s = CheckRowsLike(ops[rs_i], *rows)).ok()) return s;
  }
  if (rhs.input.dims[0] != *rows) {
    return Invalid(absl::StrCat("rhs dim 0: rows split over ", FormatAxes(rhs.input.dims[0]),
                                " but lhs rows over ", FormatAxes(*rows),
                                "; ragged K needs both operands' rows split alike"));
  }
  if (!(s = CheckGroupSizesLikeRows(gs, *rows, "lhs")).ok()) return s;
  Common common;
  common.row_axes = *rows;
  common.expert_axes = ExpertAxes(mesh, *rows);
  const int64_t R = AxesProduct(mesh, *rows);
  common.local_groups = gs.shape[0] / R;  // exact: group_sizes is split over the row axes
  common.num_groups = common.local_groups * AxesProduct(mesh, common.expert_axes);
  common.rule = "m k, m n, g -> g k n";
  const Axes reduced = Without(*rows, common.expert_axes);

  absl::StatusOr<Axes> lk = KeepTeAxes(ctx, lhs, 1, false, &drops);
  if (!lk.ok()) return lk.status();
  absl::StatusOr<Axes> rn = KeepTeAxes(ctx, rhs, 1, false, &drops);
  if (!rn.ok()) return rn.status();

  PartitionSpec requested;
  const std::vector<int64_t> out_shape = {common.num_groups, K, N};
  if (!(s = CheckOutSpec(req, mesh, "out", out_shape, &requested)).ok()) return s;

  std::vector<Strategy> candidates;
  // A common axis on K and N (non-contracting on both) is never reduced:
  // the output cannot be split over it twice, so one side gathers it.
  for (int keep_k = 1; keep_k >= 0; --keep_k) {
    Axes k_axes = *lk, n_axes = *rn;
    bool conflict = false;
    for (const std::string& a : *lk) conflict |= Contains(*rn, a);
    if (keep_k) {
      n_axes = Without(n_axes, k_axes);
    } else {
      if (ctx.te || !conflict) continue;
      k_axes = Without(k_axes, n_axes);
    }
    Strategy st;
    st.drops = drops;
    st.operands = ops;
    st.operands[0].target.dims = {*rows, k_axes};
    st.operands[1].target.dims = {*rows, n_axes};
    if (ls_i >= 0) {
      Operand& ls = st.operands[ls_i];
      Operand& rs = st.operands[rs_i];
      if (IsBlockScaling(mode)) {
        ls.target.dims = {*rows, k_axes};
        rs.target.dims = {*rows, n_axes};
      } else {
        ls.target.dims = {*rows};
        rs.target.dims = {*rows};
      }
      for (int d = 0; d < static_cast<int>(ls.input.dims.size()); ++d) {
        AddDrops(ls, d, ls.target.dims[d], "scales follow lhs", &st.drops);
        AddDrops(rs, d, rs.target.dims[d], "scales follow rhs", &st.drops);
      }
    }
    AddDrops(lhs, 1, k_axes, "also splits rhs N; the output cannot be split over it twice",
             &st.drops);
    AddDrops(rhs, 1, n_axes, "also splits lhs K; the output cannot be split over it twice",
             &st.drops);
    if (conflict) {
      st.label = keep_k ? "common K/N axis kept on K" : "common K/N axis kept on N";
    }
    st.reduced = reduced;
    if (!reduced.empty()) {
      st.notes.push_back(absl::StrCat(
          "wgrad: rows (the contracting dim) split over ", FormatAxes(reduced),
          " on both operands: per-expert partial sums reduced over ", Quoted(reduced),
          ctx.te ? " (rule 4: psum)" : ""));
    }
    if (!common.expert_axes.empty()) {
      st.notes.push_back(absl::StrCat("EP: each worker's rows hold its ", common.local_groups,
                                      " experts; the output's group dim is split over '",
                                      common.expert_axes[0], "' (no EP injection: rhs is ragged)"));
    }
    PlanOutput out;
    out.name = "out";
    out.dtype = out_dtype;
    out.global_shape = out_shape;
    out.local_op_spec.dims = {common.expert_axes, k_axes, n_axes};
    out.spec = req.out_spec.has_value() ? requested : out.local_op_spec;
    if (req.out_spec.has_value() && !ctx.te) {
      for (const auto& dim : requested.dims) {
        for (const std::string& a : dim) {
          if (Contains(reduced, a)) {
            st.notes.push_back(absl::StrCat("wgrad partial sums reduce-scattered onto the "
                                            "requested split over '", a,
                                            "' (e.g. the weight's FSDP sharding)"));
          }
        }
      }
    }
    st.outputs.push_back(std::move(out));
    candidates.push_back(std::move(st));
  }
  return Choose(ctx, common, std::move(candidates));
}

// ---------------------------------------------------------------------------
// Grouped quantize.

absl::StatusOr<Plan> PlanQuantize(const Context& ctx) {
  const PlanRequest& req = ctx.req;
  const Mesh& mesh = ctx.mesh;
  const OpAttrs& attrs = req.attrs;
  std::vector<const OperandRequest*> found;
  absl::Status s = CollectOperands(req, {"x", "group_sizes"}, {}, &found);
  if (!s.ok()) return s;
  if (!(s = CheckShape("x", found[0]->shape, 2, 8)).ok()) return s;
  if (!(s = CheckShape("group_sizes", found[1]->shape, 1, 1)).ok()) return s;
  if (!(s = CheckDType("x", found[0]->dtype, {DType::kF32, DType::kBF16, DType::kF16})).ok()) return s;
  if (!(s = CheckDType("group_sizes", found[1]->dtype, {DType::kI32, DType::kI64})).ok()) return s;
  const DType out_dtype = attrs.out_dtype == DType::kInvalid ? DType::kF8E4M3 : attrs.out_dtype;
  if (!(s = CheckDType("attrs.out_dtype", out_dtype, {DType::kF8E4M3, DType::kF8E5M2})).ok()) return s;
  if (!attrs.rowwise && !attrs.colwise) {
    return Invalid("attrs: grouped quantize needs rowwise and/or colwise output");
  }
  if (attrs.has_bias || attrs.rhs_transposed) {
    return Invalid("attrs: has_bias / rhs_transposed do not apply to grouped quantize");
  }
  const bool block_scales =
      attrs.scaling_mode == ScalingMode::kMxfp8 || attrs.scaling_mode == ScalingMode::kBlock;
  if (attrs.shared_scales && block_scales) {
    return Invalid(absl::StrCat("attrs.shared_scales: ", ScalingModeName(attrs.scaling_mode),
                                " scales are per block, not per group; nothing to share"));
  }
  const int rank = static_cast<int>(found[0]->shape.size());
  absl::StatusOr<int> resolved_flatten = ResolveFlattenAxis(attrs.flatten_axis, rank);
  if (!resolved_flatten.ok()) return resolved_flatten.status();
  const int fa = *resolved_flatten;
  std::vector<Operand> ops;
  for (const OperandRequest* r : found) {
    absl::StatusOr<Operand> op = MakeOperand(mesh, *r);
    if (!op.ok()) return op.status();
    ops.push_back(std::move(*op));
  }
  const Operand& x = ops[0];
  const Operand& gs = ops[1];
  for (int d = 1; d < fa; ++d) {
    if (!x.input.dims[d].empty()) {
      return Invalid(absl::StrCat("x dim ", d, ": a row dim (before flatten_axis ", fa,
                                  ") split over ", FormatAxes(x.input.dims[d]),
                                  "; only dim 0 may split the rows (the row shards must be "
                                  "contiguous ragged arrays)"));
    }
  }
  std::vector<Drop> drops;
  absl::StatusOr<Axes> rows = KeepTeAxes(ctx, x, 0, true, &drops);
  if (!rows.ok()) return rows.status();
  if (!(s = CheckGroupSizesLikeRows(gs, *rows, "x")).ok()) return s;
  Common common;
  common.row_axes = *rows;
  common.expert_axes = ExpertAxes(mesh, *rows);
  const int64_t R = AxesProduct(mesh, *rows);
  common.local_groups = gs.shape[0] / R;
  common.num_groups = common.local_groups * AxesProduct(mesh, common.expert_axes);
  common.rule = "m k, g -> m k";

  int64_t mflat = 1, kflat = 1;
  for (int d = 0; d < rank; ++d) (d < fa ? mflat : kflat) *= x.shape[d];
  const int64_t local_rows = mflat / R;
  const int64_t block = attrs.scaling_mode == ScalingMode::kMxfp8 ? 32 : 128;
  if (block_scales) {
    if (attrs.rowwise && kflat % block != 0) {
      return Invalid(absl::StrCat("x: ", ScalingModeName(attrs.scaling_mode),
                                  " rowwise scales need the column count (", kflat,
                                  ") to be a multiple of ", block));
    }
    // Colwise blocks run from each group's first row, so whether a shard's
    // blocks are the unsharded op's depends on the group sizes' values: the
    // coordinator checks them (kernels/quantize_assembly.h).
  }

  Strategy st;
  st.drops = drops;
  st.operands = ops;
  st.operands[0].target.dims.assign(rank, Axes{});
  st.operands[0].target.dims[0] = *rows;
  for (int d = fa; d < rank; ++d) {
    AddDrops(x, d, {}, absl::StrCat("dims after flatten_axis ", fa, " are unsharded"), &st.drops);
  }
  PartitionSpec data_spec = st.operands[0].target;
  auto add_output = [&](const std::string& name, DType dtype, std::vector<int64_t> shape,
                        PartitionSpec spec) {
    PlanOutput o;
    o.name = name;
    o.dtype = dtype;
    o.global_shape = std::move(shape);
    o.local_op_spec = spec;
    o.spec = spec;
    st.outputs.push_back(std::move(o));
  };
  PartitionSpec requested;
  if (!(s = CheckOutSpec(req, mesh, attrs.rowwise ? "data" : "colwise_data", x.shape, &requested)).ok()) {
    return s;
  }
  if (attrs.rowwise) add_output("data", out_dtype, x.shape, data_spec);
  if (attrs.colwise) add_output("colwise_data", out_dtype, x.shape, data_spec);
  if (req.out_spec.has_value()) st.outputs[0].spec = requested;
  const PartitionSpec per_group{{*rows}};
  if (!block_scales) {
    add_output("scale_inv", DType::kF32, {gs.shape[0]}, per_group);
    add_output("amax", DType::kF32, {gs.shape[0]}, per_group);
    if (attrs.shared_scales) {
      st.within_max_axes = Without(*rows, common.expert_axes);
      st.notes.push_back(
          st.within_max_axes.empty()
              ? "shared scales: no axis splits a group's rows; nothing to reduce"
              : absl::StrCat("shared scales: per-group amax all_reduce_max over ",
                             Quoted(st.within_max_axes),
                             " (row axes that split a group's rows; not ep, whose workers hold "
                             "different experts)"));
    }
  } else {
    const DType sdt = attrs.scaling_mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
    const PartitionSpec rows_spec{{*rows, {}}};
    if (attrs.rowwise) add_output("scale_inv", sdt, {mflat, kflat / block}, rows_spec);
    // Unpadded, as if each row shard were one group (colwise: a partial last block).
    if (attrs.colwise) add_output("colwise_scale_inv", sdt, {R * CeilDiv(local_rows, block), kflat}, rows_spec);
    st.notes.push_back(absl::StrCat(
        ScalingModeName(attrs.scaling_mode), ": ", block, "-element blocks from each group's "
        "first row; the service returns the unsharded quantize's padded per-group scales, "
        "which needs each shard's rows of a group to start at a block boundary of the group "
        "when blocks run along rows (checked on the group sizes)"));
  }
  st.notes.push_back("outputs (data, scale_inv, amax) follow the rows");
  return Choose(ctx, common, {std::move(st)});
}

}  // namespace

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
