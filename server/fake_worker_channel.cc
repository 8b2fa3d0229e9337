#include "server/fake_worker_channel.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/host_tensor.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

struct FakeWorkerChannel::State {
  // Set when the last handle goes; delayed answers wait on it so that the
  // destructor can join their threads without sleeping out the delays.
  struct Stop {
    absl::Mutex mu;
    bool stopped ABSL_GUARDED_BY(mu) = false;
  };
  struct Held {
    v1::Step step;
    ExecuteDone done;
  };

  ~State();

  mutable absl::Mutex mu;
  std::vector<v1::Step> steps ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> cancelled ABSL_GUARDED_BY(mu);
  std::vector<v1::AdvanceEpochRequest> epochs ABSL_GUARDED_BY(mu);
  std::vector<v1::ExpectStagedRequest> expected ABSL_GUARDED_BY(mu);
  Handler handler ABSL_GUARDED_BY(mu);
  bool never_answer ABSL_GUARDED_BY(mu) = false;
  absl::Status ping ABSL_GUARDED_BY(mu);
  HoldIf hold_if ABSL_GUARDED_BY(mu);
  absl::Duration delay ABSL_GUARDED_BY(mu) = absl::ZeroDuration();
  std::vector<Held> held ABSL_GUARDED_BY(mu);
  std::vector<std::thread> threads ABSL_GUARDED_BY(mu);
  const std::shared_ptr<Stop> stop = std::make_shared<Stop>();

  // Its own lock: handlers run without `mu` and may reach the shards.
  mutable absl::Mutex shards_mu;
  std::map<std::string, v1::LocalTensor> shards ABSL_GUARDED_BY(shards_mu);
  int64_t budget ABSL_GUARDED_BY(shards_mu) = -1;
  absl::Status put_shard_status ABSL_GUARDED_BY(shards_mu);
  int put_shards ABSL_GUARDED_BY(shards_mu) = 0;

  // RESOURCE_EXHAUSTED unless `extra` more bytes fit the budget.
  absl::Status Fits(int64_t extra) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(shards_mu) {
    if (budget < 0) return absl::OkStatus();
    int64_t used = 0;
    for (const auto& [name, t] : shards) used += static_cast<int64_t>(t.data().size());
    if (used + extra <= budget) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat("fake worker: ", extra, " bytes more do not fit its budget of ",
                                                     budget, " (", used, " used)"));
  }
};

namespace {

// An operand of a GemmStep as a host tensor: inline, or a shard of `shards`.
absl::StatusOr<HostTensor> ResolveOperand(const v1::LocalTensor& t,
                                          const std::map<std::string, v1::LocalTensor>& shards,
                                          absl::string_view field) {
  if (t.source_case() == v1::LocalTensor::kResident) {
    auto it = shards.find(t.resident());
    if (it == shards.end()) {
      return absl::NotFoundError(absl::StrCat(field, ": no resident shard '", t.resident(), "' on this worker"));
    }
    return HostTensorFromProto(it->second, field);
  }
  return HostTensorFromProto(t, field);
}

// The local ragged-M grouped GEMM in FP32, each output element summed in
// increasing k from +0 (as the CPU kernels do), rows past the groups zero.
absl::StatusOr<HostTensor> LocalRaggedM(const v1::GemmStep& gemm, const HostTensor& lhs, const HostTensor& rhs,
                                        const HostTensor* bias) {
  for (const HostTensor* t : {&lhs, &rhs, bias}) {
    if (t != nullptr && t->dtype != DType::kF32) {
      return absl::UnimplementedError("the fake worker computes F32 operands only");
    }
  }
  const int64_t groups = gemm.group_sizes_size();
  if (lhs.shape.size() != 2 || rhs.shape.size() != 3 || rhs.shape[0] != groups) {
    return absl::InvalidArgumentError(absl::StrCat("fake worker: lhs ", ShapeToString(lhs.shape), ", rhs ",
                                                   ShapeToString(rhs.shape), " and ", groups,
                                                   " group sizes do not make a ragged-M GEMM"));
  }
  const int64_t m = lhs.shape[0], k = lhs.shape[1];
  const bool transposed = gemm.rhs_transposed();
  const int64_t n = transposed ? rhs.shape[1] : rhs.shape[2];
  if ((transposed ? rhs.shape[2] : rhs.shape[1]) != k) {
    return absl::InvalidArgumentError("fake worker: lhs and rhs disagree on K");
  }
  if (bias != nullptr && bias->shape != std::vector<int64_t>{groups, n}) {
    return absl::InvalidArgumentError("fake worker: bias must be [G, N]");
  }
  auto out = ZerosTensor(DType::kF32, {m, n});
  if (!out.ok()) return out.status();
  const float* a = lhs.data<float>();
  const float* b = rhs.data<float>();
  float* c = out->data<float>();
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = gemm.group_sizes(static_cast<int>(g));
    if (size < 0 || size > m - row) {
      return absl::InvalidArgumentError(absl::StrCat("fake worker: group_sizes pass the ", m, " rows"));
    }
    const float* w = b + g * k * n;
    for (int64_t i = row; i < row + size; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) {
          acc += a[i * k + kk] * (transposed ? w[j * k + kk] : w[kk * n + j]);
        }
        if (bias != nullptr) acc += bias->data<float>()[g * n + j];
        c[i * n + j] = acc;
      }
    }
    row += size;
  }
  return out;
}

}  // namespace

