#include "worker/executor.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/fp8.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

Executor::Executor(Backend* backend, ShardStore* store)
    : backend_(backend), store_(store), collectives_(MakeLocalCollectives(position_)) {}

void Executor::Configure(const MeshPosition& position, std::unique_ptr<Collectives> collectives,
                         uint64_t next_sequence) {
  absl::MutexLock lock(&mu_);
  position_ = position;
  collectives_ = std::move(collectives);
  next_sequence_ = std::max<uint64_t>(next_sequence, 1);
  configured_ = true;
}

absl::Status Executor::WaitForTurn(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  if (sequence < next_sequence_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", sequence,
                                                   " arrived after its turn (next is ",
                                                   next_sequence_, ")"));
  }
  auto configured = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return configured_; };
  mu_.Await(absl::Condition(&configured));
  if (sequence < next_sequence_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", sequence,
                                                   " arrived after its turn (next is ",
                                                   next_sequence_, ")"));
  }
  auto my_turn = [this, sequence]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return next_sequence_ == sequence;
  };
  mu_.Await(absl::Condition(&my_turn));
  return absl::OkStatus();
}

void Executor::PassTurn() {
  absl::MutexLock lock(&mu_);
  ++next_sequence_;
}

absl::StatusOr<v1::StepResult> Executor::Execute(v1::Step step) {
  if (auto s = WaitForTurn(step.sequence()); !s.ok()) return s;
  collectives_->BeginStep(step.sequence());
  absl::StatusOr<v1::StepResult> result;
  switch (step.op_case()) {
    case v1::Step::kGemm:
      result = RunGemm(*step.mutable_gemm());
      break;
    case v1::Step::kStore:
      result = RunStore(*step.mutable_store());
      break;
    case v1::Step::kQuantize:
      result = RunQuantize(*step.mutable_quantize());
      break;
    case v1::Step::kDeleteShard: {
      absl::Status s = store_->Delete(step.delete_shard().name());
      if (s.ok()) result = v1::StepResult();
      else result = s;
      break;
    }
    default:
      result = absl::UnimplementedError("this worker does not run that kind of step");
  }
  PassTurn();
  return result;
}

absl::StatusOr<v1::StepResult> Executor::RunStore(v1::StoreShardStep& store) {
  auto shard = HostTensorFromProto(std::move(*store.mutable_shard()), "shard");
  if (!shard.ok()) return shard.status();
  if (auto s = store_->Put(store.name(), std::move(*shard)); !s.ok()) return s;
  return v1::StepResult();
}

namespace {

// A step's input: inline data decoded into `owned`, or a resident shard.
struct Input {
  std::shared_ptr<const HostTensor> tensor;
  bool resident = false;  // a shard from the store, already counted in its budget
};

absl::StatusOr<Input> ResolveInput(v1::LocalTensor&& t, const ShardStore& store,
                                   absl::string_view field) {
  Input in;
  if (t.source_case() == v1::LocalTensor::kResident) {
    auto shard = store.Get(t.resident());
    if (!shard.ok()) return shard.status();
    in.tensor = *shard;
    in.resident = true;
    return in;
  }
  auto decoded = HostTensorFromProto(std::move(t), field);
  if (!decoded.ok()) return decoded.status();
  in.tensor = std::make_shared<const HostTensor>(std::move(*decoded));
  return in;
}

bool IsReduction(const v1::CollectivePlan& c) {
  return c.kind() == "all_reduce_sum" || c.kind() == "reduce_scatter";
}

}  // namespace

