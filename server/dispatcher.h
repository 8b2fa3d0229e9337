// The mesh's workers and the one global order of their steps: workers join
// at a rank (row-major over the mesh axes, in joining order; a worker that
// comes back at the same address gets its rank back), and every request's
// steps, one per rank, take the next sequence number and go to every worker
// at once on the channels' asynchronous calls, each with a deadline.
#ifndef SHARDGEMM_SERVER_DISPATCHER_H_
#define SHARDGEMM_SERVER_DISPATCHER_H_

#include <functional>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/optional.h"
#include "planner/mesh.h"
#include "proto/shardgemm.pb.h"
#include "server/worker_channel.h"

namespace shardgemm {

// A caller's cancellation, pushed to whoever waits on its behalf (the
// callback API's OnCancel calls Cancel; a dispatch in flight registers how
// to end itself).
class Cancellation {
 public:
  // Runs the registered action, if any, once (outside the lock).
  void Cancel();
  bool cancelled() const;
  // Runs `action` at Cancel(), or at once if cancelled already. One action
  // at a time: a later one replaces it; Clear() removes it.
  void OnCancel(std::function<void()> action);
  void Clear();

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> action_ ABSL_GUARDED_BY(mu_);
};

class Dispatcher;

// One dispatch in flight (Dispatcher::DispatchAsync): its answers so far.
class PendingDispatch {
 public:
  // Ends the dispatch with CANCELLED unless every worker has answered (the
  // workers' calls end by their deadline; later steps do not wait for it).
  void Cancel();
  // Ends the dispatch with `why` unless it has ended.
  void Abandon(absl::Status why);

 private:
  friend class Dispatcher;
  using Done = std::function<void(absl::StatusOr<std::vector<v1::StepResult>>)>;
  PendingDispatch(Dispatcher* dispatcher, size_t workers, uint64_t sequence, absl::Time give_up, Done done,
                  std::string session = "");
  // A worker's answer; ends the dispatch when every worker has answered or
  // one failed on its own (not a peer's ABORTED).
  void Answer(size_t rank, absl::StatusOr<v1::StepResult> result);
  // Past the deadline and its grace: the missing answers are DEADLINE_EXCEEDED
  // (or, finished already, the epoch decision still open advances it).
  void Expire();
  // Ends the dispatch once: `why` (CANCELLED), or from the answers so far.
  void Finish(absl::Status why) ABSL_UNLOCK_FUNCTION(mu_);
  bool Complete() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Dispatcher* const dispatcher_;
  const uint64_t sequence_;
  const absl::Time give_up_;
  const std::string session_;  // the steps' coordinator session
  mutable absl::Mutex mu_;
  std::vector<absl::optional<absl::StatusOr<v1::StepResult>>> results_ ABSL_GUARDED_BY(mu_);
  size_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Finished with answers missing after another worker failed on its own:
  // the rest (or Expire at the deadline) decide whether the epoch advances.
  bool deciding_ ABSL_GUARDED_BY(mu_) = false;
  Done done_ ABSL_GUARDED_BY(mu_);
};

class Dispatcher {
 public:
  using Connector = std::function<std::unique_ptr<WorkerChannel>(const std::string& address)>;

  // `grace`: how long past a step's deadline Dispatch waits for a channel
  // that has not reported back (gRPC channels report by the deadline).
  // `prefer_local_socket`: a worker that describes a Unix socket which is,
  // on this host, that very socket and this user's is connected there
  // (`unix:PATH`) instead of at its address.
  // `session`: the coordinator's, which the workers check on AdvanceEpoch.
  // `prefer_step_socket`: such a worker's steps go on its step socket
  // (server/step_socket_channel.h) when it serves one, likewise checked.
  Dispatcher(planner::Mesh mesh, Connector connect, absl::Duration grace, bool prefer_local_socket = false,
             std::string session = "", bool prefer_step_socket = false);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  struct Joined {
    int rank = 0;
    uint64_t next_sequence = 0;  // the first step this worker will be sent
    bool rejoined = false;       // the rank had a worker before (restarted or replaced)
  };
  // RESOURCE_EXHAUSTED when every rank is taken by another address.
  // `on_joined` (optional) runs once the rank is decided, under the locks
  // that number steps and answer Complete(): no step reaches the worker, and
  // the mesh does not look complete, before it returns (the coordinator
  // marks what the worker lacks there). It must not call the dispatcher.
  absl::StatusOr<Joined> Join(const v1::RegisterRequest& request,
                              const std::function<void(const Joined&)>& on_joined = nullptr);

