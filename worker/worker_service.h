// The gRPC face of a worker: translates Worker RPCs into Executor calls.
#ifndef SHARDGEMM_WORKER_WORKER_SERVICE_H_
#define SHARDGEMM_WORKER_WORKER_SERVICE_H_

#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "platform/busy_poll.h"
#include "platform/elastic_thread_pool.h"
#include "proto/shardgemm.grpc.pb.h"
#include "worker/executor.h"
#include "worker/staging_area.h"
#include "security/tls.h"
#include "worker/step_observer.h"
#include "logging/trace_marks.h"
#include "absl/time/time.h"

namespace shardgemm {

// Execute is served on gRPC's callback API: a step whose turn it is runs on
// the thread that read it (no hand-off to a handler thread); one that
// arrived early waits for its turn on a thread of `waiting_`.
class WorkerServiceImpl final : public v1::Worker::WithCallbackMethod_Execute<v1::Worker::Service> {
 public:
  // `observer` (may be null) sees every step answered.
  // `transport` (null: accept every caller, as in-process tests do) decides
  // who may call: only the coordinator's certificate.
  WorkerServiceImpl(Executor* executor, ShardStore* store, Backend* backend,
                    StepObserver* observer = nullptr, const security::Transport* transport = nullptr)
      : executor_(executor), store_(store), backend_(backend), observer_(observer), transport_(transport) {}

  // Consumes `step`: its inline operands' bytes move into the executor (gRPC
  // hands the handler a request it allocated non-const and destroys after).
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* context, const v1::Step* step,
                                    v1::StepResult* result) override;
  grpc::Status CancelSteps(grpc::ServerContext* context, const v1::CancelStepsRequest* request,
                           v1::CancelStepsResponse* response) override;
  grpc::Status AdvanceEpoch(grpc::ServerContext* context, const v1::AdvanceEpochRequest* request,
                            v1::AdvanceEpochResponse* response) override;
  grpc::Status GetShard(grpc::ServerContext* context, const v1::GetShardRequest* request,
                        v1::LocalTensor* shard) override;
  grpc::Status PutShard(grpc::ServerContext* context, const v1::PutShardRequest* request,
                        v1::PutShardResponse* response) override;
  grpc::Status Status(grpc::ServerContext* context, const v1::WorkerStatusRequest* request,
                      v1::WorkerStatus* status) override;
  grpc::Status ExpectStaged(grpc::ServerContext* context, const v1::ExpectStagedRequest* request,
                            v1::ExpectStagedResponse* response) override;
  grpc::Status HoldShard(grpc::ServerContext* context, const v1::HoldShardRequest* request,
                         v1::HoldShardResponse* response) override;
  grpc::Status StageShard(grpc::ServerContext* context, grpc::ServerReader<v1::StageShardChunk>* reader,
                          v1::StageResponse* response) override;
  grpc::Status DropStaged(grpc::ServerContext* context, const v1::DropStagedRequest* request,
                          v1::DropStagedResponse* response) override;
  grpc::Status ForgetClientMemory(grpc::ServerContext* context, const v1::ForgetClientMemoryRequest* request,
                                  v1::ForgetClientMemoryResponse* response) override;

  // The staging area the coordinator's tickets go to (null: this worker
  // serves no staging; ExpectStaged is then FAILED_PRECONDITION). Set before
  // the server starts.
  void SetStaging(StagingArea* staging) { staging_ = staging; }

  // `handler` runs once, with Backend::DeviceHealth's error, as soon as a
  // call finds the device lost (a sticky CUDA error): the step that lost it
  // still gets its answer (with its error); from then on steps and the
  // heartbeat (Status) are UNAVAILABLE. Set before the server starts.
  void OnDeviceLost(std::function<void(const absl::Status&)> handler) { on_device_lost_ = std::move(handler); }

  // A step from the worker's step socket (worker/step_socket_server.h):
  // Execute's, answered through `reply`. The socket admits only this user's
  // processes; the step's session is checked as Execute's is.
  void ExecuteFromStepSocket(std::unique_ptr<v1::StepSocketRequest> request,
                             std::function<void(v1::StepSocketReply)> reply);

  // Keeps the process's cores busy while a step is in flight (--busy_poll).
  // Null: never. Set before the server starts.
  void SetBusyPoller(platform::BusyPoller* poller) { busy_poller_ = poller; }
  // --trace_steps: one "step_marks" log line per step (logging/trace_marks.h).
  void SetTraceSteps(bool on) { trace_steps_ = on; }

 private:
  Executor* executor_;
  ShardStore* store_;
  Backend* backend_;
  StagingArea* staging_ = nullptr;
  // PERMISSION_DENIED unless the caller is this mesh's coordinator.
  grpc::Status CheckCaller(const grpc::ServerContextBase& context) const;

  // A step's call, from its arrival to its answer (on whichever thread runs
  // it), over gRPC or the step socket.
  struct StepCall {
    v1::Step* step = nullptr;          // the call's: gRPC's request, or socket_request's
    v1::StepResult* result = nullptr;  // filled when OK: gRPC's response, or socket_reply's
    absl::Time deadline = absl::InfiniteFuture();
    // Answers the caller (after `result` is filled, when OK).
    std::function<void(StepCall&, const grpc::Status&)> finish;
    std::unique_ptr<v1::StepSocketRequest> socket_request;
    v1::StepSocketReply socket_reply;
    std::optional<logging::TraceMarks> marks;
    platform::BusyPoller::Activity busy;
    absl::Time start;
    StepObserver::StepIdentity identity;
    int64_t bytes_in = 0;
  };
  // Runs `call` now if it is its turn, else on a thread of `waiting_`
  // (the caller checked who called and that the step is to run).
  void Run(std::unique_ptr<StepCall> call);
  // Records and answers `call` with the executor's `r`.
  void Answer(StepCall& call, absl::StatusOr<v1::StepResult> r);

  // UNAVAILABLE once the device is lost (the handler then runs, once).
  grpc::Status CheckDevice();

  StepObserver* observer_;
  bool trace_steps_ = false;
  const security::Transport* transport_;
  std::function<void(const absl::Status&)> on_device_lost_;
  platform::BusyPoller* busy_poller_ = nullptr;
  std::once_flag device_lost_once_;
  // Steps that arrived before their turn: the coordinator has at most its
  // window of steps in flight; past this many waiting, a step is refused.
  static constexpr int kMaxWaitingSteps = 1024;
  platform::ElasticThreadPool waiting_{kMaxWaitingSteps};
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_WORKER_SERVICE_H_
