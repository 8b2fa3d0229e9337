#include "server/coordinator.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>

#include <cstring>
#include <limits>
#include <map>
#include <thread>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/types/optional.h"
#include "kernels/cpu/quantize.h"
#include "proto/tensor_codec.h"
#include "kernels/quantize_assembly.h"
#include "logging/log.h"
#include "proto/plan_codec.h"
#include "server/block_runs.h"
#include "server/output_assembly.h"
#include "server/row_routing.h"
#include "server/step_builder.h"
#include "security/tokens.h"

namespace shardgemm {

namespace {

absl::Status SharedMemoryOff(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": shared memory is off on this coordinator (start it with --shared_memory; the workers must share "
            "the client's host)"));
}
// 128 random bits: a session a peer cannot guess (steps and rendezvous keys carry it).
std::string MakeSessionId() {
  absl::BitGen gen;
  return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16),
                      absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
}
}  // namespace

Coordinator::Coordinator(planner::Mesh mesh, Connector connect, CoordinatorOptions options)
    : options_(options),
      mesh_(std::move(mesh)),
      num_workers_(static_cast<int>(planner::NumWorkers(mesh_))),
      session_(MakeSessionId()),
      dispatcher_(mesh_, std::move(connect), options_.dispatch_grace, options_.prefer_local_socket, session_,
                  options_.prefer_step_socket) {
  {
    absl::MutexLock lock(&heartbeat_mu_);
    missed_.assign(num_workers_, 0);
  }
  if (options_.heartbeat_interval > absl::ZeroDuration()) {
    heartbeat_ = std::thread([this] {
      absl::MutexLock lock(&heartbeat_mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(heartbeat_mu_) { return stopping_; };
      while (!heartbeat_mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.heartbeat_interval)) {
        heartbeat_mu_.Unlock();
        Heartbeat();
        heartbeat_mu_.Lock();
      }
    });
  }
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&heartbeat_mu_);
    stopping_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  std::vector<Restorer> restorers;
  {
    absl::MutexLock lock(&restore_mu_);
    restore_stopping_ = true;  // a restore in progress stops after its current call
    restorers.swap(restorers_);
  }
  for (Restorer& r : restorers) r.thread.join();
  // Requests still waiting on their workers are answered now, while the
  // registry their completion touches is still here (members go after).
  AbandonRequests();
}

absl::Status Coordinator::MakeDurable(const std::string& state_dir) {
  return registry_.MakeDurable(absl::StrCat(state_dir, "/registry.pb"));
}

void Coordinator::Heartbeat() {
  const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
  // A ping waits one interval, and at least 2 s: a loaded machine (every
  // core busy with steps) answers late, which is not being dead. A killed
  // worker's ping fails at once (connection refused).
  const absl::Duration wait = std::max(options_.heartbeat_interval, absl::Seconds(2));
  for (int r = 0; r < static_cast<int>(channels.size()); ++r) {
    if (channels[r] == nullptr) continue;
    const absl::Status s = channels[r]->Ping(absl::Now() + wait);
    int missed = 0;
    {
      absl::MutexLock lock(&heartbeat_mu_);
      missed = s.ok() ? 0 : ++missed_[r];
    }
    if (s.ok()) {
      dispatcher_.MarkUp(r, channels[r].get());
    } else if (missed >= options_.heartbeat_misses) {
      dispatcher_.MarkDown(r, absl::Status(s.code(), absl::StrCat(missed, " heartbeats missed (", s.message(), ")")),
                           channels[r].get());
    }
  }
  if (options_.allow_shared_memory) ForgetGoneClientMemory(/*wait=*/false);  // regions whose lease lapsed
}

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  const uint64_t epoch = next_epoch_.fetch_add(1);
  std::set<std::string> held;
  ResidentRegistry::Rejoin rejoin;
  // What the worker lacks is marked while its rank is being joined: no step
  // reaches it, and the mesh does not look complete, before then.
  auto joined = dispatcher_.Join(request, [&](const Dispatcher::Joined& j) {
    // Shards count only on the rank they were stored for: a worker given
    // another rank than the one it held holds none of this rank's blocks.
    if (!request.has_previous_rank() || request.previous_rank() == j.rank) {
      held.insert(request.shards().begin(), request.shards().end());
    }
    {
      absl::MutexLock lock(&restore_mu_);
      if (rank_epoch_.size() != static_cast<size_t>(num_workers_)) rank_epoch_.resize(num_workers_, 0);
      rank_epoch_[j.rank] = epoch;
    }
    if (j.rejoined) {
      // A resident tensor has a copy on every rank: one this worker lacks (a
      // restarted process holds none) is restored from the others' copies
      // with --replicas of 2 or more, and lost otherwise (never served from
      // what the other ranks still have).
      rejoin = registry_.Rejoined(j.rank, held,
                                  epoch, absl::StrCat("worker rank ", j.rank, " (", request.address(),
                                                      ") rejoined without its shard"));
    }
  });
  if (!joined.ok()) return joined.status();
  {
    absl::MutexLock lock(&heartbeat_mu_);
    missed_[joined->rank] = 0;  // a new worker does not inherit its rank's missed heartbeats
  }
  std::vector<RestoreTask> restore = std::move(rejoin.restore);
  {
    absl::MutexLock lock(&reconcile_mu_);
    if (reported_.size() != static_cast<size_t>(num_workers_)) reported_.resize(num_workers_);
    if (has_reported_.size() != static_cast<size_t>(num_workers_)) has_reported_.resize(num_workers_, false);
    reported_[joined->rank] = held;
    has_reported_[joined->rank] = true;
    // Every rank's own report first: another worker's registration may have
    // completed the mesh before this thread got here with its shards.
    const bool all_reported = std::all_of(has_reported_.begin(), has_reported_.end(), [](bool b) { return b; });
    if (!reconciled_ && all_reported && dispatcher_.Complete()) {
      reconciled_ = true;
      std::vector<uint64_t> epochs;
      {
        absl::MutexLock epochs_lock(&restore_mu_);
        epochs = rank_epoch_;
      }
      std::vector<std::string> orphans;
      ResidentRegistry::Rejoin reconciled = registry_.Reconcile(reported_, epochs, &orphans);
      for (RestoreTask& t : reconciled.restore) restore.push_back(std::move(t));
      for (const std::string& shard : orphans) dispatcher_.Release(shard);  // with the next step
    }
  }
  StartRestores(std::move(restore));
  v1::RegisterResponse response;
  response.set_rank(joined->rank);
  response.set_session(session_);
  response.set_next_sequence(joined->next_sequence);
  *response.mutable_mesh() = MeshToProto(mesh_);
  return response;
}

v1::ClusterInfo Coordinator::ClusterInfo() const {
  v1::ClusterInfo info;
  *info.mutable_mesh() = MeshToProto(mesh_);
  info.set_workers_expected(num_workers_);
  info.set_version("shardgemm v1");
  for (v1::WorkerInfo& w : dispatcher_.Workers()) *info.add_workers() = std::move(w);
  info.set_ready(dispatcher_.Complete());
  info.set_replicas(options_.replicas);
  const std::vector<int64_t> standby = registry_.StandbyBytesByRank(num_workers_);
  for (v1::WorkerInfo& w : *info.mutable_workers()) {
    if (w.rank() >= 0 && w.rank() < num_workers_) w.set_standby_bytes(standby[w.rank()]);
  }
  info.set_epoch(dispatcher_.epoch());
  info.set_inline_activation_bytes(inline_activation_bytes_.load());
  info.set_direct_activation_bytes(direct_activation_bytes_.load());
  return info;
}

Coordinator::Stats Coordinator::GetStats() const {
  Stats stats;
  stats.workers_expected = num_workers_;
  const std::vector<v1::WorkerInfo> workers = dispatcher_.Workers();
  stats.workers_registered = static_cast<int>(workers.size());
  stats.up.assign(num_workers_, false);
  for (const v1::WorkerInfo& w : workers) {
    if (w.rank() >= 0 && w.rank() < num_workers_) stats.up[w.rank()] = !w.down();
  }
  stats.ready = dispatcher_.Complete();
  for (const v1::ResidentTensorInfo& t : registry_.ListAll()) {
    ++stats.resident_tensors;
    auto dtype = DTypeFromProto(t.dtype(), "dtype");
    if (!dtype.ok()) continue;
    int64_t elements = 1;
    for (int64_t d : t.shape()) elements *= d;
    stats.resident_bytes += elements * DTypeSize(*dtype);
  }
  stats.standby_bytes = registry_.StandbyBytesByRank(num_workers_);
  stats.restoring_tensors = registry_.RestoringCount();
  {
    absl::MutexLock lock(&restore_mu_);
    stats.restored = restored_;
    stats.restore_failures = restore_failures_;
    stats.restored_bytes = restored_bytes_;
  }
  stats.inline_activation_bytes = inline_activation_bytes_.load();
  stats.direct_activation_bytes = direct_activation_bytes_.load();
  stats.dispatch = dispatcher_.GetStats();
  return stats;
}

absl::Status Coordinator::CheckTensorFits(const std::string& name, int64_t bytes) const {
  if (auto s = CheckReady(); !s.ok()) return s;
  int64_t total = 0;
  bool unbounded = false;
  for (const v1::WorkerInfo& w : dispatcher_.Workers()) {
    const int64_t budget = w.memory_budget_bytes();
    if (budget <= 0) unbounded = true;
    // Saturating: budgets a worker reports are not to be trusted to sum.
    total = budget > std::numeric_limits<int64_t>::max() - total ? std::numeric_limits<int64_t>::max()
                                                                 : total + budget;
  }
  // Every block lives on `replicas` workers.
  const int64_t copies = options_.replicas;
  const int64_t needed = bytes > std::numeric_limits<int64_t>::max() / copies ? std::numeric_limits<int64_t>::max()
                                                                              : bytes * copies;
  if (!unbounded && needed > total) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shape: tensor '", name, "' needs ", needed, " bytes",
                     copies > 1 ? absl::StrCat(" (", copies, " copies, --replicas)") : "", ", more than the ",
                     num_workers_, " workers' memory budgets together (", total, ")"));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::CheckReady() const { return dispatcher_.CheckComplete(); }

absl::Time Coordinator::StepDeadline(absl::Time client_deadline) const {
  return std::min(client_deadline, absl::Now() + options_.step_timeout);
}

absl::StatusOr<std::vector<v1::StepResult>> Coordinator::Dispatch(std::vector<v1::Step> steps,
                                                                  absl::Time deadline,
                                                                  const CallContext& call) {
  for (v1::Step& s : steps) {
    s.set_session(session_);
    if (!call.request_id.empty()) s.set_request_id(call.request_id);
  }
  return dispatcher_.Dispatch(std::move(steps), deadline, call.cancelled);
}

absl::StatusOr<planner::Plan> Coordinator::MakePlan(const planner::PlanRequest& request) const {
  auto plan = plan_cache_.Get(request);
  if (!plan.ok()) return plan.status();
  return **plan;
}

void Coordinator::DispatchThen(std::vector<v1::Step> steps, absl::Time deadline, const CallContext& call,
                               Dispatcher::DispatchDone done) {
  for (v1::Step& s : steps) {
    s.set_session(session_);
    if (!call.request_id.empty()) s.set_request_id(call.request_id);
  }
  if (call.cancellation == nullptr) {
    dispatcher_.DispatchAsync(std::move(steps), deadline, std::move(done));
    return;
  }
  std::shared_ptr<Cancellation> cancellation = call.cancellation;
  std::shared_ptr<PendingDispatch> pending = dispatcher_.DispatchAsync(
      std::move(steps), deadline,
      [cancellation, done = std::move(done)](absl::StatusOr<std::vector<v1::StepResult>> results) {
        cancellation->Clear();
        done(std::move(results));
      });
  // The client's cancellation ends the dispatch at once (not when its
  // workers answer); a dispatch done already ignores it.
  std::weak_ptr<PendingDispatch> weak = pending;
  cancellation->OnCancel([weak] {
    if (auto p = weak.lock()) p->Cancel();
  });
}

void Coordinator::Unpin(const std::vector<std::string>& pins) {
  for (const ShardCopies& copies : registry_.Unpin(pins)) DeleteShardsBestEffort(copies);
}

absl::Status Coordinator::Retire(const ShardCopies& copies, absl::Time deadline, const CallContext& call) {
  if (!registry_.Retire(copies)) return absl::OkStatus();  // deleted after its last request
  return DeleteShards(copies, deadline, call);
}

absl::Status Coordinator::DeleteShards(const ShardCopies& copies, absl::Time deadline, const CallContext& call) {
  std::vector<v1::Step> steps(num_workers_);
  for (int r = 0; r < num_workers_; ++r) {
    v1::DeleteShardStep* del = steps[r].mutable_delete_shard();
    del->set_name(copies.shard_name);
    for (std::string& standby : copies.StandbyNamesOn(r)) del->add_standby(std::move(standby));
  }
  auto results = Dispatch(std::move(steps), StepDeadline(deadline), call);
  // A worker without the shard (replaced since) has nothing to delete.
  if (!results.ok() && results.status().code() != absl::StatusCode::kNotFound) return results.status();
  return absl::OkStatus();
}

void Coordinator::DeleteShardsBestEffort(const ShardCopies& copies) {
  // Rides on the next step, in the global order: no step of its own, and no
  // caller waits for it. Until then the shard holds its workers' memory; a
  // step that needs the room drops it first. Every worker is sent every
  // name (one holds no standby copy of its own block: a missing name is no error).
  for (const std::string& name : copies.AllNames()) dispatcher_.Release(name);
}

void Coordinator::RetireBestEffort(const ShardCopies& copies) {
  if (registry_.Retire(copies)) DeleteShardsBestEffort(copies);
}

absl::StatusOr<Coordinator::Placement> Coordinator::Place(const std::string& name, DType dtype,
                                                          const std::vector<int64_t>& shape,
                                                          const planner::PartitionSpec& spec) const {
  Placement placement;
  auto owners = BlockOwners(mesh_, name, shape, spec);
  if (!owners.ok()) return owners.status();
  placement.block_of_rank = std::move(*owners);
  if (options_.replicas <= 1) return placement;
  auto local = planner::LocalShape(name, shape, spec, mesh_);
  if (!local.ok()) return local.status();
  int64_t block_bytes = DTypeSize(dtype);
  for (int64_t d : *local) block_bytes *= d;
  auto standby = PlaceStandbyCopies(placement.block_of_rank, options_.replicas, block_bytes,
                                    registry_.ResidentBytesByRank(num_workers_));
  if (!standby.ok()) return standby.status();
  placement.standby = std::move(*standby);
  return placement;
}

void Coordinator::SetPlacement(const Placement& placement, Resident* resident) const {
  resident->block_of_rank = placement.block_of_rank;
  resident->standby = placement.standby;
  resident->info.set_replicas(options_.replicas);
}

absl::Status Coordinator::StoreStandbyOfKept(const std::string& shard_name, const Placement& placement,
                                             absl::Time deadline, const CallContext& call) {
  if (placement.standby.empty()) return absl::OkStatus();
  const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
  const absl::Time step_deadline = StepDeadline(deadline);
  // Through the coordinator: the Worker service answers only the
  // coordinator, and the store step keeps its place in the global order.
  std::map<int, v1::LocalTensor> blocks;  // by block rank, each read once
  for (const StandbyCopy& c : placement.standby) {
    if (blocks.count(c.block_rank) > 0) continue;
    if (channels[c.block_rank] == nullptr) {
      return absl::UnavailableError(absl::StrCat("worker rank ", c.block_rank, " is gone"));
    }
    auto block = channels[c.block_rank]->GetShard(shard_name, step_deadline);
    if (!block.ok()) {
      return absl::Status(block.status().code(), absl::StrCat("reading worker rank ", c.block_rank,
                                                              "'s block for its standby copies: ",
                                                              block.status().message()));
    }
    blocks[c.block_rank] = std::move(*block);
  }
  std::vector<v1::Step> steps(num_workers_);
  for (v1::Step& step : steps) step.mutable_store();  // ranks that hold no copy store nothing
  for (const StandbyCopy& c : placement.standby) {
    v1::NamedShard* copy = steps[c.holder_rank].mutable_store()->add_standby();
    copy->set_name(StandbyShardName(shard_name, c.block_rank));
    *copy->mutable_shard() = blocks[c.block_rank];
  }
  return Dispatch(std::move(steps), step_deadline, call).status();
}

absl::Status Coordinator::ExplainMissingShard(absl::Status status, const std::string& tenant,
                                              const std::vector<std::string>& names) const {
  if (status.code() != absl::StatusCode::kNotFound) return status;
  for (const std::string& name : names) {
    absl::Status now = registry_.Find(tenant, name).status();
    if (now.code() == absl::StatusCode::kUnavailable || now.code() == absl::StatusCode::kDataLoss) return now;
  }
  return status;
}