  int num_workers() const { return num_workers_; }
  // The registered workers, by rank.
  std::vector<v1::WorkerInfo> Workers() const;
  // Every rank has joined and none is marked down.
  bool Complete() const;
  // UNAVAILABLE (with how many are missing, or which rank is down) until
  // every rank has joined and answers its heartbeat.
  absl::Status CheckComplete() const;

  // Liveness, from the coordinator's heartbeat: a rank marked down makes the
  // mesh incomplete (requests fail at once naming it) and its rank free for
  // a worker registering from another address; marked up again when it
  // answers (or re-registers).
  // `channel`: the one the heartbeat pinged; a rank that has a new worker
  // since is left alone.
  void MarkDown(int rank, const absl::Status& why, const WorkerChannel* channel);
  void MarkUp(int rank, const WorkerChannel* channel);
  // The channel of every rank (null where none has joined).
  std::vector<std::shared_ptr<WorkerChannel>> Channels() const;

  // The mesh epoch, stamped on every step with its sequence number (so
  // every worker sees a new epoch at the same step). It advances when the
  // membership changes (a rank newly marked down, a rank joined) and when a
  // step ends in a way that may leave a collective half done on some member:
  // a worker that did not answer (the step cancelled, expired, or given up
  // on when another worker failed) or answered with a transport or
  // collective failure (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN).
  // An agreed failure (one worker's error, the others ABORTED, all
  // answered) leaves every collective complete and the epoch as it was.
  // Every worker is told at once (WorkerChannel::AdvanceEpoch), so it
  // revokes the older epochs' communicators now, not at their timeout.
  uint64_t epoch() const;
  // Hears every advance, under the lock that numbers steps: before any step
  // of the new epoch exists (the rendezvous store ends the waits of older
  // epochs). Set before serving; AbandonAll and the destructor clear it.
  using EpochListener = std::function<void(uint64_t epoch)>;
  void SetEpochListener(EpochListener listener);

  // Gives `steps` (one per rank) the next sequence number and sends them to
  // every worker at once, without a thread per worker; fails if any worker
  // fails (with the failing worker's status, not a peer's ABORTED), as soon
  // as one does, and with DEADLINE_EXCEEDED for one that has not answered by
  // `deadline`.
  // `cancelled` (optional) is polled while waiting: once it says the caller
  // has gone, Dispatch returns CANCELLED without waiting for the answers
  // (the workers' calls end by their deadline; later steps do not wait).
  absl::StatusOr<std::vector<v1::StepResult>> Dispatch(std::vector<v1::Step> steps, absl::Time deadline,
                                                       const std::function<bool()>& cancelled = nullptr);
  // Dispatch without a thread waiting: `done` runs exactly once with what
  // Dispatch would return, on the thread of the answer that completes it
  // (a channel's callback, or inline), at the latest at `deadline` plus the
  // grace (a watchdog ends a dispatch whose channel never reported back).
  using DispatchDone = std::function<void(absl::StatusOr<std::vector<v1::StepResult>>)>;
  std::shared_ptr<PendingDispatch> DispatchAsync(std::vector<v1::Step> steps, absl::Time deadline,
                                                 DispatchDone done);
  // Ends every dispatch still waiting with `why` (shutdown: their callers
  // are answered while the server can still answer them), and answers every
  // later one with it at once, sending nothing. `why` is not OK.
  void AbandonAll(const absl::Status& why);
  // Numbers and sends `steps` like Dispatch, without waiting for answers.
  void DispatchDetached(std::vector<v1::Step> steps, absl::Time deadline);
  // Every worker drops `shard_name` with the next step dispatched (in the
  // global order, so after every step that could still read it).
  void Release(const std::string& shard_name);
  // Releases not yet sent (tests).
  size_t pending_releases() const;

