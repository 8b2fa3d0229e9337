#include "server/step_socket_channel.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/frame_socket_client.h"
#include "proto/step_frame.h"

namespace shardgemm {
namespace {

using StepSocket = FrameSocketClient<v1::StepSocketRequest, v1::StepSocketReply>;

class StepSocketChannel final : public WorkerChannel {
 public:
  StepSocketChannel(std::unique_ptr<WorkerChannel> grpc, std::string path, std::string name, uint64_t max_step_bytes)
      : grpc_(std::move(grpc)),
        socket_(std::move(path), absl::StrCat("worker at ", name), "step socket"),
        max_step_bytes_(max_step_bytes) {}

  void ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) override {
    if (step.ByteSizeLong() > max_step_bytes_) return grpc_->ExecuteAsync(std::move(step), deadline, std::move(done));
    v1::StepSocketRequest request;
    request.mutable_step()->Swap(&step);  // a put's step holds its block: not copied
    request.set_deadline_unix_us(deadline == absl::InfiniteFuture() ? 0 : absl::ToUnixMicros(deadline));
    // Shared: a step the socket did not take goes on gRPC with the same done.
    auto shared = std::make_shared<ExecuteDone>(std::move(done));
    StepSocket::Done answered = [shared](absl::StatusOr<v1::StepSocketReply> reply) {
      if (!reply.ok()) return (*shared)(reply.status());
      (*shared)(std::move(*reply->mutable_result()));
    };
    if (socket_.Send(request, deadline, &answered) || answered == nullptr) return;
    step.Swap(request.mutable_step());
    grpc_->ExecuteAsync(std::move(step), deadline, std::move(*shared));
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) override {
    return grpc_->GetShard(name, deadline);
  }
  absl::Status PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time deadline) override {
    return grpc_->PutShard(name, shard, deadline);
  }
  void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) override {
    grpc_->CancelSteps(request, deadline);
  }
  void AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time deadline) override {
    grpc_->AdvanceEpoch(request, deadline);
  }
  absl::Status ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time deadline) override {
    return grpc_->ExpectStaged(request, deadline);
  }
  absl::Status HoldShard(const v1::HoldShardRequest& request, absl::Time deadline) override {
    return grpc_->HoldShard(request, deadline);
  }
  absl::StatusOr<std::unique_ptr<StageStream>> OpenStage(const v1::StageShardChunk& header,
                                                         absl::Time deadline) override {
    return grpc_->OpenStage(header, deadline);
  }
  absl::Status DropStaged(const v1::DropStagedRequest& request, absl::Time deadline) override {
    return grpc_->DropStaged(request, deadline);
  }
  absl::Status ForgetClientMemory(const v1::ForgetClientMemoryRequest& request, absl::Time deadline) override {
    return grpc_->ForgetClientMemory(request, deadline);
  }
  absl::Status Ping(absl::Time deadline) override { return grpc_->Ping(deadline); }

 private:
  const std::unique_ptr<WorkerChannel> grpc_;
  StepSocket socket_;
  const uint64_t max_step_bytes_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeStepSocketChannel(std::unique_ptr<WorkerChannel> grpc,
                                                     const std::string& socket_path, const std::string& name,
                                                     uint64_t max_step_bytes) {
  return std::make_unique<StepSocketChannel>(std::move(grpc), socket_path, name, max_step_bytes);
}

}  // namespace shardgemm