namespace {

// A failure a retry may get past (a worker restarting, a slow link).
bool MayPass(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

// One restore call (a read or a store) waits at most this long, and a
// failed attempt is tried again after kRestoreRetry.
constexpr absl::Duration kRestoreCallTimeout = absl::Seconds(30);
constexpr absl::Duration kRestoreRetry = absl::Milliseconds(500);

}  // namespace

void Coordinator::StartRestores(std::vector<RestoreTask> tasks) {
  if (tasks.empty()) return;
  absl::MutexLock lock(&restore_mu_);
  if (restore_stopping_) return;
  std::vector<Restorer> live;
  for (Restorer& r : restorers_) {
    if (r.done->load()) {
      r.thread.join();
    } else {
      live.push_back(std::move(r));
    }
  }
  restorers_ = std::move(live);
  auto done = std::make_shared<std::atomic<bool>>(false);
  restorers_.push_back(Restorer{std::thread([this, tasks = std::move(tasks), done] {
                                  RunRestores(tasks);
                                  done->store(true);
                                }),
                                done});
}

void Coordinator::RunRestores(const std::vector<RestoreTask>& tasks) {
  for (const RestoreTask& task : tasks) {
    {
      absl::MutexLock lock(&restore_mu_);
      if (restore_stopping_) return;  // the coordinator is going: a restart finds the copies missing again
    }
    const absl::Time start = absl::Now();
    PinGuard guard{this, {}};  // the generation stays on the workers while it is copied
    registry_.Pin(task.shard_name, &guard.pins);
    int64_t bytes = 0;
    const absl::StatusOr<bool> restored = RestoreOne(task, StepDeadline(absl::InfiniteFuture()), &bytes);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (restored.ok() && !*restored) continue;  // overtaken, or stopping: not this task's to end
    if (restored.ok()) {
      const bool whole = registry_.FinishRestoring(task);
      {
        absl::MutexLock lock(&restore_mu_);
        ++restored_;
        restored_bytes_ += bytes;
      }
      logging::ProcessLogger().Log(logging::Level::kInfo, "restored",
                                   {{"tensor", task.name}, {"rank", task.rank}, {"bytes", bytes},
                                    {"elapsed_ms", seconds * 1e3}, {"whole", whole}});
      continue;
    }
    const std::string why = absl::StrCat("worker rank ", task.rank,
                                         " took a replaced worker's rank and its copies could not be restored: ",
                                         restored.status().message());
    registry_.FailRestoring(task, why);
    {
      absl::MutexLock lock(&restore_mu_);
      ++restore_failures_;
    }
    logging::ProcessLogger().Log(logging::Level::kWarning, "restore_failed",
                                 {{"tensor", task.name}, {"rank", task.rank}, {"message", why}});
  }
}

absl::StatusOr<bool> Coordinator::RestoreOne(const RestoreTask& task, absl::Time deadline, int64_t* bytes) {
  // Through the coordinator, read from a surviving copy (GetShard) and
  // stored on the new worker (PutShard): the Worker service answers only
  // the coordinator, so workers do not call each other.
  std::set<std::string> done;
  while (true) {
    const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
    const std::shared_ptr<WorkerChannel> target = channels[task.rank];
    if (target == nullptr) return absl::UnavailableError(absl::StrCat("worker rank ", task.rank, " is gone"));
    absl::Status failed;
    bool may_pass = false;
    for (const std::string& name : task.missing) {
      if (done.count(name) > 0) continue;
      auto sources = registry_.RestoreSources(task, name);
      if (!sources.ok()) return false;  // deleted, replaced, or the rank registered again
      absl::Status copied = absl::NotFoundError("no other worker holds a copy");
      for (const CopySource& source : *sources) {
        if (channels[source.rank] == nullptr) continue;
        const absl::Time until = std::min(deadline, absl::Now() + kRestoreCallTimeout);
        auto shard = channels[source.rank]->GetShard(source.shard_name, until);
        if (!shard.ok()) {
          copied = absl::Status(shard.status().code(), absl::StrCat("reading the copy on worker rank ", source.rank,
                                                                    ": ", shard.status().message()));
          may_pass |= MayPass(shard.status().code());
          continue;  // another copy may answer
        }
        const absl::Status put = target->PutShard(name, *shard, until);
        if (!put.ok()) {
          copied = absl::Status(put.code(),
                                absl::StrCat("storing it on worker rank ", task.rank, ": ", put.message()));
          may_pass |= MayPass(put.code());
          break;  // the target failed: another source will not help
        }
        *bytes += static_cast<int64_t>(shard->data().size());
        copied = absl::OkStatus();
        break;
      }
      if (!copied.ok()) {
        failed = copied;
        break;
      }
      done.insert(name);
    }
    if (failed.ok()) return true;
    if (!may_pass || absl::Now() + kRestoreRetry >= deadline) return failed;
    if (dispatcher_.Channels()[task.rank] != target) return false;  // taken again: its registration restores
    absl::MutexLock lock(&restore_mu_);
    if (restore_mu_.AwaitWithTimeout(absl::Condition(&restore_stopping_), kRestoreRetry)) return false;
  }
}

namespace {

// A claimed name, released unless registered.
// A request whose caller has gone (its deadline passed while the workers
// finished, or it was cancelled) keeps nothing: the error says so, and the
// caller retries from where it stood.
absl::Status Abandoned(absl::Time deadline, const CallContext& call, absl::string_view what) {
  if (call.cancelled && call.cancelled()) {
    return absl::CancelledError(absl::StrCat("the request was cancelled; ", what, " was not kept"));
  }
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("the request's deadline passed as the workers finished; ", what, " was not kept"));
  }
  return absl::OkStatus();
}

class ClaimGuard {
 public:
  ClaimGuard(ResidentRegistry* registry, std::string tenant, std::string name)
      : registry_(registry), tenant_(std::move(tenant)), name_(std::move(name)) {}
  ClaimGuard(const ClaimGuard&) = delete;
  ClaimGuard& operator=(const ClaimGuard&) = delete;
  ~ClaimGuard() {
    if (!registered_) registry_->Release(tenant_, name_);
  }
  // Registers the claimed tensor; returns the generation it replaced.
  // The registry released the claim either way.
  absl::StatusOr<ShardCopies> Register(Resident resident) {
    registered_ = true;
    return registry_->Register(std::move(resident));
  }
  // The claim is taken care of elsewhere (ResidentRegistry::RegisterAll).
  void Registered() { registered_ = true; }
  // Lets the name go now, for a put that can no longer register (its client
  // is told at once and may put the name again).
  void ReleaseNow() {
    if (registered_) return;
    registry_->Release(tenant_, name_);
    registered_ = true;
  }

 private:
  ResidentRegistry* registry_;
  std::string tenant_, name_;
  bool registered_ = false;
};

// A synchronous caller's wait for an answer that comes on another thread.
template <typename T>
class Answer {
 public:
  void Set(absl::StatusOr<T> value) {
    absl::MutexLock lock(&mu_);
    if (!value_.has_value()) value_ = std::move(value);
  }
  // Until the answer comes or `until`; `cancelled` (optional) is polled and,
  // once true, cancels `cancellation` (which answers at once).
  absl::StatusOr<T> Wait(absl::Time until, const std::function<bool()>& cancelled = nullptr,
                         Cancellation* cancellation = nullptr) {
    absl::MutexLock lock(&mu_);
    auto have = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return value_.has_value(); };
    while (!have() && absl::Now() < until) {
      if (cancelled != nullptr && cancellation != nullptr && cancelled()) {
        mu_.Unlock();
        cancellation->Cancel();
        mu_.Lock();
        if (have()) break;
      }
      mu_.AwaitWithDeadline(absl::Condition(&have),
                            cancelled == nullptr ? until : std::min(until, absl::Now() + kCancelPoll));
    }
    if (!have()) return absl::DeadlineExceededError("no answer from the workers by the step's deadline and grace");
    return std::move(*value_);
  }

 private:
  static constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);
  absl::Mutex mu_;
  absl::optional<absl::StatusOr<T>> value_ ABSL_GUARDED_BY(mu_);
};

// Past a dispatch's own bound (its deadline and grace), how long a
// synchronous caller still waits for the answer to be delivered.
constexpr absl::Duration kAnswerMargin = absl::Seconds(1);
// Requests and results larger than this are decoded and assembled on a
// thread of their own, not on the gRPC thread that delivered them.
constexpr size_t kOffloadBytes = size_t{1} << 20;

}  // namespace

// A GEMM request between its dispatch and its workers' answers.
struct Coordinator::GemmCall {
  explicit GemmCall(Coordinator* coordinator) : guard{coordinator, {}} {}
  const v1::GroupedGemmRequest* request = nullptr;  // the caller's: outlives the call
  absl::Time start;
  absl::Time dispatched, answered;  // the steps sent, the last answer back
  absl::Time deadline;
  CallContext call;
  PinGuard guard;  // the resident operands, pinned until the call is done
  planner::Plan plan;
  std::string shard_name;              // keep_output_as's new generation
  std::unique_ptr<ClaimGuard> claim;   // keep_output_as's name, released unless registered
  HostTensor* out_tensor = nullptr;
  bool out_to_shared_memory = false;  // the workers wrote the output into the client's region
  bool direct = false;  // staged operands or a direct output: the direct path's bytes
  std::vector<v1::StagedBlock> out_blocks;  // direct_output: where each distinct block is held
  TicketsByRank staged_tickets;  // its transfer plans' blocks: dropped if it fails
  std::vector<v1::Step> steps;
};

absl::StatusOr<v1::PutTensorResponse> Coordinator::PutTensor(const std::string& name,
                                                             HostTensor tensor,
                                                             const std::string& spec_text,
                                                             bool overwrite, absl::Time deadline,
                                                             const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  if (auto s = ValidateResidentName("name", name); !s.ok()) return s;
  auto spec = planner::ParsePartitionSpec(spec_text);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", spec.status().message()));
  }
  if (auto s = planner::ValidatePartitionSpec(name, tensor.shape, *spec, mesh_); !s.ok()) return s;
  auto claimed = registry_.Claim(call.tenant, name, overwrite, options_.max_tensors_per_tenant);
  if (!claimed.ok()) {
    const bool exists = claimed.status().code() == absl::StatusCode::kAlreadyExists;
    return absl::Status(claimed.status().code(), absl::StrCat(claimed.status().message(),
                                                              exists ? " (set overwrite to replace it)" : ""));
  }
  const std::string shard_name = *claimed;
  ClaimGuard claim(&registry_, call.tenant, name);
  auto local_shape = planner::LocalShape(name, tensor.shape, *spec, mesh_);
  if (!local_shape.ok()) return local_shape.status();
  const int64_t tensor_bytes = tensor.NumBytes();
  const bool whole = *local_shape == tensor.shape;  // every rank holds all of it
  auto placement = Place(name, tensor.dtype, tensor.shape, *spec);
  if (!placement.ok()) return placement.status();
  const ShardCopies copies{shard_name, placement->standby};
  auto block = [&](int rank, v1::LocalTensor* out) -> absl::Status {
    auto offsets = planner::BlockOffsets(name, tensor.shape, *spec, mesh_, rank);
    if (!offsets.ok()) return offsets.status();
    HostTensorToProto(SliceBlock(tensor, *offsets, *local_shape), out);
    return absl::OkStatus();
  };
  std::vector<v1::Step> steps(num_workers_);
  // Each standby copy goes with its holder's own block, in the same step
  // (sliced first: the last rank's block may take the tensor's bytes).
  for (const StandbyCopy& c : placement->standby) {
    v1::NamedShard* copy = steps[c.holder_rank].mutable_store()->add_standby();
    copy->set_name(StandbyShardName(shard_name, c.block_rank));
    if (auto s = block(c.block_rank, copy->mutable_shard()); !s.ok()) return s;
  }
  for (int r = 0; r < num_workers_; ++r) {
    v1::StoreShardStep* store = steps[r].mutable_store();
    store->set_name(shard_name);
    if (whole && r == num_workers_ - 1) {
      HostTensorToProto(std::move(tensor), store->mutable_shard());  // the last copy is the tensor itself
    } else if (auto s = block(r, store->mutable_shard()); !s.ok()) {
      return s;
    }
  }
  std::string().swap(tensor.bytes);  // the blocks hold every byte now
  auto results = Dispatch(std::move(steps), StepDeadline(deadline), call);
  if (absl::Status gone = Abandoned(deadline, call, absl::StrCat("'", name, "'")); results.ok() && !gone.ok()) {
    results = gone;
  }
  if (!results.ok()) {
    // Some workers may hold the new generation: drop it everywhere. The old
    // generation, if any, was never touched.
    DeleteShardsBestEffort(copies);
    return results.status();
  }
  Resident resident;
  resident.tenant = call.tenant;
  resident.info.set_name(name);
  resident.info.set_dtype(DTypeToProto(tensor.dtype));
  resident.info.mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  resident.info.set_spec(planner::FormatPartitionSpec(*spec));
  resident.spec = *spec;
  resident.shard_name = shard_name;
  SetPlacement(*placement, &resident);
  auto replaced = claim.Register(std::move(resident));
  if (!replaced.ok()) {  // not kept (its registry could not be written): nor are its shards
    DeleteShardsBestEffort(copies);
    return replaced.status();
  }
  if (!replaced->empty()) RetireBestEffort(*replaced);  // the new generation is in
  v1::PutTensorResponse response;
  response.set_name(name);
  response.set_bytes(tensor_bytes);
  return response;
}

absl::StatusOr<HostTensor> Coordinator::Assemble(
    DType dtype, const std::vector<int64_t>& shape, const planner::PartitionSpec& spec,
    const std::function<absl::StatusOr<HostTensor>(int)>& shard) {
  return AssembleBlocks(mesh_, dtype, shape, spec, shard);
}

absl::StatusOr<Coordinator::Fetched> Coordinator::GetTensor(const std::string& name, absl::Time deadline,
                                                            const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  PinGuard guard{this, {}};
  auto resident = registry_.FindAndPin(call.tenant, name, &guard.pins);
  if (!resident.ok()) return resident.status();
  const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
  auto dtype = DTypeFromProto(resident->info.dtype(), "dtype");
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(resident->info.shape().begin(), resident->info.shape().end());
  // One deadline for the whole read, not a fresh step timeout per shard.
  const absl::Time read_deadline = StepDeadline(deadline);
  auto tensor = Assemble(*dtype, shape, resident->spec, [&](int r) -> absl::StatusOr<HostTensor> {
    auto shard = channels[r]->GetShard(resident->shard_name, read_deadline);
    if (!shard.ok()) return shard.status();
    return HostTensorFromProto(std::move(*shard), "shard");
  });
  if (!tensor.ok()) return ExplainMissingShard(tensor.status(), call.tenant, {name});
  return Fetched{resident->info, std::move(*tensor)};
}

absl::Status Coordinator::DeleteTensor(const std::string& name, absl::Time deadline,
                                      const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  const bool lost = registry_.IsLost(call.tenant, name);
  auto copies = registry_.Remove(call.tenant, name);
  if (!copies.ok()) return copies.status();
  if (lost) {  // some worker lacks its shard: the others drop theirs with the next step
    RetireBestEffort(*copies);
    return absl::OkStatus();
  }
  return Retire(*copies, deadline, call);
}

v1::ListTensorsResponse Coordinator::ListTensors(const CallContext& call) const {
  v1::ListTensorsResponse response;
  for (v1::ResidentTensorInfo& info : registry_.List(call.tenant)) *response.add_tensors() = std::move(info);
  return response;
}


namespace {

// Group sizes must be non-negative and each row shard's entries must fit its
// rows; the planner checks shapes, this checks the values.
absl::Status CheckGroupSizes(const std::vector<int64_t>& sizes, const planner::Plan& plan,
                             int64_t local_rows, absl::string_view rows_of) {
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_sizes[", i, "] is negative (", sizes[i], ")"));
    }
  }
  for (const auto& w : plan.workers) {
    int64_t sum = 0;
    for (int64_t i = w.group_sizes_begin; i < w.group_sizes_end; ++i) {
      if (sizes[i] > local_rows - sum) {  // sum + sizes[i] > rows, without overflow
        return absl::InvalidArgumentError(absl::StrCat(
            "group_sizes[", w.group_sizes_begin, ":", w.group_sizes_end, "] sum past the ",
            local_rows, " rows of ", rows_of, " that they describe (rank ", w.rank, ")"));
      }
      sum += sizes[i];
    }
  }
  return absl::OkStatus();
}

// The planner checks FP8 operands' dtypes, their pairing and their scales'
// layouts, and lets the scales be absent (a plan of the data alone); the
// service runs no FP8 GEMM without them. `plan`'s lhs is FP8 for a fused
// quantize too (the workers make its scales).
absl::Status CheckFp8ScalesGiven(const v1::GroupedGemmRequest& request, const planner::Plan& plan) {
  if (!IsFloat8(planner::FindPlanOperand(plan, "lhs")->dtype)) return absl::OkStatus();
  if (planner::FindPlanOperand(plan, "lhs_scale_inv") == nullptr) {
    return absl::InvalidArgumentError(
        "lhs_scale_inv: an FP8 lhs needs its inverse scales (laid out per `scaling`; see the proto), or send "
        "a float lhs with quantize_lhs");
  }
  if (planner::FindPlanOperand(plan, "rhs_scale_inv") == nullptr) {
    return absl::InvalidArgumentError(
        "rhs_scale_inv: an FP8 rhs needs its inverse scales (laid out per `scaling`; see the proto)");
  }
  return absl::OkStatus();
}

