#include "worker/executor.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

Executor::Executor(Backend* backend, ShardStore* store, absl::Duration turn_timeout)
    : backend_(backend),
      store_(store),
      turn_timeout_(turn_timeout),
      collectives_(MakeLocalCollectives(position_)) {}

void Executor::Configure(const MeshPosition& position, std::unique_ptr<Collectives> collectives) {
  position_ = position;
  collectives_ = std::move(collectives);
}

absl::Status Executor::WaitForTurn(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  if (sequence < next_sequence_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", sequence,
                                                   " arrived after its turn (next is ",
                                                   next_sequence_, ")"));
  }
  auto my_turn = [this, sequence]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return next_sequence_ == sequence;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), turn_timeout_)) {
    return absl::DeadlineExceededError(absl::StrCat("step ", sequence, " waited ",
                                                    absl::FormatDuration(turn_timeout_),
                                                    " for step ", next_sequence_));
  }
  return absl::OkStatus();
}

void Executor::PassTurn() {
  absl::MutexLock lock(&mu_);
  ++next_sequence_;
}

absl::StatusOr<v1::StepResult> Executor::Execute(v1::Step step) {
  if (auto s = WaitForTurn(step.sequence()); !s.ok()) return s;
  absl::StatusOr<v1::StepResult> result;
  switch (step.op_case()) {
    case v1::Step::kGemm:
      result = RunGemm(*step.mutable_gemm());
      break;
    case v1::Step::kStore:
      result = RunStore(*step.mutable_store());
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
};

absl::StatusOr<Input> ResolveInput(v1::LocalTensor&& t, const ShardStore& store,
                                   absl::string_view field) {
  Input in;
  if (t.source_case() == v1::LocalTensor::kResident) {
    auto shard = store.Get(t.resident());
    if (!shard.ok()) return shard.status();
    in.tensor = *shard;
    return in;
  }
  auto decoded = HostTensorFromProto(std::move(t), field);
  if (!decoded.ok()) return decoded.status();
  in.tensor = std::make_shared<const HostTensor>(std::move(*decoded));
  return in;
}

// Holds a memory reservation for the life of a step.
class Reservation {
 public:
  Reservation(ShardStore* store, int64_t bytes) : store_(store), bytes_(bytes) {}
  ~Reservation() { store_->Release(bytes_); }

 private:
  ShardStore* store_;
  int64_t bytes_;
};

}  // namespace

