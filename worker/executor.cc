#include "worker/executor.h"

#include "logging/trace_marks.h"
#include "platform/shared_memory.h"

#include <algorithm>
#include <limits>
#include <cstring>
#include <numeric>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cpu/fp8_grouped_gemm.h"
#include "kernels/fp8.h"
#include "kernels/gemm_scale_layout.h"
#include "platform/shared_memory.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

bool Executor::IsSession(const std::string& session, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto configured = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return configured_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&configured), deadline)) return false;
  return session_.empty() || session == session_;
}

Executor::Executor(Backend* backend, ShardStore* store, StagingArea* staging)
    : backend_(backend), store_(store), staging_(staging) {
  collectives_ = std::make_shared<TimedCollectives>(MakeLocalCollectives(position_));
  timed_ = collectives_.get();
}

void Executor::Configure(const MeshPosition& position, std::unique_ptr<Collectives> collectives,
                         uint64_t next_sequence, std::string session) {
  absl::MutexLock lock(&mu_);
  // A step still running uses the collectives replaced here (a re-registration
  // with a restarted coordinator): let it end first; its collectives time out.
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !running_; };
  mu_.Await(absl::Condition(&idle));
  session_ = std::move(session);
  position_ = position;
  collectives_ = std::make_shared<TimedCollectives>(std::move(collectives));
  timed_ = collectives_.get();
  next_sequence_ = std::max<uint64_t>(next_sequence, 1);
  configured_ = true;
  ++configurations_;
}

void Executor::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

namespace {

// A step numbered before this worker's place in the global order: the worker
// (re)joined after the coordinator had numbered it, so the step's request
// started without it, or the coordinator gave up on it. The server's
// business, not the client's: retryable. The message names no sequence
// numbers (clients see it; the worker's step log line has them).
absl::Status StaleStep() {
  return absl::UnavailableError(
      "the step was numbered before this worker's place in the order (the worker rejoined the mesh while the "
      "request was in flight, or the coordinator gave up on the step); retry the request");
}

// A step that waits for its turn, or arrives, once the worker is stopping (Close).
absl::Status Closing() { return absl::UnavailableError("this worker is shutting down; retry the request"); }

}  // namespace

void Executor::AwaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !running_; };
  mu_.Await(absl::Condition(&idle));
}

absl::Status Executor::WaitForTurn(uint64_t sequence, uint64_t oldest_live, absl::Time deadline,
                                   const std::string& session, bool* would_wait) {
  // A step whose caller named no deadline (the coordinator always names one)
  // still gives up on a turn that never comes; once running it has no bound
  // but its collectives' timeouts.
  if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + kTurnWaitWithoutDeadline;
  steps_waiting_.fetch_add(1, std::memory_order_relaxed);
  struct Done {
    std::atomic<int64_t>* waiting;
    ~Done() { waiting->fetch_sub(1, std::memory_order_relaxed); }
  } done{&steps_waiting_};
  absl::MutexLock lock(&mu_);
  if (closed_) return Closing();
  if (sequence < next_sequence_) return StaleStep();
  auto configured = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return configured_ || closed_; };
  if (would_wait != nullptr && !configured_) {
    *would_wait = true;
    return absl::OkStatus();
  }
  if (!mu_.AwaitWithDeadline(absl::Condition(&configured), deadline)) {
    return absl::DeadlineExceededError("this worker has not joined the mesh yet");
  }
  if (closed_) return Closing();
  if (!session_.empty() && session != session_) {
    return absl::FailedPreconditionError("the step is not from this worker's coordinator session");
  }
  if (sequence > next_sequence_ && sequence - next_sequence_ > kSequenceWindow) {
    return absl::InvalidArgumentError("the step is numbered too far ahead of this worker's place in the order");
  }
  while (true) {
    if (!session_.empty() && session != session_) {  // the worker re-registered meanwhile
      return absl::FailedPreconditionError("the step is not from this worker's coordinator session");
    }
    if (sequence < next_sequence_) return StaleStep();  // gone on past it
    // Steps the coordinator has answered or given up on without this
    // worker (their calls were cancelled before they arrived) will not
    // come: with no step running, go on to the oldest one still live.
    if (!running_ && oldest_live > next_sequence_ && oldest_live <= sequence) next_sequence_ = oldest_live;
    if (next_sequence_ == sequence && !running_) break;
    if (would_wait != nullptr) {
      *would_wait = true;
      return absl::OkStatus();
    }
    const uint64_t seen_next = next_sequence_;
    const bool seen_running = running_;
    const uint64_t seen_configurations = configurations_;
    // A re-registration may leave next_sequence_ as it was: it is watched too.
    auto changed = [this, seen_next, seen_running, seen_configurations]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return next_sequence_ != seen_next || running_ != seen_running || configurations_ != seen_configurations ||
             closed_;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
      return absl::DeadlineExceededError("the step was still waiting for an earlier one at its deadline");
    }
    if (closed_) return Closing();
  }
  running_ = true;
  return absl::OkStatus();
}

void Executor::PassTurn() {
  absl::MutexLock lock(&mu_);
  running_ = false;
  ++next_sequence_;
  cancelled_.erase(cancelled_.begin(), cancelled_.lower_bound(next_sequence_));
}

absl::Status Executor::Cancel(const std::string& session, const std::vector<uint64_t>& sequences) {
  absl::MutexLock lock(&mu_);
  if (session.empty() || session != session_) {
    return absl::FailedPreconditionError("the cancel is not from this worker's coordinator session");
  }
  for (uint64_t s : sequences) {
    // A step running or done is past cancelling; one too far ahead is no step of this session's.
    if (s == next_sequence_ && running_) {  // past skipping: its backend stops between tiles
      running_step_cancelled_.store(true, std::memory_order_relaxed);
      continue;
    }
    if (s < next_sequence_ || s - next_sequence_ > kSequenceWindow) continue;
    cancelled_.insert(s);
  }
  while (cancelled_.size() > kMaxCancelled) cancelled_.erase(std::prev(cancelled_.end()));
  return absl::OkStatus();
}

namespace {

// Why the coordinator advanced the epoch, for the errors of the steps it
// revoked (clients see it; no sequence numbers).
std::string EpochReason(const v1::AdvanceEpochRequest& request) {
  switch (request.reason()) {
    case v1::EPOCH_RANK_DOWN:
      return absl::StrCat("worker rank ", request.rank(), " is down");
    case v1::EPOCH_RANK_JOINED:
      return absl::StrCat("a worker took rank ", request.rank());
    case v1::EPOCH_STEP_FAILED:
      return absl::StrCat("a step failed on worker rank ", request.rank(), " where a collective may be half done");
    case v1::EPOCH_STEP_ABANDONED:
      return request.rank() >= 0
                 ? absl::StrCat("a step was cancelled or expired before worker rank ", request.rank(), " answered")
                 : "a step was cancelled or expired";
    default:
      return "";
  }
}

}  // namespace

void Executor::LearnEpoch(const std::string& session, uint64_t epoch, const std::string& why) {
  std::shared_ptr<TimedCollectives> collectives;
  {
    absl::MutexLock lock(&mu_);
    if (!configured_ || (!session_.empty() && session != session_)) return;
    collectives = collectives_;
  }
  collectives->Revoke(epoch, why);
}

absl::Status Executor::AdvanceEpoch(const v1::AdvanceEpochRequest& request) {
  {
    absl::MutexLock lock(&mu_);
    if (request.session().empty() || request.session() != session_) {
      return absl::FailedPreconditionError("the epoch is not from this worker's coordinator session");
    }
  }
  LearnEpoch(request.session(), request.epoch(), EpochReason(request));
  return absl::OkStatus();
}

absl::StatusOr<v1::StepResult> Executor::Execute(v1::Step step, absl::Time deadline) {
  // Before waiting: a step running now of an older epoch ends at once, and
  // an older step this worker is yet to run will not communicate.
  LearnEpoch(step.session(), step.epoch(), "");
  const absl::Time arrived = absl::Now();
  if (auto s = WaitForTurn(step.sequence(), step.oldest_live_sequence(), deadline, step.session()); !s.ok()) {
    return s;
  }
  return RunTurn(std::move(step), deadline, arrived);
}

std::optional<absl::StatusOr<v1::StepResult>> Executor::ExecuteIfItsTurn(v1::Step& step, absl::Time deadline) {
  LearnEpoch(step.session(), step.epoch(), "");
  const absl::Time arrived = absl::Now();
  bool would_wait = false;
  absl::Status s = WaitForTurn(step.sequence(), step.oldest_live_sequence(), deadline, step.session(), &would_wait);
  if (would_wait) return std::nullopt;
  if (!s.ok()) return absl::StatusOr<v1::StepResult>(s);
  return RunTurn(std::move(step), deadline, arrived);
}