// A grouped quantize output kept resident: its request field, name, and
// the tensor it is (the GEMM operand layout for scales).
struct KeptOutput {
  const char* field = "";
  v1::TensorRole role = v1::TENSOR_ROLE_UNSPECIFIED;
  std::string name;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  planner::PartitionSpec spec;
  std::string shard_name;  // claimed
};

absl::StatusOr<std::vector<KeptOutput>> QuantizeKeeps(const v1::GroupedQuantizeRequest& request,
                                                      const planner::Plan& plan, const std::vector<int64_t>& x_shape,
                                                      int flatten, const std::vector<int64_t>& sizes) {
  std::vector<KeptOutput> keeps;
  const v1::QuantizeKeep& keep = request.keep();
  if (keep.rowwise_data().empty() && keep.scale_inv().empty()) return keeps;
  if (request.colwise()) {
    return absl::InvalidArgumentError(
        "keep: kept outputs are the rowwise data and its scales (a GEMM operand); ask without colwise");
  }
  if (!keep.rowwise_data().empty() && keep.rowwise_data() == keep.scale_inv()) {
    return absl::InvalidArgumentError("keep: rowwise_data and scale_inv need different names");
  }
  auto output = [&](const char* name) -> const planner::PlanOutput* {
    for (const planner::PlanOutput& o : plan.outputs) {
      if (o.name == name) return &o;
    }
    return nullptr;
  };
  const planner::PlanOutput* data = output("data");
  const planner::PlanOutput* scale = output("scale_inv");
  if (data == nullptr || scale == nullptr) return absl::InternalError("the quantize plan lacks data or scale_inv");
  if (!keep.rowwise_data().empty()) {
    if (auto s = ValidateResidentName("keep.rowwise_data", keep.rowwise_data()); !s.ok()) return s;
    keeps.push_back({"rowwise_data", v1::TENSOR_ROWWISE_DATA, keep.rowwise_data(), data->dtype, data->global_shape,
                     data->spec, ""});
  }
  if (!keep.scale_inv().empty()) {
    if (auto s = ValidateResidentName("keep.scale_inv", keep.scale_inv()); !s.ok()) return s;
    KeptOutput k{"scale_inv", v1::TENSOR_SCALE_INV, keep.scale_inv(), scale->dtype, scale->global_shape,
                 scale->spec, ""};
    int64_t cols = 1;
    for (size_t d = flatten; d < x_shape.size(); ++d) cols *= x_shape[d];
    planner::PartitionSpec rows_spec;
    rows_spec.dims = {data->spec.dims.empty() ? std::vector<std::string>() : data->spec.dims[0]};
    if (request.scaling() == v1::BLOCK_FP8 && request.block_2d()) {
      // 128x128 weights: every group (expert) N rows, kept as [G, N/128, K/128].
      const int64_t n = sizes.empty() ? 0 : sizes[0];
      for (int64_t g : sizes) {
        if (g != n || n % 128 != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "keep.scale_inv: 128x128 weight scales are kept as [G, N/128, K/128]: every group_sizes entry must "
              "be N, a multiple of 128 (got ", g, ")"));
        }
      }
      k.shape = {static_cast<int64_t>(sizes.size()), n / 128, cols / 128};
      rows_spec.dims.push_back({});
      rows_spec.dims.push_back({});
    } else if (request.scaling() == v1::BLOCK_FP8 || request.scaling() == v1::MXFP8) {
      // One per row and block of K, with x's row dims (weights [G, N, K]
      // keep [G, N, K/b], the GEMM's transposed rhs layout).
      const int64_t b = request.scaling() == v1::MXFP8 ? 32 : 128;
      k.shape.assign(x_shape.begin(), x_shape.begin() + flatten);
      k.shape.push_back(cols / b);
      rows_spec.dims.assign(data->spec.dims.begin(),
                            data->spec.dims.begin() + std::min<size_t>(flatten, data->spec.dims.size()));
      rows_spec.dims.resize(k.shape.size());
    } else {
      rows_spec = scale->spec;  // per group, like group_sizes
    }
    k.spec = rows_spec;
    keeps.push_back(std::move(k));
  }
  return keeps;
}

// The response field of a quantize output.
v1::Tensor* QuantizeField(v1::TensorRole role, v1::GroupedQuantizeResponse* response) {
  switch (role) {
    case v1::TENSOR_ROWWISE_DATA: return response->mutable_rowwise_data();
    case v1::TENSOR_COLWISE_DATA: return response->mutable_colwise_data();
    case v1::TENSOR_SCALE_INV: return response->mutable_scale_inv();
    case v1::TENSOR_AMAX: return response->mutable_amax();
    default: return response->mutable_colwise_scale_inv();
  }
}

// A worker's quantize output of plan output `name`.
absl::StatusOr<HostTensor> WorkerOutput(const v1::StepResult& result, const std::string& name, int rank) {
  const v1::TensorRole role = TensorRoleFromName(name);
  for (const v1::StepOutput& o : result.outputs()) {
    if (o.role() == role) return HostTensorFromProto(o.tensor(), name);
  }
  return absl::InternalError(absl::StrCat("worker ", rank, " returned no '", name, "'"));
}

// Block-scaled outputs laid out per group (scales, 1x128/128x128's transposed
// colwise data) are assembled into the unsharded layout; the rest follow x's rows.
bool IsBlockAssembled(ScalingMode mode, const std::string& name) {
  return name == "scale_inv" || name == "colwise_scale_inv" ||
         (name == "colwise_data" && mode != ScalingMode::kMxfp8);
}

// The plan's row shards in row order, each with the first rank holding it
// (ranks that differ only on non-row axes hold the same rows).
std::vector<std::pair<RowShard, int>> PlanRowShards(const planner::Plan& plan) {
  std::map<int64_t, std::pair<RowShard, int>> by_begin;
  for (const planner::WorkerPlan& w : plan.workers) {
    by_begin.emplace(w.group_sizes_begin,
                     std::make_pair(RowShard{w.group_sizes_begin, w.first_group}, static_cast<int>(w.rank)));
  }
  std::vector<std::pair<RowShard, int>> out;
  for (auto& [begin, shard] : by_begin) out.push_back(shard);
  return out;
}

// MXFP8 / BLOCK_FP8: the unsharded op's groups, checked for block alignment
// (docs/quantization.md); fills `bq` with the unsharded op's shape.
absl::StatusOr<GlobalGroups> CheckBlockQuantize(const v1::GroupedQuantizeRequest& request,
                                                const planner::Plan& plan,
                                                const std::vector<int64_t>& sizes,
                                                const std::vector<int64_t>& x_shape, int flatten,
                                                BlockQuantize* bq) {
  auto mode = KernelScalingMode(request.scaling(), request.block_2d());
  if (!mode.ok()) return mode.status();
  bq->mode = *mode;
  auto mk = FlattenToMatrix(x_shape, flatten);
  if (!mk.ok()) return mk.status();
  std::tie(bq->m, bq->k) = *mk;
  bq->rowwise = request.rowwise() || !request.colwise();
  bq->colwise = request.colwise();
  bq->data_dtype = request.out_dtype() == v1::F8E5M2 ? DType::kF8E5M2 : DType::kF8E4M3;
  std::vector<RowShard> shards;
  for (const auto& [shard, rank] : PlanRowShards(plan)) shards.push_back(shard);
  auto groups = MakeGlobalGroups(sizes, shards, plan.local_group_count, plan.num_groups);
  if (!groups.ok()) return groups.status();
  const std::string what = absl::StrCat(ScalingModeName(bq->mode),
                                        bq->mode == ScalingMode::kBlock128x128 ? "" : " colwise", " scales");
  if (auto s = CheckBlockAligned(sizes, *groups, ScaleRowBlock(bq->mode, bq->rowwise, bq->colwise), what);
      !s.ok()) {
    return s;
  }
  // The kernels' own shape rules (e.g. MXFP8's K % 32), before any worker runs.
  auto layout = BlockLayout(bq->mode, bq->m, bq->k, bq->rowwise, bq->colwise, groups->sizes);
  if (!layout.ok()) return absl::InvalidArgumentError(absl::StrCat("x: ", layout.status().message()));
  return groups;
}

absl::Status AssembleBlockScaled(const planner::Plan& plan, const std::vector<v1::StepResult>& results,
                                 const std::vector<int64_t>& sizes, const GlobalGroups& groups,
                                 const BlockQuantize& bq, v1::GroupedQuantizeResponse* response) {
  const auto row_shards = PlanRowShards(plan);
  // Worker outputs, per row shard, by plan output name.
  std::vector<std::map<std::string, HostTensor>> decoded(row_shards.size());
  std::vector<ShardBlockOutputs> shards;
  const int64_t shard_rows = bq.m / static_cast<int64_t>(row_shards.size());
  for (size_t s = 0; s < row_shards.size(); ++s) {
    const int rank = row_shards[s].second;
    for (size_t i = 0; i < plan.outputs.size(); ++i) {
      const std::string& name = plan.outputs[i].name;
      if (!IsBlockAssembled(bq.mode, name)) continue;
      auto t = WorkerOutput(results[rank], name, rank);
      if (!t.ok()) return t.status();
      decoded[s][name] = std::move(*t);
    }
    auto find = [&](const char* name) -> const HostTensor* {
      auto it = decoded[s].find(name);
      return it == decoded[s].end() ? nullptr : &it->second;
    };
    shards.push_back({row_shards[s].first, shard_rows, find("scale_inv"), find("colwise_scale_inv"),
                      find("colwise_data")});
  }
  auto out = AssembleBlockOutputs(bq, sizes, plan.local_group_count, groups, shards);
  if (!out.ok()) return out.status();
  // These come back whole, in the layouts the groups' padding gives them:
  // replicated, not split as x is.
  auto whole = [](const HostTensor& t, v1::Tensor* field) {
    HostTensorToProto(t, field);
    field->set_spec(planner::FormatPartitionSpec(planner::PadSpec({}, t.shape.size())));
  };
  if (bq.rowwise) whole(out->scale_inv, response->mutable_scale_inv());
  if (bq.colwise) whole(out->colwise_scale_inv, response->mutable_colwise_scale_inv());
  if (bq.colwise && bq.mode != ScalingMode::kMxfp8) {
    out->colwise_data.shape = planner::FindPlanOperand(plan, "x")->global_shape;  // [m, k] bytes, shaped like x
    whole(out->colwise_data, response->mutable_colwise_data());
  }
  response->mutable_scale_group_sizes()->Assign(groups.sizes.begin(), groups.sizes.end());
  // Where each group's scales are, so that a client need not know the padding rules.
  auto layout = BlockLayout(bq.mode, bq.m, bq.k, bq.rowwise, bq.colwise, groups.sizes);
  if (!layout.ok()) return layout.status();
  if (bq.rowwise) {
    response->mutable_scale_inv_offsets()->Assign(layout->rowwise_scale_offset.begin(),
                                                  layout->rowwise_scale_offset.end());
    for (size_t g = 0; g < groups.sizes.size(); ++g) {
      response->add_scale_inv_block_shape(layout->rowwise_scale_rows[g]);
      response->add_scale_inv_block_shape(layout->rowwise_scale_cols[g]);
    }
  }
  if (bq.colwise) {
    response->mutable_colwise_scale_inv_offsets()->Assign(layout->colwise_scale_offset.begin(),
                                                          layout->colwise_scale_offset.end());
    for (size_t g = 0; g < groups.sizes.size(); ++g) {
      response->add_colwise_scale_inv_block_shape(layout->colwise_scale_rows[g]);
      response->add_colwise_scale_inv_block_shape(layout->colwise_scale_cols[g]);
    }
  }
  return absl::OkStatus();
}

}  // namespace

TensorMeta Coordinator::MetaOf(const Resident& r) {
  TensorMeta m;
  m.dtype = static_cast<DType>(static_cast<int>(r.info.dtype()));
  m.shape.assign(r.info.shape().begin(), r.info.shape().end());
  m.spec = r.info.spec();
  m.resident_shard = r.shard_name;
  return m;
}

absl::StatusOr<TensorMeta> Coordinator::ResolveMeta(const v1::Tensor& t, const std::string& field,
                                                   const std::string& tenant, PinGuard* guard) {
  if (t.source_case() == v1::Tensor::kResident) {
    auto r = registry_.FindAndPin(tenant, t.resident(), &guard->pins);
    if (!r.ok()) return r.status();
    guard->names.push_back(t.resident());
    return MetaOf(*r);
  }
  if (t.source_case() == v1::Tensor::kStaged) return ResolveStaged(t, field, tenant);
  if (t.source_case() == v1::Tensor::kSharedMemory) {
    if (!options_.allow_shared_memory) return SharedMemoryOff(absl::StrCat(field, ".shared_memory"));
    auto dtype = DTypeFromProto(t.dtype(), field);
    if (!dtype.ok()) return dtype.status();
    TensorMeta meta;
    meta.dtype = *dtype;
    meta.shape.assign(t.shape().begin(), t.shape().end());
    meta.spec = t.spec();
    auto n = CheckedNumElements(meta.shape, DTypeSize(meta.dtype), field);
    if (!n.ok()) return n.status();
    const std::string at = absl::StrCat(field, ".shared_memory");
    auto region = shared_memory_.Resolve(tenant, t.shared_memory(), *n * DTypeSize(meta.dtype), at);
    if (!region.ok()) return region.status();
    meta.shared_memory = region->Block(t.shared_memory().offset());
    return meta;
  }
  return InlineTensorMeta(t, field);
}

void Coordinator::AbandonRequests() {
  dispatcher_.AbandonAll(absl::UnavailableError("the coordinator is shutting down; retry with another"));
}

absl::StatusOr<v1::RegisterSharedMemoryResponse> Coordinator::RegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request, const CallContext& call) {
  if (!options_.allow_shared_memory) return SharedMemoryOff("RegisterSharedMemory");
  auto expires = shared_memory_.Register(call.tenant, request);
  if (!expires.ok()) return expires.status();
  v1::RegisterSharedMemoryResponse response;
  if (*expires != absl::InfiniteFuture()) response.set_expires_unix_ms(absl::ToUnixMillis(*expires));
  return response;
}

absl::StatusOr<v1::RenewSharedMemoryResponse> Coordinator::RenewSharedMemory(
    const v1::RenewSharedMemoryRequest& request, const CallContext& call) {
  if (!options_.allow_shared_memory) return SharedMemoryOff("RenewSharedMemory");
  v1::RenewSharedMemoryResponse response;
  for (std::string& name :
       shared_memory_.Renew(call.tenant, std::vector<std::string>(request.names().begin(), request.names().end()))) {
    response.add_lapsed(std::move(name));
  }
  return response;
}

absl::Status Coordinator::UnregisterSharedMemory(const std::string& name, const CallContext& call) {
  if (!options_.allow_shared_memory) return SharedMemoryOff("UnregisterSharedMemory");
  if (absl::Status s = shared_memory_.Unregister(call.tenant, name); !s.ok()) return s;
  ForgetGoneClientMemory(/*wait=*/true);
  return absl::OkStatus();
}

namespace {

constexpr absl::Duration kForgetClientMemoryTimeout = absl::Seconds(2);

void ForgetOnWorkers(const std::vector<std::shared_ptr<WorkerChannel>>& channels,
                     const v1::ForgetClientMemoryRequest& request, absl::Time until) {
  std::vector<std::thread> tellers;
  for (const auto& channel : channels) {
    if (channel == nullptr) continue;
    tellers.emplace_back([channel, &request, until] {
      // A worker that misses it closes them as its caches fill, oldest first.
      channel->ForgetClientMemory(request, until).IgnoreError();
    });
  }
  for (std::thread& t : tellers) t.join();
}

}  // namespace

void Coordinator::ForgetGoneClientMemory(bool wait) {
  auto request_of = [](SharedMemoryRegistry::GoneObjects gone) {
    v1::ForgetClientMemoryRequest request;
    for (std::string& key : gone.keys) request.add_keys(std::move(key));
    for (std::string& handle : gone.cuda_ipc_handles) request.add_cuda_ipc_handles(std::move(handle));
    return request;
  };
  if (wait) {
    SharedMemoryRegistry::GoneObjects gone = shared_memory_.TakeGone();
    if (!gone.empty()) {
      ForgetOnWorkers(dispatcher_.Channels(), request_of(std::move(gone)), absl::Now() + kForgetClientMemoryTimeout);
    }
    return;
  }
  // One teller at a time, across coordinators of the process: a hung
  // worker cannot make heartbeats pile threads up; what lapses meanwhile
  // waits in the registry for a later heartbeat.
  static std::atomic<bool> telling{false};
  if (telling.exchange(true)) return;
  SharedMemoryRegistry::GoneObjects gone = shared_memory_.TakeGone();
  if (gone.empty()) {
    telling.store(false);
    return;
  }
  std::thread([channels = dispatcher_.Channels(), request = request_of(std::move(gone))] {
    ForgetOnWorkers(channels, request, absl::Now() + kForgetClientMemoryTimeout);
    telling.store(false);
  }).detach();
}

