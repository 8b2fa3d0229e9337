// An FP8 GemmStep whose scale operands have the right shape
// but the wrong dtype must be refused (INVALID_ARGUMENT naming the field),
// not read as F32 past the end of their bytes.
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "worker/executor.h"
#include "worker/fake_collectives.h"

namespace shardgemm {
namespace {

HostTensor Filled(DType dtype, std::vector<int64_t> shape, char byte) {
  HostTensor t = *ZerosTensor(dtype, shape);
  for (char& c : t.bytes) c = byte;
  return t;
}

HostTensor F32(std::vector<int64_t> shape, float v) {
  HostTensor t = *ZerosTensor(DType::kF32, shape);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.data<float>()[i] = v;
  return t;
}

class Fp8StepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend(1);
    executor_ = std::make_unique<Executor>(backend_.get(), &store_);
    executor_->Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  }

  // Tensor-scaled FP8 ragged-M step: lhs [M, K] E4M3, rhs [G, N, K] E4M3.
  v1::Step Step(int64_t groups, const HostTensor& lhs_scale, const HostTensor& rhs_scale) {
    const int64_t rows = 4, k = 16, n = 8;
    v1::Step step;
    step.set_sequence(next_++);
    v1::GemmStep* g = step.mutable_gemm();
    HostTensorToProto(Filled(DType::kF8E4M3, {groups * rows, k}, 0x38), g->mutable_lhs());  // 1.0
    HostTensorToProto(Filled(DType::kF8E4M3, {groups, n, k}, 0x38), g->mutable_rhs());
    for (int64_t i = 0; i < groups; ++i) g->add_group_sizes(rows);
    g->set_rhs_transposed(true);
    g->set_out_dtype(v1::F32);
    g->set_scaling(v1::CURRENT);
    HostTensorToProto(lhs_scale, g->mutable_lhs_scale_inv());
    HostTensorToProto(rhs_scale, g->mutable_rhs_scale_inv());
    return step;
  }

  std::unique_ptr<Backend> backend_;
  ShardStore store_{int64_t{1} << 30};
  std::unique_ptr<Executor> executor_;
  uint64_t next_ = 1;
};

TEST_F(Fp8StepTest, GoodStepRuns) {
  auto r = executor_->Execute(Step(2, F32({2}, 1.f), F32({2}, 1.f)));
  ASSERT_TRUE(r.ok()) << r.status();
}

// BF16 lhs scales of shape [G]: the CPU backend checks only the shape and
// reads 4*G bytes from a 2*G-byte buffer.
TEST_F(Fp8StepTest, Bf16LhsScalesAreRefused) {
  const int64_t groups = 64;
  auto r = executor_->Execute(Step(groups, Filled(DType::kBF16, {groups}, 0x3f), F32({groups}, 1.f)));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("lhs_scale_inv"), absl::string_view::npos) << r.status();
}

// E8M0 (1 byte) rhs scales for tensor scaling: 4*G bytes read from G.
TEST_F(Fp8StepTest, E8m0RhsScalesForTensorScalingAreRefused) {
  const int64_t groups = 64;
  auto r = executor_->Execute(Step(groups, F32({groups}, 1.f), Filled(DType::kE8M0, {groups}, 127)));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("rhs_scale_inv"), absl::string_view::npos) << r.status();
}

}  // namespace
}  // namespace shardgemm
