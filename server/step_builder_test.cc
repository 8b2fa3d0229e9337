#include "server/step_builder.h"

#include "gtest/gtest.h"
#include "proto/tensor_codec.h"

namespace shardgemm {
namespace {

HostTensor Iota(DType dtype, std::vector<int64_t> shape) {
  HostTensor t = *ZerosTensor(DType::kF32, shape);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.data<float>()[i] = static_cast<float>(i);
  return dtype == DType::kF32 ? t : *ConvertFloatTensor(t, dtype);
}

planner::OperandRequest Operand(const std::string& name, std::vector<int64_t> shape, DType dtype,
                                const std::string& spec) {
  planner::OperandRequest op;
  op.name = name;
  op.shape = std::move(shape);
  op.dtype = dtype;
  op.spec = *planner::ParsePartitionSpec(spec);
  return op;
}

TEST(StepBuilderTest, InlineRowsAreSplitAndResidentWeightsNamed) {
  planner::PlanRequest pr;
  pr.mesh = *planner::ParseMesh("dp=2,fsdp=2", "");
  pr.operands = {Operand("lhs", {8, 4}, DType::kF32, "((dp, fsdp), None)"),
                 Operand("rhs", {2, 4, 3}, DType::kF32, "(None, fsdp, None)"),
                 Operand("group_sizes", {8}, DType::kI64, "((dp, fsdp),)")};
  auto plan = planner::MakePlan(pr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const HostTensor lhs = Iota(DType::kF32, {8, 4});
  GemmStepsRequest r;
  r.plan = &*plan;
  r.mesh = &pr.mesh;
  r.group_sizes = {1, 1, 2, 0, 0, 2, 1, 0};
  r.operands["lhs"] = GemmOperand{TensorMeta{DType::kF32, {8, 4}, "((dp, fsdp), None)", ""}, &lhs};
  r.operands["rhs"] = GemmOperand{TensorMeta{DType::kF32, {2, 4, 3}, "(None, fsdp, None)", "w@3"}, nullptr};
  auto steps = BuildGemmSteps(r);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 4u);
  for (int rank = 0; rank < 4; ++rank) {
    const v1::GemmStep& g = (*steps)[rank].gemm();
    // Rows 2*rank, 2*rank+1 of lhs; the rank's two group sizes.
    auto block = HostTensorFromProto(g.lhs(), "lhs");
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ(block->shape, std::vector<int64_t>({2, 4}));
    EXPECT_EQ(block->data<float>()[0], static_cast<float>(8 * rank));
    EXPECT_EQ(std::vector<int64_t>(g.group_sizes().begin(), g.group_sizes().end()),
              std::vector<int64_t>({r.group_sizes[2 * rank], r.group_sizes[2 * rank + 1]}));
    // The weight's shard by name, with its local shape (K split over fsdp).
    EXPECT_EQ(g.rhs().resident(), "w@3");
    EXPECT_EQ(std::vector<int64_t>(g.rhs().shape().begin(), g.rhs().shape().end()), std::vector<int64_t>({2, 2, 3}));
    // The plan gathers the weight along fsdp: a typed collective, and the
    // mesh agrees on the step.
    ASSERT_EQ(g.collectives_size(), 1);
    EXPECT_EQ(g.collectives(0).kind(), v1::COLLECTIVE_ALL_GATHER);
    EXPECT_EQ(g.collectives(0).tensor(), v1::TENSOR_RHS);
    EXPECT_TRUE(g.agree());
  }
}

TEST(StepBuilderTest, StagedOperandsNameEachRanksTicketWithItsLocalShape) {
  planner::PlanRequest pr;
  pr.mesh = *planner::ParseMesh("dp=2", "");
  pr.operands = {Operand("lhs", {8, 4}, DType::kF32, "(dp, None)"), Operand("rhs", {2, 4, 3}, DType::kF32, ""),
                 Operand("group_sizes", {4}, DType::kI64, "(dp,)")};
  auto plan = planner::MakePlan(pr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  GemmStepsRequest r;
  r.plan = &*plan;
  r.mesh = &pr.mesh;
  r.group_sizes = {1, 3, 2, 2};
  TensorMeta lhs{DType::kF32, {8, 4}, "(dp, None)", ""};
  lhs.staging_id = "plan";
  lhs.staged_tickets = {"t0", "t1"};
  TensorMeta rhs{DType::kF32, {2, 4, 3}, "", ""};
  rhs.staging_id = "plan";
  rhs.staged_tickets = {"r0", "r1"};
  r.operands["lhs"] = GemmOperand{lhs, nullptr};
  r.operands["rhs"] = GemmOperand{rhs, nullptr};
  auto steps = BuildGemmSteps(r);
  ASSERT_TRUE(steps.ok()) << steps.status();
  for (int rank = 0; rank < 2; ++rank) {
    const v1::GemmStep& g = (*steps)[rank].gemm();
    EXPECT_EQ(g.lhs().staged(), rank == 0 ? "t0" : "t1");
    EXPECT_TRUE(g.lhs().data().empty());
    EXPECT_EQ(std::vector<int64_t>(g.lhs().shape().begin(), g.lhs().shape().end()), std::vector<int64_t>({4, 4}));
    EXPECT_EQ(g.rhs().staged(), rank == 0 ? "r0" : "r1");
    EXPECT_EQ(std::vector<int64_t>(g.rhs().shape().begin(), g.rhs().shape().end()),
              std::vector<int64_t>({2, 4, 3}));
  }
  // A ticket short of a rank is the coordinator's bug, not the client's.
  r.operands["lhs"].meta.staged_tickets = {"t0"};
  EXPECT_EQ(BuildGemmSteps(r).status().code(), absl::StatusCode::kInternal);
}

TEST(StepBuilderTest, ReplicatedOperandsAreSentWholeAndOneWorkerNeverAgrees) {
  planner::PlanRequest pr;
  pr.mesh = *planner::ParseMesh("dp=1", "");
  pr.operands = {Operand("lhs", {4, 4}, DType::kBF16, ""), Operand("rhs", {1, 4, 2}, DType::kBF16, ""),
                 Operand("group_sizes", {1}, DType::kI64, "")};
  auto plan = planner::MakePlan(pr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const HostTensor lhs = Iota(DType::kBF16, {4, 4}), rhs = Iota(DType::kBF16, {1, 4, 2});
  GemmStepsRequest r;
  r.plan = &*plan;
  r.mesh = &pr.mesh;
  r.group_sizes = {3};
  r.operands["lhs"] = GemmOperand{TensorMeta{DType::kBF16, {4, 4}, "", ""}, &lhs};
  r.operands["rhs"] = GemmOperand{TensorMeta{DType::kBF16, {1, 4, 2}, "", ""}, &rhs};
  auto steps = BuildGemmSteps(r);
  ASSERT_TRUE(steps.ok()) << steps.status();
  const v1::GemmStep& g = (*steps)[0].gemm();
  EXPECT_EQ(g.lhs().data(), lhs.bytes);
  EXPECT_EQ(g.rhs().data(), rhs.bytes);
  EXPECT_EQ(g.out_dtype(), v1::BF16);
  EXPECT_FALSE(g.agree());
  EXPECT_EQ(g.collectives_size(), 0);
}

TEST(StepBuilderTest, GroupSizesShorterThanThePlanSaysAreAnInternalError) {
  planner::PlanRequest pr;
  pr.mesh = *planner::ParseMesh("dp=1", "");
  pr.operands = {Operand("lhs", {4, 4}, DType::kF32, ""), Operand("rhs", {2, 4, 2}, DType::kF32, ""),
                 Operand("group_sizes", {2}, DType::kI64, "")};
  auto plan = planner::MakePlan(pr);
  ASSERT_TRUE(plan.ok());
  const HostTensor lhs = Iota(DType::kF32, {4, 4}), rhs = Iota(DType::kF32, {2, 4, 2});
  GemmStepsRequest r;
  r.plan = &*plan;
  r.mesh = &pr.mesh;
  r.group_sizes = {3};  // the plan reads two entries
  r.operands["lhs"] = GemmOperand{TensorMeta{DType::kF32, {4, 4}, "", ""}, &lhs};
  r.operands["rhs"] = GemmOperand{TensorMeta{DType::kF32, {2, 4, 2}, "", ""}, &rhs};
  EXPECT_EQ(BuildGemmSteps(r).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(StepBuilderTest, QuantizeStepsCarryEachShardsRowsGroupsAndScales) {
  planner::PlanRequest pr;
  pr.mesh = *planner::ParseMesh("dp=2", "");
  pr.op = planner::OpKind::kGroupedQuantize;
  pr.attrs.scaling_mode = planner::ScalingMode::kDelayed;
  pr.attrs.shared_scales = true;
  pr.operands = {Operand("x", {8, 16}, DType::kF32, "(dp, None)"), Operand("group_sizes", {4}, DType::kI64, "(dp,)")};
  auto plan = planner::MakePlan(pr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const HostTensor x = Iota(DType::kF32, {8, 16});
  QuantizeStepsRequest r;
  r.plan = &*plan;
  r.mesh = &pr.mesh;
  r.x = GemmOperand{TensorMeta{DType::kF32, {8, 16}, "(dp, None)", ""}, &x};
  r.group_sizes = {3, 1, 2, 2};
  r.scales = {1.f, 2.f, 3.f, 4.f};
  r.scaling = v1::DELAYED;
  r.flatten_axis = 1;
  auto steps = BuildQuantizeSteps(r);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 2u);
  const v1::QuantizeStep& q1 = (*steps)[1].quantize();
  auto block = HostTensorFromProto(q1.x(), "x");
  ASSERT_TRUE(block.ok());
  EXPECT_EQ(block->shape, std::vector<int64_t>({4, 16}));
  EXPECT_EQ(block->data<float>()[0], 64.f);  // row 4
  EXPECT_EQ(std::vector<int64_t>(q1.group_sizes().begin(), q1.group_sizes().end()), std::vector<int64_t>({2, 2}));
  EXPECT_EQ(std::vector<float>(q1.scales().begin(), q1.scales().end()), std::vector<float>({3.f, 4.f}));
  EXPECT_EQ(q1.scaling(), v1::DELAYED);
  EXPECT_EQ(q1.flatten_axis(), 1);
  EXPECT_TRUE(q1.agree());
  r.scales = {1.f};
  EXPECT_EQ(BuildQuantizeSteps(r).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace shardgemm