FakeWorkerChannel::State::~State() {
  {
    absl::MutexLock lock(&stop->mu);
    stop->stopped = true;
  }
  std::vector<std::thread> to_join;
  std::vector<Held> to_cancel;
  {
    absl::MutexLock lock(&mu);
    to_join.swap(threads);
    to_cancel.swap(held);
  }
  for (std::thread& t : to_join) t.join();
  // Exactly once, even for a step nobody will answer now.
  for (Held& h : to_cancel) h.done(absl::CancelledError("fake worker destroyed with the step held"));
}

FakeWorkerChannel::FakeWorkerChannel() : state_(std::make_shared<State>()) {}

void FakeWorkerChannel::ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) {
  (void)deadline;  // a hung or slow worker ignores it; the Coordinator's grace must not
  Handler handler;
  HoldIf hold_if;
  bool never;
  absl::Duration delay;
  {
    absl::MutexLock lock(&state_->mu);
    state_->steps.push_back(step);
    never = state_->never_answer;
    hold_if = state_->hold_if;
    handler = state_->handler;
    delay = state_->delay;
  }
  // The predicate runs unlocked: it may look at the fake.
  if (never || (hold_if && hold_if(step))) {
    absl::MutexLock lock(&state_->mu);
    state_->held.push_back({step, std::move(done)});
    return;
  }
  absl::StatusOr<v1::StepResult> result = handler ? handler(step) : RunTrivialWorker(step);
  if (delay <= absl::ZeroDuration()) {
    done(std::move(result));
    return;
  }
  // The thread holds only what it delivers, not the fake's state.
  std::thread answer([stop = state_->stop, delay, result = std::move(result), done = std::move(done)]() mutable {
    bool stopped;
    {
      absl::MutexLock lock(&stop->mu);
      stopped = stop->mu.AwaitWithTimeout(absl::Condition(&stop->stopped), delay);
    }
    if (stopped) {
      done(absl::CancelledError("fake worker destroyed before its delayed answer"));
    } else {
      done(std::move(result));
    }
  });
  absl::MutexLock lock(&state_->mu);
  state_->threads.push_back(std::move(answer));
}

absl::StatusOr<v1::LocalTensor> FakeWorkerChannel::GetShard(const std::string& name, absl::Time deadline) {
  (void)deadline;
  absl::MutexLock lock(&state_->shards_mu);
  auto it = state_->shards.find(name);
  if (it == state_->shards.end()) {
    return absl::NotFoundError(absl::StrCat("no resident shard '", name, "' on this worker"));
  }
  return it->second;
}

absl::Status FakeWorkerChannel::PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time) {
  absl::MutexLock lock(&state_->shards_mu);
  if (!state_->put_shard_status.ok()) return state_->put_shard_status;
  if (auto s = state_->Fits(static_cast<int64_t>(shard.data().size())); !s.ok()) return s;
  state_->shards[name] = shard;
  ++state_->put_shards;
  return absl::OkStatus();
}

void FakeWorkerChannel::SetMemoryBudget(int64_t bytes) {
  absl::MutexLock lock(&state_->shards_mu);
  state_->budget = bytes;
}

void FakeWorkerChannel::SetPutShardStatus(absl::Status status) {
  absl::MutexLock lock(&state_->shards_mu);
  state_->put_shard_status = std::move(status);
}

int FakeWorkerChannel::num_put_shards() const {
  absl::MutexLock lock(&state_->shards_mu);
  return state_->put_shards;
}

absl::Status FakeWorkerChannel::Ping(absl::Time deadline) {
  (void)deadline;
  absl::MutexLock lock(&state_->mu);
  return state_->ping;
}

