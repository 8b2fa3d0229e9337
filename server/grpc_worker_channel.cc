#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "server/worker_channel.h"
#include "worker/grpc_status.h"

namespace shardgemm {
namespace {

class GrpcWorkerChannel : public WorkerChannel {
 public:
  explicit GrpcWorkerChannel(const std::string& address) {
    grpc::ChannelArguments args = TensorChannelArguments();
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