absl::StatusOr<std::vector<std::string>> Coordinator::StagingAddresses() const {
  std::vector<std::string> addresses(num_workers_);
  for (const v1::WorkerInfo& w : dispatcher_.Workers()) {
    if (w.rank() >= 0 && w.rank() < num_workers_) addresses[w.rank()] = w.staging_address();
  }
  for (int r = 0; r < num_workers_; ++r) {
    if (addresses[r].empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker rank ", r, " serves no staging (its --staging_port is off, or it has no clients' tokens "
          "file); send the operands inline"));
    }
  }
  return addresses;
}

namespace {

// The request's operands that may be staged, in the order a plan lists them.
constexpr const char* kStageable[] = {"lhs", "rhs", "bias", "lhs_scale_inv", "rhs_scale_inv"};

absl::StatusOr<std::string> NormalizedSpec(const std::string& text, const std::string& field) {
  auto spec = planner::ParsePartitionSpec(text);
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ".spec: ", spec.status().message()));
  return planner::FormatPartitionSpec(*spec);
}

}  // namespace

absl::StatusOr<v1::StagingPlan> Coordinator::PlanStaging(const v1::StagingPlanRequest& request, absl::Time deadline,
                                                         const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  if (request.op_case() == v1::StagingPlanRequest::kPut) return PlanPutStaging(request.put(), deadline, call);
  const bool quantize = request.op_case() == v1::StagingPlanRequest::kGroupedQuantize;
  if (!quantize && request.op_case() != v1::StagingPlanRequest::kGroupedGemm) {
    return absl::InvalidArgumentError("op: give grouped_gemm, grouped_quantize or put");
  }
  const v1::GroupedGemmRequest& gemm = request.grouped_gemm();
  if (!quantize && gemm.layout() == v1::GroupedGemmRequest::GLOBAL_SORTED) {
    return absl::InvalidArgumentError(
        "grouped_gemm.layout: GLOBAL_SORTED routes the rows itself, inline; stage operands with PER_SHARD");
  }
  const std::vector<std::string> stageable =
      quantize ? std::vector<std::string>{"x"} : std::vector<std::string>(std::begin(kStageable), std::end(kStageable));
  auto addresses = StagingAddresses();
  if (!addresses.ok()) return addresses.status();
  PinGuard guard{this, {}};
  absl::flat_hash_map<std::string, TensorMeta> metas;
  std::set<std::string> to_stage;
  auto resolve = [&](const v1::Tensor& t, const std::string& field) -> absl::StatusOr<TensorMeta> {
    absl::StatusOr<TensorMeta> meta;
    const bool may_stage = std::find(stageable.begin(), stageable.end(), field) != stageable.end();
    if (t.source_case() == v1::Tensor::SOURCE_NOT_SET && may_stage) {  // to be staged
      auto dtype = DTypeFromProto(t.dtype(), field);
      if (!dtype.ok()) return dtype.status();
      TensorMeta m;
      m.dtype = *dtype;
      m.shape.assign(t.shape().begin(), t.shape().end());
      auto n = CheckedNumElements(m.shape, DTypeSize(m.dtype), field);
      if (!n.ok()) return n.status();
      auto spec = NormalizedSpec(t.spec(), field);
      if (!spec.ok()) return spec.status();
      m.spec = *spec;
      to_stage.insert(field);
      meta = std::move(m);
    } else if (t.source_case() == v1::Tensor::kStaged) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".staged: a transfer plan is asked for operands "
                                                     "without a source (dtype, shape and spec only)"));
    } else {
      meta = ResolveMeta(t, field, call.tenant, &guard);
    }
    if (meta.ok()) metas[field] = *meta;
    return meta;
  };
  auto plan_request = quantize ? QuantizePlanRequest(request.grouped_quantize(), mesh_, resolve)
                               : GemmPlanRequest(gemm, mesh_, resolve);
  if (!plan_request.ok()) return plan_request.status();
  if (!metas["group_sizes"].resident_shard.empty() || metas["group_sizes"].shared_memory.has_value()) {
    return absl::InvalidArgumentError("group_sizes must be sent inline: the plan needs its values");
  }
  auto plan = MakePlan(*plan_request);
  if (!plan.ok()) return plan.status();
  if (to_stage.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        quantize ? "grouped_quantize" : "grouped_gemm",
        ": no operand to stage (give each operand to stage its dtype, shape and spec, and no data)"));
  }

  StagingRecord record;
  record.tenant = call.tenant;
  record.expires = absl::Now() + options_.staging_ttl;
  v1::StagingPlan response;
  std::vector<v1::ExpectStagedRequest> expect(num_workers_);
  for (const std::string& field : stageable) {
    if (to_stage.count(field) == 0) continue;
    const planner::PlanOperand* op = planner::FindPlanOperand(*plan, field);
    if (op == nullptr) return absl::InternalError(absl::StrCat("the plan has no operand ", field));
    StagedOperandRecord& rec = record.operands[field];
    rec.meta = metas[field];
    v1::StagedOperand* staged = response.add_operands();
    staged->set_role(TensorRoleFromName(field));
    staged->set_dtype(DTypeToProto(rec.meta.dtype));
    staged->mutable_shape()->Assign(op->global_shape.begin(), op->global_shape.end());
    std::map<std::vector<int64_t>, v1::StagedBlock*> block_at;
    for (int r = 0; r < num_workers_; ++r) {
      auto offsets = planner::BlockOffsets(field, op->global_shape, op->input_spec, mesh_, r);
      if (!offsets.ok()) return offsets.status();
      const std::string ticket = security::RandomHex(16);
      rec.ticket_of_rank.push_back(ticket);
      rec.offsets_of_rank.push_back(*offsets);
      v1::StagedBlock*& block = block_at[*offsets];
      if (block == nullptr) {
        block = staged->add_blocks();
        block->mutable_offsets()->Assign(offsets->begin(), offsets->end());
        block->mutable_shape()->Assign(op->input_local_shape.begin(), op->input_local_shape.end());
      }
      v1::StagingDestination* to = block->add_destinations();
      to->set_rank(r);
      to->set_address((*addresses)[r]);
      to->set_ticket(ticket);
      v1::StagingTicket* t = expect[r].add_tickets();
      t->set_ticket(ticket);
      t->set_tenant(call.tenant);
      t->set_role(staged->role());
      t->set_dtype(staged->dtype());
      t->mutable_shape()->Assign(op->input_local_shape.begin(), op->input_local_shape.end());
    }
  }
  return IssueStaging(std::move(record), std::move(response), std::move(expect), deadline);
}

absl::Status Coordinator::TellStagingTickets(std::vector<v1::ExpectStagedRequest> expect, absl::Time deadline) {
  // In parallel, each call bounded by the request's deadline and the step timeout.
  const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
  std::vector<absl::Status> told(num_workers_);
  std::vector<std::thread> tellers;
  const absl::Time until = StepDeadline(deadline);
  for (int r = 0; r < num_workers_; ++r) {
    if (expect[r].tickets().empty()) continue;
    if (r >= static_cast<int>(channels.size()) || channels[r] == nullptr) {
      told[r] = absl::UnavailableError(absl::StrCat("worker rank ", r, " is not registered"));
      continue;
    }
    expect[r].set_session(session_);
    tellers.emplace_back([&, r] { told[r] = channels[r]->ExpectStaged(expect[r], until); });
  }
  for (std::thread& t : tellers) t.join();
  for (int r = 0; r < num_workers_; ++r) {
    if (!told[r].ok()) {
      return absl::Status(told[r].code(), absl::StrCat("worker rank ", r, " (its staging tickets): ",
                                                       told[r].message()));
    }
  }
  return absl::OkStatus();
}

namespace {

constexpr absl::Duration kDropStagedTimeout = absl::Seconds(2);

void DropOnWorkers(const std::vector<std::shared_ptr<WorkerChannel>>& channels, const std::string& session,
                   const std::map<int, std::vector<std::string>>& tickets, absl::Time until) {
  std::vector<std::thread> droppers;
  for (const auto& [rank, of_rank] : tickets) {
    if (of_rank.empty() || rank < 0 || rank >= static_cast<int>(channels.size()) || channels[rank] == nullptr) {
      continue;
    }
    v1::DropStagedRequest drop;
    drop.set_session(session);
    for (const std::string& t : of_rank) drop.add_tickets(t);
    droppers.emplace_back([channel = channels[rank], drop = std::move(drop), until] {
      channel->DropStaged(drop, until).IgnoreError();  // a worker that misses it expires them at its TTL
    });
  }
  for (std::thread& t : droppers) t.join();
}

}  // namespace

Coordinator::TicketsByRank Coordinator::TicketsOf(const StagingRecord& record) {
  TicketsByRank tickets;
  for (const auto& [field, op] : record.operands) {
    for (size_t r = 0; r < op.ticket_of_rank.size(); ++r) tickets[static_cast<int>(r)].push_back(op.ticket_of_rank[r]);
  }
  if (record.put != nullptr) {
    for (size_t r = 0; r < record.put->ticket_of_rank.size(); ++r) {
      tickets[static_cast<int>(r)].push_back(record.put->ticket_of_rank[r]);
    }
    for (const auto& [copy, ticket] : record.put->standby) tickets[copy.holder_rank].push_back(ticket);
  }
  return tickets;
}

Coordinator::TicketsByRank Coordinator::TicketsOf(const std::vector<v1::ExpectStagedRequest>& expect) {
  TicketsByRank tickets;
  for (size_t r = 0; r < expect.size(); ++r) {
    for (const v1::StagingTicket& t : expect[r].tickets()) tickets[static_cast<int>(r)].push_back(t.ticket());
  }
  return tickets;
}

void Coordinator::DropStaged(const TicketsByRank& tickets, absl::Time until) {
  DropOnWorkers(dispatcher_.Channels(), session_, tickets, until);
}

void Coordinator::DropStagedBestEffort(TicketsByRank tickets) {
  if (tickets.empty()) return;
  // Droppers in flight, across coordinators of the process: past the cap
  // (requests failing fast while a worker hangs) the tickets are left to
  // expire at their TTL instead of starting ever more threads.
  static std::atomic<int> in_flight{0};
  constexpr int kMaxDroppers = 16;
  if (in_flight.fetch_add(1) >= kMaxDroppers) {
    in_flight.fetch_sub(1);
    return;
  }
  // The thread holds the channels and the session, not the coordinator.
  std::thread([channels = dispatcher_.Channels(), session = session_, tickets = std::move(tickets)] {
    DropOnWorkers(channels, session, tickets, absl::Now() + kDropStagedTimeout);
    in_flight.fetch_sub(1);
  }).detach();
}