absl::StatusOr<v1::StepResult> Executor::RunTurn(v1::Step step, absl::Time deadline, absl::Time arrived) {
  const absl::Time turn = absl::Now();
  logging::TraceMark("turn");
  // Shards the coordinator retired since the last step (a missing one was
  // never stored here, e.g. by a put that failed on this worker).
  for (const std::string& name : step.release_shards()) (void)store_->Delete(name);
  {
    absl::MutexLock lock(&mu_);
    step_cancelled_ = cancelled_.erase(step.sequence()) > 0;
    running_step_cancelled_.store(false, std::memory_order_relaxed);
  }
  step_deadline_ = deadline;
  collectives_->BeginStep(step.sequence(), step.epoch());
  step_kernel_time_ = absl::ZeroDuration();
  step_collective_start_ = timed_->elapsed();
  absl::StatusOr<v1::StepResult> result;
  switch (step.op_case()) {
    case v1::Step::kGemm: {
      // The blocks a failed step named can serve no other (the coordinator
      // gave out their plan once): they go with it, not at their expiry.
      std::vector<std::string> staged;
      const v1::GemmStep& g = step.gemm();
      for (const v1::LocalTensor* t : {&g.lhs(), &g.rhs(), &g.bias(), &g.lhs_scale_inv(), &g.rhs_scale_inv()}) {
        if (t->source_case() == v1::LocalTensor::kStaged) staged.push_back(t->staged());
      }
      result = RunGemm(*step.mutable_gemm());
      if (!result.ok() && staging_ != nullptr) {
        for (const std::string& ticket : staged) staging_->Discard(ticket);
      }
      break;
    }
    case v1::Step::kStore: {
      std::vector<std::string> staged;  // a direct put's blocks: dropped if the step fails, as a GEMM's
      if (step.store().shard().source_case() == v1::LocalTensor::kStaged) staged.push_back(step.store().shard().staged());
      for (const v1::NamedShard& s : step.store().standby()) {
        if (s.shard().source_case() == v1::LocalTensor::kStaged) staged.push_back(s.shard().staged());
      }
      result = RunStore(*step.mutable_store());
      if (!result.ok() && staging_ != nullptr) {
        for (const std::string& ticket : staged) staging_->Discard(ticket);
      }
      break;
    }
    case v1::Step::kQuantize: {
      const std::string staged = step.quantize().x().staged();  // dropped if the step fails, as a GEMM's
      result = RunQuantize(*step.mutable_quantize());
      if (!result.ok() && staging_ != nullptr && !staged.empty()) staging_->Discard(staged);
      break;
    }
    case v1::Step::kDeleteShard: {
      for (const std::string& standby : step.delete_shard().standby()) (void)store_->Delete(standby);
      absl::Status s = store_->Delete(step.delete_shard().name());
      if (s.ok()) result = v1::StepResult();
      else result = s;
      break;
    }
    default:
      result = absl::UnimplementedError("this worker does not run that kind of step");
  }
  PassTurn();
  if (result.ok()) result->set_queue_seconds(absl::ToDoubleSeconds(turn - arrived));
  return result;
}

absl::Status Executor::WhyStopped(absl::Status s) const {
  // A backend that stopped (LocalGemm::stop) says CANCELLED; past the
  // deadline and not cancelled, it is the deadline that stopped it.
  if (s.code() != absl::StatusCode::kCancelled || running_step_cancelled_.load(std::memory_order_relaxed) ||
      absl::Now() < step_deadline_) {
    return s;
  }
  return absl::DeadlineExceededError(absl::StrCat("the step's deadline passed during it: ", s.message()));
}

absl::Status Executor::CancelledStatus() const {
  if (!step_cancelled_) return absl::OkStatus();
  return absl::CancelledError("the request was cancelled or expired before this step ran");
}

absl::StatusOr<Shard> Executor::StoredTensor(v1::LocalTensor&& t, absl::string_view field) {
  if (t.source_case() != v1::LocalTensor::kStaged) {
    auto decoded = HostTensorFromProto(std::move(t), field);
    if (!decoded.ok()) return decoded.status();
    return Shard::OnHost(*std::move(decoded));
  }
  // A block of a direct put: the client staged it here.
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".staged: this worker has no staging area"));
  }
  auto dtype = DTypeFromProto(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  auto block = staging_->ClaimBlock(t.staged(), *dtype, std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                                    field);
  if (!block.ok()) return block.status();
  if (block->device == nullptr) return Shard::OnHost(std::move(block->tensor));
  // Kept where the staging memory put it (device memory): a device-only shard.
  Shard shard;
  shard.dtype = block->tensor.dtype;
  shard.shape = block->tensor.shape;
  shard.device = std::move(block->device);
  return shard;
}

absl::StatusOr<v1::StepResult> Executor::RunStore(v1::StoreShardStep& store) {
  // All or none: a copy that does not fit takes the ones stored before it
  // out again (the names are a new generation's, so nothing is replaced).
  std::vector<std::string> stored;
  auto undo = [&](absl::Status why) {
    for (const std::string& name : stored) (void)store_->Delete(name);
    return why;
  };
  if (!store.name().empty()) {
    auto shard = StoredTensor(std::move(*store.mutable_shard()), "shard");
    if (!shard.ok()) return shard.status();
    if (auto s = store_->Put(store.name(), std::move(*shard)); !s.ok()) return s;
    stored.push_back(store.name());
  }
  for (v1::NamedShard& standby : *store.mutable_standby()) {
    auto shard = StoredTensor(std::move(*standby.mutable_shard()), "standby.shard");
    if (!shard.ok()) return undo(shard.status());
    if (auto s = store_->Put(standby.name(), std::move(*shard)); !s.ok()) {
      return undo(absl::Status(s.code(), absl::StrCat("a standby copy (--replicas) of another rank's block: ",
                                                      s.message(), " (--memory_budget_mb)")));
    }
    stored.push_back(standby.name());
  }
  return v1::StepResult();
}