void FakeWorkerChannel::SetPing(absl::Status status) {
  absl::MutexLock lock(&state_->mu);
  state_->ping = std::move(status);
}

void FakeWorkerChannel::SetHandler(Handler handler) {
  absl::MutexLock lock(&state_->mu);
  state_->handler = std::move(handler);
}

void FakeWorkerChannel::SetNeverAnswer(bool never) {
  absl::MutexLock lock(&state_->mu);
  state_->never_answer = never;
}

void FakeWorkerChannel::SetHoldIf(HoldIf hold) {
  absl::MutexLock lock(&state_->mu);
  state_->hold_if = std::move(hold);
}

void FakeWorkerChannel::SetAnswerDelay(absl::Duration delay) {
  absl::MutexLock lock(&state_->mu);
  state_->delay = delay;
}

int FakeWorkerChannel::AnswerHeld() {
  std::vector<State::Held> held;
  Handler handler;
  {
    absl::MutexLock lock(&state_->mu);
    held.swap(state_->held);
    handler = state_->handler;
  }
  // Outside the lock: `done` may send the Coordinator's next steps here.
  for (State::Held& h : held) h.done(handler ? handler(h.step) : RunTrivialWorker(h.step));
  return static_cast<int>(held.size());
}

std::vector<v1::Step> FakeWorkerChannel::steps() const {
  absl::MutexLock lock(&state_->mu);
  return state_->steps;
}

void FakeWorkerChannel::CancelSteps(const v1::CancelStepsRequest& request, absl::Time) {
  absl::MutexLock lock(&state_->mu);
  state_->cancelled.insert(state_->cancelled.end(), request.sequences().begin(), request.sequences().end());
}

void FakeWorkerChannel::AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time) {
  absl::MutexLock lock(&state_->mu);
  state_->epochs.push_back(request);
}

absl::Status FakeWorkerChannel::ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time) {
  absl::MutexLock lock(&state_->mu);
  state_->expected.push_back(request);
  return absl::OkStatus();
}

std::vector<v1::ExpectStagedRequest> FakeWorkerChannel::expected_staged() const {
  absl::MutexLock lock(&state_->mu);
  return state_->expected;
}

std::vector<v1::AdvanceEpochRequest> FakeWorkerChannel::epoch_advances() const {
  absl::MutexLock lock(&state_->mu);
  return state_->epochs;
}

std::vector<uint64_t> FakeWorkerChannel::cancelled() const {
  absl::MutexLock lock(&state_->mu);
  return state_->cancelled;
}

int FakeWorkerChannel::num_steps() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->steps.size());
}

int FakeWorkerChannel::num_held() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->held.size());
}

