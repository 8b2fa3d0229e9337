// Grouped GEMM, ragged K (wgrad): docs/sharding.md.
#include "planner/planner_internal.h"

namespace shardgemm {
namespace planner {
namespace internal {

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

}  // namespace internal
}  // namespace planner
}  // namespace shardgemm