namespace {

// A step's input: inline data, or a resident shard. A shard kept only in
// device memory has a header `tensor` (dtype and shape, no bytes) until a
// host path needs its bytes (EnsureOnHost).
struct Input {
  std::shared_ptr<const HostTensor> tensor;
  bool resident = false;  // a shard from the store, already counted in its budget
  std::shared_ptr<const DeviceBuffer> device;  // set while only the device holds the bytes
};

platform::TensorBlock BlockOf(const v1::SharedMemoryBlock& b, std::vector<int64_t> block_shape, DType dtype) {
  platform::TensorBlock block;
  block.offset = b.offset();
  block.global_shape.assign(b.global_shape().begin(), b.global_shape().end());
  block.block_offsets.assign(b.block_offsets().begin(), b.block_offsets().end());
  block.block_shape = std::move(block_shape);
  block.element_bytes = DTypeSize(dtype);
  return block;
}

// The process's mappings of clients' regions, kept across steps.
platform::SharedMemoryMappings& Mappings() {
  static auto* mappings = new platform::SharedMemoryMappings(16);
  return *mappings;
}

// The client memory a block lies in: a POSIX object mapped here (kept
// across steps), or a CUDA allocation's IPC handle (the backend opens it).
absl::StatusOr<ClientMemory> ClientMemoryOf(const v1::SharedMemoryBlock& b, bool writable, absl::string_view field) {
  ClientMemory memory;
  memory.region_bytes = b.region_bytes();
  if (b.object_case() == v1::SharedMemoryBlock::kCuda) {
    memory.cuda_ipc_handle = b.cuda().ipc_handle();
    return memory;
  }
  auto mapping = Mappings().Get(b.key(), b.region_bytes(), writable, field);
  if (!mapping.ok()) return mapping.status();
  memory.mapping = *std::move(mapping);
  return memory;
}

// A worker's block of a same-host client's region: into device memory where
// the step's device GEMM reads it (`on_device`) or the region is device
// memory, else copied into host memory (the region is the client's to
// change later).
absl::StatusOr<Input> ReadClientBlock(const v1::LocalTensor& t, Backend* backend, bool on_device,
                                      absl::string_view field) {
  const std::string at = absl::StrCat(field, ".shared_memory");
  auto dtype = DTypeFromProto(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  auto n = CheckedNumElements(shape, DTypeSize(*dtype), field);
  if (!n.ok()) return n.status();
  auto memory = ClientMemoryOf(t.shared_memory(), /*writable=*/false, at);
  if (!memory.ok()) return memory.status();
  const platform::TensorBlock block = BlockOf(t.shared_memory(), shape, *dtype);
  Input in;
  if (memory->mapping == nullptr || (on_device && backend->KeepsOutputsOnDevice())) {
    auto device = backend->BlockToDevice(*memory, block, at);
    if (!device.ok()) return device.status();
    auto header = std::make_shared<HostTensor>();
    header->dtype = *dtype;
    header->shape = shape;
    in.tensor = std::move(header);
    in.device = *std::move(device);
    return in;
  }
  auto out = std::make_shared<HostTensor>();
  out->dtype = *dtype;
  out->shape = shape;
  out->bytes.resize(static_cast<size_t>(*n * DTypeSize(*dtype)));
  if (auto s = platform::CopyBlockOut(*memory->mapping, block, out->bytes.data(), at); !s.ok()) return s;
  in.tensor = std::move(out);
  return in;
}

// An output block into a same-host client's region, from where the step
// holds it (device or host memory).
absl::Status WriteClientBlock(Backend* backend, const v1::SharedMemoryBlock& b, DType dtype,
                              const std::vector<int64_t>& shape, const DeviceBuffer* device, const HostTensor* host) {
  constexpr absl::string_view kField = "out_shared_memory";
  auto memory = ClientMemoryOf(b, /*writable=*/true, kField);
  if (!memory.ok()) return memory.status();
  const platform::TensorBlock block = BlockOf(b, shape, dtype);
  if (device != nullptr) return backend->BlockFromDevice(*device, *memory, block, kField);
  if (host == nullptr) return absl::InternalError("an output with neither host nor device bytes");
  return backend->BlockFromHost(host->bytes.data(), *memory, block, kField);
}

absl::StatusOr<Input> ResolveInput(v1::LocalTensor&& t, const ShardStore& store, StagingArea* staging,
                                   Backend* backend, bool on_device, absl::string_view field) {
  Input in;
  if (t.source_case() == v1::LocalTensor::kStaged) {  // a block a client streamed here directly
    if (staging == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(field, ".staged: this worker has no staging area"));
    }
    auto dtype = DTypeFromProto(t.dtype(), field);
    if (!dtype.ok()) return dtype.status();
    auto block =
        staging->ClaimBlock(t.staged(), *dtype, std::vector<int64_t>(t.shape().begin(), t.shape().end()), field);
    if (!block.ok()) return block.status();
    // A block the staging memory kept in device memory reaches the GEMM as a
    // device shard does (`tensor` a header); a host path downloads it (EnsureOnHost).
    in.tensor = std::make_shared<const HostTensor>(std::move(block->tensor));
    in.device = std::move(block->device);
    return in;
  }
  if (t.source_case() == v1::LocalTensor::kResident) {
    auto shard = store.Get(t.resident());
    if (!shard.ok()) return shard.status();
    in.resident = true;
    if ((*shard)->host != nullptr) {
      in.tensor = (*shard)->host;
    } else {
      auto header = std::make_shared<HostTensor>();
      header->dtype = (*shard)->dtype;
      header->shape = (*shard)->shape;
      in.tensor = std::move(header);
      in.device = (*shard)->device;
    }
    return in;
  }
  if (t.source_case() == v1::LocalTensor::kSharedMemory) return ReadClientBlock(t, backend, on_device, field);
  auto decoded = HostTensorFromProto(std::move(t), field);
  if (!decoded.ok()) return decoded.status();
  in.tensor = std::make_shared<const HostTensor>(std::move(*decoded));
  return in;
}

// Brings a device-only input's bytes to the host (a host collective, the
// host GEMM or quantize path).
absl::Status EnsureOnHost(Backend* backend, Input* in) {
  if (in->device == nullptr) return absl::OkStatus();
  Shard shard;
  shard.dtype = in->tensor->dtype;
  shard.shape = in->tensor->shape;
  shard.device = in->device;
  auto host = backend->Download(shard);
  if (!host.ok()) return host.status();
  in->tensor = std::make_shared<const HostTensor>(std::move(*host));
  in->device = nullptr;
  in->resident = false;  // a transient copy; the shard keeps the device one
  return absl::OkStatus();
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  return b > std::numeric_limits<int64_t>::max() - a ? std::numeric_limits<int64_t>::max() : a + b;
}

// The status of a worker that cannot hold what a step's collective needs:
// it stays out of the collective (its peers fail at the collective timeout).
absl::Status CannotHold(int64_t bytes) {
  return absl::ResourceExhaustedError(
      absl::StrCat("this worker cannot hold the ", bytes, " bytes the step's collective needs"));
}

int64_t NumElementsOf(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// An FP8 step's dtypes, scales and modes, from the step alone: FP8 lhs and
// rhs (not both E5M2) with both scales, or a float lhs the step quantizes
// (quantize_lhs_to) with an FP8 rhs and its scales; float steps carry none.
absl::Status CheckFp8Step(const v1::GemmStep& gemm, DType lhs, DType rhs, bool lhs_scale, bool rhs_scale) {
  const bool quantize = gemm.quantize_lhs_to() != v1::DTYPE_UNSPECIFIED;
  if (!quantize && !IsFloat8(lhs) && !IsFloat8(rhs)) {
    if (lhs_scale || rhs_scale) return absl::InvalidArgumentError("scale_inv operands on a step without FP8 operands");
    return absl::OkStatus();
  }
  if (!v1::ScalingMode_IsValid(gemm.scaling())) {
    return absl::InvalidArgumentError(absl::StrCat("scaling: unknown mode ", static_cast<int>(gemm.scaling())));
  }
  if (!IsFloat8(rhs)) return absl::InvalidArgumentError("rhs: an FP8 GEMM step needs an FP8 rhs");
  if (!rhs_scale) return absl::InvalidArgumentError("rhs_scale_inv: an FP8 rhs needs its scales");
  if (quantize) {
    auto to = DTypeFromProto(gemm.quantize_lhs_to(), "quantize_lhs_to");
    if (!to.ok()) return to.status();
    if (!IsFloat8(*to)) return absl::InvalidArgumentError("quantize_lhs_to: must be f8e4m3 or f8e5m2");
    if (!IsGemmFloat(lhs)) return absl::InvalidArgumentError("lhs: quantize_lhs_to needs an f32, bf16 or f16 lhs");
    if (lhs_scale) return absl::InvalidArgumentError("lhs_scale_inv: the step's quantize makes it");
    if (gemm.ragged() == v1::GroupedGemmRequest::RAGGED_K) {
      return absl::InvalidArgumentError("quantize_lhs_to: the fused quantize + GEMM is ragged M");
    }
    if (gemm.scaling() != v1::SCALING_UNSPECIFIED && gemm.scaling() != v1::CURRENT &&
        gemm.scaling() != v1::BLOCK_FP8) {
      return absl::InvalidArgumentError("scaling: quantize_lhs_to makes CURRENT or BLOCK_FP8 scales");
    }
    lhs = *to;
  } else {
    if (!IsFloat8(lhs)) return absl::InvalidArgumentError("lhs: an FP8 GEMM step needs an FP8 lhs");
    if (!lhs_scale) return absl::InvalidArgumentError("lhs_scale_inv: an FP8 lhs needs its scales");
  }
  if (lhs == DType::kF8E5M2 && rhs == DType::kF8E5M2) {
    return absl::InvalidArgumentError("rhs: f8e5m2 x f8e5m2 GEMM is not supported (one side must be f8e4m3)");
  }
  return absl::OkStatus();
}

bool IsReduction(const v1::CollectivePlan& c) {
  return c.kind() == v1::COLLECTIVE_ALL_REDUCE_SUM || c.kind() == v1::COLLECTIVE_REDUCE_SCATTER;
}

// Whether `c` exchanges data with peers (a slice only keeps a local piece).
bool Communicates(const v1::CollectivePlan& c) { return c.kind() != v1::COLLECTIVE_SLICE; }

// Whether two collectives run over the same group of workers.
bool SameGroup(const v1::CollectivePlan& a, const v1::CollectivePlan& b) {
  std::vector<std::string> x(a.axes().begin(), a.axes().end()), y(b.axes().begin(), b.axes().end());
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  return x == y;
}

absl::Status PeerFailed() { return absl::AbortedError("another worker failed this step; see the request's status"); }

std::string RoleName(v1::TensorRole role) { return absl::AsciiStrToLower(v1::TensorRole_Name(role)); }

}  // namespace

absl::StatusOr<HostTensor> Executor::ApplyCollective(const v1::CollectivePlan& c,
                                                     const HostTensor& t) {
  std::vector<std::string> axes(c.axes().begin(), c.axes().end());
  switch (c.kind()) {
    case v1::COLLECTIVE_ALL_GATHER: return collectives_->AllGather(t, c.dim(), axes);
    case v1::COLLECTIVE_REDUCE_SCATTER: return collectives_->ReduceScatter(t, c.dim(), axes);
    case v1::COLLECTIVE_ALL_REDUCE_SUM:
    case v1::COLLECTIVE_ALL_REDUCE_MAX: {
      HostTensor out = t;
      auto op = c.kind() == v1::COLLECTIVE_ALL_REDUCE_SUM ? ReduceOp::kSum : ReduceOp::kMax;
      if (auto s = collectives_->AllReduce(&out, op, axes); !s.ok()) return s;
      return out;
    }
    case v1::COLLECTIVE_SLICE: {
      auto count = position_.GroupSize(axes);
      auto index = position_.GroupIndex(axes);
      if (!count.ok()) return count.status();
      if (!index.ok()) return index.status();
      return TakePiece(t, c.dim(), *index, *count, RoleName(c.tensor()));
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("collective kind ", static_cast<int>(c.kind()), " is not one this worker runs"));
  }
}

std::vector<std::string> Executor::AgreementAxes() const {
  // The group a failure could leave waiting is the one spanned by the step's
  // collectives' axes, but the whole mesh agrees: on the CPU mesh the
  // mesh-wide agreement measured faster (it lines every worker up for the
  // collectives after it; docs/performance/service.md), and it costs a GPU
  // mesh one small all-reduce either way.
  return position_.axis_names;
}

absl::StatusOr<std::vector<int64_t>> Executor::ShapeAfter(const v1::CollectivePlan& c,
                                                          std::vector<int64_t> shape) const {
  if (c.kind() != v1::COLLECTIVE_ALL_GATHER && c.kind() != v1::COLLECTIVE_SLICE &&
      c.kind() != v1::COLLECTIVE_REDUCE_SCATTER) {
    return shape;
  }
  if (c.dim() < 0 || c.dim() >= static_cast<int>(shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("collective on ", RoleName(c.tensor()), ": dim ", c.dim(),
                                                   " out of range for rank ", shape.size()));
  }
  auto n = position_.GroupSize(std::vector<std::string>(c.axes().begin(), c.axes().end()));
  if (!n.ok()) return n.status();
  if (c.kind() == v1::COLLECTIVE_ALL_GATHER) {
    shape[c.dim()] *= *n;
  } else if (shape[c.dim()] % *n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(RoleName(c.tensor()), " dim ", c.dim(), " of size ",
                                                   shape[c.dim()], " does not split into ", *n, " pieces"));
  } else {
    shape[c.dim()] /= *n;
  }
  return shape;
}

