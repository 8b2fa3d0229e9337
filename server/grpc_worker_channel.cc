#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "server/worker_channel.h"
#include "worker/grpc_status.h"

namespace shardgemm {
namespace {

constexpr int kMaxMessageBytes = 2047 * 1024 * 1024;

class GrpcWorkerChannel : public WorkerChannel {
 public:
  explicit GrpcWorkerChannel(const std::string& address) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  // Peers start together on loopback: retry connecting quickly.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
    args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
    args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 << 20);
    stub_ = v1::Worker::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }

  absl::StatusOr<v1::StepResult> Execute(const v1::Step& step) override {
    grpc::ClientContext ctx;
    v1::StepResult result;
    grpc::Status s = stub_->Execute(&ctx, step, &result);
    if (!s.ok()) return FromGrpcStatus(s);
    return result;
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name) override {
    grpc::ClientContext ctx;
    v1::GetShardRequest request;
    request.set_name(name);
    v1::LocalTensor shard;
    grpc::Status s = stub_->GetShard(&ctx, request, &shard);
    if (!s.ok()) return FromGrpcStatus(s);
    return shard;
  }

 private:
  std::unique_ptr<v1::Worker::Stub> stub_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address) {
  return std::make_unique<GrpcWorkerChannel>(address);
}

}  // namespace shardgemm
