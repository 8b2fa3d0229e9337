#include "worker/fault_injection.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "worker/backend.h"
#include "worker/executor.h"
#include "worker/fake_collectives.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

TEST(ParseFaultPlan, EmptyIsOff) {
  auto plan = ParseFaultPlan("");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->empty());
  EXPECT_EQ(plan->ToString(), "");
}

TEST(ParseFaultPlan, TakesEachKindOnce) {
  auto plan = ParseFaultPlan("nccl:4,kernel_launch:2,illegal_address:7");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_launch, 2);
  EXPECT_EQ(plan->illegal_address, 7);
  EXPECT_EQ(plan->nccl, 4);
  EXPECT_FALSE(plan->empty());
  EXPECT_EQ(plan->ToString(), "kernel_launch:2,illegal_address:7,nccl:4");
  auto again = ParseFaultPlan(plan->ToString());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->ToString(), plan->ToString());
}

TEST(ParseFaultPlan, RefusesBadValuesNamingTheFlagAndTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bogus:1", "'bogus:1': unknown fault 'bogus' (kernel_launch, illegal_address or nccl)"},
      {"nccl", "'nccl': expected KIND:N"},
      {"nccl:0", "'nccl:0': N must be a positive integer"},
      {"nccl:-3", "'nccl:-3': N must be a positive integer"},
      {"nccl:two", "'nccl:two': N must be a positive integer"},
      {"nccl:", "'nccl:': N must be a positive integer"},
      {"nccl:1,", "'': expected KIND:N"},
      {"nccl:1,nccl:2", "'nccl:2': 'nccl' is given twice"},
      {"kernel_launch:3,illegal_address:3", "kernel_launch and illegal_address name the same launch (3)"},
  };
  for (const auto& [spec, want] : cases) {
    auto plan = ParseFaultPlan(spec);
    ASSERT_FALSE(plan.ok()) << spec;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("--fault_injection")) << spec;
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr(want)) << spec;
  }
}

TEST(FaultInjector, CountsLaunchesAndCollectivesFromOne) {
  FaultPlan plan;
  plan.kernel_launch = 2;
  plan.illegal_address = 4;
  plan.nccl = 3;
  FaultInjector faults(plan);
  using F = FaultInjector::LaunchFault;
  const std::vector<F> want = {F::kNone, F::kInvalidConfiguration, F::kNone, F::kIllegalAddress, F::kNone, F::kNone};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(faults.NextKernelLaunch(), want[i]) << "launch " << i + 1;
  const std::vector<bool> nccl = {false, false, true, false, false};
  for (size_t i = 0; i < nccl.size(); ++i) EXPECT_EQ(faults.NextCollective(), nccl[i]) << "collective " << i + 1;
}

TEST(FaultInjector, AnEmptyPlanFaultsNothing) {
  FaultInjector faults{FaultPlan()};
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(faults.NextKernelLaunch(), FaultInjector::LaunchFault::kNone);
    EXPECT_FALSE(faults.NextCollective());
  }
}

MeshPosition Fsdp(int64_t size) {
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {size};
  p.coords = {0};
  return p;
}

// What MakeDeviceNcclFault returns on a GPU, word for word but for the type.
absl::Status FakeNcclRefusal() {
  return absl::InternalError(
      "ncclAllReduce: NCCL invalid argument (run with NCCL_DEBUG=WARN for details) (AllReduce : invalid type 1000)");
}

TEST(WithCollectiveFault, TheNthCollectiveStillRunsThenFailsNamingItsGroup) {
  FaultPlan plan;
  plan.nccl = 2;
  FaultInjector faults(plan);
  auto inner = std::make_unique<MirrorCollectives>(Fsdp(2));
  MirrorCollectives* mirror = inner.get();
  int refusals = 0;
  auto collectives = WithCollectiveFault(std::move(inner), Fsdp(2), &faults, [&] {
    ++refusals;
    return FakeNcclRefusal();
  });
  // Agreements are not counted.
  EXPECT_TRUE(collectives->Agree(absl::OkStatus(), {"fsdp"}).ok());
  HostTensor t = *ZerosTensor(DType::kF32, {2, 2});
  EXPECT_TRUE(collectives->AllReduce(&t, ReduceOp::kSum, {"fsdp"}).ok());
  auto gathered = collectives->AllGather(t, 0, {"fsdp"});
  ASSERT_FALSE(gathered.ok());
  EXPECT_EQ(gathered.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(gathered.status().message()),
              HasSubstr("all_gather over (fsdp), member 0 of 2: ncclAllReduce: NCCL invalid argument"));
  EXPECT_THAT(std::string(gathered.status().message()), HasSubstr("(AllReduce : invalid type 1000)"));
  EXPECT_THAT(std::string(gathered.status().message()), HasSubstr("[--fault_injection nccl:2]"));
  EXPECT_EQ(refusals, 1);
  // The faulted call reached the group (its peers are in it).
  EXPECT_EQ(mirror->calls, std::vector<std::string>({"all_reduce", "all_gather"}));
  EXPECT_TRUE(collectives->ReduceScatter(*ZerosTensor(DType::kF32, {4, 2}), 0, {"fsdp"}).ok());
  EXPECT_EQ(refusals, 1);
}