bool FakeWorkerChannel::AwaitHeld(int n, absl::Duration timeout) const {
  State* state = state_.get();
  auto enough = [state, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
    return static_cast<int>(state->held.size()) >= n;
  };
  absl::MutexLock lock(&state->mu);
  return state->mu.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

std::vector<std::string> FakeWorkerChannel::shard_names() const {
  absl::MutexLock lock(&state_->shards_mu);
  std::vector<std::string> names;
  for (const auto& [name, unused] : state_->shards) names.push_back(name);
  return names;
}

absl::optional<v1::LocalTensor> FakeWorkerChannel::shard(const std::string& name) const {
  absl::MutexLock lock(&state_->shards_mu);
  auto it = state_->shards.find(name);
  if (it == state_->shards.end()) return absl::nullopt;
  return it->second;
}

absl::StatusOr<v1::StepResult> FakeWorkerChannel::RunTrivialWorker(const v1::Step& step) {
  absl::MutexLock lock(&state_->shards_mu);
  auto& shards = state_->shards;
  for (const std::string& name : step.release_shards()) shards.erase(name);  // as the executor does
  switch (step.op_case()) {
    case v1::Step::kStore: {
      const v1::StoreShardStep& store = step.store();
      int64_t bytes = 0;
      if (!store.name().empty()) {
        if (store.shard().source_case() != v1::LocalTensor::kData) {
          return absl::InvalidArgumentError("fake worker: a stored shard must carry its data");
        }
        bytes += static_cast<int64_t>(store.shard().data().size());
      }
      for (const v1::NamedShard& standby : store.standby()) {
        bytes += static_cast<int64_t>(standby.shard().data().size());
      }
      if (auto s = state_->Fits(bytes); !s.ok()) return s;
      if (!store.name().empty()) shards[store.name()] = store.shard();
      for (const v1::NamedShard& standby : store.standby()) shards[standby.name()] = standby.shard();
      return v1::StepResult();
    }
    case v1::Step::kDeleteShard: {
      for (const std::string& standby : step.delete_shard().standby()) shards.erase(standby);
      if (shards.erase(step.delete_shard().name()) == 0) {
        return absl::NotFoundError(
            absl::StrCat("no resident shard '", step.delete_shard().name(), "' on this worker"));
      }
      return v1::StepResult();
    }
    case v1::Step::kGemm: {
      const v1::GemmStep& gemm = step.gemm();
      if (gemm.ragged() != v1::GroupedGemmRequest::RAGGED_M) {
        return absl::UnimplementedError("the fake worker runs ragged-M GEMMs only");
      }
      if (gemm.collectives_size() > 0) {
        return absl::UnimplementedError("the fake worker runs no collectives");
      }
      if (gemm.out_dtype() != v1::DTYPE_UNSPECIFIED && gemm.out_dtype() != v1::F32) {
        return absl::UnimplementedError("the fake worker writes F32 outputs only");
      }
      auto lhs = ResolveOperand(gemm.lhs(), shards, "lhs");
      if (!lhs.ok()) return lhs.status();
      auto rhs = ResolveOperand(gemm.rhs(), shards, "rhs");
      if (!rhs.ok()) return rhs.status();
      absl::optional<HostTensor> bias;
      if (gemm.apply_bias()) {
        auto b = ResolveOperand(gemm.bias(), shards, "bias");
        if (!b.ok()) return b.status();
        bias = std::move(*b);
      }
      auto out = LocalRaggedM(gemm, *lhs, *rhs, bias ? &*bias : nullptr);
      if (!out.ok()) return out.status();
      v1::StepResult result;
      if (!gemm.keep_output_as().empty()) {
        v1::LocalTensor* info = result.mutable_out();
        info->set_dtype(v1::F32);
        info->mutable_shape()->Assign(out->shape.begin(), out->shape.end());
        info->set_resident(gemm.keep_output_as());
        HostTensorToProto(std::move(*out), &shards[gemm.keep_output_as()]);
      } else {
        HostTensorToProto(std::move(*out), result.mutable_out());
      }
      return result;
    }
    default:
      return absl::UnimplementedError("the fake worker does not run that kind of step");
  }
}

FakeWorkerChannel FakeMesh::Fakes::Get(const std::string& address) {
  absl::MutexLock lock(&mu);
  return by_address[address];  // default-constructed: a new trivial worker
}

std::string FakeMesh::Address(int i) { return absl::StrCat("fake:", i); }

FakeWorkerChannel FakeMesh::fake(const std::string& address) { return fakes_->Get(address); }

int FakeMesh::connects(const std::string& address) const {
  absl::MutexLock lock(&fakes_->mu);
  auto it = fakes_->connects.find(address);
  return it == fakes_->connects.end() ? 0 : it->second;
}

absl::StatusOr<v1::RegisterResponse> FakeMesh::Register(const std::string& address,
                                                        int64_t memory_budget_bytes, const std::string& backend,
                                                        const std::string& staging_address) {
  v1::RegisterRequest request;
  request.set_address(address);
  request.set_staging_address(staging_address);
  request.set_backend(backend);
  request.set_device("in-process");
  request.set_memory_budget_bytes(memory_budget_bytes);
  return coordinator_->Register(request);
}

absl::StatusOr<std::unique_ptr<FakeMesh>> FakeMesh::Create(absl::string_view mesh_text, Options options) {
  auto mesh = planner::ParseMesh(mesh_text, options.roles);
  if (!mesh.ok()) return mesh.status();
  std::unique_ptr<FakeMesh> fake_mesh(new FakeMesh());
  std::shared_ptr<Fakes> fakes = fake_mesh->fakes_;
  Coordinator::Connector connect = [fakes](const std::string& address) -> std::unique_ptr<WorkerChannel> {
    FakeWorkerChannel channel = fakes->Get(address);
    {
      absl::MutexLock lock(&fakes->mu);
      ++fakes->connects[address];
    }
    return std::make_unique<FakeWorkerChannel>(channel);
  };
  fake_mesh->coordinator_ = std::make_unique<Coordinator>(*mesh, std::move(connect), options.coordinator);
  const int workers = options.workers < 0 ? static_cast<int>(planner::NumWorkers(*mesh)) : options.workers;
  for (int i = 0; i < workers; ++i) {
    auto r = fake_mesh->Register(Address(i), options.memory_budget_bytes, options.backend,
                                 options.staging ? absl::StrCat("staging:", i) : "");
    if (!r.ok()) return r.status();
  }
  return fake_mesh;
}

}  // namespace shardgemm
