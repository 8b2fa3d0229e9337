// Test-only, in-process stand-ins for the workers behind the WorkerChannel
// seam: the Coordinator can be tested without gRPC, processes or collectives.
#ifndef SHARDGEMM_SERVER_FAKE_WORKER_CHANNEL_H_
#define SHARDGEMM_SERVER_FAKE_WORKER_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/optional.h"
#include "proto/shardgemm.pb.h"
#include "server/coordinator.h"
#include "planner/mesh.h"
#include "server/worker_channel.h"

namespace shardgemm {

// One fake worker. Copies are handles to the same worker (steps, shards and
// behaviour are shared), so a test keeps one and hands the Coordinator
// another through its Connector. The state lives in a shared_ptr that the
// answers in flight do not need: an answer that comes after the Coordinator
// gave up on it, or after the Coordinator is gone, is harmless.
//
// `done` runs at most once per step: inline by default, on the fake's own
// thread with an answer delay, never for a held step (until AnswerHeld), and
// with CANCELLED for whatever is still held or delayed when the last handle
// goes.
class FakeWorkerChannel : public WorkerChannel {
 public:
  using Handler = std::function<absl::StatusOr<v1::StepResult>(const v1::Step&)>;
  using HoldIf = std::function<bool(const v1::Step&)>;

  // Answers like RunTrivialWorker.
  FakeWorkerChannel();
  FakeWorkerChannel(const FakeWorkerChannel&) = default;
  FakeWorkerChannel& operator=(const FakeWorkerChannel&) = default;

  void ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) override;
  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) override;
  absl::Status PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time deadline) override;
  absl::Status Ping(absl::Time deadline) override;
  void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) override;
  void AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time deadline) override;
  // Records the tickets and answers OK.
  absl::Status ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time deadline) override;

  // --- behaviour (takes effect for steps received afterwards) ---

  // How steps are answered; nullptr restores RunTrivialWorker. A handler may
  // call RunTrivialWorker to fall back to it.
  void SetHandler(Handler handler);
  // What Ping answers (OK by default; an error: a dead worker's heartbeat).
  void SetPing(absl::Status status);
  // Steps are received and recorded but not answered (a hung worker), until
  // AnswerHeld. SetHoldIf holds only the steps `hold` picks (nullptr: none).
  void SetNeverAnswer(bool never);
  void SetHoldIf(HoldIf hold);
  // > 0: each answer is computed on receipt and delivered on a thread of the
  // fake's own after `delay` (a slow worker).
  void SetAnswerDelay(absl::Duration delay);
  // Answers the held steps now, in the order received, with the handler's
  // results; returns how many.
  int AnswerHeld();
  // The bytes of data its shards may hold together (< 0: no limit): a store
  // step or PutShard past it is RESOURCE_EXHAUSTED and stores nothing.
  void SetMemoryBudget(int64_t bytes);
  // What PutShard answers before storing anything (OK: it stores).
  void SetPutShardStatus(absl::Status status);
  // How many PutShard calls it stored.
  int num_put_shards() const;

  // --- observation ---

  std::vector<v1::Step> steps() const;  // every step received, in order
  int num_steps() const;
  std::vector<uint64_t> cancelled() const;  // the sequences CancelSteps named, in order
  std::vector<v1::AdvanceEpochRequest> epoch_advances() const;  // what AdvanceEpoch told it, in order
  std::vector<v1::ExpectStagedRequest> expected_staged() const;  // what ExpectStaged told it, in order
  int num_held() const;
  // Waits (at most `timeout`) until `n` steps are held; false on timeout.
  bool AwaitHeld(int n, absl::Duration timeout) const;
  std::vector<std::string> shard_names() const;  // sorted
  absl::optional<v1::LocalTensor> shard(const std::string& name) const;

  // A worker of a mesh with no collectives: a GemmStep (ragged M, F32, no
  // collectives) computes the local grouped GEMM (rows past the group sizes
  // zero) and returns it as `out`, or stores it under keep_output_as and
  // returns `out` with `resident` set; StoreShardStep stores the shard and
  // its standby copies (all or none, within SetMemoryBudget), DeleteShardStep
  // deletes the standby copies it names and the shard (NOT_FOUND when the
  // shard is absent). Operands may be inline
  // or resident shards. Anything else is UNIMPLEMENTED.
  absl::StatusOr<v1::StepResult> RunTrivialWorker(const v1::Step& step);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// A Coordinator whose Connector hands out fake workers by address (made on
// first use), with the first `workers` of them registered in order as
// "fake:0" .. "fake:<workers-1>".
class FakeMesh {
 public:
  struct Options {
    std::string roles;                      // ParseMesh's roles text
    int workers = -1;                       // how many to register; -1: the whole mesh
    int64_t memory_budget_bytes = 1 << 30;  // each registered worker's
    std::string backend = "fake";           // what each registered worker reports (RegisterRequest.backend)
    bool staging = false;                   // each registered worker reports the staging address "staging:<i>"
    CoordinatorOptions coordinator;
  };

  // INVALID_ARGUMENT for a bad mesh; a registration's error otherwise.
  static absl::StatusOr<std::unique_ptr<FakeMesh>> Create(absl::string_view mesh, Options options);
  static absl::StatusOr<std::unique_ptr<FakeMesh>> Create(absl::string_view mesh) {
    return Create(mesh, Options());
  }

  Coordinator& coordinator() { return *coordinator_; }
  // The fake at "fake:<rank>" (for the registered workers: the one with that rank).
  FakeWorkerChannel worker(int rank) { return fake(Address(rank)); }
  // The fake at `address`, made if no worker has used it yet.
  FakeWorkerChannel fake(const std::string& address);
  static std::string Address(int i);
  // Registers the fake at `address` (what a worker process does on start).
  absl::StatusOr<v1::RegisterResponse> Register(const std::string& address,
                                                int64_t memory_budget_bytes = 1 << 30,
                                                const std::string& backend = "fake",
                                                const std::string& staging_address = "");
  // How many times the Coordinator asked the Connector for `address`.
  int connects(const std::string& address) const;

 private:
  // Shared with the Connector, which the Coordinator keeps.
  struct Fakes {
    mutable absl::Mutex mu;
    std::map<std::string, FakeWorkerChannel> by_address ABSL_GUARDED_BY(mu);
    std::map<std::string, int> connects ABSL_GUARDED_BY(mu);
    FakeWorkerChannel Get(const std::string& address);
  };
  FakeMesh() = default;

  std::shared_ptr<Fakes> fakes_ = std::make_shared<Fakes>();
  std::unique_ptr<Coordinator> coordinator_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_FAKE_WORKER_CHANNEL_H_
