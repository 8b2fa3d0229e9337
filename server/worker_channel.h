// How the coordinator reaches one worker. The gRPC implementation is the real
// one; tests substitute in-process fakes (server/fake_worker_channel.h).
#ifndef SHARDGEMM_SERVER_WORKER_CHANNEL_H_
#define SHARDGEMM_SERVER_WORKER_CHANNEL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

// One block streamed into a worker's staging area (Worker.StageShard).
// Destroyed before Finish, the stream is cancelled and the worker holds
// nothing of it.
class StageStream {
 public:
  virtual ~StageStream() = default;
  // Waits, at most until the stream's deadline, for the worker's answer to
  // the header: OK once it reserved the block's bytes in its staging area;
  // else its refusal (RESOURCE_EXHAUSTED when its --staging_budget is taken
  // now), and the stream is finished.
  virtual absl::Status WaitReserved() = 0;
  // The block's next bytes; blocks while the worker's flow control says
  // wait, at most until the stream's deadline. An error means the stream
  // broke: Finish says why.
  virtual absl::Status Write(absl::string_view data) = 0;
  // After the last bytes: the worker's answer (the bytes it staged).
  virtual absl::StatusOr<int64_t> Finish() = 0;
  // Ends the stream from another thread (a stalled put's watchdog): a
  // WaitReserved, Write or Finish waiting on it returns soon after.
  virtual void Cancel() = 0;
};

class WorkerChannel {
 public:
  using ExecuteDone = std::function<void(absl::StatusOr<v1::StepResult>)>;

  virtual ~WorkerChannel() = default;
  // Sends `step` and returns at once; `done` runs exactly once, on another
  // thread or inline, with the worker's result or why there is none (at the
  // latest DEADLINE_EXCEEDED soon after `deadline`).
  virtual void ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) = 0;
  virtual absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) = 0;
  // Stores a shard outside the steps' order (a restored copy: no step reads
  // it until the coordinator says it is back).
  virtual absl::Status PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot store shards directly");
  }
  // Tells the worker the coordinator gave up on these steps; no answer is
  // waited for (a worker that does not hear it runs them as before).
  virtual void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) {}
  // Tells the worker the mesh epoch advanced (it revokes the collectives of
  // older epochs); no answer is waited for (a worker that does not hear it
  // learns the epoch from its next step).
  virtual void AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time deadline) {}
  // Tells the worker the tickets of a transfer plan (its staging service
  // accepts no others); waits for its answer until `deadline`.
  virtual absl::Status ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot announce staging tickets");
  }
  // Has the worker hold a copy of its shard for a client's fetch (PlanFetch).
  virtual absl::Status HoldShard(const v1::HoldShardRequest& request, absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot hold shards for fetch");
  }
  // Opens a stream staging a block under a ticket ExpectStaged announced
  // (`header`: session, ticket, tenant; its data, if any, goes first); the
  // whole stream is bounded by `deadline`.
  virtual absl::StatusOr<std::unique_ptr<StageStream>> OpenStage(const v1::StageShardChunk& header,
                                                                 absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot stage blocks");
  }
  // Has the worker drop these tickets' blocks now (staged or not).
  virtual absl::Status DropStaged(const v1::DropStagedRequest& request, absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot drop staged blocks");
  }
  // Tells the worker which same-host clients' memory no region names any
  // more (it closes its mappings and handles of it); waits until `deadline`.
  virtual absl::Status ForgetClientMemory(const v1::ForgetClientMemoryRequest& request, absl::Time deadline) {
    return absl::UnimplementedError("this worker channel cannot forget client memory");
  }
  // A liveness check (the heartbeat): OK when the worker answers by `deadline`.
  virtual absl::Status Ping(absl::Time deadline) = 0;
};

// A channel to the worker at `address` with `credentials` (mutual TLS, or
// insecure ones with --insecure).
std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address,
                                                     std::shared_ptr<grpc::ChannelCredentials> credentials);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_WORKER_CHANNEL_H_