void Executor::FinishResult(absl::Time start, int agreements, const Backend::Transfers& before,
                            v1::StepResult* result) const {
  const Backend::Transfers after = backend_->TransferCounts();
  result->set_host_to_device_bytes(after.host_to_device - before.host_to_device);
  result->set_device_to_host_bytes(after.device_to_host - before.device_to_host);
  result->set_agreements(agreements);
  result->set_compute_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  result->set_kernel_seconds(absl::ToDoubleSeconds(step_kernel_time_));
  result->set_collective_seconds(absl::ToDoubleSeconds(timed_->elapsed() - step_collective_start_));
}

template <typename F>
auto Executor::TimeKernel(F&& f) {
  const absl::Time start = absl::Now();
  const absl::Duration collectives_before = timed_->elapsed();
  auto result = f();
  step_kernel_time_ += (absl::Now() - start) - (timed_->elapsed() - collectives_before);
  return result;
}

absl::StatusOr<HostTensor> Executor::AllGatherWithStatus(const v1::CollectivePlan& c, const HostTensor* local,
                                                         DType dtype, const std::vector<int64_t>& shape,
                                                         const absl::Status& status) {
  const int64_t piece = NumElementsOf(shape) * DTypeSize(dtype);
  // One byte of status ahead of the piece's bytes, gathered as raw bytes.
  HostTensor wire;
  wire.dtype = DType::kE8M0;
  wire.shape = {1, piece + 1};
  if (piece >= store_->budget_bytes()) return status.ok() ? CannotHold(piece) : status;
  try {
    wire.bytes.assign(static_cast<size_t>(piece + 1), '\0');
  } catch (const std::exception&) {
    return status.ok() ? CannotHold(piece) : status;
  }
  wire.bytes[0] = status.ok() ? 0 : 1;
  if (status.ok() && piece > 0) std::memcpy(&wire.bytes[1], local->bytes.data(), piece);
  std::vector<std::string> axes(c.axes().begin(), c.axes().end());
  auto gathered = collectives_->AllGather(wire, 0, axes);
  if (!status.ok()) return status;
  if (!gathered.ok()) return gathered.status();
  const int64_t members = gathered->shape[0];
  for (int64_t m = 0; m < members; ++m) {
    if (gathered->bytes[m * (piece + 1)] != 0) return PeerFailed();
  }
  std::vector<int64_t> out_shape = shape;
  out_shape[c.dim()] *= members;
  auto out = ZerosTensor(dtype, out_shape);
  if (!out.ok()) return out.status();
  HostTensor p;
  p.dtype = dtype;
  p.shape = shape;
  for (int64_t m = 0; m < members; ++m) {
    p.bytes.assign(gathered->bytes, m * (piece + 1) + 1, piece);
    std::vector<int64_t> offsets(shape.size(), 0);
    offsets[c.dim()] = m * shape[c.dim()];
    InsertBlock(p, offsets, &*out);
  }
  return out;
}

absl::Status Executor::AllReduceWithStatus(const v1::CollectivePlan& c, HostTensor* out, int64_t elements,
                                           const absl::Status& given) {
  // The sum (or max) of failure flags rides in one more FP32 element.
  if (elements >= store_->budget_bytes() / 4) return given.ok() ? CannotHold(elements * 4) : given;
  HostTensor wire;
  try {
    wire = *ZerosTensor(DType::kF32, {elements + 1});
  } catch (const std::exception&) {
    return given.ok() ? CannotHold(elements * 4) : given;
  }
  absl::Status status = given;
  if (status.ok() && (out == nullptr || out->dtype != DType::kF32 || out->NumElements() != elements)) {
    // Still joins the collective, as a failure: its peers are in it.
    status = absl::InternalError(absl::StrCat("a fused all-reduce takes ", elements, " FP32 values"));
  }
  if (status.ok()) std::memcpy(&wire.bytes[0], out->bytes.data(), elements * 4);
  wire.data<float>()[elements] = status.ok() ? 0.f : 1.f;
  std::vector<std::string> axes(c.axes().begin(), c.axes().end());
  const ReduceOp op = c.kind() == v1::COLLECTIVE_ALL_REDUCE_MAX ? ReduceOp::kMax : ReduceOp::kSum;
  absl::Status reduced = collectives_->AllReduce(&wire, op, axes);
  if (!status.ok()) return status;
  if (!reduced.ok()) return reduced;
  if (wire.data<float>()[elements] != 0.f) return PeerFailed();
  std::memcpy(&out->bytes[0], wire.bytes.data(), elements * 4);
  return absl::OkStatus();
}

