#include "server/dispatcher.h"

#include <algorithm>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "platform/local_socket.h"
#include "server/step_socket_channel.h"

namespace shardgemm {

namespace {

// A worker's answer that says a collective of the step may be half done on
// some member (a transport failure, a collective's timeout, a step this
// worker did not run, an NCCL error): the epoch advances. A worker's own
// error before the step's agreement, and its peers' ABORTED, do not.
bool MayLeaveCollectivesHalfDone(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kInternal || code == absl::StatusCode::kUnknown;
}

v1::AdvanceEpochRequest EpochChange(v1::EpochReason reason, int rank, uint64_t sequence) {
  v1::AdvanceEpochRequest change;
  change.set_reason(reason);
  change.set_rank(rank);
  change.set_sequence(sequence);
  return change;
}

}  // namespace

Dispatcher::Dispatcher(planner::Mesh mesh, Connector connect, absl::Duration grace, bool prefer_local_socket,
                       std::string session, bool prefer_step_socket)
    : mesh_(std::move(mesh)),
      num_workers_(static_cast<int>(planner::NumWorkers(mesh_))),
      connect_(std::move(connect)),
      grace_(grace),
      prefer_local_socket_(prefer_local_socket),
      prefer_step_socket_(prefer_step_socket),
      session_(std::move(session)) {
  workers_.resize(num_workers_);
  watchdog_ = std::thread([this] { Watchdog(); });
}

Dispatcher::~Dispatcher() {
  SetEpochListener(nullptr);  // what it reaches may be gone already
  std::vector<std::weak_ptr<PendingDispatch>> left;
  {
    absl::MutexLock lock(&watch_mu_);
    stopping_ = true;
    left = std::move(watched_);
  }
  watchdog_.join();
  // Nothing may call back into the dispatcher once it is gone.
  for (auto& w : left) {
    if (auto p = w.lock()) p->Expire();
  }
}

absl::StatusOr<Dispatcher::Joined> Dispatcher::Join(const v1::RegisterRequest& request,
                                                    const std::function<void(const Joined&)>& on_joined) {
  if (request.address().empty()) {
    return absl::InvalidArgumentError("address is empty: a worker must say where it serves");
  }
  Joined joined;
  v1::AdvanceEpochRequest advance;
  // The channel a rejoining worker replaces goes after the locks: closing it
  // ends calls whose callbacks take them.
  std::shared_ptr<WorkerChannel> replaced;
  {
    absl::MutexLock sequence_lock(&sequence_mu_);
    absl::MutexLock lock(&workers_mu_);
    int rank = -1;
    for (int r = 0; r < num_workers_; ++r) {
      // A worker that restarts on the same address gets its rank back.
      if (workers_[r].channel != nullptr && workers_[r].info.address() == request.address()) rank = r;
    }
    // A worker registering again with a restarted coordinator asks for the
    // rank its shards belong to.
    if (rank < 0 && request.has_previous_rank() && request.previous_rank() >= 0 &&
        request.previous_rank() < num_workers_) {
      const Worker& was = workers_[request.previous_rank()];
      if (was.channel == nullptr || was.down) rank = request.previous_rank();
    }
    if (rank < 0 && joined_ == num_workers_) {
      // A worker restarted on another address takes a rank that is down.
      for (int r = 0; r < num_workers_ && rank < 0; ++r) {
        if (workers_[r].down) rank = r;
      }
      if (rank < 0) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the mesh ", planner::FormatMesh(mesh_), " already has all ", num_workers_, " workers, all answering"));
      }
    }
    if (rank < 0) {
      // The lowest rank no worker has taken (ranks asked for by number may be taken out of order).
      for (int r = 0; r < num_workers_ && rank < 0; ++r) {
        if (workers_[r].channel == nullptr) rank = r;
      }
    }
    Worker& w = workers_[rank];
    if (w.channel == nullptr) ++joined_;
    const bool rejoined = w.channel != nullptr;
    w.down = false;
    w.down_because.clear();
    const v1::LocalSocket& local = request.local_socket();
    const bool same_host = prefer_local_socket_ && !local.path().empty() &&
                           platform::CheckSameHostSocket(local.path(), local.boot_id(), local.inode()).ok();
    const std::string target = same_host ? absl::StrCat("unix:", local.path()) : request.address();
    std::unique_ptr<WorkerChannel> channel = connect_(target);
    const v1::LocalSocket& steps = request.step_socket();
    const bool step_socket = same_host && prefer_step_socket_ && channel != nullptr && !steps.path().empty() &&
                             platform::CheckSameHostSocket(steps.path(), steps.boot_id(), steps.inode()).ok();
    if (step_socket) channel = MakeStepSocketChannel(std::move(channel), steps.path(), target);
    replaced = std::move(w.channel);
    w.channel = std::move(channel);
    w.info.set_rank(rank);
    w.info.set_address(request.address());
    w.info.set_hop(same_host ? v1::WORKER_HOP_UNIX_SOCKET : v1::WORKER_HOP_TCP);
    w.info.set_step_socket(step_socket);
    w.info.set_backend(request.backend());
    w.info.set_device(request.device());
    w.info.set_memory_budget_bytes(request.memory_budget_bytes());
    w.info.set_staging_address(request.staging_address());
    w.info.set_staging_budget_bytes(request.staging_budget_bytes());
    w.info.set_staging_tenant_limit_bytes(request.staging_tenant_limit_bytes());
    auto coords = planner::RankToCoords(mesh_, rank);
    if (coords.ok()) w.info.mutable_coords()->Assign(coords->begin(), coords->end());
    // A rank's member changed: its communicators in every group it belongs
    // to are built afresh (the new epoch) from the worker's first step on.
    advance = AdvanceEpochLocked(EpochChange(v1::EPOCH_RANK_JOINED, rank, 0));
    // A worker that (re)joins starts at the current place in the global order.
    joined = Joined{rank, next_sequence_, rejoined};
    if (on_joined) on_joined(joined);
  }
  TellWorkers(advance);
  return joined;
}

