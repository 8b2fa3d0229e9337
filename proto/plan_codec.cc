#include "proto/plan_codec.h"

#include "absl/strings/str_cat.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

v1::Mesh MeshToProto(const planner::Mesh& mesh) {
  v1::Mesh out;
  for (const auto& axis : mesh.axes) {
    v1::MeshAxis* a = out.add_axes();
    a->set_name(axis.name);
    a->set_size(axis.size);
  }
  out.mutable_roles()->set_dp(mesh.roles.dp);
  out.mutable_roles()->set_fsdp(mesh.roles.fsdp);
  out.mutable_roles()->set_ep(mesh.roles.ep);
  out.mutable_roles()->set_tp(mesh.roles.tp);
  return out;
}

absl::StatusOr<planner::Mesh> MeshFromProto(const v1::Mesh& mesh) {
  planner::Mesh out;
  for (const auto& axis : mesh.axes()) out.axes.push_back({axis.name(), axis.size()});
  out.roles = {mesh.roles().dp(), mesh.roles().fsdp(), mesh.roles().ep(), mesh.roles().tp()};
  if (auto s = planner::ValidateMesh(out); !s.ok()) return s;
  return out;
}

absl::StatusOr<TensorMeta> InlineTensorMeta(const v1::Tensor& tensor, const std::string& field) {
  auto dtype = DTypeFromProto(tensor.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  TensorMeta meta;
  meta.dtype = *dtype;
  meta.shape.assign(tensor.shape().begin(), tensor.shape().end());
  meta.spec = tensor.spec();
  auto n = CheckedNumElements(meta.shape, DTypeSize(meta.dtype), field);
  if (!n.ok()) return n.status();
  const int64_t expected = *n * DTypeSize(meta.dtype);
  if (static_cast<int64_t>(tensor.data().size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data has ", tensor.data().size(),
                                                   " bytes but shape ", ShapeToString(meta.shape),
                                                   " of ", DTypeName(meta.dtype), " needs ",
                                                   expected));
  }
  return meta;
}

bool IsGiven(const v1::Tensor& tensor) {
  return tensor.dtype() != v1::DTYPE_UNSPECIFIED || tensor.source_case() != v1::Tensor::SOURCE_NOT_SET;
}

bool HasBias(const v1::GroupedGemmRequest& request) { return request.has_bias() && IsGiven(request.bias()); }

namespace {

absl::StatusOr<planner::OperandRequest> Operand(const v1::Tensor& t, const std::string& name,
                                                const TensorResolver& resolve) {
  auto meta = resolve(t, name);
  if (!meta.ok()) return meta.status();
  auto spec = planner::ParsePartitionSpec(meta->spec);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".spec: ", spec.status().message()));
  }
  planner::OperandRequest op;
  op.name = name;
  op.shape = meta->shape;
  op.dtype = meta->dtype;
  op.spec = *spec;
  return op;
}

planner::CompatMode Compat(v1::Compat c) {
  return c == v1::COMPAT_TE ? planner::CompatMode::kTe : planner::CompatMode::kDefault;
}

absl::Status SetOutSpec(const std::string& text, planner::PlanRequest* request) {
  if (text.empty()) return absl::OkStatus();
  auto spec = planner::ParsePartitionSpec(text);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("out_spec: ", spec.status().message()));
  }
  request->out_spec = *spec;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGemmEnums(const v1::GroupedGemmRequest& request) {
  if (!v1::GroupedGemmRequest::Ragged_IsValid(request.ragged())) {
    return absl::InvalidArgumentError(absl::StrCat("ragged: ", request.ragged(),
                                                   " is not a Ragged value (RAGGED_M = 0, RAGGED_K = 1)"));
  }
  if (!v1::GroupedGemmRequest::Layout_IsValid(request.layout())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: ", request.layout(), " is not a Layout value (PER_SHARD = 0, GLOBAL_SORTED = 1)"));
  }
  return ValidateCompat(request.compat());
}