absl::Status Coordinator::RoomForStagingPlan() {
  const absl::Time now = absl::Now();
  for (auto it = staging_.begin(); it != staging_.end();) {
    it = it->second.expires <= now ? staging_.erase(it) : std::next(it);
  }
  if (static_cast<int>(staging_.size()) >= options_.max_staging_plans) {
    return absl::ResourceExhaustedError(absl::StrCat(options_.max_staging_plans,
                                                     " transfer plans are waiting for their requests; retry later"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StagingPlan> Coordinator::IssueStaging(StagingRecord record, v1::StagingPlan response,
                                                          std::vector<v1::ExpectStagedRequest> expect,
                                                          absl::Time deadline) {
  {  // Refused before any worker hears of its tickets (a refused plan's would sit there until they expire).
    absl::MutexLock lock(&staging_mu_);
    if (auto s = RoomForStagingPlan(); !s.ok()) return s;
  }
  // Every worker hears of its tickets before the client does; those that
  // did when another failed drop them again.
  TicketsByRank told = TicketsOf(expect);
  if (auto s = TellStagingTickets(std::move(expect), deadline); !s.ok()) {
    DropStagedBestEffort(std::move(told));
    return s;
  }
  const std::string staging_id = security::RandomHex(16);
  response.set_staging_id(staging_id);
  response.set_expires_unix_ms(absl::ToUnixMillis(record.expires));
  record.is_put = record.put != nullptr;
  absl::MutexLock lock(&staging_mu_);
  if (auto s = RoomForStagingPlan(); !s.ok()) {  // others took the room meanwhile
    DropStagedBestEffort(std::move(told));
    return s;
  }
  staging_[staging_id] = std::move(record);
  return response;
}

absl::StatusOr<v1::StagingPlan> Coordinator::PlanPutStaging(const v1::PutStagingRequest& put, absl::Time deadline,
                                                            const CallContext& call) {
  if (auto s = ValidateResidentName("put.name", put.name()); !s.ok()) return s;
  auto dtype = DTypeFromProto(put.dtype(), "put.dtype");
  if (!dtype.ok()) return dtype.status();
  const std::vector<int64_t> shape(put.shape().begin(), put.shape().end());
  auto n = CheckedNumElements(shape, DTypeSize(*dtype), "put.shape");
  if (!n.ok()) return n.status();
  auto spec = planner::ParsePartitionSpec(put.spec());
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("put.spec: ", spec.status().message()));
  if (auto s = planner::ValidatePartitionSpec(put.name(), shape, *spec, mesh_); !s.ok()) return s;
  if (auto s = CheckTensorFits(put.name(), *n * DTypeSize(*dtype)); !s.ok()) return s;
  if (!put.overwrite()) {  // refused now, before the client stages anything (PutStaged checks again)
    PinGuard guard{this, {}};
    if (registry_.FindAndPin(call.tenant, put.name(), &guard.pins).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("put.name: tensor '", put.name(),
                                                   "' is resident (set overwrite to replace it)"));
    }
  }
  auto addresses = StagingAddresses();
  if (!addresses.ok()) return addresses.status();
  auto local = planner::LocalShape(put.name(), shape, *spec, mesh_);
  if (!local.ok()) return local.status();
  // Where the copies go is decided now: the blocks are staged where they will be stored.
  auto placement = Place(put.name(), *dtype, shape, *spec);
  if (!placement.ok()) return placement.status();

  StagingRecord record;
  record.tenant = call.tenant;
  record.expires = absl::Now() + options_.staging_ttl;
  record.put = std::make_unique<StagedPut>();
  StagedPut& staged_put = *record.put;
  staged_put.name = put.name();
  staged_put.overwrite = put.overwrite();
  staged_put.dtype = *dtype;
  staged_put.shape = shape;
  staged_put.spec = *spec;
  staged_put.local_shape = *local;
  staged_put.block_of_rank = placement->block_of_rank;
  v1::StagingPlan response;
  v1::StagedOperand* op = response.add_operands();
  op->set_dtype(DTypeToProto(*dtype));
  op->mutable_shape()->Assign(shape.begin(), shape.end());
  std::vector<v1::ExpectStagedRequest> expect(num_workers_);
  std::map<std::vector<int64_t>, v1::StagedBlock*> block_at;
  auto destination = [&](int block_rank, int holder) -> absl::StatusOr<std::string> {
    auto offsets = planner::BlockOffsets(put.name(), shape, *spec, mesh_, block_rank);
    if (!offsets.ok()) return offsets.status();
    v1::StagedBlock*& block = block_at[*offsets];
    if (block == nullptr) {
      block = op->add_blocks();
      block->mutable_offsets()->Assign(offsets->begin(), offsets->end());
      block->mutable_shape()->Assign(local->begin(), local->end());
    }
    const std::string ticket = security::RandomHex(16);
    v1::StagingDestination* to = block->add_destinations();
    to->set_rank(holder);
    to->set_address((*addresses)[holder]);
    to->set_ticket(ticket);
    v1::StagingTicket* t = expect[holder].add_tickets();
    t->set_ticket(ticket);
    t->set_tenant(call.tenant);
    t->set_put_tensor(put.name());
    t->set_put_block_rank(block_rank);
    t->set_dtype(DTypeToProto(*dtype));
    t->mutable_shape()->Assign(local->begin(), local->end());
    return ticket;
  };
  for (int r = 0; r < num_workers_; ++r) {
    auto ticket = destination(r, r);
    if (!ticket.ok()) return ticket.status();
    staged_put.ticket_of_rank.push_back(*ticket);
  }
  for (const StandbyCopy& c : placement->standby) {
    auto ticket = destination(c.block_rank, c.holder_rank);
    if (!ticket.ok()) return ticket.status();
    staged_put.standby.push_back({c, *ticket});
  }
  return IssueStaging(std::move(record), std::move(response), std::move(expect), deadline);
}

absl::StatusOr<v1::TensorBlocks> Coordinator::PlanFetch(const std::string& name, absl::Time deadline,
                                                       const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  auto addresses = StagingAddresses();
  if (!addresses.ok()) return addresses.status();
  PinGuard guard{this, {}};  // the generation stays until every copy is held
  auto resident = registry_.FindAndPin(call.tenant, name, &guard.pins);
  if (!resident.ok()) return resident.status();
  const std::vector<int64_t> shape(resident->info.shape().begin(), resident->info.shape().end());
  auto local = planner::LocalShape(name, shape, resident->spec, mesh_);
  if (!local.ok()) return local.status();
  v1::TensorBlocks response;
  response.set_dtype(resident->info.dtype());
  response.mutable_shape()->Assign(shape.begin(), shape.end());
  response.set_spec(resident->info.spec());
  // Each distinct block once, from the lowest rank that holds it.
  std::set<std::vector<int64_t>> seen;
  std::vector<std::pair<int, v1::HoldShardRequest>> holds;
  for (int r = 0; r < num_workers_; ++r) {
    auto offsets = planner::BlockOffsets(name, shape, resident->spec, mesh_, r);
    if (!offsets.ok()) return offsets.status();
    if (!seen.insert(*offsets).second) continue;
    v1::StagedBlock* block = response.add_blocks();
    block->mutable_offsets()->Assign(offsets->begin(), offsets->end());
    block->mutable_shape()->Assign(local->begin(), local->end());
    v1::StagingDestination* at = block->add_destinations();
    at->set_rank(r);
    at->set_address((*addresses)[r]);
    at->set_ticket(security::RandomHex(16));
    v1::HoldShardRequest hold;
    hold.set_session(session_);
    hold.set_name(resident->shard_name);
    hold.mutable_ticket()->set_ticket(at->ticket());
    hold.mutable_ticket()->set_tenant(call.tenant);
    holds.emplace_back(r, std::move(hold));
  }
  const std::vector<std::shared_ptr<WorkerChannel>> channels = dispatcher_.Channels();
  std::vector<absl::Status> held(holds.size());
  std::vector<std::thread> threads;
  const absl::Time until = StepDeadline(deadline);
  for (size_t i = 0; i < holds.size(); ++i) {
    const int r = holds[i].first;
    if (r >= static_cast<int>(channels.size()) || channels[r] == nullptr) {
      held[i] = absl::UnavailableError(absl::StrCat("worker rank ", r, " is not registered"));
      continue;
    }
    threads.emplace_back([&, i, r] { held[i] = channels[r]->HoldShard(holds[i].second, until); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : held) {
    if (s.ok()) continue;
    // The copies that were held will not be fetched: their holders free them now.
    TicketsByRank dropped;
    for (size_t i = 0; i < holds.size(); ++i) {
      if (held[i].ok()) dropped[holds[i].first].push_back(holds[i].second.ticket().ticket());
    }
    DropStagedBestEffort(std::move(dropped));
    return ExplainMissingShard(s, call.tenant, {name});
  }
  return response;
}

absl::StatusOr<bool> Coordinator::StagingPlanIsPut(const std::string& staging_id, const CallContext& call) {
  absl::MutexLock lock(&staging_mu_);
  auto it = staging_.find(staging_id);
  if (it == staging_.end() || it->second.expires <= absl::Now()) {
    return absl::NotFoundError(absl::StrCat("staging_id: no transfer plan of that id (unknown, or expired after ",
                                            absl::FormatDuration(options_.staging_ttl), ")"));
  }
  if (it->second.tenant != call.tenant) {
    return absl::PermissionDeniedError("staging_id: the transfer plan was issued to another tenant");
  }
  return it->second.is_put;
}

absl::StatusOr<v1::ReleaseStagingResponse> Coordinator::ReleaseStaging(const std::string& staging_id,
                                                                      absl::Time deadline, const CallContext& call) {
  if (auto is_put = StagingPlanIsPut(staging_id, call); !is_put.ok()) return is_put.status();
  v1::ReleaseStagingResponse response;
  TicketsByRank tickets;
  {
    absl::MutexLock lock(&staging_mu_);
    auto it = staging_.find(staging_id);
    if (it == staging_.end()) {
      return absl::NotFoundError("staging_id: the transfer plan expired meanwhile");
    }
    StagingRecord& record = it->second;
    if (record.released) {
      response.set_outcome(v1::RELEASE_ALREADY_RELEASED);
      return response;
    }
    if (record.used) {  // its request owns the blocks now
      response.set_outcome(v1::RELEASE_PLAN_SUBMITTED);
      return response;
    }
    record.used = record.released = true;
    tickets = TicketsOf(record);
    record.operands.clear();
    record.put.reset();
  }
  DropStaged(tickets, std::min(deadline, absl::Now() + kDropStagedTimeout));
  response.set_outcome(v1::RELEASE_DROPPED);
  return response;
}

absl::StatusOr<v1::PutTensorResponse> Coordinator::PutStaged(const v1::PutStagedRequest& request, absl::Time deadline,
                                                             const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  std::unique_ptr<StagedPut> put;
  {
    absl::MutexLock lock(&staging_mu_);
    auto it = staging_.find(request.staging_id());
    if (it == staging_.end() || it->second.expires <= absl::Now()) {
      return absl::NotFoundError(absl::StrCat("staging_id: no transfer plan of that id (unknown, or expired "
                                              "after ", absl::FormatDuration(options_.staging_ttl), ")"));
    }
    if (it->second.tenant != call.tenant) {
      return absl::PermissionDeniedError("staging_id: the transfer plan was issued to another tenant");
    }
    if (it->second.released) {
      return absl::FailedPreconditionError("staging_id: the transfer plan was released (ReleaseStaging)");
    }
    if (it->second.used) return absl::FailedPreconditionError("staging_id: the transfer plan was used already");
    if (it->second.put == nullptr) return absl::InvalidArgumentError("staging_id: the transfer plan is no put's");
    it->second.used = true;  // the workers consume the staged blocks now
    put = std::move(it->second.put);
  }
  auto claimed = registry_.Claim(call.tenant, put->name, put->overwrite, options_.max_tensors_per_tenant);
  if (!claimed.ok()) {
    {  // Refused before any step: the plan and its staged blocks stay for another try.
      absl::MutexLock lock(&staging_mu_);
      auto it = staging_.find(request.staging_id());
      if (it != staging_.end()) {
        it->second.put = std::move(put);
        it->second.used = false;
      }
    }
    const bool exists = claimed.status().code() == absl::StatusCode::kAlreadyExists;
    return absl::Status(claimed.status().code(), absl::StrCat(claimed.status().message(),
                                                              exists ? " (set overwrite to replace it)" : ""));
  }
  const std::string shard_name = *claimed;
  ClaimGuard claim(&registry_, call.tenant, put->name);
  auto stored = StoreStagedPut(
      *put, shard_name, [&claim](Resident resident) { return claim.Register(std::move(resident)); }, deadline, call);
  if (!stored.ok()) {  // the copies whose store steps did not run will not be stored
    StagingRecord failed;
    failed.put = std::move(put);
    DropStagedBestEffort(TicketsOf(failed));
  }
  return stored;
}

absl::StatusOr<v1::PutTensorResponse> Coordinator::StoreStagedPut(
    const StagedPut& put, const std::string& shard_name,
    const std::function<absl::StatusOr<ShardCopies>(Resident)>& register_resident, absl::Time deadline,
    const CallContext& call) {
  Placement placement;
  placement.block_of_rank = put.block_of_rank;
  for (const auto& [copy, ticket] : put.standby) placement.standby.push_back(copy);
  const ShardCopies copies{shard_name, placement.standby};
  auto staged = [&](const std::string& ticket, v1::LocalTensor* t) {
    t->set_dtype(DTypeToProto(put.dtype));
    t->mutable_shape()->Assign(put.local_shape.begin(), put.local_shape.end());
    t->set_staged(ticket);
  };
  std::vector<v1::Step> steps(num_workers_);
  for (int r = 0; r < num_workers_; ++r) {
    v1::StoreShardStep* store = steps[r].mutable_store();
    store->set_name(shard_name);
    staged(put.ticket_of_rank[r], store->mutable_shard());
  }
  for (const auto& [copy, ticket] : put.standby) {
    v1::NamedShard* standby = steps[copy.holder_rank].mutable_store()->add_standby();
    standby->set_name(StandbyShardName(shard_name, copy.block_rank));
    staged(ticket, standby->mutable_shard());
  }
  auto results = Dispatch(std::move(steps), StepDeadline(deadline), call);
  if (absl::Status gone = Abandoned(deadline, call, absl::StrCat("'", put.name, "'")); results.ok() && !gone.ok()) {
    results = gone;
  }
  if (!results.ok()) {
    DeleteShardsBestEffort(copies);
    return results.status();
  }
  Resident resident;
  resident.tenant = call.tenant;
  resident.info.set_name(put.name);
  resident.info.set_dtype(DTypeToProto(put.dtype));
  resident.info.mutable_shape()->Assign(put.shape.begin(), put.shape.end());
  resident.info.set_spec(planner::FormatPartitionSpec(put.spec));
  resident.spec = put.spec;
  resident.shard_name = shard_name;
  SetPlacement(placement, &resident);
  auto replaced = register_resident(std::move(resident));
  if (!replaced.ok()) {
    DeleteShardsBestEffort(copies);
    return replaced.status();
  }
  if (!replaced->empty()) RetireBestEffort(*replaced);
  int64_t bytes = DTypeSize(put.dtype);
  for (int64_t d : put.shape) bytes *= d;
  v1::PutTensorResponse response;
  response.set_name(put.name);
  response.set_bytes(bytes);
  return response;
}

// The streams of one BeginStreamedPut: each copy of each block (a rank's
// own, a standby) has its holder's stream and its range of the tensor's
// row-major bytes; every arriving chunk is cut to the ranges it meets.
// Bounded by progress, not by its length: a watchdog ends the put (cancels
// every stream, then runs OnStall's callback) once it has waited
// `idle_timeout` (--step_timeout) for one thing (the client's next chunk, a
// worker's reservation, write or answer); the streams' own deadline is the
// call's.
class Coordinator::StreamedPutImpl final : public Coordinator::StreamedPut {
 public:
  struct Destination {
    int holder = 0;
    std::string ticket;
    BlockRuns runs;  // where the block's bytes lie in the tensor's
    std::unique_ptr<StageStream> stream;  // set and reset under mu_ (the watchdog cancels it)
    absl::Time last_sent = absl::InfinitePast();  // its last message (the worker's bound runs from it)
  };

  StreamedPutImpl(Coordinator* coordinator, StagedPut put, std::string shard_name, absl::Time deadline,
                  CallContext call, int64_t total_bytes, std::vector<Destination> destinations,
                  absl::Duration idle_timeout)
      : coordinator_(coordinator),
        put_(std::move(put)),
        shard_name_(std::move(shard_name)),
        claim_(&coordinator->registry_, call.tenant, put_.name),
        deadline_(deadline),
        call_(std::move(call)),
        total_bytes_(total_bytes),
        destinations_(std::move(destinations)),
        idle_timeout_(idle_timeout) {}

  ~StreamedPutImpl() override {
    StopWatchdog();
    if (!stored_) Abandon();
  }

  // Opens every destination's stream (its header goes first), once the holders know the tickets.
  absl::Status Open() {
    Waiting("the holders to learn of their tickets");  // the watchdog's bound starts now
    watchdog_ = std::thread([this] { Watch(); });
    const std::vector<std::shared_ptr<WorkerChannel>> channels = coordinator_->dispatcher_.Channels();
    for (Destination& d : destinations_) {
      if (d.holder >= static_cast<int>(channels.size()) || channels[d.holder] == nullptr) {
        return absl::UnavailableError(absl::StrCat("worker rank ", d.holder, " is not registered"));
      }
      v1::StageShardChunk header;
      header.set_session(coordinator_->session_);
      header.set_ticket(d.ticket);
      header.set_tenant(call_.tenant);
      // The worker's bound on a silence: twice the longest wait here (a keep-alive goes with the next
      // chunk, which may come a step timeout after the last, behind the writes to other blocks).
      header.set_idle_timeout_ms(absl::ToInt64Milliseconds(2 * idle_timeout_));
      Waiting(absl::StrCat("worker rank ", d.holder, " to open its stage stream"));
      auto stream = channels[d.holder]->OpenStage(header, deadline_);
      if (!stream.ok()) return Broken(d, stream.status());
      d.last_sent = absl::Now();
      absl::MutexLock lock(&mu_);
      d.stream = std::move(*stream);
      if (stalled_) d.stream->Cancel();  // the watchdog fired meanwhile
    }
    // Every header is out before the first answer is awaited: the holders reserve at once.
    for (Destination& d : destinations_) {
      Waiting(absl::StrCat("worker rank ", d.holder, " to reserve its block"));
      if (absl::Status reserved = d.stream->WaitReserved(); !reserved.ok()) {
        ResetStream(d);
        return Broken(d, reserved);
      }
    }
    Waiting("the client's next chunk");
    return absl::OkStatus();
  }

  absl::Status Append(absl::string_view data) override {
    const int64_t from = received_;
    const int64_t to = from + static_cast<int64_t>(data.size());
    if (to > total_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("data: tensor '", put_.name, "' needs ", total_bytes_,
                                                     " bytes, the chunks carry ", to, " or more"));
    }
    // A chunk is taken a slice at a time: what a slice's runs gather, and each message to a holder, stay small.
    size_t done = 0;
    do {
      const absl::string_view slice = data.substr(done, kAppendSlice);
      if (auto s = AppendSlice(from + static_cast<int64_t>(done), slice); !s.ok()) return s;
      done += slice.size();
    } while (done < data.size());
    received_ = to;
    Waiting("the client's next chunk");
    return absl::OkStatus();
  }

  int64_t received_bytes() const override { return received_; }

  void OnStall(std::function<void()> stalled) override {
    absl::MutexLock lock(&mu_);
    if (stalled_) {
      stalled();
      return;
    }
    on_stall_ = std::move(stalled);
  }

  absl::Status Stalled() const override {
    absl::MutexLock lock(&mu_);
    return StalledLocked();
  }

  absl::StatusOr<v1::PutTensorResponse> Finish() override {
    if (received_ != total_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("data: tensor '", put_.name, "' needs ", total_bytes_,
                                                     " bytes, the chunks carry ", received_.load()));
    }
    for (Destination& d : destinations_) {
      Waiting(absl::StrCat("worker rank ", d.holder, " to answer its stream"));
      auto staged = d.stream->Finish();
      ResetStream(d);
      if (!staged.ok()) return Broken(d, staged.status());
    }
    {
      // The streams are done: from here the store steps' own deadline bounds the put.
      absl::MutexLock lock(&mu_);
      if (stalled_) return StalledLocked();
      done_ = true;
    }
    StopWatchdog();
    if (absl::Status gone = Abandoned(deadline_, call_, absl::StrCat("'", put_.name, "'")); !gone.ok()) return gone;
    auto response = coordinator_->StoreStagedPut(
        put_, shard_name_, [this](Resident resident) { return claim_.Register(std::move(resident)); }, deadline_,
        call_);
    stored_ = response.ok();
    return response;
  }

 private:
  static constexpr int64_t kAppendSlice = int64_t{4} << 20;

  absl::Status AppendSlice(int64_t from, absl::string_view data) {
    const absl::Time now = absl::Now();
    for (Destination& d : destinations_) {
      // A block split on a later dimension meets a slice in many runs: gathered into one message.
      int pieces = 0;
      absl::string_view piece;
      d.runs.Take(from, data, [&](absl::string_view p) {
        if (++pieces == 1) {
          piece = p;
          return;
        }
        if (pieces == 2) gathered_.assign(piece.data(), piece.size());
        gathered_.append(p.data(), p.size());
      });
      if (pieces > 1) piece = gathered_;
      // A block this chunk does not meet gets an empty message now and then: its holder's ticket
      // expires after a silence (the put's bytes may go to other blocks for longer than that).
      if (pieces == 0 && now - d.last_sent < kKeepAlive) continue;
      Waiting(absl::StrCat("worker rank ", d.holder, " to take the bytes of its block"));
      if (!d.stream->Write(piece).ok()) {
        auto answer = d.stream->Finish();  // why it broke
        ResetStream(d);
        absl::Status why = answer.ok() ? absl::UnavailableError("the stage stream ended early") : answer.status();
        if (why.code() == absl::StatusCode::kCancelled) {
          why = absl::Status(why.code(), absl::StrCat(why.message(), " (a worker ends a put's stream that "
                                                      "brought nothing for its --staged_block_ttl, or twice "
                                                      "--step_timeout if longer)"));
        }
        return Broken(d, why);
      }
      d.last_sent = absl::Now();
    }
    return absl::OkStatus();
  }

  // A stream's failure, naming the rank; the watchdog's own when it ended the stream.
  absl::Status Broken(const Destination& d, const absl::Status& s) {
    if (absl::Status stalled = Stalled(); !stalled.ok()) return stalled;
    return absl::Status(s.code(), absl::StrCat("worker rank ", d.holder, " (staging its block): ", s.message()));
  }

  absl::Status StalledLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!stalled_) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat(
        "data: tensor '", put_.name, "': waited --step_timeout (", absl::FormatDuration(idle_timeout_), ") for ",
        stalled_waiting_for_, " with ", received_bytes_when_stalled_, " of its ", total_bytes_,
        " bytes in; it was not kept (a streamed put may take any time while its bytes keep coming)"));
  }

  // What the put waits for now; each change is progress, and restarts the watchdog's bound.
  void Waiting(std::string what) {
    absl::MutexLock lock(&mu_);
    waiting_for_ = std::move(what);
    last_progress_ = absl::Now();
  }

  void ResetStream(Destination& d) {
    std::unique_ptr<StageStream> gone;  // destroyed (cancelled, its call released) once the lock is let go
    absl::MutexLock lock(&mu_);
    gone = std::move(d.stream);
  }

  void Watch() {
    absl::MutexLock lock(&mu_);
    while (!done_) {
      const absl::Time until = last_progress_ + idle_timeout_;
      if (absl::Now() >= until) {
        stalled_ = true;
        stalled_waiting_for_ = waiting_for_;
        received_bytes_when_stalled_ = received_;
        for (Destination& d : destinations_) {
          if (d.stream != nullptr) d.stream->Cancel();
        }
        // Finish registers nothing once stalled_ is set: the name is free
        // before the client hears the put ended.
        claim_.ReleaseNow();
        if (on_stall_) on_stall_();
        return;
      }
      mu_.AwaitWithDeadline(absl::Condition(&done_), until);
    }
  }

  void StopWatchdog() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    if (watchdog_.joinable()) watchdog_.join();
  }

  // Cancels the open streams and has every holder drop its tickets now, in
  // parallel, each call bounded (a failed put's blocks do not wait for their TTL).
  void Abandon() {
    for (Destination& d : destinations_) ResetStream(d);
    std::map<int, v1::DropStagedRequest> drops;
    for (const Destination& d : destinations_) {
      v1::DropStagedRequest& drop = drops[d.holder];
      drop.set_session(coordinator_->session_);
      drop.add_tickets(d.ticket);
    }
    const std::vector<std::shared_ptr<WorkerChannel>> channels = coordinator_->dispatcher_.Channels();
    const absl::Time until = absl::Now() + kDropTimeout;
    std::vector<std::thread> droppers;
    for (const auto& [holder, drop] : drops) {
      if (holder >= static_cast<int>(channels.size()) || channels[holder] == nullptr) continue;
      droppers.emplace_back([&channels, &drop = drop, holder = holder, until] {
        channels[holder]->DropStaged(drop, until).IgnoreError();  // a worker that missed it expires them
      });
    }
    for (std::thread& t : droppers) t.join();
  }

  static constexpr absl::Duration kDropTimeout = absl::Seconds(2);
  static constexpr absl::Duration kKeepAlive = absl::Seconds(1);
  Coordinator* coordinator_;
  const StagedPut put_;
  const std::string shard_name_;
  ClaimGuard claim_;  // released unless registered
  const absl::Time deadline_;
  const CallContext call_;
  const int64_t total_bytes_;
  std::vector<Destination> destinations_;
  const absl::Duration idle_timeout_;
  std::atomic<int64_t> received_{0};  // the watchdog reads it
  std::string gathered_;              // a chunk's runs of one strided block, sent as one message
  bool stored_ = false;
  mutable absl::Mutex mu_;
  absl::Time last_progress_ ABSL_GUARDED_BY(mu_);
  std::string waiting_for_ ABSL_GUARDED_BY(mu_) = "the client's next chunk";
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // the watchdog stops
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  std::string stalled_waiting_for_ ABSL_GUARDED_BY(mu_);
  int64_t received_bytes_when_stalled_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> on_stall_ ABSL_GUARDED_BY(mu_);
  std::thread watchdog_;
};

