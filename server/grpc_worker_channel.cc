#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "server/worker_channel.h"
#include "proto/grpc_status.h"

namespace shardgemm {
namespace {

constexpr absl::Duration kConnectTimeout = absl::Seconds(10);

class GrpcWorkerChannel : public WorkerChannel {
 public:
  GrpcWorkerChannel(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : address_(address) {
    grpc::ChannelArguments args = TensorChannelArguments();
    channel_ = grpc::CreateCustomChannel(address, std::move(credentials), args);
    stub_ = v1::Worker::NewStub(channel_);
  }

  // gRPC's callback API: no thread waits on the call once it is sent.
  void ExecuteAsync(const v1::Step& step, absl::Time deadline, ExecuteDone done) override {
    if (absl::Status c = Connected(deadline); !c.ok()) {
      done(c);
      return;
    }
    struct Call {
      grpc::ClientContext ctx;
      v1::Step step;
      v1::StepResult result;
      ExecuteDone done;
    };
    auto* call = new Call;
    call->step = step;
    call->done = std::move(done);
    call->ctx.set_deadline(ToGrpcDeadline(deadline));
    stub_->async()->Execute(&call->ctx, &call->step, &call->result, [call, this](grpc::Status s) {
      std::unique_ptr<Call> owned(call);
      if (s.ok()) {
        owned->done(std::move(owned->result));
      } else {
        absl::Status status = FromGrpcStatus(s);
        owned->done(absl::Status(status.code(), absl::StrCat("worker at ", address_, ": ", status.message())));
      }
    });
  }

  void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) override {
    struct Call {
      grpc::ClientContext ctx;
      v1::CancelStepsRequest request;
      v1::CancelStepsResponse response;
    };
    auto* call = new Call;
    call->request = request;
    call->ctx.set_deadline(ToGrpcDeadline(deadline));
    stub_->async()->CancelSteps(&call->ctx, &call->request, &call->response,
                                [call](grpc::Status) { delete call; });
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) override {
    if (absl::Status c = Connected(deadline); !c.ok()) return c;
    grpc::ClientContext ctx;
    ctx.set_deadline(ToGrpcDeadline(deadline));
    v1::GetShardRequest request;
    request.set_name(name);
    v1::LocalTensor shard;
    grpc::Status s = stub_->GetShard(&ctx, request, &shard);
    if (!s.ok()) return FromGrpcStatus(s);
    return shard;
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
    grpc::Status s = stub_->Status(&ctx, v1::WorkerStatusRequest(), &status);
    return FromGrpcStatus(s);
  }

 private:
  // A registered worker is listening, but a first connect attempt can still
  // fail transiently (seen under load in CI), and a call on a channel in
  // transient failure fails at once: until the channel has connected once,
  // wait for the connection, at most kConnectTimeout and never past the
  // deadline. Once it has, no wait: the call itself waits for a reconnect
  // (a connection reset) and fails at once where the worker refuses (it
  // died). The wait blocks the caller, which sends every rank's step in
  // turn, so a dead worker waited for here held its peers' steps (and the
  // whole mesh, in the global order) until the deadline.
  absl::Status Connected(absl::Time deadline) {
    if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY || connected_once_.load()) {
      connected_once_.store(true);
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    const absl::Time until = std::min(deadline, start + kConnectTimeout);
    if (channel_->WaitForConnected(ToGrpcDeadline(until))) {
      connected_once_.store(true);
      return absl::OkStatus();
    }
    return absl::UnavailableError(absl::StrCat("worker at ", address_, ": not connected within ",
                                               absl::FormatDuration(until - start)));
  }

  std::atomic<bool> connected_once_{false};
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address,
                                                     std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return std::make_unique<GrpcWorkerChannel>(address, std::move(credentials));
}

}  // namespace shardgemm