absl::Status ValidateCompat(v1::Compat compat) {
  if (!v1::Compat_IsValid(compat)) {
    return absl::InvalidArgumentError(
        absl::StrCat("compat: ", compat, " is not a Compat value (COMPAT_DEFAULT = 0, COMPAT_TE = 1)"));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<planner::ScalingMode> PlannerScalingMode(v1::ScalingMode scaling) {
  switch (scaling) {
    case v1::SCALING_UNSPECIFIED:
    case v1::CURRENT: return planner::ScalingMode::kCurrent;
    case v1::DELAYED: return planner::ScalingMode::kDelayed;
    case v1::MXFP8: return planner::ScalingMode::kMxfp8;
    case v1::BLOCK_FP8: return planner::ScalingMode::kBlock;
    default:
      return absl::InvalidArgumentError(absl::StrCat("scaling: unknown mode ", static_cast<int>(scaling)));
  }
}

}  // namespace

absl::StatusOr<planner::PlanRequest> GemmPlanRequest(const v1::GroupedGemmRequest& request,
                                                     const planner::Mesh& mesh,
                                                     const TensorResolver& resolve) {
  if (auto s = ValidateGemmEnums(request); !s.ok()) return s;
  planner::PlanRequest out;
  out.mesh = mesh;
  out.op = request.ragged() == v1::GroupedGemmRequest::RAGGED_K
               ? planner::OpKind::kGroupedGemmRaggedK
               : planner::OpKind::kGroupedGemmRaggedM;
  out.compat = Compat(request.compat());
  out.attrs.rhs_transposed = request.rhs_transposed();
  out.attrs.has_bias = HasBias(request);
  const std::pair<const v1::Tensor*, const char*> operands[] = {
      {&request.lhs(), "lhs"}, {&request.rhs(), "rhs"}, {&request.group_sizes(), "group_sizes"}};
  for (const auto& [tensor, name] : operands) {
    auto op = Operand(*tensor, name, resolve);
    if (!op.ok()) return op.status();
    out.operands.push_back(std::move(*op));
  }
  if (out.attrs.has_bias) {
    auto op = Operand(request.bias(), "bias", resolve);
    if (!op.ok()) return op.status();
    out.operands.push_back(std::move(*op));
  }
  auto mode = PlannerScalingMode(request.scaling());
  if (!mode.ok()) return mode.status();
  out.attrs.scaling_mode = *mode;
  const bool quantize_lhs = request.has_quantize_lhs();
  if (quantize_lhs) {
    // Planned as the FP8 GEMM it runs: lhs in its FP8 dtype, with the
    // scales the workers' quantize makes (laid out as the GEMM takes them).
    planner::OperandRequest& lhs = out.operands[0];
    if (!IsGemmFloat(lhs.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize_lhs: lhs must be f32, bf16 or f16 to be quantized, got ", DTypeName(lhs.dtype)));
    }
    const v1::DType to = request.quantize_lhs().dtype() == v1::DTYPE_UNSPECIFIED ? v1::F8E4M3
                                                                                 : request.quantize_lhs().dtype();
    if (to != v1::F8E4M3 && to != v1::F8E5M2) {
      return absl::InvalidArgumentError("quantize_lhs.dtype must be F8E4M3 or F8E5M2");
    }
    if (*mode != planner::ScalingMode::kCurrent && *mode != planner::ScalingMode::kBlock) {
      return absl::InvalidArgumentError(
          "scaling: quantize_lhs computes CURRENT (per-group) or BLOCK_FP8 (1x128) scales; "
          "DELAYED and MXFP8 need lhs quantized by the client (GroupedQuantize)");
    }
    if (IsGiven(request.lhs_scale_inv())) {
      return absl::InvalidArgumentError("lhs_scale_inv: not sent with quantize_lhs (the workers make it)");
    }
    if (out.op == planner::OpKind::kGroupedGemmRaggedK) {
      return absl::InvalidArgumentError("quantize_lhs: the fused quantize + GEMM is ragged M (the forward)");
    }
    lhs.dtype = to == v1::F8E4M3 ? DType::kF8E4M3 : DType::kF8E5M2;
    planner::OperandRequest scale;
    scale.name = "lhs_scale_inv";
    scale.dtype = DType::kF32;
    if (*mode == planner::ScalingMode::kCurrent) {
      scale.shape = out.operands[2].shape;  // group_sizes
      scale.spec = out.operands[2].spec;
    } else {
      if (lhs.shape.size() != 2 || lhs.shape[1] % 128 != 0) {
        return absl::InvalidArgumentError(absl::StrCat("lhs dim 1: BLOCK_FP8 needs K a multiple of 128, got ",
                                                       lhs.shape.size() == 2 ? lhs.shape[1] : -1));
      }
      scale.shape = {lhs.shape[0], lhs.shape[1] / 128};
      scale.spec = lhs.spec;
    }
    out.operands.push_back(std::move(scale));
  } else if (IsGiven(request.lhs_scale_inv())) {
    auto op = Operand(request.lhs_scale_inv(), "lhs_scale_inv", resolve);
    if (!op.ok()) return op.status();
    out.operands.push_back(std::move(*op));
  }
  if (IsGiven(request.rhs_scale_inv())) {
    auto op = Operand(request.rhs_scale_inv(), "rhs_scale_inv", resolve);
    if (!op.ok()) return op.status();
    out.operands.push_back(std::move(*op));
  }
  if (request.out_dtype() != v1::DTYPE_UNSPECIFIED) {
    auto d = DTypeFromProto(request.out_dtype(), "out_dtype");
    if (!d.ok()) return d.status();
    if (!IsGemmFloat(*d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "out_dtype must be f32, bf16 or f16, got ", DTypeName(*d)));
    }
    out.attrs.out_dtype = *d;
  } else {
    DType lhs = out.operands[0].dtype;
    out.attrs.out_dtype = IsGemmFloat(lhs) ? lhs : DType::kBF16;
  }
  if (auto s = SetOutSpec(request.out_spec(), &out); !s.ok()) return s;
  return out;
}

absl::StatusOr<planner::PlanRequest> QuantizePlanRequest(const v1::GroupedQuantizeRequest& request,
                                                         const planner::Mesh& mesh,
                                                         const TensorResolver& resolve) {
  if (auto s = ValidateCompat(request.compat()); !s.ok()) return s;
  planner::PlanRequest out;
  out.mesh = mesh;
  out.op = planner::OpKind::kGroupedQuantize;
  out.compat = Compat(request.compat());
  for (const auto& [tensor, name] : {std::make_pair(&request.x(), "x"),
                                     std::make_pair(&request.group_sizes(), "group_sizes")}) {
    auto op = Operand(*tensor, name, resolve);
    if (!op.ok()) return op.status();
    out.operands.push_back(std::move(*op));
  }
  switch (request.scaling()) {
    case v1::SCALING_UNSPECIFIED:
    case v1::CURRENT: out.attrs.scaling_mode = planner::ScalingMode::kCurrent; break;
    case v1::DELAYED: out.attrs.scaling_mode = planner::ScalingMode::kDelayed; break;
    case v1::MXFP8: out.attrs.scaling_mode = planner::ScalingMode::kMxfp8; break;
    case v1::BLOCK_FP8: out.attrs.scaling_mode = planner::ScalingMode::kBlock; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("scaling: unknown mode ", static_cast<int>(request.scaling())));
  }
  if (request.block_2d() && request.scaling() != v1::BLOCK_FP8) {
    return absl::InvalidArgumentError(
        "block_2d: 128x128 blocks are a BLOCK_FP8 layout; set scaling BLOCK_FP8 or clear block_2d");
  }
  out.attrs.rowwise = request.rowwise() || !request.colwise();
  out.attrs.colwise = request.colwise();
  out.attrs.shared_scales = request.shared_scales();
  // 0 (unset) is the default: the last dim is the only column dim.
  out.attrs.flatten_axis = request.flatten_axis() != 0 ? request.flatten_axis() : -1;
  auto d = request.out_dtype() == v1::DTYPE_UNSPECIFIED ? absl::StatusOr<DType>(DType::kF8E4M3)
                                                        : DTypeFromProto(request.out_dtype(), "out_dtype");
  if (!d.ok()) return d.status();
  out.attrs.out_dtype = *d;
  return out;
}