absl::StatusOr<v1::StepResult> Executor::RunGemm(v1::GemmStep& gemm) {
  const absl::Time start = absl::Now();
  auto lhs = ResolveInput(std::move(*gemm.mutable_lhs()), *store_, "lhs");
  if (!lhs.ok()) return lhs.status();
  auto rhs = ResolveInput(std::move(*gemm.mutable_rhs()), *store_, "rhs");
  if (!rhs.ok()) return rhs.status();
  Input bias;
  if (gemm.has_bias()) {
    auto b = ResolveInput(std::move(*gemm.mutable_bias()), *store_, "bias");
    if (!b.ok()) return b.status();
    bias = *b;
  }
  const bool ragged_k = gemm.ragged() == v1::GroupedGemmRequest::RAGGED_K;

  // Before-collectives bring each operand to the layout the local op needs.
  std::shared_ptr<const HostTensor>* operands[] = {&lhs->tensor, &rhs->tensor, &bias.tensor};
  const char* names[] = {"lhs", "rhs", "bias"};
  int64_t working_bytes = lhs->tensor->NumBytes() + rhs->tensor->NumBytes();
  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != "before") continue;
    std::shared_ptr<const HostTensor>* target = nullptr;
    for (int i = 0; i < 3; ++i) {
      if (c.tensor() == names[i]) target = operands[i];
    }
    if (target == nullptr || *target == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan collective names unknown tensor '", c.tensor(), "'"));
    }
    std::vector<std::string> axes(c.axes().begin(), c.axes().end());
    absl::StatusOr<HostTensor> next;
    if (c.kind() == "all_gather") {
      next = collectives_->AllGather(**target, c.dim(), axes);
    } else if (c.kind() == "slice") {
      auto count = position_.GroupSize(axes);
      auto index = position_.GroupIndex(axes);
      if (!count.ok()) return count.status();
      if (!index.ok()) return index.status();
      next = TakePiece(**target, c.dim(), *index, *count, c.tensor());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("collective '", c.kind(), "' cannot run before the local op"));
    }
    if (!next.ok()) return next.status();
    working_bytes += next->NumBytes();
    *target = std::make_shared<const HostTensor>(std::move(*next));
  }

  const HostTensor& l = *lhs->tensor;
  const HostTensor& r = *rhs->tensor;
  std::vector<int64_t> group_sizes(gemm.group_sizes().begin(), gemm.group_sizes().end());
  if (l.shape.size() != 2) return absl::InvalidArgumentError("local lhs must be rank 2");
  const int64_t g = static_cast<int64_t>(group_sizes.size());
  int64_t out_elems;
  if (ragged_k) {
    if (r.shape.size() != 2) return absl::InvalidArgumentError("local rhs must be rank 2");
    out_elems = g * l.shape[1] * r.shape[1];
  } else {
    if (r.shape.size() != 3) return absl::InvalidArgumentError("local rhs must be rank 3");
    if (r.shape[0] != g) {
      return absl::InvalidArgumentError(absl::StrCat("local rhs has ", r.shape[0],
                                                     " groups but group_sizes has ", g));
    }
    out_elems = l.shape[0] * (gemm.rhs_transposed() ? r.shape[1] : r.shape[2]);
  }
  auto out_dtype = DTypeFromProto(gemm.out_dtype(), "out_dtype");
  if (!out_dtype.ok()) return out_dtype.status();
  working_bytes += out_elems * DTypeSize(*out_dtype);
  if (auto s = store_->Reserve(working_bytes); !s.ok()) return s;
  Reservation reservation(store_, working_bytes);

  LocalGemm local;
  local.ragged_k = ragged_k;
  local.lhs = &l;
  local.rhs = &r;
  local.bias = bias.tensor.get();
  local.group_sizes = std::move(group_sizes);
  local.rhs_transposed = gemm.rhs_transposed();
  local.out_dtype = *out_dtype;
  auto out = backend_->GroupedGemm(local);
  if (!out.ok()) return out.status();

  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != "after") continue;
    if (c.tensor() != "out") {
      return absl::InvalidArgumentError(
          absl::StrCat("after-collective names '", c.tensor(), "', expected 'out'"));
    }
    std::vector<std::string> axes(c.axes().begin(), c.axes().end());
    if (c.kind() == "all_reduce_sum") {
      if (auto s = collectives_->AllReduce(&*out, ReduceOp::kSum, axes); !s.ok()) return s;
    } else if (c.kind() == "all_reduce_max") {
      if (auto s = collectives_->AllReduce(&*out, ReduceOp::kMax, axes); !s.ok()) return s;
    } else if (c.kind() == "reduce_scatter") {
      auto next = collectives_->ReduceScatter(*out, c.dim(), axes);
      if (!next.ok()) return next.status();
      *out = std::move(*next);
    } else if (c.kind() == "slice") {
      auto count = position_.GroupSize(axes);
      auto index = position_.GroupIndex(axes);
      if (!count.ok()) return count.status();
      if (!index.ok()) return index.status();
      auto next = TakePiece(*out, c.dim(), *index, *count, "out");
      if (!next.ok()) return next.status();
      *out = std::move(*next);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("collective '", c.kind(), "' cannot run after the local op"));
    }
  }

  v1::StepResult result;
  if (!gemm.keep_output_as().empty()) {
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(out->dtype));
    info->mutable_shape()->Assign(out->shape.begin(), out->shape.end());
    info->set_resident(gemm.keep_output_as());
    if (auto s = store_->Put(gemm.keep_output_as(), std::move(*out)); !s.ok()) return s;
  } else {
    HostTensorToProto(std::move(*out), result.mutable_out());
  }
  result.set_compute_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return result;
}

}  // namespace shardgemm
