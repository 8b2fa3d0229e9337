// Grouped quantize: docs/sharding.md and docs/quantization.md.
#include "planner/planner_internal.h"

namespace shardgemm {
namespace planner {
namespace internal {

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

}  // namespace internal
}  // namespace planner
}  // namespace shardgemm