std::vector<v1::WorkerInfo> Dispatcher::Workers() const {
  std::vector<v1::WorkerInfo> out;
  absl::MutexLock lock(&workers_mu_);
  for (const Worker& w : workers_) {
    if (w.channel == nullptr) continue;
    out.push_back(w.info);
    out.back().set_down(w.down);
    out.back().set_down_reason(w.down_because);
  }
  return out;
}

bool Dispatcher::Complete() const {
  absl::MutexLock lock(&workers_mu_);
  if (joined_ < num_workers_) return false;
  for (const Worker& w : workers_) {
    if (w.down) return false;
  }
  return true;
}

absl::Status Dispatcher::CheckComplete() const {
  absl::MutexLock lock(&workers_mu_);
  if (joined_ < num_workers_) {
    return absl::UnavailableError(absl::StrCat("the mesh is not complete: ", num_workers_ - joined_, " of ",
                                               num_workers_, " workers have not registered"));
  }
  for (int r = 0; r < num_workers_; ++r) {
    if (workers_[r].down) {
      return absl::UnavailableError(absl::StrCat("worker rank ", r, " (", workers_[r].info.address(),
                                                 ") is not answering: ", workers_[r].down_because,
                                                 "; the mesh is ready again when it answers or a worker "
                                                 "takes its rank"));
    }
  }
  return absl::OkStatus();
}

void Dispatcher::MarkDown(int rank, const absl::Status& why, const WorkerChannel* channel) {
  absl::optional<v1::AdvanceEpochRequest> advance;
  {
    absl::MutexLock sequence_lock(&sequence_mu_);
    absl::MutexLock lock(&workers_mu_);
    if (rank < 0 || rank >= num_workers_ || workers_[rank].channel.get() != channel) return;
    if (!workers_[rank].down) advance = AdvanceEpochLocked(EpochChange(v1::EPOCH_RANK_DOWN, rank, 0));
    workers_[rank].down = true;
    workers_[rank].down_because = std::string(why.message());
  }
  if (advance.has_value()) TellWorkers(*advance);
}

void Dispatcher::MarkUp(int rank, const WorkerChannel* channel) {
  absl::MutexLock lock(&workers_mu_);
  if (rank < 0 || rank >= num_workers_ || workers_[rank].channel.get() != channel) return;
  workers_[rank].down = false;
  workers_[rank].down_because.clear();
}

std::vector<std::shared_ptr<WorkerChannel>> Dispatcher::Channels() const {
  std::vector<std::shared_ptr<WorkerChannel>> channels;
  absl::MutexLock lock(&workers_mu_);
  for (const Worker& w : workers_) channels.push_back(w.channel);
  return channels;
}