absl::StatusOr<v1::StepResult> Executor::RunGemm(v1::GemmStep& gemm) {
  const absl::Time start = absl::Now();
  const Backend::Transfers transfers_before = backend_->TransferCounts();
  int agreements = 0;
  const std::vector<std::string> agree_axes = AgreementAxes();
  auto agree = [&](absl::Status local) {
    ++agreements;
    return collectives_->Agree(local, agree_axes);
  };
  const bool ragged_k = gemm.ragged() == v1::GroupedGemmRequest::RAGGED_K;
  // The step's operands; the optional ones are present only when sent
  // (looked at before mutable_*() creates them).
  constexpr int kOperands = 5;
  constexpr int kBias = 2, kLhsScale = 3, kRhsScale = 4;
  const v1::TensorRole roles[kOperands] = {v1::TENSOR_LHS, v1::TENSOR_RHS, v1::TENSOR_BIAS,
                                           v1::TENSOR_LHS_SCALE_INV, v1::TENSOR_RHS_SCALE_INV};
  const bool present[kOperands] = {true, true, gemm.has_bias(), gemm.has_lhs_scale_inv(),
                                   gemm.has_rhs_scale_inv()};
  v1::LocalTensor* protos[kOperands] = {gemm.mutable_lhs(), gemm.mutable_rhs(),
                                        present[kBias] ? gemm.mutable_bias() : nullptr,
                                        present[kLhsScale] ? gemm.mutable_lhs_scale_inv() : nullptr,
                                        present[kRhsScale] ? gemm.mutable_rhs_scale_inv() : nullptr};
  auto index_of = [&](v1::TensorRole role) {
    for (int i = 0; i < kOperands; ++i) {
      if (roles[i] == role && present[i]) return i;
    }
    return -1;
  };

  // Stage 0, from the step alone (the same on every worker of the plan, so
  // a failure here fails them all alike, before any communicates): dtypes,
  // the operands' shapes through the before-collectives, the GEMM's shapes,
  // and where each collective runs.
  auto out_dtype = DTypeFromProto(gemm.out_dtype(), "out_dtype");
  if (!out_dtype.ok()) return out_dtype.status();
  DType declared_dtype[kOperands] = {DType::kInvalid, DType::kInvalid, DType::kInvalid, DType::kInvalid,
                                     DType::kInvalid};
  std::vector<int64_t> declared_shape[kOperands], compute_shape[kOperands];
  for (int i = 0; i < kOperands; ++i) {
    if (!present[i]) continue;
    auto d = DTypeFromProto(protos[i]->dtype(), RoleName(roles[i]));
    if (!d.ok()) return d.status();
    declared_dtype[i] = *d;
    declared_shape[i].assign(protos[i]->shape().begin(), protos[i]->shape().end());
    compute_shape[i] = declared_shape[i];
    // No negative dims, no overflow: every worker refuses such a step alike.
    if (auto n = CheckedNumElements(declared_shape[i], DTypeSize(*d), RoleName(roles[i])); !n.ok()) {
      return n.status();
    }
  }
  if (auto s = CheckFp8Step(gemm, declared_dtype[0], declared_dtype[1], present[kLhsScale], present[kRhsScale]);
      !s.ok()) {
    return s;
  }
  bool before_communicates = false, after_communicates = false;
  for (const auto& c : gemm.collectives()) {
    if (c.phase() == v1::PHASE_BEFORE) {
      const int i = index_of(c.tensor());
      if (i < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("a before-collective names ", RoleName(c.tensor()), ", which this step lacks"));
      }
      auto next = ShapeAfter(c, compute_shape[i]);
      if (!next.ok()) return next.status();
      if (auto n = CheckedNumElements(*next, DTypeSize(declared_dtype[i]), RoleName(roles[i])); !n.ok()) {
        return n.status();
      }
      compute_shape[i] = std::move(*next);
      before_communicates |= Communicates(c);
    } else if (c.phase() == v1::PHASE_AFTER) {
      if (c.tensor() != v1::TENSOR_OUT) {
        return absl::InvalidArgumentError(
            absl::StrCat("an after-collective names ", RoleName(c.tensor()), ", expected out"));
      }
      after_communicates |= Communicates(c);
    } else {
      return absl::InvalidArgumentError("a GEMM step's collectives run before or after its GEMM");
    }
  }
  const int64_t g = gemm.group_sizes_size();
  {
    const std::vector<int64_t>& ls = compute_shape[0];
    const std::vector<int64_t>& rs = compute_shape[1];
    if (ls.size() != 2) return absl::InvalidArgumentError("local lhs must be rank 2");
    if (rs.size() != (ragged_k ? 2u : 3u)) {
      return absl::InvalidArgumentError(absl::StrCat("local rhs must be rank ", ragged_k ? 2 : 3));
    }
    if (!ragged_k && rs[0] != g) {
      return absl::InvalidArgumentError(absl::StrCat("local rhs has ", rs[0], " groups but group_sizes has ", g));
    }
  }
  // FP8 scales: dtype and compute shape as the GEMM's layouts want them
  // (a crafted step must not reach a kernel with a short scale buffer).
  GemmScalingModes fp8_modes;  // the kernels' modes of an FP8 step's operands
  if (IsFloat8(declared_dtype[1])) {
    auto modes = KernelGemmScalingModes(gemm.scaling(), ragged_k);
    if (!modes.ok()) return modes.status();
    fp8_modes = *modes;
    cpu::Fp8GroupedGemmArgs shape_of;
    shape_of.ragged_k = ragged_k;
    shape_of.lhs_mode = modes->lhs;
    shape_of.rhs_mode = modes->rhs;
    shape_of.m = compute_shape[0][0];
    shape_of.k = compute_shape[0][1];
    shape_of.n = ragged_k ? compute_shape[1][1] : compute_shape[1][gemm.rhs_transposed() ? 1 : 2];
    shape_of.num_groups = g;
    shape_of.rhs_transposed = gemm.rhs_transposed();
    const DType scale_dtype = modes->lhs == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
    for (const auto& [i, want] : {std::make_pair(kLhsScale, cpu::Fp8LhsScaleShape(shape_of)),
                                  std::make_pair(kRhsScale, cpu::Fp8RhsScaleShape(shape_of))}) {
      if (!present[i]) continue;  // a fused quantize makes lhs's
      if (declared_dtype[i] != scale_dtype || compute_shape[i] != want) {
        return absl::InvalidArgumentError(absl::StrCat(
            RoleName(roles[i]), ": ", DTypeName(declared_dtype[i]), " ", ShapeToString(compute_shape[i]),
            " after its collectives, but ", ScalingModeName(i == kLhsScale ? modes->lhs : modes->rhs),
            " scaling of this step's operands needs ", DTypeName(scale_dtype), " ", ShapeToString(want)));
      }
    }
  }
  const std::vector<int64_t> local_out_shape =
      ragged_k ? std::vector<int64_t>{g, compute_shape[0][1], compute_shape[1][1]}
               : std::vector<int64_t>{compute_shape[0][0],
                                      gemm.rhs_transposed() ? compute_shape[1][1] : compute_shape[1][2]};
  if (auto n = CheckedNumElements(local_out_shape, 4, "out"); !n.ok()) return n.status();
  const bool reduces = std::any_of(gemm.collectives().begin(), gemm.collectives().end(), [](const auto& c) {
    return c.phase() == v1::PHASE_AFTER && IsReduction(c);
  });
  // Partial sums stay in FP32 until reduced: one rounding, at the end.
  const DType local_dtype = reduces ? DType::kF32 : *out_dtype;
  // The FSDP weight gather (the one before-collective on rhs, an all-gather,
  // ragged M) goes to a backend that gathers on its device (NCCL into the
  // GEMM's operand): no host round trip. Only where the device GEMM runs
  // (BF16 or F16 operands of one dtype): other dtypes take the host path.
  const bool device_gemm = declared_dtype[0] == declared_dtype[1] &&
                           (declared_dtype[0] == DType::kBF16 || declared_dtype[0] == DType::kF16);
  const v1::CollectivePlan* device_gather = nullptr;
  if (device_gemm && !ragged_k && backend_->CanGatherOnDevice() && collectives_->SupportsDeviceAllGather()) {
    const v1::CollectivePlan* candidate = nullptr;
    int on_rhs = 0;
    for (const auto& c : gemm.collectives()) {
      if (c.phase() != v1::PHASE_BEFORE || c.tensor() != v1::TENSOR_RHS) continue;
      ++on_rhs;
      if (c.kind() == v1::COLLECTIVE_ALL_GATHER) candidate = &c;
    }
    if (on_rhs == 1 && candidate != nullptr) device_gather = candidate;
  }
  // The step's one agreement. Where every collective that communicates runs
  // over one group, the status rides along the first of them (a flag byte
  // in the gather, a flag element in the sum): that group is everyone a
  // failure could leave waiting, and no separate round is paid. Otherwise a
  // mesh-wide agreement right before the first collective.
  const v1::CollectivePlan* first_communicating = nullptr;
  bool one_group = true;
  for (const auto& c : gemm.collectives()) {
    if (!Communicates(c)) continue;
    if (first_communicating == nullptr) {
      first_communicating = &c;
    } else if (!SameGroup(c, *first_communicating)) {
      one_group = false;
    }
  }
  const bool agreeing = gemm.agree() && first_communicating != nullptr;
  const v1::CollectivePlan* fused = nullptr;
  if (agreeing && one_group && first_communicating != device_gather &&
      ((first_communicating->phase() == v1::PHASE_BEFORE &&
        first_communicating->kind() == v1::COLLECTIVE_ALL_GATHER) ||
       (first_communicating->phase() == v1::PHASE_AFTER &&
        first_communicating->kind() == v1::COLLECTIVE_ALL_REDUCE_SUM))) {
    fused = first_communicating;
  }

  // Stage 1, local: inputs, memory (this worker alone may fail here).
  Input lhs, rhs, bias, lhs_scale, rhs_scale;
  Input* inputs[kOperands] = {&lhs, &rhs, &bias, &lhs_scale, &rhs_scale};
  absl::Status prepared = CancelledStatus();
  // Whether an operand can stay in device memory for the device GEMM (and
  // its device weight gather): every host path takes its bytes first.
  auto stays_on_device = [&](int i) {
    if (!device_gemm || i >= kBias) return false;
    for (const auto& c : gemm.collectives()) {
      if (c.phase() == v1::PHASE_BEFORE && c.tensor() == roles[i] && &c != device_gather) return false;
    }
    return true;
  };
  for (int i = 0; i < kOperands && prepared.ok(); ++i) {
    if (!present[i]) continue;
    auto in = ResolveInput(std::move(*protos[i]), *store_, staging_, backend_, stays_on_device(i), RoleName(roles[i]));
    if (!in.ok()) {
      prepared = in.status();
    } else if (in->tensor->dtype != declared_dtype[i] || in->tensor->shape != declared_shape[i]) {
      prepared = absl::InvalidArgumentError(absl::StrCat(
          RoleName(roles[i]), " is ", DTypeName(in->tensor->dtype), " ", ShapeToString(in->tensor->shape),
          " but the step declares ", DTypeName(declared_dtype[i]), " ", ShapeToString(declared_shape[i])));
    } else {
      *inputs[i] = *in;
    }
  }
  for (int i = 0; i < kOperands && prepared.ok(); ++i) {
    if (inputs[i]->device != nullptr && !stays_on_device(i)) prepared = EnsureOnHost(backend_, inputs[i]);
  }
  // An output into client memory goes there from the device (stage 3): a
  // contiguous block of a CUDA region is the GEMM's output itself. Opened
  // here, with the inputs, so that a failure is this step's local failure
  // and meets the agreement (the device weight gather's included); not in
  // place where it overlaps an operand read in place (the GEMM would
  // overwrite what it still reads): the output then comes through a buffer.
  const bool has_after = std::any_of(gemm.collectives().begin(), gemm.collectives().end(),
                                     [](const auto& c) { return c.phase() == v1::PHASE_AFTER; });
  const bool out_from_device = gemm.has_out_shared_memory() && !has_after && local_dtype == *out_dtype &&
                               device_gemm && backend_->KeepsOutputsOnDevice();
  std::shared_ptr<const DeviceBuffer> out_in_place;
  if (prepared.ok() && out_from_device) {
    const v1::SharedMemoryBlock& b = gemm.out_shared_memory();
    const platform::TensorBlock block = BlockOf(b, local_out_shape, local_dtype);
    prepared = platform::CheckTensorBlock(block, b.region_bytes(), "out_shared_memory");
    if (prepared.ok() && b.object_case() == v1::SharedMemoryBlock::kCuda && platform::BlockIsContiguous(block)) {
      auto memory = ClientMemoryOf(b, /*writable=*/true, "out_shared_memory");
      auto target = memory.ok() ? backend_->BlockToDevice(*memory, block, "out_shared_memory")
                                : absl::StatusOr<std::shared_ptr<const DeviceBuffer>>(memory.status());
      if (!target.ok()) {
        prepared = target.status();
      } else {
        auto overlaps = [&](const DeviceBuffer* in) {
          if (in == nullptr || in->bytes() == 0 || (*target)->bytes() == 0) return false;
          const auto a = reinterpret_cast<uintptr_t>(in->data()), o = reinterpret_cast<uintptr_t>((*target)->data());
          return a < o + static_cast<uintptr_t>((*target)->bytes()) && o < a + static_cast<uintptr_t>(in->bytes());
        };
        if (!overlaps(lhs.device.get()) && !overlaps(rhs.device.get())) out_in_place = *std::move(target);
      }
    }
  }
  int64_t working_bytes = 0;
  if (prepared.ok()) {
    // Inline inputs (resident ones are already counted), host gathers and
    // the output. A weight gathered on the device takes device memory.
    for (int i = 0; i < kOperands; ++i) {
      if (inputs[i]->tensor != nullptr && !inputs[i]->resident) {
        working_bytes = SaturatingAdd(working_bytes, inputs[i]->tensor->NumBytes());
      }
    }
    for (const auto& c : gemm.collectives()) {
      if (c.phase() != v1::PHASE_BEFORE || c.kind() != v1::COLLECTIVE_ALL_GATHER || &c == device_gather) continue;
      const int i = index_of(c.tensor());
      working_bytes = SaturatingAdd(working_bytes, DTypeSize(declared_dtype[i]) * NumElementsOf(compute_shape[i]));
    }
    working_bytes = SaturatingAdd(working_bytes, NumElementsOf(local_out_shape) * 4);
    if (IsFloat8(declared_dtype[1]) && backend_->Fp8GemmOnHost(ragged_k, gemm.rhs_transposed())) {
      // The host reference's FP32 copies of both operands (and a quantized lhs).
      const int64_t lhs_elements = NumElementsOf(compute_shape[0]), rhs_elements = NumElementsOf(compute_shape[1]);
      const int64_t elements = SaturatingAdd(lhs_elements, rhs_elements);
      const int64_t f32_bytes = elements > std::numeric_limits<int64_t>::max() / 4
                                    ? std::numeric_limits<int64_t>::max()
                                    : elements * 4;
      working_bytes = SaturatingAdd(working_bytes, f32_bytes);
      if (gemm.quantize_lhs_to() != v1::DTYPE_UNSPECIFIED) working_bytes = SaturatingAdd(working_bytes, lhs_elements);
    }
    prepared = store_->Reserve(working_bytes);
  }
  ShardStore::ScopedReservation reservation(store_, working_bytes, prepared.ok());
  logging::TraceMark("inputs");
  const bool agree_first = agreeing && fused == nullptr && first_communicating->phase() == v1::PHASE_BEFORE &&
                           device_gather == nullptr;
  if (agree_first) prepared = agree(prepared);
  if (!prepared.ok()) {
    // A worker that failed still meets its peers where they next wait for
    // it: the fused collective, or the agreement they run later.
    if (fused != nullptr) {
      ++agreements;
      if (fused->phase() == v1::PHASE_BEFORE) {
        std::vector<int64_t> shape = declared_shape[index_of(fused->tensor())];
        for (const auto& c : gemm.collectives()) {
          if (&c == fused) break;
          if (c.phase() == v1::PHASE_BEFORE && c.tensor() == fused->tensor()) shape = *ShapeAfter(c, shape);
        }
        (void)AllGatherWithStatus(*fused, nullptr, declared_dtype[index_of(fused->tensor())], shape, prepared);
      } else {
        (void)AllReduceWithStatus(*fused, nullptr, NumElementsOf(local_out_shape), prepared);
      }
    } else if (agreeing && !agree_first) {
      (void)agree(prepared);
    }
    return prepared;
  }

  // Stage 2: before-collectives bring each operand to its compute layout.
  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != v1::PHASE_BEFORE || &c == device_gather) continue;  // that one runs in the backend
    Input* target = inputs[index_of(c.tensor())];
    absl::StatusOr<HostTensor> next =
        &c == fused ? (++agreements, AllGatherWithStatus(c, target->tensor.get(), target->tensor->dtype,
                                                         target->tensor->shape, absl::OkStatus()))
                    : ApplyCollective(c, *target->tensor);
    if (!next.ok()) return next.status();
    target->tensor = std::make_shared<const HostTensor>(std::move(*next));
    target->resident = false;
  }

  // Stage 3: the local op (its operands in their compute layout now).
  logging::TraceMark("operands_ready");
  LocalGemm local;
  local.stop = [this] {
    return running_step_cancelled_.load(std::memory_order_relaxed) || absl::Now() >= step_deadline_;
  };
  local.ragged_k = ragged_k;
  local.lhs = lhs.tensor.get();
  local.rhs = rhs.tensor.get();
  // A resident weight may stay on the device between requests.
  if (rhs.resident && rhs.device == nullptr) local.resident_rhs = rhs.tensor;
  if (lhs.resident && lhs.device == nullptr) local.resident_lhs = lhs.tensor;
  local.lhs_device = lhs.device;
  local.rhs_device = rhs.device;
  local.bias = gemm.apply_bias() ? bias.tensor.get() : nullptr;
  local.lhs_scale_inv = lhs_scale.tensor.get();
  local.rhs_scale_inv = rhs_scale.tensor.get();
  if (rhs_scale.resident) local.resident_rhs_scale_inv = rhs_scale.tensor;
  local.lhs_mode = fp8_modes.lhs;
  local.rhs_mode = fp8_modes.rhs;
  if (gemm.quantize_lhs_to() != v1::DTYPE_UNSPECIFIED) {
    local.quantize_lhs_to = *DTypeFromProto(gemm.quantize_lhs_to(), "quantize_lhs_to");  // checked
  }
  local.group_sizes.assign(gemm.group_sizes().begin(), gemm.group_sizes().end());
  local.rhs_transposed = gemm.rhs_transposed();
  local.out_dtype = local_dtype;
  if (device_gather != nullptr) {
    local.rhs_gather.enabled = true;
    local.rhs_gather.dim = device_gather->dim();
    local.rhs_gather.axes.assign(device_gather->axes().begin(), device_gather->axes().end());
    local.rhs_gather.collectives = collectives_.get();
    local.rhs_gather.gathered_shape = compute_shape[1];
    // The backend's own preparation (device memory, uploads) can fail on
    // this worker alone: it holds the step's one agreement.
    local.rhs_gather.agree = gemm.agree();
    local.rhs_gather.agree_axes = agree_axes;
    if (gemm.agree()) ++agreements;
  }
  // A kept output with nothing after the GEMM stays where the GEMM wrote it
  // (device memory on a device backend): no copy to the host. An output
  // into client memory likewise goes there from the device (in place where
  // stage 1 opened its block).
  if (out_from_device) {
    local.keep_on_device = true;
    const v1::SharedMemoryBlock& b = gemm.out_shared_memory();
    const bool in_place = out_in_place != nullptr;
    local.out_device = std::move(out_in_place);
    auto kept = TimeKernel([&] { return backend_->GroupedGemmToShard(local); });
    if (!kept.ok()) return WhyStopped(kept.status());
    if (!in_place || kept->device != local.out_device) {
      if (auto s = WriteClientBlock(backend_, b, kept->dtype, kept->shape, kept->device.get(), kept->host.get());
          !s.ok()) {
        return s;
      }
    }
    v1::StepResult result;
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(kept->dtype));
    info->mutable_shape()->Assign(kept->shape.begin(), kept->shape.end());
    FinishResult(start, agreements, transfers_before, &result);
    return result;
  }
  if (!gemm.keep_output_as().empty() && !has_after && local_dtype == *out_dtype &&
      backend_->KeepsOutputsOnDevice()) {
    local.keep_on_device = true;
    auto kept = TimeKernel([&] { return backend_->GroupedGemmToShard(local); });
    if (!kept.ok()) return WhyStopped(kept.status());
    v1::StepResult result;
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(kept->dtype));
    info->mutable_shape()->Assign(kept->shape.begin(), kept->shape.end());
    info->set_resident(gemm.keep_output_as());
    logging::TraceMark("local_op");
    if (auto s = store_->Put(gemm.keep_output_as(), std::move(*kept)); !s.ok()) return s;
    logging::TraceMark("kept");
    FinishResult(start, agreements, transfers_before, &result);
    return result;
  }
  // An output held for a direct fetch with nothing after the GEMM, on a
  // device backend: kept on the device, then copied once into the staging
  // memory's host block (pinned on a CUDA worker), from which the fetch
  // streams; no pageable copy in between.
  if (gemm.has_out_staged() && !has_after && local_dtype == *out_dtype && backend_->KeepsOutputsOnDevice()) {
    if (staging_ == nullptr) return absl::FailedPreconditionError("out_staged: this worker has no staging area");
    local.keep_on_device = true;
    auto kept = TimeKernel([&] { return backend_->GroupedGemmToShard(local); });
    if (!kept.ok()) return WhyStopped(kept.status());
    if (kept->shape != local_out_shape) {
      return absl::InternalError(absl::StrCat("the GEMM gave ", ShapeToString(kept->shape), ", expected ",
                                              ShapeToString(local_out_shape)));
    }
    logging::TraceMark("local_op");
    reservation.Release();  // the block leaves the step's working memory for the staging area's budget
    const v1::StagingTicket& to = gemm.out_staged();
    // A GEMM the backend ran on the host gave host bytes (this step's alone): held as they are.
    absl::Status held =
        kept->host != nullptr
            ? staging_->Hold(to.ticket(), to.tenant(), std::move(*std::const_pointer_cast<HostTensor>(kept->host)))
            : staging_->HoldOutput(to.ticket(), to.tenant(), kept->dtype, kept->shape,
                                   [&](char* dst) { return backend_->CopyToHost(*kept, dst); });
    if (!held.ok()) return held;
    logging::TraceMark("held");
    v1::StepResult result;
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(kept->dtype));
    info->mutable_shape()->Assign(kept->shape.begin(), kept->shape.end());
    FinishResult(start, agreements, transfers_before, &result);
    return result;
  }
  absl::StatusOr<HostTensor> out = TimeKernel([&] { return backend_->GroupedGemm(local); });
  if (!out.ok()) out = WhyStopped(out.status());
  // A step whose only communication comes after its GEMM agrees after it
  // (fused into its all-reduce where it can), so a GEMM that fails on one
  // worker fails the step everywhere.
  const bool agree_after = agreeing && !agree_first && device_gather == nullptr &&
                           first_communicating->phase() == v1::PHASE_AFTER;
  if (agree_after && fused == nullptr) {
    absl::Status s = agree(out.status());
    if (!s.ok()) return s;
  }
  if (out.ok() && out->shape != local_out_shape) {
    out = absl::InternalError(absl::StrCat("the GEMM gave ", ShapeToString(out->shape), ", expected ",
                                           ShapeToString(local_out_shape)));
  }

  // Stage 4: after-collectives give the output its spec.
  for (const v1::CollectivePlan& c : gemm.collectives()) {
    if (c.phase() != v1::PHASE_AFTER) continue;
    if (&c == fused) {
      ++agreements;
      absl::Status s = AllReduceWithStatus(c, out.ok() ? &*out : nullptr, NumElementsOf(local_out_shape),
                                           out.status());
      if (!s.ok()) return s;
      continue;
    }
    if (!out.ok()) return out.status();
    auto next = ApplyCollective(c, *out);
    if (!next.ok()) return next.status();
    *out = std::move(*next);
  }
  if (!out.ok()) return out.status();
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
  } else if (gemm.has_out_staged()) {
    // Held here for the client's direct fetch: the result carries the header only.
    if (staging_ == nullptr) return absl::FailedPreconditionError("out_staged: this worker has no staging area");
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(out->dtype));
    info->mutable_shape()->Assign(out->shape.begin(), out->shape.end());
    reservation.Release();  // the block leaves the step's working memory for the staging area's budget
    if (auto s = staging_->Hold(gemm.out_staged().ticket(), gemm.out_staged().tenant(), std::move(*out)); !s.ok()) {
      return s;
    }
  } else if (gemm.has_out_shared_memory() || gemm.discard_output()) {
    // Into the client's region (or another worker writes this block): the
    // result carries the header only.
    if (gemm.has_out_shared_memory()) {
      if (auto s = WriteClientBlock(backend_, gemm.out_shared_memory(), out->dtype, out->shape, nullptr, &*out);
          !s.ok()) {
        return s;
      }
    }
    v1::LocalTensor* info = result.mutable_out();
    info->set_dtype(DTypeToProto(out->dtype));
    info->mutable_shape()->Assign(out->shape.begin(), out->shape.end());
  } else {
    HostTensorToProto(std::move(*out), result.mutable_out());
  }
  FinishResult(start, agreements, transfers_before, &result);
  return result;
}