absl::StatusOr<HostTensor> Executor::ApplyCollective(const v1::CollectivePlan& c,
                                                     const HostTensor& t) {
  std::vector<std::string> axes(c.axes().begin(), c.axes().end());
  if (c.kind() == "all_gather") return collectives_->AllGather(t, c.dim(), axes);
  if (c.kind() == "reduce_scatter") return collectives_->ReduceScatter(t, c.dim(), axes);
  if (c.kind() == "all_reduce_sum" || c.kind() == "all_reduce_max") {
    HostTensor out = t;
    auto op = c.kind() == "all_reduce_sum" ? ReduceOp::kSum : ReduceOp::kMax;
    if (auto s = collectives_->AllReduce(&out, op, axes); !s.ok()) return s;
    return out;
  }
  if (c.kind() == "slice") {
    auto count = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!count.ok()) return count.status();
    if (!index.ok()) return index.status();
    return TakePiece(t, c.dim(), *index, *count, c.tensor());
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown collective kind '", c.kind(), "'"));
}

absl::StatusOr<v1::StepResult> Executor::RunGemm(v1::GemmStep& gemm) {
  const absl::Time start = absl::Now();
  // Stage 1, local: inputs, shapes, memory. Its status is agreed on by the
  // whole mesh before any collective runs.
  Input lhs, rhs, bias;
  auto out_dtype = DTypeFromProto(gemm.out_dtype(), "out_dtype");
  absl::Status prepared = out_dtype.status();
  const char* names[] = {"lhs", "rhs", "bias"};
  Input* inputs[] = {&lhs, &rhs, &bias};
  const bool has_bias = gemm.has_bias();  // before mutable_bias() creates one
  v1::LocalTensor* protos[] = {gemm.mutable_lhs(), gemm.mutable_rhs(), gemm.mutable_bias()};
  for (int i = 0; i < 3 && prepared.ok(); ++i) {
    if (i == 2 && !has_bias) break;
    auto in = ResolveInput(std::move(*protos[i]), *store_, names[i]);
    if (in.ok()) *inputs[i] = *in;
    else prepared = in.status();
  }
  // The FSDP weight gather (the one before-collective on rhs, an all-gather,
  // ragged M) goes to a backend that gathers on its device (NCCL into the
  // GEMM's operand): no host round trip. Every member decides alike (same
  // plan, shapes and kind of backend), so the collectives still match.
  const bool ragged_k = gemm.ragged() == v1::GroupedGemmRequest::RAGGED_K;
  const v1::CollectivePlan* device_gather = nullptr;
  std::vector<int64_t> gathered_rhs_shape;
  // Only where the device GEMM runs (BF16 or F16 operands of one dtype):
  // other dtypes fall back to the host kernels, which need the host gather.
  const bool device_gemm = prepared.ok() && lhs.tensor != nullptr && rhs.tensor != nullptr &&
                           lhs.tensor->dtype == rhs.tensor->dtype &&
                           (lhs.tensor->dtype == DType::kBF16 || lhs.tensor->dtype == DType::kF16);
  if (device_gemm && !ragged_k && backend_->CanGatherOnDevice() && collectives_->SupportsDeviceAllGather()) {
    const v1::CollectivePlan* candidate = nullptr;
    int on_rhs = 0;
    for (const auto& c : gemm.collectives()) {
      if (c.phase() != "before" || c.tensor() != "rhs") continue;
      ++on_rhs;
      if (c.kind() == "all_gather") candidate = &c;
    }
    const std::vector<int64_t>& shape = rhs.tensor->shape;
    if (on_rhs == 1 && candidate != nullptr && candidate->dim() >= 0 &&
        candidate->dim() < static_cast<int>(shape.size())) {
      auto n = position_.GroupSize(std::vector<std::string>(candidate->axes().begin(), candidate->axes().end()));
      if (n.ok()) {
        device_gather = candidate;
        gathered_rhs_shape = shape;
        gathered_rhs_shape[candidate->dim()] *= *n;
      }
    }
  }
  bool reduces = false;
  for (const auto& c : gemm.collectives()) reduces |= c.phase() == "after" && IsReduction(c);
  // Partial sums stay in FP32 until reduced: one rounding, at the end.
  const DType local_dtype = reduces ? DType::kF32 : out_dtype.value_or(DType::kF32);
  int64_t working_bytes = 0;
  if (prepared.ok()) {
    // Inline inputs (resident ones are already counted), gathered copies and
    // the output. A weight gathered on the device takes device memory, not
    // this worker's host budget.
    for (int i = 0; i < 3; ++i) {
      if (inputs[i]->tensor != nullptr && !inputs[i]->resident) working_bytes += inputs[i]->tensor->NumBytes();
    }
    const HostTensor& l = *lhs.tensor;
    const std::vector<int64_t>& rs = device_gather != nullptr ? gathered_rhs_shape : rhs.tensor->shape;
    if (l.shape.size() == 2 && (rs.size() == 2 || rs.size() == 3)) {
      const bool rk = ragged_k;
      const int64_t n = rk ? rs[1] : (gemm.rhs_transposed() ? rs[1] : rs.back());
      const int64_t out_elems = rk ? gemm.group_sizes_size() * l.shape[1] * n : l.shape[0] * n;
      working_bytes += out_elems * 4;
    }
    for (const auto& c : gemm.collectives()) {
      std::vector<std::string> axes(c.axes().begin(), c.axes().end());
      auto n = position_.GroupSize(axes);
      if (!n.ok()) { prepared = n.status(); break; }
      if (c.phase() == "before" && c.kind() == "all_gather" && &c != device_gather) {
        const Input* in = c.tensor() == "lhs" ? &lhs : c.tensor() == "rhs" ? &rhs : &bias;
        if (in->tensor != nullptr) working_bytes += in->tensor->NumBytes() * *n;
      }
    }
  }
  if (prepared.ok()) prepared = store_->Reserve(working_bytes);
  const bool reserved = prepared.ok();
  ShardStore::ScopedReservation reservation(store_, working_bytes, reserved);
  if (gemm.agree()) prepared = collectives_->Agree(prepared);
  if (!prepared.ok()) return prepared;

  // Stage 2: before-collectives bring each operand to its compute layout.
  absl::Status status;
  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != "before" || &c == device_gather) continue;  // that one runs in the backend
    Input* target = nullptr;
    for (int i = 0; i < 3; ++i) {
      if (c.tensor() == names[i]) target = inputs[i];
    }
    if (target == nullptr || target->tensor == nullptr) {
      status = absl::InvalidArgumentError(
          absl::StrCat("plan collective names unknown tensor '", c.tensor(), "'"));
      break;
    }
    auto next = ApplyCollective(c, *target->tensor);
    if (!next.ok()) { status = next.status(); break; }
    target->tensor = std::make_shared<const HostTensor>(std::move(*next));
    target->resident = false;
  }

  // Stage 3: the local op.
  absl::StatusOr<HostTensor> out = absl::UnknownError("not run");
  if (status.ok()) {
    const HostTensor& l = *lhs.tensor;
    const HostTensor& r = *rhs.tensor;
    // With the gather in the backend, r is this worker's shard and the
    // GEMM's weight has the gathered shape.
    const std::vector<int64_t>& rs = device_gather != nullptr ? gathered_rhs_shape : r.shape;
    const int64_t g = gemm.group_sizes_size();
    if (l.shape.size() != 2) {
      status = absl::InvalidArgumentError("local lhs must be rank 2");
    } else if (rs.size() != (ragged_k ? 2u : 3u)) {
      status = absl::InvalidArgumentError(absl::StrCat("local rhs must be rank ", ragged_k ? 2 : 3));
    } else if (!ragged_k && rs[0] != g) {
      status = absl::InvalidArgumentError(
          absl::StrCat("local rhs has ", rs[0], " groups but group_sizes has ", g));
    }
  }
  // The weight gather now runs inside the backend, after steps that can fail
  // on one worker only: agree on everything so far first (every worker, in
  // every case), and the backend agrees again on its own preparation right
  // before the gather, so a peer's failure never leaves a worker waiting in
  // the collective until the timeout.
  const bool agree_before_gather = device_gather != nullptr && gemm.agree();
  if (agree_before_gather) status = collectives_->Agree(status);
  if (status.ok()) {
    LocalGemm local;
    local.ragged_k = ragged_k;
    local.lhs = lhs.tensor.get();
    local.rhs = rhs.tensor.get();
    // A resident weight may stay on the device between requests.
    if (rhs.resident) local.resident_rhs = rhs.tensor;
    if (lhs.resident) local.resident_lhs = lhs.tensor;
    local.bias = gemm.apply_bias() ? bias.tensor.get() : nullptr;
    local.group_sizes.assign(gemm.group_sizes().begin(), gemm.group_sizes().end());
    local.rhs_transposed = gemm.rhs_transposed();
    local.out_dtype = local_dtype;
    if (device_gather != nullptr) {
      local.rhs_gather.enabled = true;
      local.rhs_gather.dim = device_gather->dim();
      local.rhs_gather.axes.assign(device_gather->axes().begin(), device_gather->axes().end());
      local.rhs_gather.collectives = collectives_.get();
      local.rhs_gather.gathered_shape = gathered_rhs_shape;
      local.rhs_gather.agree = agree_before_gather;
    }
    out = backend_->GroupedGemm(local);
    status = out.status();
  }
  bool has_after = false;
  for (const auto& c : gemm.collectives()) has_after |= c.phase() == "after";
  if (gemm.agree() && has_after) status = collectives_->Agree(status);
  if (!status.ok()) return status;

  // Stage 4: after-collectives give the output its spec.
  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != "after") continue;
    if (c.tensor() != "out") {
      return absl::InvalidArgumentError(
          absl::StrCat("after-collective names '", c.tensor(), "', expected 'out'"));
    }
    auto next = ApplyCollective(c, *out);
    if (!next.ok()) return next.status();
    *out = std::move(*next);
  }
  if (out->dtype != *out_dtype) {
    auto converted = ConvertFloatTensor(*out, *out_dtype);
    if (!converted.ok()) return converted.status();
    *out = std::move(*converted);
  }

  v1::StepResult result;
  if (!gemm.keep_output_as().empty()) {
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(out->dtype));
    info->mutable_shape()->Assign(out->shape.begin(), out->shape.end());
    info->set_resident(gemm.keep_output_as());
    // The output leaves the step's working memory for the store.
    reservation.Release();
    if (auto s = store_->Put(gemm.keep_output_as(), std::move(*out)); !s.ok()) return s;
  } else {
    HostTensorToProto(std::move(*out), result.mutable_out());
  }
  result.set_compute_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return result;
}

