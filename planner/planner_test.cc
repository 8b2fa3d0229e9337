#include "planner/planner.h"

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "planner/operand_text.h"

namespace shardgemm {
namespace planner {
namespace {

// Builds a request from text: operands as "name=SHAPE@SPEC".
PlanRequest Req(const std::string& mesh, const std::string& roles, OpKind op, CompatMode compat,
                const std::vector<std::string>& operands, const std::string& out_spec = "-") {
  PlanRequest req;
  req.mesh = *ParseMesh(mesh, roles);
  req.op = op;
  req.compat = compat;
  for (const std::string& text : operands) {
    size_t eq = text.find('=');
    std::string name = text.substr(0, eq);
    DType dtype = name == "group_sizes" ? DType::kI32 : name == "bias" ? DType::kF32 : DType::kBF16;
    absl::StatusOr<OperandRequest> o = ParseOperand(name, text.substr(eq + 1), dtype);
    EXPECT_TRUE(o.ok()) << o.status();
    req.operands.push_back(*o);
    if (name == "bias") req.attrs.has_bias = true;
  }
  if (out_spec != "-") req.out_spec = *ParsePartitionSpec(out_spec);
  return req;
}

// "phase kind tensor dim axes" per collective, joined by "; ".
std::string Collectives(const Plan& plan) {
  std::vector<std::string> parts;
  for (const Collective& c : plan.collectives) {
    parts.push_back(absl::StrCat(PhaseName(c.phase), " ", CollectiveKindName(c.kind), " ",
                                 c.tensor, " ", c.dim, " ", FormatAxes(c.axes)));
  }
  return absl::StrJoin(parts, "; ");
}

std::string Warnings(const Plan& plan) {
  std::vector<std::string> parts;
  for (const PlanWarning& w : plan.warnings) {
    parts.push_back(absl::StrCat(w.tensor, ":", w.dim, ":", w.axis));
  }
  return absl::StrJoin(parts, ", ");
}

std::string ComputeSpec(const Plan& plan, const std::string& name) {
  for (const PlanOperand& op : plan.operands) {
    if (op.name == name) return FormatPartitionSpec(op.compute_spec);
  }
  return "?";
}

constexpr OpKind kM = OpKind::kGroupedGemmRaggedM;
constexpr OpKind kK = OpKind::kGroupedGemmRaggedK;
constexpr CompatMode kTe = CompatMode::kTe;
constexpr CompatMode kDef = CompatMode::kDefault;

struct RuleCase {
  const char* name;
  PlanRequest req;
  std::string collectives;  // Collectives(plan)
  std::string out_spec;
  std::string warnings;     // Warnings(plan)
  std::string rhs_compute;  // compute spec of rhs ("" = don't check)
};

std::vector<RuleCase> RuleCases() {
  return {
      // Rule 5 + rule 2: nested (fsdp, ep) rows; rhs experts split over ep
      // (EP injection: rhs replicated on dim 0 -> slice).
      {"nested_fsdp_ep_te",
       Req("fsdp=2,ep=2", "", kM, kTe,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=4x32x16", "group_sizes=8@((fsdp,ep),)"}),
       "before slice rhs 0 ep", "((fsdp, ep), None)", "", "(ep, None, None)"},
      {"nested_fsdp_ep_default",
       Req("fsdp=2,ep=2", "", kM, kDef,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=4x32x16", "group_sizes=8@((fsdp,ep),)"}),
       "before slice rhs 0 ep", "((fsdp, ep), None)", "", "(ep, None, None)"},
      // Nested entry on rhs where the kept axis is minor: regather + slice.
      {"nested_rhs_ep_fsdp_te",
       Req("fsdp=2,ep=2", "", kM, kTe,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=4x32x16@((fsdp,ep),None,None)",
            "group_sizes=8@((fsdp,ep),)"}),
       "before all_gather rhs 0 (fsdp, ep); before slice rhs 0 ep", "((fsdp, ep), None)",
       "rhs:0:fsdp", "(ep, None, None)"},
      // Rule 2 with ep already on rhs: nothing to do.
      {"ep_on_rhs_already",
       Req("dp=2,ep=4", "", kM, kTe,
           {"lhs=64x32@((dp,ep),None)", "rhs=8x32x16@(ep,None,None)", "group_sizes=16@((dp,ep),)"}),
       "", "((dp, ep), None)", "", "(ep, None, None)"},
      // Rule 3: FSDP weight gathered (te and default: fsdp also splits rows).
      {"fsdp_gather_te",
       Req("dp=2,fsdp=2", "", kM, kTe,
           {"lhs=64x32@((dp,fsdp),None)", "rhs=4x32x16@(None,None,fsdp)", "group_sizes=16@((dp,fsdp),)"}),
       "before all_gather rhs 2 fsdp", "((dp, fsdp), None)", "rhs:2:fsdp", "(None, None, None)"},
      {"fsdp_gather_default",
       Req("dp=2,fsdp=2", "", kM, kDef,
           {"lhs=64x32@((dp,fsdp),None)", "rhs=4x32x16@(None,None,fsdp)", "group_sizes=16@((dp,fsdp),)"}),
       "before all_gather rhs 2 fsdp", "((dp, fsdp), None)", "rhs:2:fsdp", "(None, None, None)"},
      // Rule 3 in te mode even when the rows are not split over fsdp; the
      // default mode keeps it (column-parallel over fsdp, output split on N).
      {"fsdp_on_n_rows_unsplit_te",
       Req("dp=2,fsdp=2", "", kM, kTe,
           {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,fsdp)", "group_sizes=8@(dp,)"}),
       "before all_gather rhs 2 fsdp", "(dp, None)", "rhs:2:fsdp", ""},
      {"fsdp_on_n_rows_unsplit_default",
       Req("dp=2,fsdp=2", "", kM, kDef,
           {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,fsdp)", "group_sizes=8@(dp,)"}),
       "", "(dp, fsdp)", "", ""},
      // Rule 4: common dp axis on both contracting dims -> psum.
      {"psum_dp_contracting_te",
       Req("dp=2,ep=2", "", kM, kTe,
           {"lhs=64x32@(ep,dp)", "rhs=4x32x16@(None,dp,None)", "group_sizes=4@(ep,)"}),
       "before slice rhs 0 ep; after all_reduce_sum out -1 dp", "(ep, None)", "", "(ep, dp, None)"},
      // A common axis on non-contracting dims is no reason to reduce: rows
      // over dp and rhs N over dp -> rhs N gathered, no all-reduce.
      {"common_axis_non_contracting_te",
       Req("dp=2", "", kM, kTe, {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,dp)", "group_sizes=8@(dp,)"}),
       "before all_gather rhs 2 dp", "(dp, None)", "rhs:2:dp", ""},
      {"common_axis_non_contracting_wgrad_default",
       Req("dp=2,tp=2", "", kK, kDef, {"lhs=64x32@(dp,tp)", "rhs=64x16@(dp,tp)", "group_sizes=8@(dp,)"}),
       "before all_gather rhs 1 tp; after all_reduce_sum out -1 dp", "(None, tp, None)", "rhs:1:tp", ""},
      // tp: dropped with warnings in te mode, column-parallel by default.
      {"tp_column_parallel_te",
       Req("dp=2,tp=2", "", kM, kTe, {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,tp)", "group_sizes=8@(dp,)"}),
       "before all_gather rhs 2 tp", "(dp, None)", "rhs:2:tp", ""},
      {"tp_column_parallel_default",
       Req("dp=2,tp=2", "", kM, kDef, {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,tp)", "group_sizes=8@(dp,)"}),
       "", "(dp, tp)", "", "(None, None, tp)"},
      // Row-parallel: tp on both contracting dims.
      {"tp_row_parallel_te",
       Req("dp=2,tp=2", "", kM, kTe, {"lhs=64x32@(dp,tp)", "rhs=4x32x16@(None,tp,None)", "group_sizes=8@(dp,)"}),
       "before all_gather lhs 1 tp; before all_gather rhs 1 tp", "(dp, None)", "lhs:1:tp, rhs:1:tp", ""},
      {"tp_row_parallel_default",
       Req("dp=2,tp=2", "", kM, kDef, {"lhs=64x32@(dp,tp)", "rhs=4x32x16@(None,tp,None)", "group_sizes=8@(dp,)"}),
       "after all_reduce_sum out -1 tp", "(dp, None)", "", "(None, tp, None)"},
      // Requested output split along the reduced axis.
      {"requested_out_on_reduced_axis_default",
       Req("dp=2,tp=2", "", kM, kDef, {"lhs=64x32@(dp,tp)", "rhs=4x32x16@(None,tp,None)", "group_sizes=8@(dp,)"},
           "((dp,tp),None)"),
       "after reduce_scatter out 0 tp", "((dp, tp), None)", "", ""},
      {"requested_out_on_reduced_axis_te",
       Req("dp=2,ep=2", "", kM, kTe, {"lhs=64x32@(ep,dp)", "rhs=4x32x16@(None,dp,None)", "group_sizes=4@(ep,)"},
           "(ep,dp)"),
       "before slice rhs 0 ep; after all_reduce_sum out -1 dp; after slice out 1 dp", "(ep, dp)", "", ""},
      {"requested_out_on_reduced_axis_te_default",
       Req("dp=2,ep=2", "", kM, kDef, {"lhs=64x32@(ep,dp)", "rhs=4x32x16@(None,dp,None)", "group_sizes=4@(ep,)"},
           "(ep,dp)"),
       "before slice rhs 0 ep; after reduce_scatter out 1 dp", "(ep, dp)", "", ""},
      // Wgrad: rows over (fsdp, ep): expert dim over ep, partial sums over fsdp.
      {"wgrad_te",
       Req("fsdp=2,ep=2", "", kK, kTe,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=64x16@((fsdp,ep),None)", "group_sizes=8@((fsdp,ep),)"}),
       "after all_reduce_sum out -1 fsdp", "(ep, None, None)", "", ""},
      {"wgrad_reduce_scatter_onto_weight_fsdp_default",
       Req("fsdp=2,ep=2", "", kK, kDef,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=64x16@((fsdp,ep),None)", "group_sizes=8@((fsdp,ep),)"},
           "(ep,fsdp,None)"),
       "after reduce_scatter out 1 fsdp", "(ep, fsdp, None)", "", ""},
      {"wgrad_requested_fsdp_te",
       Req("fsdp=2,ep=2", "", kK, kTe,
           {"lhs=64x32@((fsdp,ep),None)", "rhs=64x16@((fsdp,ep),None)", "group_sizes=8@((fsdp,ep),)"},
           "(ep,fsdp,None)"),
       "after all_reduce_sum out -1 fsdp; after slice out 1 fsdp", "(ep, fsdp, None)", "", ""},
      // Renamed axes through roles.
      {"roles_renamed",
       Req("data=2,expert=2", "dp=data,ep=expert", kM, kTe,
           {"lhs=64x32@((data,expert),None)", "rhs=4x32x16", "group_sizes=8@((data,expert),)"}),
       "before slice rhs 0 expert", "((data, expert), None)", "", "(expert, None, None)"},
      // An axis with no role is dropped in te mode.
      {"unroled_axis_te",
       Req("dp=2,x=2", "", kM, kTe, {"lhs=64x32@(dp,x)", "rhs=4x32x16@(None,x,None)", "group_sizes=8@(dp,)"}),
       "before all_gather lhs 1 x; before all_gather rhs 1 x", "(dp, None)", "lhs:1:x, rhs:1:x", ""},
  };
}

TEST(PlannerTest, RuleTable) {
  for (const RuleCase& c : RuleCases()) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<Plan> plan = MakePlan(c.req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(Collectives(*plan), c.collectives) << FormatPlanText(*plan);
    EXPECT_EQ(FormatPartitionSpec(plan->out_spec), c.out_spec);
    EXPECT_EQ(Warnings(*plan), c.warnings);
    if (!c.rhs_compute.empty()) {
      EXPECT_EQ(ComputeSpec(*plan, "rhs"), c.rhs_compute);
    }
    for (const PlanWarning& w : plan->warnings) {
      EXPECT_NE(w.text.find("all-gathered along"), std::string::npos) << w.text;
    }
  }
}

TEST(PlannerTest, WarningTextNamesTensorDimAxisAndCost) {
  absl::StatusOr<Plan> plan = MakePlan(Req("dp=2,tp=2", "", kM, kTe,
      {"lhs=64x32@(dp,None)", "rhs=4x32x16@(None,None,tp)", "group_sizes=8@(dp,)"}));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->warnings.size(), 1u);
  EXPECT_EQ(plan->warnings[0].text,
            "rhs dim 2: axis 'tp' dropped (role tp, not a dp/fsdp/ep axis in te mode): rhs is "
            "all-gathered along tp (2.00 KiB per worker)");
}

TEST(PlannerTest, ChoosesGatherWhenCheaperThanReducing) {
  // Tall activations, small weights: reducing the [4096, 64] output over tp
  // moves more than gathering lhs's K plus the weight.
  absl::StatusOr<Plan> plan = MakePlan(Req("tp=2", "", kM, kDef,
      {"lhs=4096x64@(None,tp)", "rhs=2x64x64@(None,tp,None)", "group_sizes=2"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before all_gather lhs 1 tp; before all_gather rhs 1 tp");
  EXPECT_NE(plan->strategy_note.find("gather K on both operands"), std::string::npos);
  EXPECT_NE(plan->strategy_note.find("chosen by bytes"), std::string::npos);
  // Short activations: reducing wins.
  plan = MakePlan(Req("tp=2", "", kM, kDef,
      {"lhs=16x4096@(None,tp)", "rhs=2x4096x4096@(None,tp,None)", "group_sizes=2"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "after all_reduce_sum out -1 tp");
}

TEST(PlannerTest, DefaultModeMaySliceWeightToMatchActivation) {
  // lhs K over tp, weight replicated: slicing the weight is free, reducing a
  // small output is cheaper than gathering lhs.
  absl::StatusOr<Plan> plan = MakePlan(Req("tp=4", "", kM, kDef,
      {"lhs=16x4096@(None,tp)", "rhs=2x4096x512", "group_sizes=2"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before slice rhs 1 tp; after all_reduce_sum out -1 tp");
}

TEST(PlannerTest, DefaultModeKeepsFsdpWeightSplitOnKWhenCheaper) {
  // Rows not over fsdp, small M: slice lhs's K to the weight's fsdp split and
  // reduce the small output instead of gathering the big weight (rule 3).
  const std::vector<std::string> ops = {"lhs=256x4096@(dp,None)", "rhs=8x4096x1024@(None,fsdp,None)",
                                        "group_sizes=16@(dp,)"};
  absl::StatusOr<Plan> plan = MakePlan(Req("dp=2,fsdp=2", "", kM, kDef, ops));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before slice lhs 1 fsdp; after all_reduce_sum out -1 fsdp");
  EXPECT_NE(plan->strategy_note.find("chosen: K split like rhs over fsdp"), std::string::npos)
      << plan->strategy_note;
  plan = MakePlan(Req("dp=2,fsdp=2", "", kM, kTe, ops));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before all_gather rhs 1 fsdp");
}

TEST(PlannerTest, WorkerLayoutFollowsDesignExample) {
  // DESIGN.md: fsdp=2, ep=2, rows over (fsdp, ep), 4 experts split over ep:
  // each worker owns 2 experts; group_sizes has 4 x 2 entries.
  absl::StatusOr<Plan> plan = MakePlan(Req("fsdp=2,ep=2", "", kM, kDef,
      {"lhs=64x32@((fsdp,ep),None)", "rhs=4x32x16@(ep,None,None)", "group_sizes=8@((fsdp,ep),)"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->workers.size(), 4u);
  for (const WorkerPlan& w : plan->workers) {
    const int64_t f = w.coords[0], e = w.coords[1];
    EXPECT_EQ(w.local_group_count, 2);
    EXPECT_EQ(w.group_sizes_begin, (f * 2 + e) * 2);
    EXPECT_EQ(w.group_sizes_end, (f * 2 + e) * 2 + 2);
    EXPECT_EQ(w.first_group, e * 2);
    EXPECT_EQ(w.local_shapes[0], (std::vector<int64_t>{16, 32}));
    EXPECT_EQ(w.local_shapes[1], (std::vector<int64_t>{2, 32, 16}));
  }
  EXPECT_EQ(plan->rule, "m k, g k n, g -> m n");
  EXPECT_EQ(plan->flops_per_worker, 2 * 16 * 32 * 16);
  // fsdp only: group_sizes has 2 x 4 entries; worker 1 reads 4-7.
  plan = MakePlan(Req("fsdp=2", "", kM, kDef,
      {"lhs=64x32@(fsdp,None)", "rhs=4x32x16", "group_sizes=8@(fsdp,)"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->workers[1].group_sizes_begin, 4);
  EXPECT_EQ(plan->workers[1].first_group, 0);
}

TEST(PlannerTest, BiasAddedOnceUnderPartialSums) {
  absl::StatusOr<Plan> plan = MakePlan(Req("dp=2,tp=2", "", kM, kDef,
      {"lhs=64x32@(dp,tp)", "rhs=4x32x16@(None,tp,None)", "group_sizes=8@(dp,)", "bias=4x16"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->rule, "m k, g k n, g, g n -> m n");
  for (const WorkerPlan& w : plan->workers) EXPECT_EQ(w.apply_bias, w.coords[1] == 0);
}

TEST(PlannerTest, TransposedRhs) {
  PlanRequest req = Req("dp=2,tp=2", "", kM, kDef,
      {"lhs=64x32@(dp,None)", "rhs=4x16x32@(None,tp,None)", "group_sizes=8@(dp,)"});
  req.attrs.rhs_transposed = true;
  absl::StatusOr<Plan> plan = MakePlan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(FormatPartitionSpec(plan->out_spec), "(dp, tp)");
  EXPECT_EQ(plan->rule, "m k, g n k, g -> m n");
}

// ---------------------------------------------------------------------------
// FP8 inputs and their scale_inv operands.

PlanRequest Fp8Req(const std::string& mesh, CompatMode compat, ScalingMode mode,
                   const std::vector<std::string>& operands) {
  PlanRequest req = Req(mesh, "", kM, compat, operands);
  req.attrs.scaling_mode = mode;
  for (OperandRequest& op : req.operands) {
    if (op.name == "lhs" || op.name == "rhs") op.dtype = DType::kF8E4M3;
    if (op.name == "lhs_scale_inv" || op.name == "rhs_scale_inv") {
      op.dtype = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
    }
  }
  return req;
}

TEST(PlannerTest, Fp8TensorScalesFollowGroupsAndExperts) {
  absl::StatusOr<Plan> plan = MakePlan(Fp8Req("fsdp=2,ep=2", kTe, ScalingMode::kCurrent,
      {"lhs=64x32@((fsdp,ep),None)", "rhs=4x32x16", "group_sizes=8@((fsdp,ep),)",
       "lhs_scale_inv=8@((fsdp,ep),)", "rhs_scale_inv=4"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before slice rhs 0 ep; before slice rhs_scale_inv 0 ep");
  EXPECT_EQ(ComputeSpec(*plan, "lhs_scale_inv"), "((fsdp, ep),)");
  EXPECT_EQ(plan->out_dtype, DType::kBF16);
}

TEST(PlannerTest, Fp8BlockScalesFollowTheContractingSplit) {
  // MXFP8, row-parallel tp in default mode: scales stay split like K.
  absl::StatusOr<Plan> plan = MakePlan(Fp8Req("dp=2,tp=2", kDef, ScalingMode::kMxfp8,
      {"lhs=64x128@(dp,tp)", "rhs=4x128x16@(None,tp,None)", "group_sizes=8@(dp,)",
       "lhs_scale_inv=64x4@(dp,tp)", "rhs_scale_inv=4x4x16@(None,tp,None)"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "after all_reduce_sum out -1 tp");
  // K = 64: each tp shard would hold one 32-block, fine; K = 32 splits a block.
  plan = MakePlan(Fp8Req("dp=2,tp=2", kDef, ScalingMode::kMxfp8,
      {"lhs=64x32@(dp,tp)", "rhs=4x32x16@(None,tp,None)", "group_sizes=8@(dp,)",
       "lhs_scale_inv=64x1@(dp,None)", "rhs_scale_inv=4x1x16"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "before all_gather lhs 1 tp; before all_gather rhs 1 tp");
}

TEST(PlannerTest, Fp8WithoutScaleOperandsPlansDataOnly) {
  absl::StatusOr<Plan> plan = MakePlan(Fp8Req("dp=2", kDef, ScalingMode::kCurrent,
      {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=8@(dp,)"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->operands.size(), 3u);
}

TEST(PlannerTest, Fp8ScaleOperandsValidated) {
  struct Bad {
    PlanRequest req;
    std::string needle;
  };
  std::vector<Bad> cases = {
      {Fp8Req("dp=2", kDef, ScalingMode::kCurrent,
              {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=8@(dp,)", "rhs_scale_inv=4"}),
       "lhs_scale_inv: FP8 scale operands come in pairs"},
      {Fp8Req("dp=2", kDef, ScalingMode::kCurrent,
              {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=8@(dp,)",
               "lhs_scale_inv=8", "rhs_scale_inv=4"}),
       "lhs_scale_inv dim 0: split over None, must be split like the rows"},
      {Fp8Req("dp=2", kDef, ScalingMode::kMxfp8,
              {"lhs=64x48@(dp,None)", "rhs=4x48x16", "group_sizes=8@(dp,)",
               "lhs_scale_inv=64x1@(dp,None)", "rhs_scale_inv=4x1x16"}),
       "multiple of 32"},
      {Fp8Req("dp=2", kDef, ScalingMode::kMxfp8,
              {"lhs=64x64@(dp,None)", "rhs=4x64x16", "group_sizes=8@(dp,)",
               "lhs_scale_inv=64x2@(dp,None)", "rhs_scale_inv=4x16x2"}),
       "rhs_scale_inv: shape [4x16x2], expected [4x2x16]"},
  };
  PlanRequest not_fp8 = Req("dp=2", "", kM, kDef,
      {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=8@(dp,)", "lhs_scale_inv=8@(dp,)"});
  cases.push_back({not_fp8, "not FP8"});
  for (const Bad& b : cases) {
    absl::StatusOr<Plan> plan = MakePlan(b.req);
    ASSERT_FALSE(plan.ok()) << b.needle;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    EXPECT_NE(plan.status().message().find(b.needle), std::string::npos)
        << "want '" << b.needle << "' in: " << plan.status();
  }
}

// ---------------------------------------------------------------------------
// Grouped quantize.

PlanRequest QReq(const std::string& mesh, CompatMode compat, const std::string& x,
                 const std::string& gs, ScalingMode mode, bool shared, bool colwise = false) {
  PlanRequest req = Req(mesh, "", OpKind::kGroupedQuantize, compat,
                        {"x=" + x, "group_sizes=" + gs});
  req.operands[0].dtype = DType::kBF16;
  req.attrs.scaling_mode = mode;
  req.attrs.shared_scales = shared;
  req.attrs.colwise = colwise;
  return req;
}

TEST(PlannerTest, QuantizeSharedScalesReduceAmaxOverRowAxesButNotEp) {
  absl::StatusOr<Plan> plan = MakePlan(QReq("fsdp=2,ep=2", kTe, "64x32@((fsdp,ep),None)",
                                            "8@((fsdp,ep),)", ScalingMode::kCurrent, true));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Collectives(*plan), "within all_reduce_max amax -1 fsdp");
  ASSERT_GE(plan->outputs.size(), 3u);
  EXPECT_EQ(plan->outputs[0].name, "data");
  EXPECT_EQ(FormatPartitionSpec(plan->outputs[0].spec), "((fsdp, ep), None)");
  EXPECT_EQ(plan->outputs[1].name, "scale_inv");
  EXPECT_EQ(FormatPartitionSpec(plan->outputs[1].spec), "((fsdp, ep),)");
  EXPECT_EQ(plan->outputs[2].name, "amax");
  // Not shared: no collective at all.
  plan = MakePlan(QReq("fsdp=2,ep=2", kTe, "64x32@((fsdp,ep),None)", "8@((fsdp,ep),)",
                       ScalingMode::kCurrent, false));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(Collectives(*plan), "");
}

TEST(PlannerTest, QuantizeColumnsAreGatheredWithWarning) {
  for (CompatMode mode : {kTe, kDef}) {
    absl::StatusOr<Plan> plan = MakePlan(QReq("dp=2,tp=2", mode, "64x32@(dp,tp)", "4@(dp,)",
                                              ScalingMode::kDelayed, false));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(Collectives(*plan), "before all_gather x 1 tp");
    EXPECT_EQ(Warnings(*plan), "x:1:tp");
  }
}

TEST(PlannerTest, QuantizeBlockScalingShapes) {
  // 64 rows over 4 shards = 16 local rows: colwise blocks run from each
  // group's first row, so only the group sizes (checked by the coordinator)
  // decide whether a block straddles shards; the plan is fine.
  absl::StatusOr<Plan> plan = MakePlan(QReq("dp=4", kDef, "64x64@(dp,None)", "4@(dp,)",
                                            ScalingMode::kMxfp8, false, /*colwise=*/true));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->outputs.back().name, "colwise_scale_inv");
  EXPECT_EQ(plan->outputs.back().global_shape, (std::vector<int64_t>{4, 64}));  // a partial block per shard
  // Rowwise only: blocks run along columns; fine.
  plan = MakePlan(QReq("dp=4", kDef, "64x64@(dp,None)", "4@(dp,)", ScalingMode::kMxfp8, false));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->outputs[1].name, "scale_inv");
  EXPECT_EQ(plan->outputs[1].global_shape, (std::vector<int64_t>{64, 2}));
  EXPECT_EQ(plan->outputs[1].dtype, DType::kE8M0);
  plan = MakePlan(QReq("dp=2", kDef, "256x128@(dp,None)", "2@(dp,)", ScalingMode::kBlock, false, true));
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan = MakePlan(QReq("dp=4", kDef, "256x128@(dp,None)", "4@(dp,)", ScalingMode::kBlock, false, true));
  EXPECT_TRUE(plan.ok()) << plan.status();
  plan = MakePlan(QReq("dp=2", kDef, "256x100@(dp,None)", "2@(dp,)", ScalingMode::kBlock, false));
  EXPECT_FALSE(plan.ok());
}

// ---------------------------------------------------------------------------
// Invalid requests: INVALID_ARGUMENT with a reason.

TEST(PlannerTest, InvalidRequestsSayWhy) {
  struct Bad {
    PlanRequest req;
    std::string needle;
  };
  std::vector<Bad> cases = {
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(zz,None)", "rhs=4x32x16", "group_sizes=8@(dp,)"}),
       "unknown mesh axis 'zz'"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(dp,dp)", "rhs=4x32x16", "group_sizes=8@(dp,)"}),
       "used twice"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(dp,None,None)", "rhs=4x32x16", "group_sizes=8@(dp,)"}),
       "rank 2"},
      {Req("dp=2", "", kM, kDef, {"lhs=63x32@(dp,None)", "rhs=4x32x16", "group_sizes=8@(dp,)"}),
       "lhs dim 0: size 63 is not divisible by 2"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=4"}),
       "must split its entries like lhs rows"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(dp,None)", "rhs=4x32x16", "group_sizes=4@(dp,)"}),
       "group_sizes: 4 entries, expected 2 row shard(s) x 4 groups = 8"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32@(dp,None)", "rhs=4x31x16", "group_sizes=8@(dp,)"}),
       "does not match lhs K = 32"},
      {Req("ep=2", "", kM, kDef, {"lhs=64x32@(ep,None)", "rhs=3x32x16", "group_sizes=4@(ep,)"}),
       "3 groups not divisible by 2"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4", "bias=4x15"}),
       "bias: shape"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16"}), "'group_sizes' is required"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4", "zz=4"}),
       "unknown operand 'zz'"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4", "lhs=64x32"}),
       "given twice"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32", "group_sizes=4"}), "rhs: rank 2"},
      {Req("dp=2,tp=2", "", kM, kTe, {"lhs=64x32@(tp,None)", "rhs=4x32x16", "group_sizes=8@(tp,)"}),
       "te mode keeps only dp/fsdp/ep"},
      {Req("dp=2", "", kK, kDef, {"lhs=64x32@(dp,None)", "rhs=64x16", "group_sizes=8@(dp,)"}),
       "both operands' rows split alike"},
      {Req("dp=2", "", kK, kDef, {"lhs=64x32", "rhs=32x16", "group_sizes=4"}), "does not match lhs M"},
      {Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4"}, "(dp,dp)"),
       "used twice"},
      {Req("dp=4", "", kM, kDef, {"lhs=64x32", "rhs=4x32x18", "group_sizes=4"}, "(None,(dp,))"),
       "requested out spec dim 1"},
  };
  PlanRequest dtype_bad = Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4"});
  dtype_bad.operands[2].dtype = DType::kF32;
  cases.push_back({dtype_bad, "group_sizes: dtype f32 not allowed"});
  PlanRequest out_bad = Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4"});
  out_bad.attrs.out_dtype = DType::kF8E4M3;
  cases.push_back({out_bad, "attrs.out_dtype"});
  PlanRequest fp8_mix = Req("dp=2", "", kM, kDef, {"lhs=64x32", "rhs=4x32x16", "group_sizes=4"});
  fp8_mix.operands[0].dtype = DType::kF8E4M3;
  cases.push_back({fp8_mix, "both be FP8"});
  PlanRequest q_fa = QReq("dp=2", kDef, "64x32@(dp,None)", "2@(dp,)", ScalingMode::kCurrent, false);
  q_fa.attrs.flatten_axis = 2;
  cases.push_back({q_fa, "flatten_axis: "});
  PlanRequest q_rows = QReq("dp=2", kDef, "8x64x32@(None,dp,None)", "2", ScalingMode::kCurrent, false);
  q_rows.attrs.flatten_axis = 2;
  cases.push_back({q_rows, "only dim 0 may split the rows"});
  PlanRequest q_shared = QReq("dp=2", kDef, "64x64@(dp,None)", "2@(dp,)", ScalingMode::kMxfp8, true);
  cases.push_back({q_shared, "attrs.shared_scales"});
  for (const Bad& b : cases) {
    absl::StatusOr<Plan> plan = MakePlan(b.req);
    ASSERT_FALSE(plan.ok()) << b.needle;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    EXPECT_NE(plan.status().message().find(b.needle), std::string::npos)
        << "want '" << b.needle << "' in: " << plan.status();
  }
}

TEST(PlannerTest, PlanTextHasTableCollectivesAndWarnings) {
  absl::StatusOr<Plan> plan = MakePlan(Req("dp=2,fsdp=2,ep=2", "", kM, kTe,
      {"lhs=64x32@((dp,fsdp,ep),None)", "rhs=8x32x16@(ep,fsdp,tp)", "group_sizes=16@((dp,fsdp,ep),)"}));
  ASSERT_FALSE(plan.ok());  // tp is not a mesh axis here
  plan = MakePlan(Req("dp=2,fsdp=2,ep=2", "", kM, kTe,
      {"lhs=64x32@((dp,fsdp,ep),None)", "rhs=8x32x16@(ep,fsdp,None)", "group_sizes=32@((dp,fsdp,ep),)"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::string text = FormatPlanText(*plan);
  EXPECT_NE(text.find("operand"), std::string::npos);
  EXPECT_NE(text.find("((dp, fsdp, ep), None)"), std::string::npos);
  EXPECT_NE(text.find("collectives (in order)"), std::string::npos);
  EXPECT_NE(text.find("all_gather"), std::string::npos);
  EXPECT_NE(text.find("warnings:"), std::string::npos);
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm

namespace shardgemm {
namespace planner {
namespace {

TEST(PlannerTest, PartialSumsAreCountedInFp32Bytes) {
  // A BF16 output reduced over tp: its partial sums travel in FP32 (one
  // rounding, at the end), so the all-reduce moves 4 bytes an element.
  absl::StatusOr<Plan> plan = MakePlan(Req("tp=2", "", kM, kDef,
      {"lhs=16x64@(None,tp)", "rhs=2x64x32@(None,tp,None)", "group_sizes=2"}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->collectives.size(), 1u);
  EXPECT_EQ(plan->out_dtype, DType::kBF16);
  // Ring all-reduce of 16x32 FP32 over 2 workers: 2 * (2 - 1) / 2 of the buffer.
  EXPECT_EQ(plan->collectives[0].bytes_per_worker, 16 * 32 * 4);
}

TEST(PlannerTest, FlattenAxisCountsFromTheEndWhenNegative) {
  EXPECT_EQ(*ResolveFlattenAxis(-1, 3), 2);
  EXPECT_EQ(*ResolveFlattenAxis(-2, 3), 1);
  EXPECT_EQ(*ResolveFlattenAxis(1, 3), 1);
  EXPECT_EQ(*ResolveFlattenAxis(2, 3), 2);
  for (int bad : {-3, -4, 0, 3, 7}) {
    absl::StatusOr<int> r = ResolveFlattenAxis(bad, 3);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("flatten_axis"), std::string::npos) << r.status();
  }
  // Through the planner: a rank-3 x flattened at -2 has rows [0, 1).
  PlanRequest req;
  req.mesh = *ParseMesh("dp=2", "");
  req.op = OpKind::kGroupedQuantize;
  req.attrs.flatten_axis = -2;
  req.operands.push_back(*ParseOperand("x", "8x4x16@(dp,None,None)", DType::kBF16));
  req.operands.push_back(*ParseOperand("group_sizes", "4@(dp,)", DType::kI32));
  absl::StatusOr<Plan> plan = MakePlan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->outputs[0].global_shape, std::vector<int64_t>({8, 4, 16}));
  req.attrs.flatten_axis = -5;
  EXPECT_EQ(MakePlan(req).status().code(), absl::StatusCode::kInvalidArgument);
}


// Every field MakePlan reads changes the key: a plan cached under it is the
// request's own.
TEST(PlanRequestKeyTest, EveryFieldChangesTheKey) {
  const PlanRequest base = Req("dp=2,ep=2", "", kM, CompatMode::kDefault,
                               {"lhs=64x32@(dp,None)", "rhs=4x32x16@(ep,None,None)", "group_sizes=4@(dp,)"});
  const std::string key = PlanRequestKey(base);
  EXPECT_EQ(key, PlanRequestKey(base));
  std::vector<std::pair<std::string, std::function<void(PlanRequest&)>>> changes = {
      {"mesh axis size", [](PlanRequest& r) { r.mesh.axes[0].size = 4; }},
      {"mesh axis name", [](PlanRequest& r) { r.mesh.axes[1].name = "ep2"; }},
      {"mesh axes", [](PlanRequest& r) { r.mesh.axes.push_back({"tp", 1}); }},
      {"roles.dp", [](PlanRequest& r) { r.mesh.roles.dp = ""; }},
      {"roles.fsdp", [](PlanRequest& r) { r.mesh.roles.fsdp = "dp"; }},
      {"roles.ep", [](PlanRequest& r) { r.mesh.roles.ep = ""; }},
      {"roles.tp", [](PlanRequest& r) { r.mesh.roles.tp = "ep"; }},
      {"op", [](PlanRequest& r) { r.op = OpKind::kGroupedGemmRaggedK; }},
      {"rhs_transposed", [](PlanRequest& r) { r.attrs.rhs_transposed = true; }},
      {"has_bias", [](PlanRequest& r) { r.attrs.has_bias = true; }},
      {"flatten_axis", [](PlanRequest& r) { r.attrs.flatten_axis = 1; }},
      {"scaling_mode", [](PlanRequest& r) { r.attrs.scaling_mode = ScalingMode::kBlock; }},
      {"shared_scales", [](PlanRequest& r) { r.attrs.shared_scales = true; }},
      {"rowwise", [](PlanRequest& r) { r.attrs.rowwise = false; }},
      {"colwise", [](PlanRequest& r) { r.attrs.colwise = true; }},
      {"out_dtype", [](PlanRequest& r) { r.attrs.out_dtype = DType::kF32; }},
      {"operand name", [](PlanRequest& r) { r.operands[0].name = "x"; }},
      {"operand dtype", [](PlanRequest& r) { r.operands[0].dtype = DType::kF16; }},
      {"operand shape", [](PlanRequest& r) { r.operands[0].shape[0] = 128; }},
      {"operand rank", [](PlanRequest& r) { r.operands[0].shape.push_back(1); }},
      {"operand spec", [](PlanRequest& r) { r.operands[1].spec.dims[0] = {"dp"}; }},
      {"operand spec axes", [](PlanRequest& r) { r.operands[0].spec.dims[0] = {"dp", "ep"}; }},
      {"operands", [](PlanRequest& r) { r.operands.pop_back(); }},
      {"out_spec given", [](PlanRequest& r) { r.out_spec = PartitionSpec(); }},
      {"compat", [](PlanRequest& r) { r.compat = CompatMode::kTe; }},
  };
  std::set<std::string> keys = {key};
  for (auto& [what, change] : changes) {
    PlanRequest r = base;
    change(r);
    EXPECT_NE(PlanRequestKey(r), key) << what;
    keys.insert(PlanRequestKey(r));
  }
  EXPECT_EQ(keys.size(), changes.size() + 1);  // and no two changes collide
  PlanRequest with_out = base, other_out = base;
  with_out.out_spec = *ParsePartitionSpec("(dp, None)");
  other_out.out_spec = *ParsePartitionSpec("((dp, ep), None)");
  EXPECT_NE(PlanRequestKey(with_out), PlanRequestKey(other_out));
  // Axis names that run together differently are different keys.
  PlanRequest a = base, b = base;
  a.operands[0].spec.dims[0] = {"dp", "ep"};
  b.operands[0].spec.dims[0] = {"dpep"};
  EXPECT_NE(PlanRequestKey(a), PlanRequestKey(b));
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm
