#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "server/worker_channel.h"
#include "proto/grpc_status.h"

namespace shardgemm {
namespace {

constexpr absl::Duration kConnectTimeout = absl::Seconds(10);

struct ChannelCore;

// Calls in flight keep their channel alive (a worker re-registering drops
// its handle while calls are out). The last reference must not go on gRPC's
// callback thread, nor right after: gRPC finishes its own bookkeeping of
// the call on the channel's completion queue after the callback returns.
// Callbacks hand their reference here; one thread of the process drops it
// a while later.
class ChannelReaper {
 public:
  static void Hand(std::shared_ptr<ChannelCore> core) {
    static ChannelReaper* reaper = new ChannelReaper;  // for the process's life
    absl::MutexLock lock(&reaper->mu_);
    reaper->queue_.push_back({absl::Now(), std::move(core)});
  }

 private:
  static constexpr absl::Duration kGrace = absl::Seconds(1);
  ChannelReaper() {
    std::thread([this] {
      while (true) {
        absl::SleepFor(kGrace / 2);
        std::vector<std::shared_ptr<ChannelCore>> drop;
        {
          absl::MutexLock lock(&mu_);
          const absl::Time before = absl::Now() - kGrace;
          while (!queue_.empty() && queue_.front().first < before) {
            drop.push_back(std::move(queue_.front().second));
            queue_.pop_front();
          }
        }
        drop.clear();  // here, off every callback thread
      }
    }).detach();
  }
  absl::Mutex mu_;
  std::deque<std::pair<absl::Time, std::shared_ptr<ChannelCore>>> queue_ ABSL_GUARDED_BY(mu_);
};

// The channel's state, shared with the calls in flight and the thread that
// waits for a first connection.
struct ChannelCore {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> stub;
  std::atomic<bool> connected_once{false};

  // A registered worker is listening, but a first connect attempt can still
  // fail transiently (seen under load in CI), and a call on a channel in
  // transient failure fails at once: until the channel has connected once,
  // wait for the connection, at most kConnectTimeout and never past the
  // deadline. Once it has, no wait: the call itself waits for a reconnect
  // (a connection reset) and fails at once where the worker refuses (it
  // died).
  // Connected once, or now: a call may go without waiting.
  bool MayCall() {
    if (connected_once.load() || channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
      connected_once.store(true);
      return true;
    }
    return false;
  }

  absl::Status Connected(absl::Time deadline) {
    if (MayCall()) return absl::OkStatus();
    const absl::Time start = absl::Now();
    const absl::Time until = std::min(deadline, start + kConnectTimeout);
    if (channel->WaitForConnected(ToGrpcDeadline(until))) {
      connected_once.store(true);
      return absl::OkStatus();
    }
    return absl::UnavailableError(absl::StrCat("worker at ", address, ": not connected within ",
                                               absl::FormatDuration(until - start)));
  }

  // gRPC's callback API: no thread waits on the call once it is sent.
  static void Send(const std::shared_ptr<ChannelCore>& core, v1::Step step, absl::Time deadline,
                   WorkerChannel::ExecuteDone done) {
    struct Call {
      grpc::ClientContext ctx;
      v1::Step step;
      v1::StepResult result;
      WorkerChannel::ExecuteDone done;
    };
    auto* call = new Call;
    call->step = std::move(step);  // a put's step holds its block: not copied
    call->done = std::move(done);
    call->ctx.set_deadline(ToGrpcDeadline(deadline));
    core->stub->async()->Execute(&call->ctx, &call->step, &call->result, [call, core](grpc::Status s) mutable {
      std::unique_ptr<Call> owned(call);
      // Freed before the answer wakes the request, which then finds the
      // memory free (the service hands large frees back to the system).
      v1::Step().Swap(&owned->step);
      if (s.ok()) {
        owned->done(std::move(owned->result));
      } else {
        absl::Status status = FromGrpcStatus(s);
        owned->done(absl::Status(status.code(), absl::StrCat("worker at ", core->address, ": ", status.message())));
      }
      owned.reset();
      ChannelReaper::Hand(std::move(core));
    });
  }
};

// A Worker.StageShard call: the synchronous writer blocks on flow control,
// so at most gRPC's window of the block is buffered on either side.
class GrpcStageStream final : public StageStream {
 public:
  // Starts the call and sends `header` (WaitReserved then has the worker's answer).
  static absl::StatusOr<std::unique_ptr<StageStream>> Open(std::shared_ptr<ChannelCore> core,
                                                           const v1::StageShardChunk& header, absl::Time deadline) {
    std::unique_ptr<GrpcStageStream> stream(new GrpcStageStream(core));
    stream->context_.set_deadline(ToGrpcDeadline(deadline));
    stream->writer_ = core->stub->StageShard(&stream->context_, &stream->response_);
    if (!stream->WriteChunk(header).ok()) return stream->Finish().status();
    return std::unique_ptr<StageStream>(std::move(stream));
  }
  ~GrpcStageStream() override {
    if (!finished_) {
      context_.TryCancel();
      writer_->Finish();  // CANCELLED at once; releases the call
    }
  }
  absl::Status WaitReserved() override {
    if (!broken_) {
      writer_->WaitForInitialMetadata();  // bounded by the call's deadline
      const auto& metadata = context_.GetServerInitialMetadata();
      if (metadata.find(kStageReservedMetadataKey) != metadata.end()) return absl::OkStatus();
    }
    absl::StatusOr<int64_t> answer = Finish();
    if (!answer.ok()) return answer.status();
    return absl::InternalError("the worker answered the stage stream without reserving its block");
  }
  absl::Status Write(absl::string_view data) override {
    chunk_.Clear();
    chunk_.set_data(data.data(), data.size());
    return WriteChunk(chunk_);
  }
  absl::StatusOr<int64_t> Finish() override {
    if (!broken_) writer_->WritesDone();
    finished_ = true;
    grpc::Status s = writer_->Finish();
    if (!s.ok()) return FromGrpcStatus(s);
    if (broken_) return absl::UnavailableError("the stage stream broke");
    return response_.bytes();
  }
  void Cancel() override { context_.TryCancel(); }  // thread-safe, also during a Write

 private:
  explicit GrpcStageStream(std::shared_ptr<ChannelCore> core) : core_(std::move(core)) {}
  absl::Status WriteChunk(const v1::StageShardChunk& chunk) {
    if (!broken_ && writer_->Write(chunk)) return absl::OkStatus();
    broken_ = true;
    return absl::UnavailableError("the stage stream broke");
  }

  std::shared_ptr<ChannelCore> core_;  // the channel outlives the call
  grpc::ClientContext context_;
  v1::StageResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::StageShardChunk>> writer_;
  v1::StageShardChunk chunk_;
  bool broken_ = false;
  bool finished_ = false;
};

class GrpcWorkerChannel : public WorkerChannel {
 public:
  GrpcWorkerChannel(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : core_(std::make_shared<ChannelCore>()) {
    grpc::ChannelArguments args = TensorChannelArguments();
    core_->address = address;
    core_->channel = grpc::CreateCustomChannel(address, std::move(credentials), args);
    core_->stub = v1::Worker::NewStub(core_->channel);
  }

  void ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) override {
    if (!core_->MayCall()) {
      // Never connected yet: wait for it on a thread of its own, so the
      // caller (sending every rank its step in turn) is not held by it.
      std::thread([core = core_, step = std::move(step), deadline, done = std::move(done)]() mutable {
        if (absl::Status c = core->Connected(deadline); !c.ok()) {
          done(c);
          return;
        }
        ChannelCore::Send(core, std::move(step), deadline, std::move(done));
      }).detach();
      return;
    }
    ChannelCore::Send(core_, std::move(step), deadline, std::move(done));
  }

  // A call whose answer nobody waits for (a cancel, an epoch notice): sent
  // with its deadline, its state freed when gRPC is done with it.
  template <typename Response, typename Request, typename Start>
  void Notify(const Request& request, absl::Time deadline, Start start) {
    struct Call {
      grpc::ClientContext ctx;
      Request request;
      Response response;
    };
    auto* call = new Call;
    call->request = request;
    call->ctx.set_deadline(ToGrpcDeadline(deadline));
    start(core_->stub->async(), &call->ctx, &call->request, &call->response,
          [call, core = core_](grpc::Status) mutable {
            delete call;
            ChannelReaper::Hand(std::move(core));
          });
  }

  void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) override {
    Notify<v1::CancelStepsResponse>(request, deadline, [](auto* async, auto&&... args) {
      async->CancelSteps(std::forward<decltype(args)>(args)...);
    });
  }

  void AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time deadline) override {
    Notify<v1::AdvanceEpochResponse>(request, deadline, [](auto* async, auto&&... args) {
      async->AdvanceEpoch(std::forward<decltype(args)>(args)...);
    });
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::GetShardRequest request;
    request.set_name(name);
    v1::LocalTensor shard;
    grpc::Status s = core_->stub->GetShard(&ctx, request, &shard);
    if (!s.ok()) return FromGrpcStatus(s);
    return shard;
  }

  absl::Status PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::PutShardRequest request;
    request.set_name(name);
    *request.mutable_shard() = shard;
    v1::PutShardResponse response;
    return FromGrpcStatus(core_->stub->PutShard(&ctx, request, &response));
  }

  absl::Status ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::ExpectStagedResponse response;
    return FromGrpcStatus(core_->stub->ExpectStaged(&ctx, request, &response));
  }

  absl::Status HoldShard(const v1::HoldShardRequest& request, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::HoldShardResponse response;
    return FromGrpcStatus(core_->stub->HoldShard(&ctx, request, &response));
  }

  absl::StatusOr<std::unique_ptr<StageStream>> OpenStage(const v1::StageShardChunk& header,
                                                         absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    return GrpcStageStream::Open(core_, header, deadline);
  }

  absl::Status DropStaged(const v1::DropStagedRequest& request, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::DropStagedResponse response;
    return FromGrpcStatus(core_->stub->DropStaged(&ctx, request, &response));
  }

  absl::Status ForgetClientMemory(const v1::ForgetClientMemoryRequest& request, absl::Time deadline) override {
    if (absl::Status c = core_->Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::ForgetClientMemoryResponse response;
    return FromGrpcStatus(core_->stub->ForgetClientMemory(&ctx, request, &response));
  }

  // The worker's Status RPC, which answers on its own thread whatever its
  // steps are doing. Not wait-for-ready: a killed worker's ping fails at
  // once (connection refused), not at the ping's deadline (at least 2 s,
  // which made a dead worker's detection take misses x 2 s); a connection
  // in reconnect backoff (at most 1 s, proto/transport.cc) is one miss.
  absl::Status Ping(absl::Time deadline) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::WorkerStatus status;
    grpc::Status s = core_->stub->Status(&ctx, v1::WorkerStatusRequest(), &status);
    return FromGrpcStatus(s);
  }

 private:
  std::shared_ptr<ChannelCore> core_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address,
                                                     std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return std::make_unique<GrpcWorkerChannel>(address, std::move(credentials));
}

}  // namespace shardgemm