std::vector<std::shared_ptr<WorkerChannel>> Dispatcher::Number(std::vector<v1::Step>* steps) {
  absl::MutexLock lock(&sequence_mu_);
  std::vector<std::shared_ptr<WorkerChannel>> channels = Channels();
  const uint64_t sequence = next_sequence_++;
  in_flight_.insert(sequence);
  const uint64_t oldest_live = *in_flight_.begin();
  for (v1::Step& s : *steps) {
    s.set_sequence(sequence);
    s.set_oldest_live_sequence(oldest_live);
    s.set_epoch(epoch_);
    for (const std::string& name : releases_) s.add_release_shards(name);
  }
  releases_.clear();
  return channels;
}

void Dispatcher::Done(uint64_t sequence, const absl::optional<v1::AdvanceEpochRequest>& advance) {
  v1::AdvanceEpochRequest told;
  {
    absl::MutexLock lock(&sequence_mu_);
    in_flight_.erase(sequence);
    if (!advance.has_value()) return;
    told = AdvanceEpochLocked(*advance);
  }
  TellWorkers(told);
}

v1::AdvanceEpochRequest Dispatcher::AdvanceEpochLocked(v1::AdvanceEpochRequest change) {
  ++epoch_;
  if (epoch_listener_) epoch_listener_(epoch_);
  change.set_session(session_);
  change.set_epoch(epoch_);
  return change;
}

void Dispatcher::TellWorkers(const v1::AdvanceEpochRequest& request) {
  const absl::Time deadline = absl::Now() + kCancelTimeout;
  for (const std::shared_ptr<WorkerChannel>& channel : Channels()) {
    if (channel != nullptr) channel->AdvanceEpoch(request, deadline);
  }
}

uint64_t Dispatcher::epoch() const {
  absl::MutexLock lock(&sequence_mu_);
  return epoch_;
}

void Dispatcher::SetEpochListener(EpochListener listener) {
  absl::MutexLock lock(&sequence_mu_);
  epoch_listener_ = std::move(listener);
}

void Dispatcher::Release(const std::string& shard_name) {
  absl::MutexLock lock(&sequence_mu_);
  releases_.push_back(shard_name);
}

size_t Dispatcher::pending_releases() const {
  absl::MutexLock lock(&sequence_mu_);
  return releases_.size();
}

void Dispatcher::DispatchDetached(std::vector<v1::Step> steps, absl::Time deadline) {
  const std::vector<std::shared_ptr<WorkerChannel>> channels = Number(&steps);
  const uint64_t sequence = steps.empty() ? 0 : steps[0].sequence();
  // Live until its last answer (every channel answers by the deadline).
  struct Answers {
    std::atomic<int> remaining{1};
    std::atomic<int> half_done_on{-1};  // a rank whose answer may leave a collective half done
  };
  auto answers = std::make_shared<Answers>();
  auto answered = [this, answers, sequence](int rank, absl::StatusCode code) {
    if (rank >= 0 && MayLeaveCollectivesHalfDone(code)) answers->half_done_on.store(rank);
    if (--answers->remaining > 0) return;
    const int on = answers->half_done_on.load();
    if (on < 0) {
      Done(sequence);
    } else {
      Done(sequence, EpochChange(v1::EPOCH_STEP_FAILED, on, sequence));
    }
  };
  for (size_t r = 0; r < steps.size() && r < channels.size(); ++r) {
    if (channels[r] == nullptr) continue;
    ++answers->remaining;
    channels[r]->ExecuteAsync(std::move(steps[r]), deadline, [answered, r](absl::StatusOr<v1::StepResult> result) {
      answered(static_cast<int>(r), result.status().code());
    });
  }
  answered(-1, absl::StatusCode::kOk);
}

void Cancellation::Cancel() {
  std::function<void()> action;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    action = std::move(action_);
    action_ = nullptr;
  }
  if (action) action();
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void Cancellation::OnCancel(std::function<void()> action) {
  {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      action_ = std::move(action);
      return;
    }
  }
  action();
}

void Cancellation::Clear() {
  absl::MutexLock lock(&mu_);
  action_ = nullptr;
}