  struct Stats {
    int64_t steps_in_flight = 0;  // numbered, not yet answered or given up on
    uint64_t epoch = 0;
    // Worker calls that failed, by rank and status code (a peer's ABORTED
    // is not counted: the failing worker is).
    std::map<std::pair<int, absl::StatusCode>, int64_t> failed_calls;
  };
  Stats GetStats() const;

 private:
  // How often a waiting Dispatch looks at its caller's cancellation.
  static constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);
  // Numbers `steps` and returns the channels, under the lock Join holds
  // while it hands a (re)joining worker its first number: a worker gets
  // either every step numbered before it joined or none of them.
  std::vector<std::shared_ptr<WorkerChannel>> Number(std::vector<v1::Step>* steps);
  // The step numbered `sequence` is answered or given up on; with `advance`,
  // the epoch advances for that reason in the same instant (a step numbered
  // after it leaves the in-flight set has the new epoch: a worker that skips
  // the step, on a later step's oldest_live_sequence, has heard of the new
  // epoch from that step).
  void Done(uint64_t sequence, const absl::optional<v1::AdvanceEpochRequest>& advance = absl::nullopt);
  // Advances the epoch (`change`'s reason, rank and sequence); returns what
  // to tell the workers once the locks are released (TellWorkers).
  v1::AdvanceEpochRequest AdvanceEpochLocked(v1::AdvanceEpochRequest change)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sequence_mu_);
  void TellWorkers(const v1::AdvanceEpochRequest& request);
  friend class PendingDispatch;
  // Counts a finished dispatch's failed calls; the failing worker's status.
  absl::StatusOr<std::vector<v1::StepResult>> Resolve(std::vector<absl::StatusOr<v1::StepResult>> results);
  // Ends the asynchronous dispatches past their deadline and grace, every
  // kWatchdogPeriod, until the dispatcher goes.
  void Watchdog();
  static constexpr absl::Duration kWatchdogPeriod = absl::Milliseconds(100);
  static constexpr absl::Duration kCancelTimeout = absl::Seconds(2);
  // A dispatch given up on (cancelled, or a worker past its deadline): every
  // worker drops the step if it has not started it.
  void CancelOnWorkers(const std::string& session, uint64_t sequence);

  struct Worker {
    v1::WorkerInfo info;
    std::shared_ptr<WorkerChannel> channel;  // shared: a dispatch may outlive a re-registration
    bool down = false;
    std::string down_because;
  };

  const planner::Mesh mesh_;
  const int num_workers_;
  const Connector connect_;
  const absl::Duration grace_;
  const bool prefer_local_socket_;
  const bool prefer_step_socket_;
  const std::string session_;

  // Lock order: sequence_mu_, then workers_mu_.
  mutable absl::Mutex sequence_mu_;
  uint64_t next_sequence_ ABSL_GUARDED_BY(sequence_mu_) = 1;
  uint64_t epoch_ ABSL_GUARDED_BY(sequence_mu_) = 1;
  EpochListener epoch_listener_ ABSL_GUARDED_BY(sequence_mu_);
  std::vector<std::string> releases_ ABSL_GUARDED_BY(sequence_mu_);
  // Numbered steps not yet answered or given up on (oldest_live_sequence).
  std::set<uint64_t> in_flight_ ABSL_GUARDED_BY(sequence_mu_);
  mutable absl::Mutex stats_mu_;
  std::map<std::pair<int, absl::StatusCode>, int64_t> failed_calls_ ABSL_GUARDED_BY(stats_mu_);
  mutable absl::Mutex workers_mu_;
  std::vector<Worker> workers_ ABSL_GUARDED_BY(workers_mu_);
  int joined_ ABSL_GUARDED_BY(workers_mu_) = 0;
  // The asynchronous dispatches not yet finished (weak: finishing drops them).
  mutable absl::Mutex watch_mu_;
  std::vector<std::weak_ptr<PendingDispatch>> watched_ ABSL_GUARDED_BY(watch_mu_);
  bool stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
  absl::Status abandoned_ ABSL_GUARDED_BY(watch_mu_);  // AbandonAll's why: later dispatches refused
  std::thread watchdog_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_DISPATCHER_H_