namespace {

// Delayed scaling is kCurrent with given scales (LocalQuantize::scales).
absl::StatusOr<ScalingMode> KernelScalingMode(v1::ScalingMode scaling, bool block_2d) {
  switch (scaling) {
    case v1::SCALING_UNSPECIFIED:
    case v1::CURRENT:
    case v1::DELAYED: return ScalingMode::kCurrent;
    case v1::MXFP8: return ScalingMode::kMxfp8;
    case v1::BLOCK_FP8: return block_2d ? ScalingMode::kBlock128x128 : ScalingMode::kBlock1x128;
    default:
      return absl::InvalidArgumentError(absl::StrCat("scaling: unknown mode ", static_cast<int>(scaling)));
  }
}

}  // namespace

absl::StatusOr<v1::StepResult> Executor::RunQuantize(v1::QuantizeStep& q) {
  const absl::Time start = absl::Now();
  auto out_dtype = DTypeFromProto(q.out_dtype(), "out_dtype");
  absl::Status prepared = out_dtype.status();
  Input x;
  if (prepared.ok()) {
    auto in = ResolveInput(std::move(*q.mutable_x()), *store_, "x");
    if (in.ok()) x = *in;
    else prepared = in.status();
  }
  int64_t working_bytes = 0;
  if (prepared.ok()) {
    working_bytes = x.tensor->NumElements() * (q.rowwise() + q.colwise()) + x.tensor->NumBytes();
    prepared = store_->Reserve(working_bytes);
  }
  ShardStore::ScopedReservation reservation(store_, working_bytes, prepared.ok());
  if (q.agree()) prepared = collectives_->Agree(prepared);
  if (!prepared.ok()) return prepared;

  absl::Status status;
  for (const v1::CollectivePlan& c : q.collectives()) {
    if (c.phase() != "before") continue;
    if (c.tensor() != "x") {
      status = absl::InvalidArgumentError(absl::StrCat("plan collective names '", c.tensor(), "'"));
      break;
    }
    auto next = ApplyCollective(c, *x.tensor);
    if (!next.ok()) { status = next.status(); break; }
    x.tensor = std::make_shared<const HostTensor>(std::move(*next));
  }
  // Rows are the dims before the flatten axis; the plan splits only dim 0.
  LocalQuantize local;
  local.x = x.tensor.get();
  const int flatten = std::max(1, q.flatten_axis());
  local.m = 1;
  local.k = 1;
  for (size_t d = 0; d < x.tensor->shape.size(); ++d) {
    (static_cast<int>(d) < flatten ? local.m : local.k) *= x.tensor->shape[d];
  }
  auto mode = KernelScalingMode(q.scaling(), q.block_2d());
  if (mode.ok()) local.mode = *mode;
  else status.Update(mode.status());
  local.group_sizes.assign(q.group_sizes().begin(), q.group_sizes().end());
  local.out_dtype = out_dtype.value_or(DType::kF8E4M3);
  local.rowwise = q.rowwise();
  local.colwise = q.colwise();
  std::vector<float> scales(q.scales().begin(), q.scales().end());
  if (q.scaling() == v1::DELAYED) local.scales = &scales;
  absl::StatusOr<QuantizeOutputs> out = absl::UnknownError("not run");
  if (status.ok()) {
    out = backend_->GroupedQuantize(local);
    status = out.status();
  }
  // Shared scales: the per-group amax is max-reduced over the shards that
  // split a group's rows, then the data is cast again with the shared scale.
  bool within = false;
  for (const auto& c : q.collectives()) within |= c.phase() == "within";
  if (q.agree() && within) status = collectives_->Agree(status);
  if (!status.ok()) return status;
  for (const v1::CollectivePlan& c : q.collectives()) {
    if (c.phase() != "within") continue;
    if (c.tensor() != "amax") {
      return absl::InvalidArgumentError(absl::StrCat("within-collective names '", c.tensor(), "'"));
    }
    auto reduced = ApplyCollective(c, out->amax);
    if (!reduced.ok()) return reduced.status();
    // Delayed scaling keeps its given scales: only the reported amax is shared.
    if (reduced->bytes == out->amax.bytes || local.scales != nullptr) {
      out->amax = std::move(*reduced);
      continue;
    }
    std::vector<float> shared(local.group_sizes.size());
    const float fp8_max = local.out_dtype == DType::kF8E5M2 ? kE5M2Max : kE4M3Max;
    for (size_t g = 0; g < shared.size(); ++g) {
      shared[g] = ScaleFromAmax(reduced->data<float>()[g], fp8_max);
    }
    LocalQuantize again = local;
    again.scales = &shared;
    auto recast = backend_->GroupedQuantize(again);
    if (!recast.ok()) return recast.status();
    recast->amax = std::move(*reduced);
    *out = std::move(*recast);
  }

  v1::StepResult result;
  auto add = [&](HostTensor&& t) { HostTensorToProto(std::move(t), result.add_extra()); };
  if (local.rowwise) {
    out->rowwise_data.shape = x.tensor->shape;
    add(std::move(out->rowwise_data));
  }
  if (local.colwise) {
    out->colwise_data.shape = x.tensor->shape;
    add(std::move(out->colwise_data));
  }
  if (local.block_scaled()) {
    if (local.rowwise) add(std::move(out->scale_inv));
    if (local.colwise) add(std::move(out->colwise_scale_inv));
  } else {
    add(std::move(out->scale_inv));
    add(std::move(out->amax));
  }
  result.set_compute_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return result;
}

}  // namespace shardgemm
