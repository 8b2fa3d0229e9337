// Runs the steps the coordinator sends, one at a time, in the global order
// given by their sequence numbers: every worker issues its collectives in the
// same order, so concurrent requests can never mismatch them.
#ifndef SHARDGEMM_WORKER_EXECUTOR_H_
#define SHARDGEMM_WORKER_EXECUTOR_H_

#include <atomic>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/shardgemm.pb.h"
#include "worker/backend.h"
#include "worker/collectives.h"
#include "worker/shard_store.h"
#include "worker/staging_area.h"
#include "worker/timed_collectives.h"

namespace shardgemm {

class Executor {
 public:
  // `staging` (may be null: steps naming staged blocks then fail) holds
  // the blocks clients stage here and the outputs kept for their fetch.
  Executor(Backend* backend, ShardStore* store, StagingArea* staging = nullptr);

  // Called once the coordinator has placed this worker on the mesh; steps
  // wait for it. `next_sequence`: the first step the coordinator will send.
  // `session`: the coordinator's (its RegisterResponse); when set, a step of
  // another session is refused.
  void Configure(const MeshPosition& position, std::unique_ptr<Collectives> collectives,
                 uint64_t next_sequence = 1, std::string session = "");

  // How far ahead of the next expected step a step may be numbered: the
  // coordinator never has more in flight; a step past it is refused.
  static constexpr uint64_t kSequenceWindow = uint64_t{1} << 16;
  // How long a step with no deadline waits for its turn (or for the worker to join).
  static constexpr absl::Duration kTurnWaitWithoutDeadline = absl::Minutes(10);

  // Waits until every step with a lower sequence number has run, then runs
  // this one. A step that fails still passes the turn on. The turn's only
  // timeout is the step's deadline: the coordinator sends every sequence
  // number to every worker, and a step queued behind long ones must still
  // run in its place.
  // `deadline`: the coordinator's for this step (the call's); a step still
  // waiting for its turn then gives up (DEADLINE_EXCEEDED). With none, it
  // waits kTurnWaitWithoutDeadline.
  absl::StatusOr<v1::StepResult> Execute(v1::Step step, absl::Time deadline = absl::InfiniteFuture());
  // Execute, but only if `step` can start without waiting (this worker is
  // configured, no step runs and it is the step's turn): nullopt, with
  // `step` untouched, where it would wait. A step refused at once (stale, of
  // another session, numbered too far ahead) is answered with its error.
  // Lets a caller run the common in-order step on the thread that received
  // it and hand only the early ones to a thread that may wait.
  std::optional<absl::StatusOr<v1::StepResult>> ExecuteIfItsTurn(v1::Step& step,
                                                                  absl::Time deadline = absl::InfiniteFuture());

  // The worker is stopping: steps waiting for their turn (or for the worker
  // to join) end UNAVAILABLE now, and later ones at once; a running step
  // runs to its end. Lets the server's shutdown finish whatever deadlines
  // the waiting steps carry.
  void Close();

  const MeshPosition& position() const { return position_; }
  // Returns once no step is running (a running step's collectives are bounded by their timeout).
  void AwaitIdle();
  // The coordinator gave up on the steps numbered `sequences` of `session`
  // (their request was cancelled or expired): one that has not started
  // fails CANCELLED when its turn comes, without reading its inputs or
  // running its op (its peers hear of it at the step's agreement, before
  // any collective). FAILED_PRECONDITION for another session's.
  absl::Status Cancel(const std::string& session, const std::vector<uint64_t>& sequences);
  // The coordinator advanced the mesh epoch (Worker.AdvanceEpoch): the
  // collectives of older epochs are revoked now, and a step blocked in one
  // ends at once (ABORTED naming the request's reason). A step of a newer
  // epoch arriving does the same (Execute, before it waits for its turn):
  // a worker that missed the request still hears of the epoch before it
  // runs any later step. FAILED_PRECONDITION for another session's.
  absl::Status AdvanceEpoch(const v1::AdvanceEpochRequest& request);

  // Same-host clients' memory no region names any more (Worker.ForgetClientMemory):
  // the mappings and handles kept across steps are let go; how many were held.
  int ForgetClientMemory(const v1::ForgetClientMemoryRequest& request);
  // Whether `session` is the coordinator's this worker is configured by. A
  // worker the coordinator registered may not have configured itself yet
  // (it builds its collectives first): the answer waits for that until
  // `deadline`, as a step does.
  bool IsSession(const std::string& session, absl::Time deadline);
  // Steps waiting for their turn now (the worker's queue depth).
  int64_t steps_waiting() const { return steps_waiting_.load(std::memory_order_relaxed); }
  // Collective calls that failed since start (transport errors, timeouts).
  int64_t collective_failures() const { return timed_->failures(); }

