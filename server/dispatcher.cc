#include "server/dispatcher.h"

#include <algorithm>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"

namespace shardgemm {

Dispatcher::Dispatcher(planner::Mesh mesh, Connector connect, absl::Duration grace)
    : mesh_(std::move(mesh)),
      num_workers_(static_cast<int>(planner::NumWorkers(mesh_))),
      connect_(std::move(connect)),
      grace_(grace) {
  workers_.resize(num_workers_);
}

absl::StatusOr<Dispatcher::Joined> Dispatcher::Join(const v1::RegisterRequest& request) {
  if (request.address().empty()) {
    return absl::InvalidArgumentError("address is empty: a worker must say where it serves");
  }
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
  w.channel = connect_(request.address());
  w.info.set_rank(rank);
  w.info.set_address(request.address());
  w.info.set_backend(request.backend());
  w.info.set_device(request.device());
  w.info.set_memory_budget_bytes(request.memory_budget_bytes());
  auto coords = planner::RankToCoords(mesh_, rank);
  if (coords.ok()) w.info.mutable_coords()->Assign(coords->begin(), coords->end());
  // A worker that (re)joins starts at the current place in the global order.
  return Joined{rank, next_sequence_, rejoined};
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
  absl::MutexLock lock(&workers_mu_);
  if (rank < 0 || rank >= num_workers_ || workers_[rank].channel.get() != channel) return;
  workers_[rank].down = true;
  workers_[rank].down_because = std::string(why.message());
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
    for (const std::string& name : releases_) s.add_release_shards(name);
  }
  releases_.clear();
  return channels;
}

void Dispatcher::Done(uint64_t sequence) {
  absl::MutexLock lock(&sequence_mu_);
  in_flight_.erase(sequence);
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
  auto remaining = std::make_shared<std::atomic<int>>(1);
  auto answered = [this, remaining, sequence] {
    if (--*remaining == 0) Done(sequence);
  };
  for (size_t r = 0; r < steps.size() && r < channels.size(); ++r) {
    if (channels[r] == nullptr) continue;
    ++*remaining;
    channels[r]->ExecuteAsync(steps[r], deadline, [answered](absl::StatusOr<v1::StepResult>) { answered(); });
  }
  answered();
}

absl::StatusOr<std::vector<v1::StepResult>> Dispatcher::Dispatch(std::vector<v1::Step> steps, absl::Time deadline,
                                                                 const std::function<bool()>& cancelled) {
  if (static_cast<int>(steps.size()) != num_workers_) {
    return absl::InternalError(absl::StrCat(steps.size(), " steps for ", num_workers_, " workers"));
  }
  // The answers of one dispatch; shared with the callbacks, which may come
  // after Dispatch has given up on a worker that did not answer in time.
  struct Pending {
    absl::Mutex mu;
    std::vector<absl::optional<absl::StatusOr<v1::StepResult>>> results ABSL_GUARDED_BY(mu);
    size_t answered ABSL_GUARDED_BY(mu) = 0;
  };
  auto pending = std::make_shared<Pending>();
  {
    absl::MutexLock lock(&pending->mu);
    pending->results.resize(steps.size());
  }
  const std::vector<std::shared_ptr<WorkerChannel>> channels = Number(&steps);
  for (size_t r = 0; r < steps.size(); ++r) {
    if (channels[r] == nullptr) {
      absl::MutexLock lock(&pending->mu);
      pending->results[r] = absl::UnavailableError("not registered");
      ++pending->answered;
      continue;
    }
    channels[r]->ExecuteAsync(steps[r], deadline, [pending, r](absl::StatusOr<v1::StepResult> result) {
      absl::MutexLock lock(&pending->mu);
      pending->results[r] = std::move(result);
      ++pending->answered;
    });
  }
  std::vector<absl::StatusOr<v1::StepResult>> results;
  {
    absl::MutexLock lock(&pending->mu);
    // Done when every worker answered, or one failed on its own (not a
    // peer's ABORTED): a dead or failing worker fails the request at once,
    // and its peers' steps end by themselves (their collectives time out).
    auto one_failed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pending->mu) {
      for (const auto& r : pending->results) {
        if (r.has_value() && !r->ok() && r->status().code() != absl::StatusCode::kAborted) return true;
      }
      return false;
    };
    auto all_answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pending->mu) {
      return pending->answered == steps.size() || one_failed();
    };
    // The channel enforces the deadline itself; the grace covers a channel
    // (or a fake) that does not.
    bool gone = false;
    if (cancelled == nullptr) {
      pending->mu.AwaitWithDeadline(absl::Condition(&all_answered), deadline + grace_);
    } else {
      // Polled: the caller's cancellation has no wakeup of its own.
      const absl::Time give_up = deadline + grace_;
      while (!all_answered() && absl::Now() < give_up && !(gone = cancelled())) {
        pending->mu.AwaitWithDeadline(absl::Condition(&all_answered),
                                      std::min(give_up, absl::Now() + kCancelPoll));
      }
    }
    Done(steps[0].sequence());  // answered, or given up on: later steps need not wait for it
    if (gone && pending->answered < steps.size()) {
      return absl::CancelledError("the client cancelled the request before every worker answered");
    }
    const bool another_failed = one_failed();
    for (size_t r = 0; r < steps.size(); ++r) {
      if (pending->results[r].has_value()) {
        results.push_back(std::move(*pending->results[r]));
      } else if (another_failed) {
        results.push_back(absl::AbortedError("still running when another worker failed the step"));
      } else {
        results.push_back(absl::DeadlineExceededError("no answer by the step's deadline"));
      }
    }
  }
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
    return absl::Status(s.code(), absl::StrCat("worker ", failed, ": ", s.message()));
  }
  std::vector<v1::StepResult> out;
  for (auto& r : results) out.push_back(std::move(*r));
  return out;
}

Dispatcher::Stats Dispatcher::GetStats() const {
  Stats stats;
  {
    absl::MutexLock lock(&sequence_mu_);
    stats.steps_in_flight = static_cast<int64_t>(in_flight_.size());
  }
  absl::MutexLock lock(&stats_mu_);
  stats.failed_calls = failed_calls_;
  return stats;
}

}  // namespace shardgemm