PendingDispatch::PendingDispatch(Dispatcher* dispatcher, size_t workers, uint64_t sequence, absl::Time give_up,
                                 Done done, std::string session)
    : dispatcher_(dispatcher),
      sequence_(sequence),
      give_up_(give_up),
      session_(std::move(session)),
      done_(std::move(done)) {
  results_.resize(workers);
}

bool PendingDispatch::Complete() const {
  if (answered_ == results_.size()) return true;
  for (const auto& r : results_) {
    if (r.has_value() && !r->ok() && r->status().code() != absl::StatusCode::kAborted) return true;
  }
  return false;
}

void PendingDispatch::Answer(size_t rank, absl::StatusOr<v1::StepResult> result) {
  mu_.Lock();
  if (rank >= results_.size() || results_[rank].has_value() || (finished_ && !deciding_)) {
    mu_.Unlock();
    return;
  }
  if (finished_) {
    // The caller has its answer; this one only decides the epoch (its
    // status is kept, not its tensors).
    const absl::StatusCode code = result.status().code();
    results_[rank] = result.ok() ? absl::StatusOr<v1::StepResult>(v1::StepResult()) : result.status();
    ++answered_;
    absl::optional<v1::AdvanceEpochRequest> advance;
    if (MayLeaveCollectivesHalfDone(code)) {
      advance = EpochChange(v1::EPOCH_STEP_FAILED, static_cast<int>(rank), sequence_);
    } else if (answered_ < results_.size()) {
      mu_.Unlock();
      return;
    }
    deciding_ = false;
    mu_.Unlock();
    dispatcher_->Done(sequence_, advance);
    return;
  }
  results_[rank] = std::move(result);
  ++answered_;
  if (!Complete()) {
    mu_.Unlock();
    return;
  }
  Finish(absl::OkStatus());
}

void PendingDispatch::Cancel() {
  mu_.Lock();
  if (finished_) {
    mu_.Unlock();
    return;
  }
  Finish(absl::CancelledError("the client cancelled the request before every worker answered"));
}

void PendingDispatch::Abandon(absl::Status why) {
  mu_.Lock();
  if (finished_) {
    mu_.Unlock();
    return;
  }
  Finish(std::move(why));
}

void PendingDispatch::Expire() {
  mu_.Lock();
  if (finished_) {
    if (!deciding_) {
      mu_.Unlock();
      return;
    }
    // Answers still missing at the deadline: they may be in a collective.
    deciding_ = false;
    int missing = -1;
    for (size_t r = 0; r < results_.size() && missing < 0; ++r) {
      if (!results_[r].has_value()) missing = static_cast<int>(r);
    }
    mu_.Unlock();
    dispatcher_->Done(sequence_, EpochChange(v1::EPOCH_STEP_ABANDONED, missing, sequence_));
    return;
  }
  Finish(absl::OkStatus());
}

void PendingDispatch::Finish(absl::Status why) {
  finished_ = true;
  Done done = std::move(done_);
  done_ = nullptr;
  const bool another_failed = Complete() && answered_ < results_.size();
  // Whether a collective of the step may be half done on some member, and
  // on whose account (the epoch advances).
  absl::optional<v1::AdvanceEpochRequest> advance;
  int missing = -1, half_done = -1;
  for (size_t r = 0; r < results_.size(); ++r) {
    if (!results_[r].has_value()) {
      if (missing < 0) missing = static_cast<int>(r);
    } else if (MayLeaveCollectivesHalfDone(results_[r]->status().code()) && half_done < 0) {
      half_done = static_cast<int>(r);
    }
  }
  if (!why.ok() || (missing >= 0 && !another_failed)) {
    advance = EpochChange(v1::EPOCH_STEP_ABANDONED, missing, sequence_);
  } else if (half_done >= 0) {
    advance = EpochChange(v1::EPOCH_STEP_FAILED, half_done, sequence_);
  } else if (missing >= 0) {
    // A worker failed on its own (its error, not a collective's): usually
    // at the step's agreement, which every worker reached, so the others
    // answer ABORTED and every collective is complete. Their answers, or
    // the deadline, decide; the step stays live until then (a worker may
    // not pass it over before the epoch is decided).
    deciding_ = true;
  }
  std::vector<absl::StatusOr<v1::StepResult>> results;
  if (why.ok()) {
    for (auto& r : results_) {
      if (r.has_value()) {
        results.push_back(std::move(*r));
      } else if (another_failed) {
        results.push_back(absl::AbortedError("still running when another worker failed the step"));
      } else {
        results.push_back(absl::DeadlineExceededError("no answer by the step's deadline"));
      }
    }
  }
  const bool decided = !deciding_;
  mu_.Unlock();
  // Answered, or given up on: later steps need not wait for it.
  if (decided) dispatcher_->Done(sequence_, advance);
  absl::StatusOr<std::vector<v1::StepResult>> resolved =
      why.ok() ? dispatcher_->Resolve(std::move(results)) : absl::StatusOr<std::vector<v1::StepResult>>(why);
  const absl::StatusCode code = resolved.status().code();
  if (code == absl::StatusCode::kCancelled || code == absl::StatusCode::kDeadlineExceeded) {
    dispatcher_->CancelOnWorkers(session_, sequence_);
  }
  done(std::move(resolved));
}

