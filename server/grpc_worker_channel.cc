#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "server/worker_channel.h"
#include "worker/grpc_status.h"

namespace shardgemm {
namespace {

// How long a call waits for a worker's channel to connect. A registered
// worker is listening, but a first connect attempt can still fail
// transiently (seen under load in CI), and a call on a channel in transient
// failure fails at once; a worker that stays unreachable is an UNAVAILABLE
// error after this, never a hang.
constexpr std::chrono::seconds kConnectTimeout{10};

class GrpcWorkerChannel : public WorkerChannel {
 public:
  explicit GrpcWorkerChannel(const std::string& address) : address_(address) {
    grpc::ChannelArguments args = TensorChannelArguments();
    channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Worker::NewStub(channel_);
  }

  absl::StatusOr<v1::StepResult> Execute(const v1::Step& step) override {
    if (absl::Status c = Connected(); !c.ok()) return c;
    grpc::ClientContext ctx;
    v1::StepResult result;
    grpc::Status s = stub_->Execute(&ctx, step, &result);
    if (!s.ok()) return FromGrpcStatus(s);
    return result;
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name) override {
    if (absl::Status c = Connected(); !c.ok()) return c;
    grpc::ClientContext ctx;
    v1::GetShardRequest request;
    request.set_name(name);
    v1::LocalTensor shard;
    grpc::Status s = stub_->GetShard(&ctx, request, &shard);
    if (!s.ok()) return FromGrpcStatus(s);
    return shard;
  }

 private:
  absl::Status Connected() {
    if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) return absl::OkStatus();
    if (channel_->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout)) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("worker at ", address_, ": not connected within ", kConnectTimeout.count(), " s"));
  }

  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address) {
  return std::make_unique<GrpcWorkerChannel>(address);
}

}  // namespace shardgemm