namespace {

void OperandToProto(const planner::PlanOperand& op, v1::OperandPlan* out) {
  out->set_name(op.name);
  out->mutable_global_shape()->Assign(op.global_shape.begin(), op.global_shape.end());
  out->set_input_spec(planner::FormatPartitionSpec(op.input_spec));
  out->set_compute_spec(planner::FormatPartitionSpec(op.compute_spec));
  out->mutable_local_shape()->Assign(op.local_shape.begin(), op.local_shape.end());
}

}  // namespace

namespace {

constexpr std::pair<v1::TensorRole, absl::string_view> kTensorRoleNames[] = {
    {v1::TENSOR_LHS, "lhs"},
    {v1::TENSOR_RHS, "rhs"},
    {v1::TENSOR_BIAS, "bias"},
    {v1::TENSOR_GROUP_SIZES, "group_sizes"},
    {v1::TENSOR_X, "x"},
    {v1::TENSOR_OUT, "out"},
    {v1::TENSOR_ROWWISE_DATA, "data"},
    {v1::TENSOR_COLWISE_DATA, "colwise_data"},
    {v1::TENSOR_SCALE_INV, "scale_inv"},
    {v1::TENSOR_COLWISE_SCALE_INV, "colwise_scale_inv"},
    {v1::TENSOR_AMAX, "amax"},
    {v1::TENSOR_LHS_SCALE_INV, "lhs_scale_inv"},
    {v1::TENSOR_RHS_SCALE_INV, "rhs_scale_inv"},
};

v1::CollectivePhase PhaseToProto(planner::Phase phase) {
  switch (phase) {
    case planner::Phase::kBefore: return v1::PHASE_BEFORE;
    case planner::Phase::kWithin: return v1::PHASE_WITHIN;
    case planner::Phase::kAfter: return v1::PHASE_AFTER;
  }
  return v1::PHASE_UNSPECIFIED;
}

v1::CollectiveKind KindToProto(planner::CollectiveKind kind) {
  switch (kind) {
    case planner::CollectiveKind::kAllGather: return v1::COLLECTIVE_ALL_GATHER;
    case planner::CollectiveKind::kAllReduceSum: return v1::COLLECTIVE_ALL_REDUCE_SUM;
    case planner::CollectiveKind::kAllReduceMax: return v1::COLLECTIVE_ALL_REDUCE_MAX;
    case planner::CollectiveKind::kReduceScatter: return v1::COLLECTIVE_REDUCE_SCATTER;
    case planner::CollectiveKind::kSlice: return v1::COLLECTIVE_SLICE;
  }
  return v1::COLLECTIVE_KIND_UNSPECIFIED;
}

}  // namespace

