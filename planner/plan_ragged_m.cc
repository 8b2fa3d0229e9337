// Grouped GEMM, ragged M (forward, dgrad): docs/sharding.md.
#include "planner/planner_internal.h"

namespace shardgemm {
namespace planner {
namespace internal {

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

}  // namespace internal
}  // namespace planner
}  // namespace shardgemm
