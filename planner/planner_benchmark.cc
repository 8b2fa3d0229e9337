// MakePlan throughput. The figure in docs/performance/planner.md comes from
//   bazel --output_base=/tmp/bazel_planner run -c opt //planner:planner_benchmark
#include "benchmark/benchmark.h"
#include "planner/operand_text.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {
namespace {

PlanRequest Request(OpKind op, CompatMode compat) {
  PlanRequest req;
  req.mesh = *ParseMesh("dp=2,fsdp=2,ep=2", "");
  req.op = op;
  req.compat = compat;
  auto add = [&](const char* name, const char* text, DType dtype) {
    req.operands.push_back(*ParseOperand(name, text, dtype));
  };
  if (op == OpKind::kGroupedGemmRaggedM) {
    // The example: rows over (dp, fsdp, ep), experts over ep, FSDP weight.
    add("lhs", "4096x7168@((dp,fsdp,ep),None)", DType::kBF16);
    add("rhs", "8x7168x2048@(ep,fsdp,None)", DType::kBF16);
    add("group_sizes", "32@((dp,fsdp,ep),)", DType::kI32);
  } else if (op == OpKind::kGroupedGemmRaggedK) {
    add("lhs", "4096x7168@((dp,fsdp,ep),None)", DType::kBF16);
    add("rhs", "4096x2048@((dp,fsdp,ep),None)", DType::kBF16);
    add("group_sizes", "32@((dp,fsdp,ep),)", DType::kI32);
    req.out_spec = *ParsePartitionSpec("(ep,fsdp,None)");
  } else {
    add("x", "4096x7168@((dp,fsdp,ep),None)", DType::kBF16);
    add("group_sizes", "32@((dp,fsdp,ep),)", DType::kI32);
    req.attrs.shared_scales = true;
  }
  return req;
}

void BM_MakePlan(benchmark::State& state, OpKind op, CompatMode compat) {
  const PlanRequest req = Request(op, compat);
  for (auto _ : state) {
    absl::StatusOr<Plan> plan = MakePlan(req);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(plan);
  }
  state.SetItemsProcessed(state.iterations());  // items/s = plans/s
}

BENCHMARK_CAPTURE(BM_MakePlan, ragged_m_default, OpKind::kGroupedGemmRaggedM, CompatMode::kDefault);
BENCHMARK_CAPTURE(BM_MakePlan, ragged_m_te, OpKind::kGroupedGemmRaggedM, CompatMode::kTe);
BENCHMARK_CAPTURE(BM_MakePlan, ragged_k_default, OpKind::kGroupedGemmRaggedK, CompatMode::kDefault);
BENCHMARK_CAPTURE(BM_MakePlan, quantize_default, OpKind::kGroupedQuantize, CompatMode::kDefault);

void BM_FormatPlanText(benchmark::State& state) {
  const Plan plan = *MakePlan(Request(OpKind::kGroupedGemmRaggedM, CompatMode::kDefault));
  for (auto _ : state) benchmark::DoNotOptimize(FormatPlanText(plan));
}
BENCHMARK(BM_FormatPlanText);

}  // namespace
}  // namespace planner
}  // namespace shardgemm