absl::StatusOr<ScalingMode> KernelScalingMode(v1::ScalingMode scaling, bool block_2d) {
  switch (scaling) {
    case v1::SCALING_UNSPECIFIED:
    case v1::CURRENT: return ScalingMode::kCurrent;
    case v1::DELAYED: return ScalingMode::kDelayed;
    case v1::MXFP8: return ScalingMode::kMxfp8;
    case v1::BLOCK_FP8: return block_2d ? ScalingMode::kBlock128x128 : ScalingMode::kBlock1x128;
    default:
      return absl::InvalidArgumentError(absl::StrCat("scaling: unknown mode ", static_cast<int>(scaling)));
  }
}

absl::StatusOr<GemmScalingModes> KernelGemmScalingModes(v1::ScalingMode scaling, bool ragged_k) {
  switch (scaling) {
    case v1::SCALING_UNSPECIFIED:
    case v1::CURRENT: return GemmScalingModes{ScalingMode::kCurrent, ScalingMode::kCurrent};
    case v1::DELAYED: return GemmScalingModes{ScalingMode::kDelayed, ScalingMode::kDelayed};
    case v1::MXFP8: return GemmScalingModes{ScalingMode::kMxfp8, ScalingMode::kMxfp8};
    case v1::BLOCK_FP8:
      // Ragged M: 1x128 activations, 128x128 weights. Ragged K (wgrad): both
      // operands are colwise activations and gradients, 128x1 along the rows.
      return GemmScalingModes{ScalingMode::kBlock1x128,
                              ragged_k ? ScalingMode::kBlock1x128 : ScalingMode::kBlock128x128};
    default:
      return absl::InvalidArgumentError(absl::StrCat("scaling: unknown mode ", static_cast<int>(scaling)));
  }
}

v1::TensorRole TensorRoleFromName(absl::string_view name) {
  for (const auto& [role, role_name] : kTensorRoleNames) {
    if (role_name == name) return role;
  }
  return v1::TENSOR_ROLE_UNSPECIFIED;
}

absl::string_view TensorRoleName(v1::TensorRole role) {
  for (const auto& [r, name] : kTensorRoleNames) {
    if (r == role) return name;
  }
  return "unspecified";
}

void CollectiveToProto(const planner::Collective& c, v1::CollectivePlan* out) {
  out->set_phase(PhaseToProto(c.phase));
  out->set_kind(KindToProto(c.kind));
  out->set_tensor(TensorRoleFromName(c.tensor));
  out->set_dim(c.dim);
  for (const auto& a : c.axes) out->add_axes(a);
  out->set_bytes_per_worker(c.bytes_per_worker);
}

void PlanToProto(const planner::Plan& plan, v1::Plan* out, bool with_text) {
  out->set_op(std::string(planner::OpKindName(plan.op)));
  out->set_rule(plan.rule);
  for (const auto& op : plan.operands) OperandToProto(op, out->add_operands());
  for (const auto& c : plan.collectives) CollectiveToProto(c, out->add_collectives());
  out->mutable_out_shape()->Assign(plan.out_shape.begin(), plan.out_shape.end());
  out->set_out_spec(planner::FormatPartitionSpec(plan.out_spec));
  out->mutable_local_out_shape()->Assign(plan.local_out_shape.begin(), plan.local_out_shape.end());
  for (const auto& w : plan.workers) {
    v1::WorkerPlan* wp = out->add_workers();
    wp->set_rank(static_cast<int32_t>(w.rank));
    wp->mutable_coords()->Assign(w.coords.begin(), w.coords.end());
    // Every worker's local shapes are the operands' local_shape (specs split
    // dimensions evenly), so they are not repeated per worker.
    wp->set_local_groups(w.local_group_count);
    wp->set_group_sizes_begin(w.group_sizes_begin);
    wp->set_group_sizes_end(w.group_sizes_end);
    wp->set_first_group(w.first_group);
    wp->set_flops(static_cast<double>(plan.flops_per_worker));
  }
  for (const auto& w : plan.warnings) out->add_warnings(w.text);
  out->set_strategy_note(plan.strategy_note);
  out->set_flops_per_worker(static_cast<double>(plan.flops_per_worker));
  if (with_text) out->set_text(planner::FormatPlanText(plan));
}

}  // namespace shardgemm
