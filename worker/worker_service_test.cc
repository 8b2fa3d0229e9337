#include "worker/worker_service.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "worker/backend.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

// The CPU backend, whose `lose_at`th GroupedGemm fails as a sticky CUDA
// error does: the call's error, and the device lost from then on.
class LosesItsDeviceBackend : public Backend {
 public:
  explicit LosesItsDeviceBackend(int lose_at) : cpu_(MakeCpuBackend(1)), lose_at_(lose_at) {}
  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return "a device that is lost once"; }
  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& gemm) override {
    if (++calls_ == lose_at_) {
      lost_ = absl::InternalError("the CUDA context is lost (cudaErrorIllegalAddress)");
      return absl::InternalError("grouped GEMM: CUDA error cudaErrorIllegalAddress: an illegal memory access");
    }
    return cpu_->GroupedGemm(gemm);
  }
  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override { return cpu_->GroupedQuantize(q); }
  absl::Status DeviceHealth() const override { return lost_; }

 private:
  std::unique_ptr<Backend> cpu_;
  int lose_at_;
  int calls_ = 0;
  absl::Status lost_;
};

v1::Step GemmStep(uint64_t sequence) {
  v1::Step step;
  step.set_sequence(sequence);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensorToProto(*ZerosTensor(DType::kF32, {4, 3}), g->mutable_lhs());
  HostTensorToProto(*ZerosTensor(DType::kF32, {2, 3, 5}), g->mutable_rhs());
  g->add_group_sizes(1);
  g->add_group_sizes(3);
  g->set_out_dtype(v1::F32);
  return step;
}

TEST(WorkerService, AStepThatLosesTheDeviceIsAnsweredThenTheWorkerGoesUnavailable) {
  LosesItsDeviceBackend backend(/*lose_at=*/2);
  ShardStore store(int64_t{1} << 30);
  Executor executor(&backend, &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, &backend);
  std::vector<std::string> lost;
  service.OnDeviceLost([&](const absl::Status& why) { lost.emplace_back(why.message()); });

  {
    grpc::ServerContext context;
    v1::StepResult result;
    v1::Step step = GemmStep(1);
    EXPECT_TRUE(service.Execute(&context, &step, &result).ok());
  }
  EXPECT_TRUE(lost.empty());
  {
    grpc::ServerContext context;
    v1::StepResult result;
    v1::Step step = GemmStep(2);
    grpc::Status s = service.Execute(&context, &step, &result);
    // The step that lost the device gets its own error.
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
    EXPECT_THAT(s.error_message(), HasSubstr("cudaErrorIllegalAddress: an illegal memory access"));
  }
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_THAT(lost[0], HasSubstr("the CUDA context is lost"));
  {
    // The heartbeat fails from now on: the coordinator marks the rank down.
    grpc::ServerContext context;
    v1::WorkerStatus status;
    grpc::Status s = service.Status(&context, nullptr, &status);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("exiting for its supervisor to restart it"));
  }
  {
    grpc::ServerContext context;
    v1::StepResult result;
    v1::Step step = GemmStep(3);
    EXPECT_EQ(service.Execute(&context, &step, &result).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  EXPECT_EQ(lost.size(), 1u);  // once
}

TEST(WorkerService, AStepsInlineBytesMoveIntoTheExecutorUncopied) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  ShardStore store(int64_t{1} << 30);
  Executor executor(backend.get(), &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, backend.get());
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensor lhs = *ZerosTensor(DType::kF32, {2, 2});
  for (int i = 0; i < 4; ++i) StoreFromFloat(&lhs, i, static_cast<float>(i + 1));  // [[1, 2], [3, 4]]
  HostTensor rhs = *ZerosTensor(DType::kF32, {1, 2, 1});
  StoreFromFloat(&rhs, 0, 10.0f);
  StoreFromFloat(&rhs, 1, 100.0f);
  HostTensorToProto(lhs, g->mutable_lhs());
  HostTensorToProto(rhs, g->mutable_rhs());
  g->add_group_sizes(2);
  g->set_out_dtype(v1::F32);
  grpc::ServerContext context;
  v1::StepResult result;
  ASSERT_TRUE(service.Execute(&context, &step, &result).ok());
  auto out = HostTensorFromProto(result.out(), "out");
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(out->data<float>()[0], 210.0f);
  EXPECT_EQ(out->data<float>()[1], 430.0f);
  // The request's operand bytes were taken, not copied.
  EXPECT_TRUE(step.gemm().lhs().data().empty());
  EXPECT_TRUE(step.gemm().rhs().data().empty());
}

}  // namespace
}  // namespace shardgemm