std::shared_ptr<PendingDispatch> Dispatcher::DispatchAsync(std::vector<v1::Step> steps, absl::Time deadline,
                                                           DispatchDone done) {
  // Answered at once, nothing sent (and no sequence number taken).
  auto refuse = [&](absl::Status why) {
    std::shared_ptr<PendingDispatch> refused(new PendingDispatch(this, 0, 0, deadline, std::move(done)));
    refused->mu_.Lock();
    refused->finished_ = true;
    DispatchDone d = std::move(refused->done_);
    refused->mu_.Unlock();
    d(std::move(why));
    return refused;
  };
  if (static_cast<int>(steps.size()) != num_workers_) {
    return refuse(absl::InternalError(absl::StrCat(steps.size(), " steps for ", num_workers_, " workers")));
  }
  absl::Status abandoned;
  {
    absl::MutexLock lock(&watch_mu_);
    abandoned = abandoned_;
  }
  if (!abandoned.ok()) return refuse(std::move(abandoned));
  const std::vector<std::shared_ptr<WorkerChannel>> channels = Number(&steps);
  std::shared_ptr<PendingDispatch> pending(new PendingDispatch(this, steps.size(), steps[0].sequence(),
                                                               deadline + grace_, std::move(done), steps[0].session()));
  {
    absl::MutexLock lock(&watch_mu_);
    watched_.push_back(pending);
    abandoned = abandoned_;
  }
  // AbandonAll ran while these steps were numbered: they go (the global
  // order needs them), their caller is answered now.
  if (!abandoned.ok()) pending->Abandon(abandoned);
  for (size_t r = 0; r < steps.size(); ++r) {
    if (channels[r] == nullptr) {
      pending->Answer(r, absl::UnavailableError("not registered"));
      continue;
    }
    channels[r]->ExecuteAsync(std::move(steps[r]), deadline, [pending, r](absl::StatusOr<v1::StepResult> result) {
      pending->Answer(r, std::move(result));
    });
  }
  return pending;
}

absl::StatusOr<std::vector<v1::StepResult>> Dispatcher::Dispatch(std::vector<v1::Step> steps, absl::Time deadline,
                                                                 const std::function<bool()>& cancelled) {
  struct Wait {
    absl::Mutex mu;
    absl::optional<absl::StatusOr<std::vector<v1::StepResult>>> result ABSL_GUARDED_BY(mu);
  };
  auto wait = std::make_shared<Wait>();
  std::shared_ptr<PendingDispatch> pending =
      DispatchAsync(std::move(steps), deadline, [wait](absl::StatusOr<std::vector<v1::StepResult>> r) {
        absl::MutexLock lock(&wait->mu);
        wait->result = std::move(r);
      });
  auto have = [&wait]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wait->mu) { return wait->result.has_value(); };
  // The channel enforces the deadline itself; the grace covers a channel
  // (or a fake) that does not.
  const absl::Time give_up = deadline + grace_;
  wait->mu.Lock();
  if (cancelled == nullptr) {
    wait->mu.AwaitWithDeadline(absl::Condition(&have), give_up);
  } else {
    // Polled: this caller's cancellation has no wakeup of its own.
    while (!have() && absl::Now() < give_up) {
      if (cancelled()) {
        wait->mu.Unlock();
        pending->Cancel();
        wait->mu.Lock();
        break;
      }
      wait->mu.AwaitWithDeadline(absl::Condition(&have), std::min(give_up, absl::Now() + kCancelPoll));
    }
  }
  if (!have()) {
    wait->mu.Unlock();
    pending->Expire();
    wait->mu.Lock();
  }
  absl::StatusOr<std::vector<v1::StepResult>> result = std::move(*wait->result);
  wait->mu.Unlock();
  return result;
}