absl::StatusOr<std::unique_ptr<Coordinator::StreamedPut>> Coordinator::BeginStreamedPut(
    const std::string& name, DType dtype, const std::vector<int64_t>& shape, const std::string& spec_text,
    bool overwrite, absl::Time deadline, const CallContext& call) {
  if (auto s = CheckReady(); !s.ok()) return s;
  if (auto s = ValidateResidentName("name", name); !s.ok()) return s;
  auto spec = planner::ParsePartitionSpec(spec_text);
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("spec: ", spec.status().message()));
  if (auto s = planner::ValidatePartitionSpec(name, shape, *spec, mesh_); !s.ok()) return s;
  auto local = planner::LocalShape(name, shape, *spec, mesh_);
  if (!local.ok()) return local.status();
  auto n = CheckedNumElements(shape, DTypeSize(dtype), "shape");
  if (!n.ok()) return n.status();
  const int64_t total_bytes = *n * DTypeSize(dtype);
  if (total_bytes == 0 || !StagingAddresses().ok()) return nullptr;
  auto placement = Place(name, dtype, shape, *spec);
  if (!placement.ok()) return placement.status();

  StagedPut put;
  put.name = name;
  put.overwrite = overwrite;
  put.dtype = dtype;
  put.shape = shape;
  put.spec = *spec;
  put.local_shape = *local;
  put.block_of_rank = placement->block_of_rank;
  std::vector<StreamedPutImpl::Destination> destinations;
  std::vector<v1::ExpectStagedRequest> expect(num_workers_);
  std::vector<int64_t> staged_bytes(num_workers_, 0);
  auto destination = [&](int block_rank, int holder) -> absl::StatusOr<std::string> {
    auto offsets = planner::BlockOffsets(name, shape, *spec, mesh_, block_rank);
    if (!offsets.ok()) return offsets.status();
    StreamedPutImpl::Destination d;
    d.holder = holder;
    d.ticket = security::RandomHex(16);
    auto runs = BlockRuns::Make(shape, *offsets, *local, DTypeSize(dtype));
    if (!runs.ok()) return absl::InternalError(absl::StrCat("block of rank ", block_rank, ": ", runs.status().message()));
    d.runs = *std::move(runs);
    v1::StagingTicket* t = expect[holder].add_tickets();
    t->set_ticket(d.ticket);
    t->set_tenant(call.tenant);
    t->set_put_tensor(name);
    t->set_put_block_rank(block_rank);
    t->set_dtype(DTypeToProto(dtype));
    t->mutable_shape()->Assign(local->begin(), local->end());
    staged_bytes[holder] += d.runs.block_bytes();
    destinations.push_back(std::move(d));
    return destinations.back().ticket;
  };
  for (int r = 0; r < num_workers_; ++r) {
    auto ticket = destination(r, r);
    if (!ticket.ok()) return ticket.status();
    put.ticket_of_rank.push_back(*ticket);
  }
  for (const StandbyCopy& c : placement->standby) {
    auto ticket = destination(c.block_rank, c.holder_rank);
    if (!ticket.ok()) return ticket.status();
    put.standby.push_back({c, *ticket});
  }
  // A block a worker's staging budget (or the tenant's share of it) could never hold goes the assembled way.
  for (const v1::WorkerInfo& w : dispatcher_.Workers()) {
    if (w.rank() < 0 || w.rank() >= num_workers_) continue;
    const int64_t room = call.tenant.empty() ? w.staging_budget_bytes()
                                             : std::min(w.staging_budget_bytes(), w.staging_tenant_limit_bytes());
    if (room < staged_bytes[w.rank()]) return nullptr;
  }

  auto claimed = registry_.Claim(call.tenant, name, overwrite, options_.max_tensors_per_tenant);
  if (!claimed.ok()) {
    const bool exists = claimed.status().code() == absl::StatusCode::kAlreadyExists;
    return absl::Status(claimed.status().code(), absl::StrCat(claimed.status().message(),
                                                              exists ? " (set overwrite to replace it)" : ""));
  }
  auto streamed = std::make_unique<StreamedPutImpl>(this, std::move(put), *claimed, deadline, call, total_bytes,
                                                    std::move(destinations), options_.step_timeout);
  // From here the object's destructor releases the claim and drops the tickets.
  if (auto s = TellStagingTickets(std::move(expect), deadline); !s.ok()) return s;
  if (auto s = streamed->Open(); !s.ok()) {
    // A holder's staging budget is taken now (other puts' streams, direct-path blocks), and no byte has
    // left yet: the assembled path needs none of it.
    if (s.code() == absl::StatusCode::kResourceExhausted) return nullptr;
    return s;
  }
  return std::unique_ptr<StreamedPut>(std::move(streamed));
}

absl::StatusOr<TensorMeta> Coordinator::ResolveStaged(const v1::Tensor& t, const std::string& field,
                                                     const std::string& tenant) {
  const std::string at = absl::StrCat(field, ".staged");
  absl::MutexLock lock(&staging_mu_);
  auto it = staging_.find(t.staged());
  if (it == staging_.end() || it->second.expires <= absl::Now()) {
    return absl::NotFoundError(absl::StrCat(at, ": no transfer plan of that id (unknown, or expired after ",
                                            absl::FormatDuration(options_.staging_ttl), "); ask PlanStaging again"));
  }
  const StagingRecord& record = it->second;
  if (record.tenant != tenant) {
    return absl::PermissionDeniedError(absl::StrCat(at, ": the transfer plan was issued to another tenant"));
  }
  if (record.released) {
    return absl::FailedPreconditionError(absl::StrCat(at, ": the transfer plan was released (ReleaseStaging; its "
                                                      "blocks dropped); stage again under a new one"));
  }
  if (record.used) {
    return absl::FailedPreconditionError(absl::StrCat(at, ": the transfer plan was used already (its blocks are "
                                                      "consumed); stage again under a new one"));
  }
  auto op = record.operands.find(field);
  if (op == record.operands.end()) {
    return absl::InvalidArgumentError(absl::StrCat(at, ": the transfer plan staged no ", field));
  }
  const TensorMeta& planned = op->second.meta;
  auto dtype = DTypeFromProto(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  if (*dtype != planned.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", DTypeName(*dtype), ", but ",
                                                   DTypeName(planned.dtype), " was staged"));
  }
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  if (shape != planned.shape) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: ", ShapeToString(shape), ", but ",
                                                   ShapeToString(planned.shape), " was staged"));
  }
  auto spec = NormalizedSpec(t.spec(), field);
  if (!spec.ok()) return spec.status();
  if (*spec != planned.spec) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".spec: '", *spec, "', but the blocks were staged for '",
                                                   planned.spec, "'"));
  }
  TensorMeta meta = planned;
  meta.staging_id = t.staged();
  meta.staged_tickets = op->second.ticket_of_rank;
  return meta;
}