 private:
  // `would_wait` (null: wait): set, with OK, where the step cannot start at once.
  absl::Status WaitForTurn(uint64_t sequence, uint64_t oldest_live, absl::Time deadline,
                           const std::string& session, bool* would_wait = nullptr);
  // The step, once it has the turn (`arrived`: when it came, for its queue time).
  absl::StatusOr<v1::StepResult> RunTurn(v1::Step step, absl::Time deadline, absl::Time arrived);
  void PassTurn();
  // CANCELLED when the running step was cancelled before it started.
  absl::Status WhyStopped(absl::Status s) const;
  absl::Status CancelledStatus() const;
  absl::StatusOr<v1::StepResult> RunGemm(v1::GemmStep& gemm);
  absl::StatusOr<HostTensor> ApplyCollective(const v1::CollectivePlan& c, const HostTensor& t);
  // An all-gather (along c.dim over c.axes of a piece of `dtype` and
  // `shape`) carrying this worker's `status`: every member gets the
  // gathered tensor only if every member was OK (its own error, or ABORTED
  // for a peer's). `local` is unused when `status` is an error.
  absl::StatusOr<HostTensor> AllGatherWithStatus(const v1::CollectivePlan& c, const HostTensor* local, DType dtype,
                                                 const std::vector<int64_t>& shape, const absl::Status& status);
  // An all-reduce of `elements` FP32 values in `out` carrying `status`, likewise.
  absl::Status AllReduceWithStatus(const v1::CollectivePlan& c, HostTensor* out, int64_t elements,
                                   const absl::Status& status);
  // The axes of the group that agrees on a step with these collectives.
  std::vector<std::string> AgreementAxes() const;
  // The shape a tensor of `shape` has after `c` on this worker.
  absl::StatusOr<std::vector<int64_t>> ShapeAfter(const v1::CollectivePlan& c, std::vector<int64_t> shape) const;
  absl::StatusOr<v1::StepResult> RunStore(v1::StoreShardStep& store);
  // A store step's tensor: inline, or the block a client staged here
  // (claimed; device-only where the staging memory kept it on the device).
  absl::StatusOr<Shard> StoredTensor(v1::LocalTensor&& t, absl::string_view field);
  absl::StatusOr<v1::StepResult> RunQuantize(v1::QuantizeStep& quantize);
  // Times, agreements and the host<->device bytes of a step, into its result.
  void FinishResult(absl::Time start, int agreements, const Backend::Transfers& before,
                    v1::StepResult* result) const;
  // Runs a backend call `f`, adding its time (less the collectives it ran) to the step's kernel time.
  template <typename F>
  auto TimeKernel(F&& f);
  absl::Duration step_collective_start_;

  Backend* backend_;
  ShardStore* store_;
  StagingArea* staging_;
  MeshPosition position_;
  // Revokes the epochs before `epoch` if `session` is this worker's (from any thread).
  void LearnEpoch(const std::string& session, uint64_t epoch, const std::string& why);

  // Replaced by Configure while no step runs (under mu_); LearnEpoch takes
  // a reference under mu_.
  std::shared_ptr<TimedCollectives> collectives_;
  TimedCollectives* timed_ = nullptr;  // collectives_, for its times
  // The running step's kernel time (backend calls, less collectives they ran).
  absl::Duration step_kernel_time_;
  std::atomic<int64_t> steps_waiting_{0};

  absl::Mutex mu_;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  std::set<uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);  // steps not yet run that are not to run
  static constexpr size_t kMaxCancelled = 4096;
  // Set while the step now running was cancelled before it started.
  bool step_cancelled_ = false;
  // The running step's: a CancelSteps that names it, and its deadline. A
  // backend asks (LocalGemm::stop) between tiles and gives up.
  std::atomic<bool> running_step_cancelled_{false};
  absl::Time step_deadline_ = absl::InfiniteFuture();
  bool configured_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::string session_ ABSL_GUARDED_BY(mu_);
  uint64_t configurations_ ABSL_GUARDED_BY(mu_) = 0;  // Configure calls: a waiting step sees a re-registration
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // a step has its turn
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_EXECUTOR_H_