absl::StatusOr<std::vector<v1::StepResult>> Dispatcher::Resolve(std::vector<absl::StatusOr<v1::StepResult>> results) {
  {
    absl::MutexLock lock(&stats_mu_);
    for (size_t r = 0; r < results.size(); ++r) {
      const absl::StatusCode code = results[r].status().code();
      if (code != absl::StatusCode::kOk && code != absl::StatusCode::kAborted) {
        ++failed_calls_[{static_cast<int>(r), code}];
      }
    }
  }
  // The worker that failed says why; the others only report ABORTED.
  int failed = -1;
  for (size_t r = 0; r < results.size(); ++r) {
    if (results[r].ok()) continue;
    if (failed < 0 || (results[failed].status().code() == absl::StatusCode::kAborted &&
                       results[r].status().code() != absl::StatusCode::kAborted)) {
      failed = static_cast<int>(r);
    }
  }
  if (failed >= 0) {
    const absl::Status& s = results[failed].status();
    const std::string failure = absl::StrCat("worker ", failed, ": ", s.message());
    // A rank marked down while the step ran is its cause: its death revoked its peers' communicators,
    // and they fail naming only themselves.
    absl::MutexLock lock(&workers_mu_);
    for (size_t r = 0; r < results.size() && r < workers_.size(); ++r) {
      if (results[r].ok() || !workers_[r].down) continue;
      return absl::UnavailableError(absl::StrCat("worker ", r, " is down (", workers_[r].down_because, ")",
                                                 static_cast<int>(r) == failed ? "" : absl::StrCat("; ", failure)));
    }
    return absl::Status(s.code(), failure);
  }
  std::vector<v1::StepResult> out;
  for (auto& r : results) out.push_back(std::move(*r));
  return out;
}

void Dispatcher::CancelOnWorkers(const std::string& session, uint64_t sequence) {
  if (session.empty()) return;  // steps without a session are not the coordinator's
  v1::CancelStepsRequest request;
  request.set_session(session);
  request.add_sequences(sequence);
  const absl::Time deadline = absl::Now() + kCancelTimeout;
  for (const std::shared_ptr<WorkerChannel>& channel : Channels()) {
    if (channel != nullptr) channel->CancelSteps(request, deadline);
  }
}

void Dispatcher::AbandonAll(const absl::Status& why) {
  SetEpochListener(nullptr);  // shutting down: what it reaches may go before the dispatcher
  std::vector<std::shared_ptr<PendingDispatch>> live;
  {
    absl::MutexLock lock(&watch_mu_);
    abandoned_ = why;
    for (auto& w : watched_) {
      if (auto p = w.lock()) live.push_back(std::move(p));
    }
  }
  for (auto& p : live) p->Abandon(why);
}

void Dispatcher::Watchdog() {
  absl::MutexLock lock(&watch_mu_);
  while (!stopping_) {
    watch_mu_.AwaitWithTimeout(absl::Condition(&stopping_), kWatchdogPeriod);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    std::vector<std::shared_ptr<PendingDispatch>> expired;
    std::vector<std::weak_ptr<PendingDispatch>> live;
    for (auto& w : watched_) {
      std::shared_ptr<PendingDispatch> p = w.lock();
      if (p == nullptr) continue;
      if (now >= p->give_up_) {
        expired.push_back(std::move(p));
      } else {
        live.push_back(std::move(w));
      }
    }
    watched_ = std::move(live);
    watch_mu_.Unlock();
    for (auto& p : expired) p->Expire();
    expired.clear();
    watch_mu_.Lock();
  }
}

Dispatcher::Stats Dispatcher::GetStats() const {
  Stats stats;
  {
    absl::MutexLock lock(&sequence_mu_);
    stats.steps_in_flight = static_cast<int64_t>(in_flight_.size());
    stats.epoch = epoch_;
  }
  absl::MutexLock lock(&stats_mu_);
  stats.failed_calls = failed_calls_;
  return stats;
}

}  // namespace shardgemm