absl::Status Coordinator::TakeStaged(const std::string& staging_id, const planner::Plan& plan,
                                     TicketsByRank* tickets) {
  absl::MutexLock lock(&staging_mu_);
  auto it = staging_.find(staging_id);
  if (it == staging_.end()) return absl::NotFoundError("staged: the transfer plan expired meanwhile");
  if (it->second.used) return absl::FailedPreconditionError("staged: the transfer plan was used already");
  for (const auto& [field, op] : it->second.operands) {
    const planner::PlanOperand* planned = planner::FindPlanOperand(plan, field);
    if (planned == nullptr) continue;  // an operand this request does not name
    for (int r = 0; r < num_workers_; ++r) {
      auto offsets = planner::BlockOffsets(field, planned->global_shape, planned->input_spec, mesh_, r);
      if (!offsets.ok()) return offsets.status();
      if (*offsets != op.offsets_of_rank[r]) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".staged: this request's plan places rank ", r, "'s block elsewhere than the transfer plan did "
            "(plan the transfer with the request as it is submitted)"));
      }
    }
  }
  it->second.used = true;
  for (auto& [rank, of_rank] : TicketsOf(it->second)) {
    std::vector<std::string>& to = (*tickets)[rank];
    to.insert(to.end(), of_rank.begin(), of_rank.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::GroupedQuantizeResponse> Coordinator::GroupedQuantize(
    const v1::GroupedQuantizeRequest& request, absl::Time deadline, const CallContext& call) {
  const absl::Time start = absl::Now();
  if (auto s = CheckReady(); !s.ok()) return s;
  absl::flat_hash_map<std::string, TensorMeta> metas;
  PinGuard guard{this, {}};
  auto resolve = [&](const v1::Tensor& t, const std::string& field) -> absl::StatusOr<TensorMeta> {
    auto meta = ResolveMeta(t, field, call.tenant, &guard);
    if (meta.ok()) metas[field] = *meta;
    return meta;
  };
  auto plan_request = QuantizePlanRequest(request, mesh_, resolve);
  if (!plan_request.ok()) return plan_request.status();
  const bool direct = !metas["x"].staging_id.empty();
  if (metas["x"].shared_memory.has_value()) {
    return absl::UnimplementedError(
        "x.shared_memory: grouped quantize reads x inline or resident; shared memory is for GEMM operands and "
        "outputs");
  }
  if (!IsGemmFloat(metas["x"].dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("x.dtype must be f32, bf16 or f16, got ", DTypeName(metas["x"].dtype)));
  }
  if (!IsFloat8(plan_request->attrs.out_dtype)) {
    return absl::InvalidArgumentError("out_dtype must be F8E4M3 or F8E5M2");
  }
  auto plan = MakePlan(*plan_request);
  if (!plan.ok()) return plan.status();
  auto gs_tensor = HostTensorFromProto(request.group_sizes(), "group_sizes");
  if (!gs_tensor.ok()) return gs_tensor.status();
  auto sizes = ToInt64Vector(*gs_tensor, "group_sizes");
  if (!sizes.ok()) return sizes.status();
  const planner::PlanOperand* x_op = planner::FindPlanOperand(*plan, "x");
  const int rank = static_cast<int>(x_op->global_shape.size());
  auto resolved_flatten = planner::ResolveFlattenAxis(plan_request->attrs.flatten_axis, rank);
  if (!resolved_flatten.ok()) return resolved_flatten.status();
  const int flatten = *resolved_flatten;
  auto local = FlattenToMatrix(x_op->input_local_shape, flatten);  // the planner checked flatten_axis
  if (!local.ok()) return local.status();
  if (auto s = CheckGroupSizes(*sizes, *plan, local->first, "x"); !s.ok()) return s;
  const bool block = request.scaling() == v1::MXFP8 || request.scaling() == v1::BLOCK_FP8;
  BlockQuantize bq;
  GlobalGroups groups;
  if (block) {
    auto checked = CheckBlockQuantize(request, *plan, *sizes, x_op->global_shape, flatten, &bq);
    if (!checked.ok()) return checked.status();
    groups = std::move(*checked);
  }
  std::vector<float> scales;
  if (request.scaling() == v1::DELAYED) {
    auto t = HostTensorFromProto(request.scales(), "scales");
    if (!t.ok()) return t.status();
    if (t->dtype != DType::kF32 || t->NumElements() != static_cast<int64_t>(sizes->size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scales: delayed scaling needs F32 scales, one per group_sizes entry (", sizes->size(), ")"));
    }
    scales.assign(t->data<float>(), t->data<float>() + t->NumElements());
  }
  TicketsByRank staged_tickets;
  // A request that fails from here has its staged blocks dropped now, not at their TTL.
  absl::Cleanup drop_staged = [&] { DropStagedBestEffort(std::move(staged_tickets)); };
  if (direct) {  // the workers consume the staged blocks now: a plan is used once
    if (auto s = TakeStaged(metas["x"].staging_id, *plan, &staged_tickets); !s.ok()) return s;
  }
  HostTensor x_data;
  const bool x_inline = metas["x"].resident_shard.empty() && metas["x"].staged_tickets.empty();
  if (x_inline) {
    auto t = HostTensorFromProto(request.x(), "x");
    if (!t.ok()) return t.status();
    x_data = std::move(*t);
    inline_activation_bytes_ += x_data.NumBytes();
  }
  QuantizeStepsRequest step_request;
  step_request.plan = &*plan;
  step_request.mesh = &mesh_;
  step_request.x = GemmOperand{metas["x"], x_inline ? &x_data : nullptr};
  step_request.group_sizes = *sizes;
  step_request.scales = std::move(scales);
  step_request.out_dtype = plan_request->attrs.out_dtype;
  step_request.scaling = request.scaling();
  step_request.rowwise = plan_request->attrs.rowwise;
  step_request.colwise = plan_request->attrs.colwise;
  step_request.block_2d = request.block_2d();
  step_request.flatten_axis = flatten;
  auto built = BuildQuantizeSteps(step_request);
  if (!built.ok()) return built.status();
  std::vector<v1::Step> steps = std::move(*built);

  // Kept outputs: each name claimed now, registered once every worker holds
  // its shard (a failed step leaves no shard and no name behind).
  auto keeps = QuantizeKeeps(request, *plan, x_op->global_shape, flatten, *sizes);
  if (!keeps.ok()) return keeps.status();
  std::vector<std::unique_ptr<ClaimGuard>> claims;
  std::vector<ShardCopies> kept_shards;
  auto drop_kept = [&] {
    for (const ShardCopies& copies : kept_shards) DeleteShardsBestEffort(copies);
  };
  for (KeptOutput& k : *keeps) {
    auto claimed = registry_.Claim(call.tenant, k.name, request.keep().overwrite(), options_.max_tensors_per_tenant);
    if (!claimed.ok()) {
      const bool exists = claimed.status().code() == absl::StatusCode::kAlreadyExists;
      return absl::Status(claimed.status().code(), absl::StrCat("keep.", k.field, ": ", claimed.status().message(),
                                                                exists ? " (set keep.overwrite to replace it)" : ""));
    }
    k.shard_name = *claimed;
    claims.push_back(std::make_unique<ClaimGuard>(&registry_, call.tenant, k.name));
    for (v1::Step& step : steps) {
      if (k.role == v1::TENSOR_ROWWISE_DATA) step.mutable_quantize()->set_keep_rowwise_data_as(k.shard_name);
      if (k.role == v1::TENSOR_SCALE_INV) step.mutable_quantize()->set_keep_scale_inv_as(k.shard_name);
    }
  }
  for (const KeptOutput& k : *keeps) kept_shards.push_back({k.shard_name, {}});
  auto results = Dispatch(std::move(steps), StepDeadline(deadline), call);
  if (results.ok()) std::move(drop_staged).Cancel();  // every step claimed its block
  // Each kept output's standby copies (--replicas), before anything is registered.
  std::vector<Placement> placements;
  for (size_t i = 0; results.ok() && i < keeps->size(); ++i) {
    const KeptOutput& k = (*keeps)[i];
    auto placement = Place(k.name, k.dtype, k.shape, k.spec);
    if (!placement.ok()) {
      results = placement.status();
      break;
    }
    kept_shards[i].standby = placement->standby;
    if (absl::Status s = StoreStandbyOfKept(k.shard_name, *placement, deadline, call); !s.ok()) {
      results = absl::Status(s.code(), absl::StrCat("keep.", k.field, ": its standby copies (--replicas=",
                                                    options_.replicas, "): ", s.message()));
      break;
    }
    placements.push_back(std::move(*placement));
  }
  if (absl::Status gone = Abandoned(deadline, call, "the kept output");
      results.ok() && !keeps->empty() && !gone.ok()) {
    results = gone;
  }
  if (!results.ok()) {
    drop_kept();
    return ExplainMissingShard(results.status(), call.tenant, guard.names);
  }

  v1::GroupedQuantizeResponse response;
  bool scale_kept = false;
  std::vector<Resident> kept_residents;
  for (size_t i = 0; i < keeps->size(); ++i) {
    KeptOutput& k = (*keeps)[i];
    scale_kept |= k.role == v1::TENSOR_SCALE_INV;
    Resident resident;
    resident.tenant = call.tenant;
    resident.info.set_name(k.name);
    resident.info.set_dtype(DTypeToProto(k.dtype));
    resident.info.mutable_shape()->Assign(k.shape.begin(), k.shape.end());
    resident.info.set_spec(planner::FormatPartitionSpec(k.spec));
    resident.spec = k.spec;
    resident.shard_name = k.shard_name;
    SetPlacement(placements[i], &resident);
    kept_residents.push_back(std::move(resident));
    v1::Tensor* field = QuantizeField(k.role, &response);
    field->set_dtype(DTypeToProto(k.dtype));
    field->mutable_shape()->Assign(k.shape.begin(), k.shape.end());
    field->set_resident(k.name);
    field->set_spec(planner::FormatPartitionSpec(k.spec));
  }
  for (size_t i = 0; i < plan->outputs.size(); ++i) {
    const planner::PlanOutput& o = plan->outputs[i];
    if (block && IsBlockAssembled(bq.mode, o.name)) continue;
    const v1::TensorRole role = TensorRoleFromName(o.name);
    if (std::any_of(keeps->begin(), keeps->end(), [&](const KeptOutput& k) { return k.role == role; })) continue;
    auto assembled = Assemble(o.dtype, o.global_shape, o.spec, [&](int r) {
      return WorkerOutput((*results)[r], o.name, r);
    });
    if (!assembled.ok()) {
      drop_kept();
      return assembled.status();
    }
    v1::Tensor* field = QuantizeField(TensorRoleFromName(o.name), &response);
    HostTensorToProto(*assembled, field);
    field->set_spec(planner::FormatPartitionSpec(o.spec));
  }
  if (block && !scale_kept) {
    if (auto s = AssembleBlockScaled(*plan, *results, *sizes, groups, bq, &response); !s.ok()) {
      drop_kept();
      return s;
    }
  }
  // Kept outputs are registered together, last: a failed request leaves
  // none of them (and replaces nothing).
  if (!kept_residents.empty()) {
    for (auto& claim : claims) claim->Registered();
    auto replaced = registry_.RegisterAll(std::move(kept_residents));
    if (!replaced.ok()) {
      drop_kept();
      return absl::Status(replaced.status().code(), absl::StrCat("keep: ", replaced.status().message()));
    }
    for (const ShardCopies& r : *replaced) {
      if (!r.empty()) RetireBestEffort(r);
    }
  }
  if (request.include_plan()) PlanToProto(*plan, response.mutable_plan());
  response.set_plan_summary(planner::PlanSummary(*plan));
  double worker_seconds = 0;
  for (const v1::StepResult& r : *results) worker_seconds = std::max(worker_seconds, r.compute_seconds());
  response.set_worker_seconds(worker_seconds);
  for (const v1::Tensor* t : {&response.rowwise_data(), &response.colwise_data(), &response.scale_inv(),
                              &response.colwise_scale_inv(), &response.amax()}) {
    (direct ? direct_activation_bytes_ : inline_activation_bytes_) += static_cast<int64_t>(t->data().size());
  }
  response.set_server_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return response;
}

absl::StatusOr<v1::Plan> Coordinator::Plan(const v1::PlanRequest& request, const CallContext& call) const {
  auto resolve = [this, &call](const v1::Tensor& t, const std::string& field) -> absl::StatusOr<TensorMeta> {
    if (t.source_case() == v1::Tensor::kResident) {
      auto r = registry_.Find(call.tenant, t.resident());
      if (!r.ok()) return r.status();
      return MetaOf(*r);
    }
    // A dry run needs no data: shape, dtype and spec describe the tensor.
    auto dtype = DTypeFromProto(t.dtype(), field);
    if (!dtype.ok()) return dtype.status();
    TensorMeta meta;
    meta.dtype = *dtype;
    meta.shape.assign(t.shape().begin(), t.shape().end());
    meta.spec = t.spec();
    auto n = CheckedNumElements(meta.shape, DTypeSize(meta.dtype), field);
    if (!n.ok()) return n.status();
    return meta;
  };
  absl::StatusOr<planner::PlanRequest> pr;
  if (request.has_grouped_gemm()) {
    pr = GemmPlanRequest(request.grouped_gemm(), mesh_, resolve);
  } else if (request.has_grouped_quantize()) {
    pr = QuantizePlanRequest(request.grouped_quantize(), mesh_, resolve);
  } else {
    return absl::InvalidArgumentError("op: set grouped_gemm or grouped_quantize");
  }
  if (!pr.ok()) return pr.status();
  auto plan = MakePlan(*pr);
  if (!plan.ok()) return plan.status();
  v1::Plan out;
  PlanToProto(*plan, &out, !request.omit_text());
  return out;
}

absl::StatusOr<v1::GroupedGemmResponse> Coordinator::GroupedGemm(
    const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call) {
  if (auto s = ValidateGemmEnums(request); !s.ok()) return s;
  if (request.layout() == v1::GroupedGemmRequest::GLOBAL_SORTED) {
    return GroupedGemmGlobalSorted(request, deadline, call);
  }
  return GroupedGemmPerShard(request, deadline, call);
}

void Coordinator::GroupedGemmAsync(const v1::GroupedGemmRequest& request, absl::Time deadline, CallContext call,
                                   GemmDone done) {
  if (auto s = ValidateGemmEnums(request); !s.ok()) {
    done(s);
    return;
  }
  if (request.layout() == v1::GroupedGemmRequest::GLOBAL_SORTED || request.ByteSizeLong() > kOffloadBytes) {
    // Routing rows or decoding large inline operands takes a thread of its own.
    std::thread([this, &request, deadline, call = std::move(call), done = std::move(done)] {
      done(GroupedGemm(request, deadline, call));
    }).detach();
    return;
  }
  StartGroupedGemmPerShard(request, deadline, call, {}, nullptr, std::move(done));
}

namespace {

// Rows of `t` ([rows, cols]) laid out per `routing` (padding rows zero).
HostTensor RouteRows(const HostTensor& t, const RowRouting& routing) {
  HostTensor out = *ZerosTensor(t.dtype, {routing.num_shards * routing.shard_rows, t.shape[1]});
  const size_t row_bytes = static_cast<size_t>(t.shape[1]) * DTypeSize(t.dtype);
  for (size_t i = 0; i < routing.source_row.size(); ++i) {
    if (routing.source_row[i] < 0) continue;
    std::memcpy(&out.bytes[i * row_bytes], &t.bytes[routing.source_row[i] * row_bytes], row_bytes);
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::GroupedGemmResponse> Coordinator::GroupedGemmGlobalSorted(
    const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call) {
  const bool ragged_k = request.ragged() == v1::GroupedGemmRequest::RAGGED_K;
  bool in_shared_memory = request.has_out_shared_memory();
  bool staged = request.direct_output();
  for (const v1::Tensor* t : {&request.lhs(), &request.rhs(), &request.bias(), &request.lhs_scale_inv(),
                              &request.rhs_scale_inv()}) {
    in_shared_memory |= t->source_case() == v1::Tensor::kSharedMemory;
    staged |= t->source_case() == v1::Tensor::kStaged;
  }
  if (in_shared_memory || staged) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout GLOBAL_SORTED routes the rows itself: its operands and output travel inline; use the PER_SHARD "
        "layout with ", in_shared_memory ? "shared memory" : "staged operands or direct_output"));
  }
  if (request.lhs().source_case() == v1::Tensor::kResident ||
      (ragged_k && request.rhs().source_case() == v1::Tensor::kResident)) {
    return absl::InvalidArgumentError(
        "layout GLOBAL_SORTED routes the rows itself: send lhs (and ragged-K rhs) inline");
  }
  if (!ragged_k && !request.keep_output_as().empty()) {
    return absl::InvalidArgumentError(
        "keep_output_as: the GLOBAL_SORTED layout returns rows in the client's order; keep "
        "outputs resident with the PER_SHARD layout");
  }
  if (IsGiven(request.lhs_scale_inv()) || (ragged_k && IsGiven(request.rhs_scale_inv())) ||
      request.lhs().dtype() == v1::F8E4M3 || request.lhs().dtype() == v1::F8E5M2) {
    return absl::InvalidArgumentError(
        "lhs_scale_inv: layout GLOBAL_SORTED routes the rows itself, and per-row-group scales would not "
        "follow them; send FP8 operands with the PER_SHARD layout, or BF16 lhs with quantize_lhs");
  }
  auto lhs = HostTensorFromProto(request.lhs(), "lhs");
  if (!lhs.ok()) return lhs.status();
  if (lhs->shape.size() != 2) return absl::InvalidArgumentError("lhs must be [M, K]");
  auto gs_tensor = HostTensorFromProto(request.group_sizes(), "group_sizes");
  if (!gs_tensor.ok()) return gs_tensor.status();
  auto sizes = ToInt64Vector(*gs_tensor, "group_sizes");
  if (!sizes.ok()) return sizes.status();
  auto spec = planner::ParsePartitionSpec(request.lhs().spec());
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("lhs.spec: ", spec.status().message()));
  std::vector<std::string> row_axes = spec->dims.empty() ? std::vector<std::string>() : spec->dims[0];
  std::vector<int64_t> row_axis_sizes;
  int ep_index = -1;
  for (size_t i = 0; i < row_axes.size(); ++i) {
    if (planner::AxisIndex(mesh_, row_axes[i]) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("lhs.spec: unknown mesh axis '", row_axes[i], "'"));
    }
    row_axis_sizes.push_back(planner::AxisSize(mesh_, row_axes[i]));
    if (!mesh_.roles.ep.empty() && row_axes[i] == mesh_.roles.ep) ep_index = static_cast<int>(i);
  }
  auto routing = RouteSortedRows(*sizes, lhs->shape[0], row_axis_sizes, ep_index);
  if (!routing.ok()) return routing.status();

  // The routed operands go to the PER_SHARD path decoded (the request's
  // own, and its bytes, are not copied or encoded again).
  absl::flat_hash_map<std::string, DecodedOperand> decoded;
  decoded["lhs"] = {RouteRows(*lhs, *routing), request.lhs().spec()};
  if (ragged_k) {
    auto rhs = HostTensorFromProto(request.rhs(), "rhs");
    if (!rhs.ok()) return rhs.status();
    if (rhs->shape.size() != 2 || rhs->shape[0] != lhs->shape[0]) {
      return absl::InvalidArgumentError("rhs must be [M, N] with the rows of lhs");
    }
    decoded["rhs"] = {RouteRows(*rhs, *routing), request.rhs().spec()};
  }
  HostTensor shard_sizes = *ZerosTensor(DType::kI64, {static_cast<int64_t>(routing->shard_group_sizes.size())});
  std::copy(routing->shard_group_sizes.begin(), routing->shard_group_sizes.end(), shard_sizes.data<int64_t>());
  decoded["group_sizes"] = {std::move(shard_sizes),
                            row_axes.empty() ? "" : absl::StrCat("((", absl::StrJoin(row_axes, ","), "),)")};

  HostTensor out;
  auto response = GroupedGemmPerShard(request, deadline, call, std::move(decoded), ragged_k ? nullptr : &out);
  if (!response.ok() || ragged_k) return response;
  // Output rows back in the client's order.
  HostTensor client_out = *ZerosTensor(out.dtype, {lhs->shape[0], out.shape[1]});
  const size_t row_bytes = static_cast<size_t>(out.shape[1]) * DTypeSize(out.dtype);
  for (size_t i = 0; i < routing->source_row.size(); ++i) {
    if (routing->source_row[i] < 0) continue;
    std::memcpy(&client_out.bytes[routing->source_row[i] * row_bytes], &out.bytes[i * row_bytes], row_bytes);
  }
  HostTensorToProto(client_out, response->mutable_out());  // the client's rows: no spec of the plan's
  return response;
}

absl::StatusOr<std::shared_ptr<Coordinator::GemmCall>> Coordinator::PrepareGroupedGemm(
    const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call,
    absl::flat_hash_map<std::string, DecodedOperand> decoded, HostTensor* out_tensor) {
  auto c = std::make_shared<GemmCall>(this);
  c->start = absl::Now();
  c->request = &request;
  c->deadline = deadline;
  c->call = call;
  c->out_tensor = out_tensor;
  if (auto s = CheckReady(); !s.ok()) return s;
  if (!request.keep_output_as().empty()) {
    if (auto s = ValidateResidentName("keep_output_as", request.keep_output_as()); !s.ok()) return s;
  }
  absl::flat_hash_map<std::string, TensorMeta> metas;
  auto resolve = [&](const v1::Tensor& t, const std::string& field) -> absl::StatusOr<TensorMeta> {
    absl::StatusOr<TensorMeta> meta;
    if (auto it = decoded.find(field); it != decoded.end()) {
      meta = TensorMeta{it->second.tensor.dtype, it->second.tensor.shape, it->second.spec};
    } else {
      meta = ResolveMeta(t, field, call.tenant, &c->guard);
    }
    if (meta.ok()) metas[field] = *meta;
    return meta;
  };
  auto plan_request = GemmPlanRequest(request, mesh_, resolve);
  if (!plan_request.ok()) return plan_request.status();
  if (!metas["group_sizes"].resident_shard.empty() || metas["group_sizes"].shared_memory.has_value() ||
      !metas["group_sizes"].staging_id.empty()) {
    return absl::InvalidArgumentError(
        "group_sizes must be sent inline, not as a resident tensor, in shared memory or staged");
  }
  if (request.has_out_shared_memory() && !request.keep_output_as().empty()) {
    return absl::InvalidArgumentError("out_shared_memory: an output is kept resident or written to shared memory, "
                                      "not both");
  }
  if (request.direct_output() && (!request.keep_output_as().empty() || request.has_out_shared_memory())) {
    return absl::InvalidArgumentError(
        "direct_output: an output is left on the workers for direct fetch, kept resident (keep_output_as) or "
        "written to shared memory (out_shared_memory), one of them");
  }
  std::set<std::string> staging_ids;
  for (const auto& [field, meta] : metas) {
    if (!meta.staging_id.empty()) staging_ids.insert(meta.staging_id);
  }
  c->direct = !staging_ids.empty() || request.direct_output();
  logging::TraceMark("checked");
  auto plan = MakePlan(*plan_request);
  logging::TraceMark("planned");
  if (!plan.ok() && request.has_quantize_lhs() &&
      absl::StrContains(plan.status().message(), "lhs_scale_inv")) {
    // The operand is the one the workers' quantize makes, not the client's.
    return absl::Status(plan.status().code(),
                        absl::StrCat("quantize_lhs: the scales the workers make (lhs_scale_inv, per group for "
                                     "CURRENT, 1x128 blocks of K for BLOCK_FP8) cannot be laid out: ",
                                     plan.status().message()));
  }
  if (!plan.ok()) return plan.status();
  if (auto s = CheckFp8ScalesGiven(request, *plan); !s.ok()) return s;
  if (request.scaling() == v1::MXFP8 && IsFloat8(metas["rhs"].dtype)) {
    for (const v1::WorkerInfo& w : dispatcher_.Workers()) {
      if (w.backend() == "cuda") {
        return absl::UnimplementedError(absl::StrCat(
            "scaling: MXFP8 GEMM needs Blackwell (cuBLASLt's VEC32_UE8M0); rank ", w.rank(), " is ",
            w.device(), ". Use BLOCK_FP8 (1x128 x 128x128) or per-group CURRENT scaling on Hopper"));
      }
    }
  }
  auto group_sizes_tensor = decoded.contains("group_sizes")
                                ? absl::StatusOr<HostTensor>(std::move(decoded["group_sizes"].tensor))
                                : HostTensorFromProto(request.group_sizes(), "group_sizes");
  if (!group_sizes_tensor.ok()) return group_sizes_tensor.status();
  auto group_sizes = ToInt64Vector(*group_sizes_tensor, "group_sizes");
  if (!group_sizes.ok()) return group_sizes.status();
  const bool ragged_k = request.ragged() == v1::GroupedGemmRequest::RAGGED_K;
  if (auto s = CheckGroupSizes(*group_sizes, *plan, planner::FindPlanOperand(*plan, "lhs")->input_local_shape[0],
                               ragged_k ? "lhs/rhs" : "lhs");
      !s.ok()) {
    return s;
  }

  // Decode inline operands once; each worker gets its block. (A std::map:
  // the step request points at its values.)
  std::map<std::string, HostTensor> inline_tensors;
  const std::pair<const v1::Tensor*, const char*> sources[] = {{&request.lhs(), "lhs"},
                                                               {&request.rhs(), "rhs"},
                                                               {&request.bias(), "bias"},
                                                               {&request.lhs_scale_inv(), "lhs_scale_inv"},
                                                               {&request.rhs_scale_inv(), "rhs_scale_inv"}};
  GemmStepsRequest step_request;
  step_request.plan = &*plan;
  step_request.mesh = &mesh_;
  step_request.ragged = request.ragged();
  step_request.rhs_transposed = request.rhs_transposed();
  step_request.scaling = request.scaling();
  if (request.has_quantize_lhs()) step_request.quantize_lhs_to = planner::FindPlanOperand(*plan, "lhs")->dtype;
  step_request.group_sizes = std::move(*group_sizes);
  for (const auto& [tensor, name] : sources) {
    if (!metas.contains(name)) continue;
    if (metas[name].resident_shard.empty() && !metas[name].shared_memory.has_value() &&
        metas[name].staged_tickets.empty()) {
      if (auto it = decoded.find(name); it != decoded.end()) {
        inline_tensors[name] = std::move(it->second.tensor);
      } else {
        auto t = HostTensorFromProto(*tensor, name);
        if (!t.ok()) return t.status();
        inline_tensors[name] = std::move(*t);
      }
      (c->direct ? direct_activation_bytes_ : inline_activation_bytes_) += inline_tensors[name].NumBytes();
    }
    auto held = inline_tensors.find(name);
    step_request.operands[name] = GemmOperand{metas[name], held != inline_tensors.end() ? &held->second : nullptr};
  }
  auto built = BuildGemmSteps(step_request);
  logging::TraceMark("steps_built");
  if (!built.ok()) return built.status();
  std::vector<v1::Step> steps = std::move(*built);
  std::string shard_name;
  if (!request.keep_output_as().empty()) {
    auto claimed = registry_.Claim(call.tenant, request.keep_output_as(), request.overwrite_output(),
                                   options_.max_tensors_per_tenant);
    if (!claimed.ok()) {
      const bool exists = claimed.status().code() == absl::StatusCode::kAlreadyExists;
      return absl::Status(claimed.status().code(),
                          absl::StrCat("keep_output_as: ", claimed.status().message(),
                                       exists ? " (set overwrite_output to replace it)" : ""));
    }
    shard_name = *claimed;
    c->claim = std::make_unique<ClaimGuard>(&registry_, call.tenant, request.keep_output_as());
    for (v1::Step& s : steps) s.mutable_gemm()->set_keep_output_as(shard_name);
  }
  if (request.has_out_shared_memory()) {
    if (!options_.allow_shared_memory) return SharedMemoryOff("out_shared_memory");
    auto n = CheckedNumElements(plan->out_shape, DTypeSize(plan->out_dtype), "out");
    if (!n.ok()) return n.status();
    auto region = shared_memory_.Resolve(call.tenant, request.out_shared_memory(), *n * DTypeSize(plan->out_dtype),
                                         "out_shared_memory");
    if (!region.ok()) return region.status();
    // Each distinct block of the output is written once, by the first rank
    // that holds it; the others return only its header.
    std::set<std::vector<int64_t>> written;
    for (int r = 0; r < num_workers_; ++r) {
      auto offsets = planner::BlockOffsets("out", plan->out_shape, plan->out_spec, mesh_, r);
      if (!offsets.ok()) return offsets.status();
      v1::GemmStep* gemm = steps[r].mutable_gemm();
      if (!written.insert(*offsets).second) {
        gemm->set_discard_output(true);
        continue;
      }
      v1::SharedMemoryBlock* block = gemm->mutable_out_shared_memory();
      *block = region->Block(request.out_shared_memory().offset());
      block->mutable_global_shape()->Assign(plan->out_shape.begin(), plan->out_shape.end());
      block->mutable_block_offsets()->Assign(offsets->begin(), offsets->end());
    }
    c->out_to_shared_memory = true;
  }
  if (request.direct_output()) {
    auto addresses = StagingAddresses();
    if (!addresses.ok()) {
      return absl::Status(addresses.status().code(), absl::StrCat("direct_output: ", addresses.status().message()));
    }
    // Each distinct block of the output is held once, by the first rank
    // that has it; the others return only its header.
    auto block_shape = planner::LocalShape("out", plan->out_shape, plan->out_spec, mesh_);
    if (!block_shape.ok()) return block_shape.status();
    std::set<std::vector<int64_t>> held;
    for (int r = 0; r < num_workers_; ++r) {
      auto offsets = planner::BlockOffsets("out", plan->out_shape, plan->out_spec, mesh_, r);
      if (!offsets.ok()) return offsets.status();
      v1::GemmStep* gemm = steps[r].mutable_gemm();
      if (!held.insert(*offsets).second) {
        gemm->set_discard_output(true);
        continue;
      }
      v1::StagingTicket* ticket = gemm->mutable_out_staged();
      ticket->set_ticket(security::RandomHex(16));
      ticket->set_tenant(call.tenant);
      ticket->set_role(v1::TENSOR_OUT);
      ticket->set_dtype(DTypeToProto(plan->out_dtype));
      ticket->mutable_shape()->Assign(block_shape->begin(), block_shape->end());
      v1::StagedBlock& block = c->out_blocks.emplace_back();
      block.mutable_offsets()->Assign(offsets->begin(), offsets->end());
      block.mutable_shape()->Assign(block_shape->begin(), block_shape->end());
      v1::StagingDestination* at = block.add_destinations();
      at->set_rank(r);
      at->set_address((*addresses)[r]);
      at->set_ticket(ticket->ticket());
    }
  }
  // The staged blocks are the workers' to consume now: a plan is used once,
  // and only by a request that passed every check (a refused one may submit
  // the plan again).
  for (const std::string& id : staging_ids) {
    if (auto s = TakeStaged(id, *plan, &c->staged_tickets); !s.ok()) {
      DropStagedBestEffort(std::move(c->staged_tickets));  // the plans taken before this one
      return s;
    }
  }
  logging::TraceMark("prepared");
  c->shard_name = std::move(shard_name);
  c->steps = std::move(steps);
  c->plan = std::move(*plan);
  return c;
}

namespace {

// `start`: the request's arrival; `dispatched` / `answered`: its steps sent,
// the last answer back; `done`: its response made.
void SetPhases(absl::Time start, absl::Time dispatched, absl::Time answered, absl::Time done,
               const std::vector<v1::StepResult>& results, v1::RequestPhases* phases) {
  const v1::StepResult* slowest = nullptr;
  for (const v1::StepResult& r : results) {
    if (slowest == nullptr ||
        r.queue_seconds() + r.compute_seconds() > slowest->queue_seconds() + slowest->compute_seconds()) {
      slowest = &r;
    }
  }
  const double round_trip = absl::ToDoubleSeconds(answered - dispatched);
  phases->set_plan_seconds(absl::ToDoubleSeconds(dispatched - start));
  phases->set_assemble_seconds(absl::ToDoubleSeconds(done - answered));
  if (slowest == nullptr) {
    phases->set_transport_seconds(round_trip);
    return;
  }
  phases->set_queue_seconds(slowest->queue_seconds());
  phases->set_kernel_seconds(slowest->kernel_seconds());
  phases->set_collective_seconds(slowest->collective_seconds());
  phases->set_transfer_seconds(
      std::max(0.0, slowest->compute_seconds() - slowest->kernel_seconds() - slowest->collective_seconds()));
  phases->set_transport_seconds(
      std::max(0.0, round_trip - slowest->queue_seconds() - slowest->compute_seconds()));
}

}  // namespace

absl::StatusOr<v1::GroupedGemmResponse> Coordinator::CompleteGroupedGemm(
    GemmCall& c, absl::StatusOr<std::vector<v1::StepResult>> results) {
  const v1::GroupedGemmRequest& request = *c.request;
  const planner::Plan* plan = &c.plan;
  const std::string& shard_name = c.shard_name;
  ShardCopies kept{shard_name, {}};
  Placement placement;
  if (results.ok() && !shard_name.empty()) {
    // Its standby copies (--replicas) first: a keep that cannot place them keeps nothing.
    auto placed = Place(request.keep_output_as(), plan->out_dtype, plan->out_shape, plan->out_spec);
    absl::Status stored = placed.status();
    if (placed.ok()) {
      placement = std::move(*placed);
      kept.standby = placement.standby;
      stored = StoreStandbyOfKept(shard_name, placement, c.deadline, c.call);
    }
    if (!stored.ok()) {
      results = absl::Status(stored.code(), absl::StrCat("keep_output_as: its standby copies (--replicas=",
                                                         options_.replicas, "): ", stored.message()));
    }
  }
  if (results.ok() && !shard_name.empty()) {
    absl::Status gone = Abandoned(c.deadline, c.call, absl::StrCat("keep_output_as '", request.keep_output_as(), "'"));
    if (!gone.ok()) results = gone;
  }
  if (!results.ok()) {
    if (!shard_name.empty()) DeleteShardsBestEffort(kept);
    // The other ranks' staged blocks and held outputs: no step or fetch will use them.
    TicketsByRank dropped = std::move(c.staged_tickets);
    for (const v1::StagedBlock& b : c.out_blocks) {
      for (const v1::StagingDestination& d : b.destinations()) dropped[d.rank()].push_back(d.ticket());
    }
    DropStagedBestEffort(std::move(dropped));
    return ExplainMissingShard(results.status(), c.call.tenant, c.guard.names);
  }

  v1::GroupedGemmResponse response;
  if (request.include_plan()) PlanToProto(*plan, response.mutable_plan());
  response.set_plan_summary(planner::PlanSummary(*plan));
  if (!shard_name.empty()) {
    Resident resident;
    resident.tenant = c.call.tenant;
    resident.info.set_name(request.keep_output_as());
    resident.info.set_dtype(DTypeToProto(plan->out_dtype));
    resident.info.mutable_shape()->Assign(plan->out_shape.begin(), plan->out_shape.end());
    resident.info.set_spec(planner::FormatPartitionSpec(plan->out_spec));
    resident.spec = plan->out_spec;
    resident.shard_name = shard_name;
    SetPlacement(placement, &resident);
    const std::string spec_text = resident.info.spec();
    auto replaced = c.claim->Register(std::move(resident));
    if (!replaced.ok()) {
      DeleteShardsBestEffort(kept);
      return absl::Status(replaced.status().code(), absl::StrCat("keep_output_as: ", replaced.status().message()));
    }
    if (!replaced->empty()) RetireBestEffort(*replaced);  // the new generation is in
    response.mutable_out()->set_dtype(DTypeToProto(plan->out_dtype));
    response.mutable_out()->mutable_shape()->Assign(plan->out_shape.begin(), plan->out_shape.end());
    response.mutable_out()->set_resident(request.keep_output_as());
    response.mutable_out()->set_spec(spec_text);
  } else if (request.direct_output()) {
    response.mutable_out()->set_dtype(DTypeToProto(plan->out_dtype));
    response.mutable_out()->mutable_shape()->Assign(plan->out_shape.begin(), plan->out_shape.end());
    response.mutable_out()->set_spec(planner::FormatPartitionSpec(plan->out_spec));
    for (v1::StagedBlock& b : c.out_blocks) *response.add_out_blocks() = std::move(b);
  } else if (c.out_to_shared_memory) {
    response.mutable_out()->set_dtype(DTypeToProto(plan->out_dtype));
    response.mutable_out()->mutable_shape()->Assign(plan->out_shape.begin(), plan->out_shape.end());
    *response.mutable_out()->mutable_shared_memory() = request.out_shared_memory();
    response.mutable_out()->set_spec(planner::FormatPartitionSpec(plan->out_spec));
  } else {
    auto out = Assemble(plan->out_dtype, plan->out_shape, plan->out_spec,
                        [&](int r) { return HostTensorFromProto(std::move(*(*results)[r].mutable_out()), "out"); });
    if (!out.ok()) return out.status();
    (c.direct ? direct_activation_bytes_ : inline_activation_bytes_) += out->NumBytes();
    if (c.out_tensor != nullptr) {
      *c.out_tensor = std::move(*out);
    } else {
      HostTensorToProto(*out, response.mutable_out());
      response.mutable_out()->set_spec(planner::FormatPartitionSpec(plan->out_spec));
    }
  }
  double worker_seconds = 0;
  int64_t h2d = 0, d2h = 0;
  for (const v1::StepResult& r : *results) {
    worker_seconds = std::max(worker_seconds, r.compute_seconds());
    h2d += r.host_to_device_bytes();
    d2h += r.device_to_host_bytes();
  }
  response.set_worker_seconds(worker_seconds);
  response.set_host_to_device_bytes(h2d);
  response.set_device_to_host_bytes(d2h);
  const absl::Time done = absl::Now();
  response.set_server_seconds(absl::ToDoubleSeconds(done - c.start));
  SetPhases(c.start, c.dispatched, c.answered, done, *results, response.mutable_phases());
  return response;
}

void Coordinator::StartGroupedGemmPerShard(const v1::GroupedGemmRequest& request, absl::Time deadline,
                                           const CallContext& call,
                                           absl::flat_hash_map<std::string, DecodedOperand> decoded,
                                           HostTensor* out_tensor, GemmDone done) {
  auto prepared = PrepareGroupedGemm(request, deadline, call, std::move(decoded), out_tensor);
  if (!prepared.ok()) {
    done(prepared.status());
    return;
  }
  std::shared_ptr<GemmCall> c = std::move(*prepared);
  std::vector<v1::Step> steps = std::move(c->steps);
  c->dispatched = absl::Now();
  if (c->call.marks != nullptr) c->call.marks->Mark("dispatching");
  DispatchThen(std::move(steps), StepDeadline(deadline), c->call,
               [this, c, done = std::move(done)](absl::StatusOr<std::vector<v1::StepResult>> results) {
                 c->answered = absl::Now();
                 if (c->call.marks != nullptr) c->call.marks->Mark("answered");
                 size_t out_bytes = 0;
                 if (results.ok()) {
                   for (const v1::StepResult& r : *results) out_bytes += r.out().data().size();
                 }
                 // A kept output's standby copies are read and stored with calls that wait.
                 const bool places_copies = results.ok() && !c->shard_name.empty() && options_.replicas > 1;
                 if (out_bytes <= kOffloadBytes && !places_copies) {
                   done(CompleteGroupedGemm(*c, std::move(results)));
                   return;
                 }
                 // Assembling a large output, or placing standby copies, takes a thread of its own.
                 std::thread([this, c, done, results = std::move(results)]() mutable {
                   done(CompleteGroupedGemm(*c, std::move(results)));
                 }).detach();
               });
}

absl::StatusOr<v1::GroupedGemmResponse> Coordinator::GroupedGemmPerShard(
    const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call,
    absl::flat_hash_map<std::string, DecodedOperand> decoded, HostTensor* out_tensor) {
  auto answer = std::make_shared<Answer<v1::GroupedGemmResponse>>();
  CallContext with_cancellation = call;
  if (call.cancelled != nullptr && call.cancellation == nullptr) {
    with_cancellation.cancellation = std::make_shared<Cancellation>();  // fed by polling `cancelled`
  }
  StartGroupedGemmPerShard(request, deadline, with_cancellation, std::move(decoded), out_tensor,
                           [answer](absl::StatusOr<v1::GroupedGemmResponse> r) { answer->Set(std::move(r)); });
  return answer->Wait(StepDeadline(deadline) + options_.dispatch_grace + kAnswerMargin, call.cancelled,
                      with_cancellation.cancellation.get());
}

}  // namespace shardgemm