absl::StatusOr<v1::StepResult> Executor::RunQuantize(v1::QuantizeStep& q) {
  const absl::Time start = absl::Now();
  const Backend::Transfers transfers_before = backend_->TransferCounts();
  int agreements = 0;
  auto out_dtype = DTypeFromProto(q.out_dtype(), "out_dtype");
  absl::Status prepared = out_dtype.status();
  if (prepared.ok()) prepared = CancelledStatus();
  Input x;
  if (prepared.ok()) {
    auto in = ResolveInput(std::move(*q.mutable_x()), *store_, staging_, backend_, /*on_device=*/false, "x");
    if (in.ok()) x = *in;
    else prepared = in.status();
    if (prepared.ok()) prepared = EnsureOnHost(backend_, &x);
  }
  bool before_communicates = false, within_communicates = false;
  for (const v1::CollectivePlan& c : q.collectives()) {
    const bool ok = (c.phase() == v1::PHASE_BEFORE && c.tensor() == v1::TENSOR_X) ||
                    (c.phase() == v1::PHASE_WITHIN && c.tensor() == v1::TENSOR_AMAX);
    if (!ok) {
      prepared.Update(absl::InvalidArgumentError(absl::StrCat(
          "a quantize step's collectives run on x before it or on amax within it, not on ",
          RoleName(c.tensor()), " (phase ", static_cast<int>(c.phase()), ")")));
    }
    (c.phase() == v1::PHASE_BEFORE ? before_communicates : within_communicates) |= Communicates(c);
  }
  std::vector<int64_t> x_shape = prepared.ok() ? x.tensor->shape : std::vector<int64_t>();
  for (const v1::CollectivePlan& c : q.collectives()) {
    if (!prepared.ok() || c.phase() != v1::PHASE_BEFORE) continue;
    auto next = ShapeAfter(c, x_shape);
    if (next.ok()) x_shape = std::move(*next);
    else prepared = next.status();
  }
  auto mode = KernelScalingMode(q.scaling(), q.block_2d());
  // Delayed scaling is kCurrent with given scales (LocalQuantize::scales).
  if (mode.ok() && *mode == ScalingMode::kDelayed) mode = ScalingMode::kCurrent;
  if (!mode.ok()) prepared.Update(mode.status());
  int64_t working_bytes = 0;
  if (prepared.ok()) {
    const int64_t elements = NumElementsOf(x_shape);
    working_bytes = elements * (q.rowwise() + q.colwise()) + elements * DTypeSize(x.tensor->dtype);
    prepared = store_->Reserve(working_bytes);
  }
  ShardStore::ScopedReservation reservation(store_, working_bytes, prepared.ok());
  // One agreement, right before the step's first collective. With no
  // before-collective, and every within one over the same group, it rides
  // along the first amax max-reduction (a flag element).
  const bool agree_first = q.agree() && before_communicates;
  const bool agree_within = q.agree() && !before_communicates && within_communicates;
  const std::vector<std::string> agree_axes = AgreementAxes();
  const v1::CollectivePlan* fused = nullptr;
  if (agree_within) {
    bool one_group = true;
    for (const v1::CollectivePlan& c : q.collectives()) {
      if (c.phase() != v1::PHASE_WITHIN || !Communicates(c)) continue;
      if (fused == nullptr) {
        fused = &c;
      } else if (!SameGroup(c, *fused)) {
        one_group = false;
      }
    }
    if (fused == nullptr || !one_group || fused->kind() != v1::COLLECTIVE_ALL_REDUCE_MAX) fused = nullptr;
  }
  const int64_t groups = q.group_sizes_size();
  if (agree_first) {
    ++agreements;
    prepared = collectives_->Agree(prepared, agree_axes);
  }
  if (!prepared.ok()) {
    // Its peers agree after their amax pass: this worker meets them there.
    if (fused != nullptr) {
      ++agreements;
      (void)AllReduceWithStatus(*fused, nullptr, groups, prepared);
    } else if (agree_within) {
      ++agreements;
      (void)collectives_->Agree(prepared, agree_axes);
    }
    return prepared;
  }

  absl::Status status;
  for (const v1::CollectivePlan& c : q.collectives()) {
    if (c.phase() != v1::PHASE_BEFORE) continue;
    auto next = ApplyCollective(c, *x.tensor);
    if (!next.ok()) return next.status();
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
  local.mode = *mode;
  local.group_sizes.assign(q.group_sizes().begin(), q.group_sizes().end());
  local.out_dtype = out_dtype.value_or(DType::kF8E4M3);
  local.rowwise = q.rowwise();
  local.colwise = q.colwise();
  std::vector<float> scales(q.scales().begin(), q.scales().end());
  if (q.scaling() == v1::DELAYED) local.scales = &scales;
  absl::StatusOr<QuantizeOutputs> out = TimeKernel([&] { return backend_->GroupedQuantize(local); });
  status = out.status();
  // Shared scales: the per-group amax is max-reduced over the shards that
  // split a group's rows, then the data is cast again with the shared scale.
  if (agree_within && fused == nullptr) {
    ++agreements;
    status = collectives_->Agree(status, agree_axes);
  }
  if (!status.ok() && fused == nullptr) return status;
  for (const v1::CollectivePlan& c : q.collectives()) {
    if (c.phase() != v1::PHASE_WITHIN) continue;
    absl::StatusOr<HostTensor> reduced = absl::UnknownError("not reduced");
    if (&c == fused) {
      ++agreements;
      HostTensor amax = status.ok() ? out->amax : HostTensor();
      absl::Status s = AllReduceWithStatus(c, status.ok() ? &amax : nullptr, groups, status);
      if (!s.ok()) return s;
      reduced = std::move(amax);
    } else {
      reduced = ApplyCollective(c, out->amax);
    }
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
    auto recast = TimeKernel([&] { return backend_->GroupedQuantize(again); });
    if (!recast.ok()) return recast.status();
    recast->amax = std::move(*reduced);
    *out = std::move(*recast);
  }

  v1::StepResult result;
  // An output the step keeps goes to the store under its shard name; the
  // result then names it.
  const std::string keep_data = q.keep_rowwise_data_as(), keep_scale = q.keep_scale_inv_as();
  if (!keep_scale.empty()) {
    auto gemm_scales = GemmScalesFromQuantize(local.mode, out->scale_inv, local.m, local.k, local.group_sizes);
    if (!gemm_scales.ok()) return gemm_scales.status();
    if (local.mode == ScalingMode::kBlock1x128 || local.mode == ScalingMode::kMxfp8) {
      // [M, K/b] with x's row dims: weights [G, N, K] keep [G, N, K/b].
      std::vector<int64_t> shape(x.tensor->shape.begin(), x.tensor->shape.begin() + flatten);
      shape.push_back(gemm_scales->shape.back());
      gemm_scales->shape = std::move(shape);
    }
    out->scale_inv = std::move(*gemm_scales);
  }
  if (!keep_data.empty() || !keep_scale.empty()) reservation.Release();
  absl::Status kept;
  auto add = [&](v1::TensorRole role, HostTensor&& t, const std::string& keep_as = "") {
    v1::StepOutput* o = result.add_outputs();
    o->set_role(role);
    if (keep_as.empty()) {
      HostTensorToProto(std::move(t), o->mutable_tensor());
      return;
    }
    o->mutable_tensor()->set_dtype(DTypeToProto(t.dtype));
    o->mutable_tensor()->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    o->mutable_tensor()->set_resident(keep_as);
    kept.Update(store_->Put(keep_as, std::move(t)));
  };
  if (local.rowwise) {
    out->rowwise_data.shape = x.tensor->shape;
    add(v1::TENSOR_ROWWISE_DATA, std::move(out->rowwise_data), keep_data);
  }
  if (local.colwise) {
    out->colwise_data.shape = x.tensor->shape;
    add(v1::TENSOR_COLWISE_DATA, std::move(out->colwise_data));
  }
  if (local.block_scaled()) {
    if (local.rowwise) add(v1::TENSOR_SCALE_INV, std::move(out->scale_inv), keep_scale);
    if (local.colwise) add(v1::TENSOR_COLWISE_SCALE_INV, std::move(out->colwise_scale_inv));
  } else {
    add(v1::TENSOR_SCALE_INV, std::move(out->scale_inv), keep_scale);
    add(v1::TENSOR_AMAX, std::move(out->amax));
  }
  if (!kept.ok()) {
    for (const std::string& name : {keep_data, keep_scale}) {
      if (!name.empty()) (void)store_->Delete(name);
    }
    return kept;
  }
  FinishResult(start, agreements, transfers_before, &result);
  return result;
}

int Executor::ForgetClientMemory(const v1::ForgetClientMemoryRequest& request) {
  std::vector<std::shared_ptr<const platform::SharedMemoryMapping>> mappings;
  for (const std::string& key : request.keys()) {
    for (auto& m : Mappings().Forget(key)) mappings.push_back(std::move(m));
  }
  const std::vector<std::string> handles(request.cuda_ipc_handles().begin(), request.cuda_ipc_handles().end());
  return static_cast<int>(mappings.size()) + backend_->ForgetClientMemory(mappings, handles);
}

}  // namespace shardgemm