TEST(WithCollectiveFault, AFaultThatDoesNotFailStillFailsTheCall) {
  FaultPlan plan;
  plan.nccl = 1;
  FaultInjector faults(plan);
  auto collectives = WithCollectiveFault(MakeLocalCollectives(Fsdp(1)), Fsdp(1), &faults,
                                         [] { return absl::OkStatus(); });
  HostTensor t = *ZerosTensor(DType::kF32, {1});
  absl::Status s = collectives->AllReduce(&t, ReduceOp::kSum, {"fsdp"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not fail"));
}

HostTensor F32(std::vector<int64_t> shape, float start) {
  HostTensor t = *ZerosTensor(DType::kF32, shape);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.data<float>()[i] = start + 0.25f * static_cast<float>(i % 7);
  return t;
}

// The CPU backend, whose GroupedGemm fails once, on its `fail_at`th call,
// as the CUDA backend reports a refused launch.
class FailsOnceBackend : public Backend {
 public:
  explicit FailsOnceBackend(int fail_at) : cpu_(MakeCpuBackend(1)), fail_at_(fail_at) {}
  std::string Name() const override { return "cpu"; }
  std::string Device() const override { return "cpu, failing once"; }
  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& gemm) override {
    if (++calls_ == fail_at_) {
      return absl::InternalError(
          "grouped GEMM kernel launch: CUDA error cudaErrorInvalidValue: invalid argument");
    }
    return cpu_->GroupedGemm(gemm);
  }
  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override {
    return cpu_->GroupedQuantize(q);
  }

 private:
  std::unique_ptr<Backend> cpu_;
  int fail_at_;
  int calls_ = 0;
};

class FaultedStepTest : public ::testing::Test {
 protected:
  // A step on the resident weight "w@1" [2, 3, 4], F32 out, `collectives` after.
  v1::Step Step(const HostTensor& lhs, std::vector<v1::CollectivePlan> collectives = {}) {
    v1::Step step;
    step.set_sequence(next_++);
    v1::GemmStep* g = step.mutable_gemm();
    HostTensorToProto(lhs, g->mutable_lhs());
    g->mutable_rhs()->set_dtype(v1::F32);
    for (int64_t d : {2, 3, 4}) g->mutable_rhs()->add_shape(d);
    g->mutable_rhs()->set_resident("w@1");
    g->add_group_sizes(1);
    g->add_group_sizes(3);
    g->set_out_dtype(v1::F32);
    for (auto& c : collectives) *g->add_collectives() = std::move(c);
    return step;
  }

  // The step's output against the CPU backend's for the same operands.
  void ExpectRight(const absl::StatusOr<v1::StepResult>& result, const HostTensor& lhs) {
    ASSERT_TRUE(result.ok()) << result.status();
    auto out = HostTensorFromProto(result->out(), "out");
    ASSERT_TRUE(out.ok()) << out.status();
    LocalGemm g;
    g.lhs = &lhs;
    const HostTensor rhs = F32({2, 3, 4}, -1);
    g.rhs = &rhs;
    g.group_sizes = {1, 3};
    auto want = MakeCpuBackend(1)->GroupedGemm(g);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(out->shape, want->shape);
    EXPECT_EQ(out->bytes, want->bytes);
  }

  ShardStore store_{int64_t{1} << 30};
  uint64_t next_ = 1;
};

TEST_F(FaultedStepTest, ABackendErrorFailsItsStepAndTheNextStepIsRight) {
  FailsOnceBackend backend(/*fail_at=*/2);
  Executor e(&backend, &store_);
  e.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  ASSERT_TRUE(store_.Put("w@1", F32({2, 3, 4}, -1)).ok());
  const int64_t held = store_.used_bytes();
  const HostTensor lhs = F32({4, 3}, 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ExpectRight(e.Execute(Step(lhs), deadline), lhs);
  auto failed = e.Execute(Step(lhs), deadline);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(failed.status().message()),
              HasSubstr("CUDA error cudaErrorInvalidValue: invalid argument"));
  // The failed step's working memory is back, the resident weight is kept,
  // and the next step has its turn.
  EXPECT_EQ(store_.used_bytes(), held);
  EXPECT_TRUE(store_.Get("w@1").ok());
  ExpectRight(e.Execute(Step(lhs), deadline), lhs);
}

TEST_F(FaultedStepTest, AnInjectedNcclFaultOnAMeshOfOneFailsItsStepAndTheNextStepIsRight) {
  // A mesh of one worker (fsdp=1) and a plan that still reduces over fsdp:
  // the all-reduce has no peer to wait for, and the fault still fails it.
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  Executor e(backend.get(), &store_);
  FaultPlan plan;
  plan.nccl = 1;
  FaultInjector faults(plan);
  e.Configure(Fsdp(1), WithCollectiveFault(MakeLocalCollectives(Fsdp(1)), Fsdp(1), &faults, FakeNcclRefusal));
  ASSERT_TRUE(store_.Put("w@1", F32({2, 3, 4}, -1)).ok());
  v1::CollectivePlan reduce;
  reduce.set_phase(v1::PHASE_AFTER);
  reduce.set_kind(v1::COLLECTIVE_ALL_REDUCE_SUM);
  reduce.set_tensor(v1::TENSOR_OUT);
  reduce.add_axes("fsdp");
  const HostTensor lhs = F32({4, 3}, 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto failed = e.Execute(Step(lhs, {reduce}), deadline);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.status().message()),
              HasSubstr("all_reduce over (fsdp), member 0 of 1: ncclAllReduce: NCCL invalid argument"));
  EXPECT_EQ(e.collective_failures(), 1);
  ExpectRight(e.Execute(Step(lhs, {reduce}), deadline), lhs);
  ExpectRight(e.Execute(Step(lhs), deadline), lhs);
}

}  // namespace
}  // namespace shardgemm
