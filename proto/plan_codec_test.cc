#include "proto/plan_codec.h"

#include <string>

#include "gtest/gtest.h"
#include "proto/tensor_codec.h"

namespace shardgemm {
namespace {

// Resolves every tensor as inline (dtype, shape and spec from the request).
absl::StatusOr<TensorMeta> Inline(const v1::Tensor& t, const std::string& field) {
  auto d = DTypeFromProto(t.dtype(), field);
  if (!d.ok()) return d.status();
  TensorMeta m;
  m.dtype = *d;
  m.shape.assign(t.shape().begin(), t.shape().end());
  m.spec = t.spec();
  return m;
}

v1::Tensor Meta(v1::DType dtype, std::vector<int64_t> shape, const std::string& spec = "") {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_spec(spec);
  return t;
}

v1::GroupedGemmRequest Gemm() {
  v1::GroupedGemmRequest r;
  *r.mutable_lhs() = Meta(v1::BF16, {64, 32}, "(dp, None)");
  *r.mutable_rhs() = Meta(v1::BF16, {4, 32, 16});
  *r.mutable_group_sizes() = Meta(v1::I64, {8}, "(dp,)");
  return r;
}

TEST(PlanCodecTest, GemmRequestBecomesThePlannersRequest) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2", "");
  auto pr = GemmPlanRequest(Gemm(), mesh, Inline);
  ASSERT_TRUE(pr.ok()) << pr.status();
  EXPECT_EQ(pr->op, planner::OpKind::kGroupedGemmRaggedM);
  EXPECT_EQ(pr->attrs.out_dtype, DType::kBF16);  // the lhs dtype by default
  EXPECT_FALSE(pr->attrs.has_bias);
  ASSERT_EQ(pr->operands.size(), 3u);
  EXPECT_EQ(pr->operands[0].name, "lhs");
  EXPECT_EQ(planner::FormatPartitionSpec(pr->operands[0].spec), "(dp, None)");
  EXPECT_TRUE(planner::MakePlan(*pr).ok());
}

TEST(PlanCodecTest, EnumsOutsideTheirValuesNameTheField) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2", "");
  struct Case {
    void (*set)(v1::GroupedGemmRequest*);
    const char* field;
  } cases[] = {
      {[](v1::GroupedGemmRequest* r) { r->set_ragged(static_cast<v1::GroupedGemmRequest::Ragged>(7)); }, "ragged"},
      {[](v1::GroupedGemmRequest* r) { r->set_layout(static_cast<v1::GroupedGemmRequest::Layout>(9)); }, "layout"},
      {[](v1::GroupedGemmRequest* r) { r->set_compat(static_cast<v1::Compat>(5)); }, "compat"},
  };
  for (const Case& c : cases) {
    v1::GroupedGemmRequest r = Gemm();
    c.set(&r);
    absl::Status s = GemmPlanRequest(r, mesh, Inline).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_EQ(s.message().rfind(c.field, 0), 0u) << s;
  }
}

TEST(PlanCodecTest, OutDtypeMustBeAGemmFloat) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2", "");
  v1::GroupedGemmRequest r = Gemm();
  r.set_out_dtype(v1::F8E4M3);
  absl::Status s = GemmPlanRequest(r, mesh, Inline).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("out_dtype"), std::string::npos) << s;
}

TEST(PlanCodecTest, QuantizeFlattenAxisKeepsItsSign) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2", "");
  v1::GroupedQuantizeRequest q;
  *q.mutable_x() = Meta(v1::BF16, {8, 4, 16}, "(dp, None, None)");
  *q.mutable_group_sizes() = Meta(v1::I64, {4}, "(dp,)");
  q.set_flatten_axis(-2);
  auto pr = QuantizePlanRequest(q, mesh, Inline);
  ASSERT_TRUE(pr.ok()) << pr.status();
  EXPECT_EQ(pr->attrs.flatten_axis, -2);  // not the default -1: resolved by the planner against the rank
  q.set_flatten_axis(0);
  EXPECT_EQ(QuantizePlanRequest(q, mesh, Inline)->attrs.flatten_axis, -1);  // unset: the default
  q.set_scaling(static_cast<v1::ScalingMode>(42));
  EXPECT_EQ(QuantizePlanRequest(q, mesh, Inline).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlanCodecTest, CollectivesCarryTypedKindsPhasesAndRoles) {
  planner::Collective c;
  c.phase = planner::Phase::kAfter;
  c.kind = planner::CollectiveKind::kReduceScatter;
  c.tensor = "out";
  c.dim = 1;
  c.axes = {"tp"};
  v1::CollectivePlan p;
  CollectiveToProto(c, &p);
  EXPECT_EQ(p.phase(), v1::PHASE_AFTER);
  EXPECT_EQ(p.kind(), v1::COLLECTIVE_REDUCE_SCATTER);
  EXPECT_EQ(p.tensor(), v1::TENSOR_OUT);
  for (const char* name : {"lhs", "rhs", "bias", "group_sizes", "x", "out", "data", "colwise_data", "scale_inv",
                           "colwise_scale_inv", "amax"}) {
    const v1::TensorRole role = TensorRoleFromName(name);
    EXPECT_NE(role, v1::TENSOR_ROLE_UNSPECIFIED) << name;
    EXPECT_EQ(TensorRoleName(role), name);
  }
  EXPECT_EQ(TensorRoleFromName("nonsense"), v1::TENSOR_ROLE_UNSPECIFIED);
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(PlanCodecTest, OneMappingFromTheWiresScalingModesToTheKernels) {
  EXPECT_EQ(*KernelScalingMode(v1::SCALING_UNSPECIFIED, false), ScalingMode::kCurrent);
  EXPECT_EQ(*KernelScalingMode(v1::CURRENT, false), ScalingMode::kCurrent);
  EXPECT_EQ(*KernelScalingMode(v1::DELAYED, false), ScalingMode::kDelayed);
  EXPECT_EQ(*KernelScalingMode(v1::MXFP8, false), ScalingMode::kMxfp8);
  EXPECT_EQ(*KernelScalingMode(v1::BLOCK_FP8, false), ScalingMode::kBlock1x128);
  EXPECT_EQ(*KernelScalingMode(v1::BLOCK_FP8, true), ScalingMode::kBlock128x128);
  auto bad = KernelScalingMode(static_cast<v1::ScalingMode>(9), false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message().rfind("scaling", 0), 0u) << bad.status();
}

}  // namespace
}  // namespace shardgemm
