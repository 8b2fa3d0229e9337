#include "worker/executor.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "worker/fake_collectives.h"
#include "worker/fake_staging_memory.h"

namespace shardgemm {
namespace {

HostTensor F32(std::vector<int64_t> shape, float start) {
  HostTensor t = *ZerosTensor(DType::kF32, shape);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.data<float>()[i] = start + 0.25f * static_cast<float>(i % 7);
  return t;
}

// out[rows of g] = lhs[rows of g] @ rhs[g], rhs [G, K, N].
std::vector<float> RaggedM(const HostTensor& lhs, const HostTensor& rhs, const std::vector<int64_t>& sizes) {
  const int64_t m = lhs.shape[0], k = lhs.shape[1], n = rhs.shape[2];
  std::vector<float> out(m * n, 0.f);
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t r = row; r < row + sizes[g]; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < k; ++i) acc += lhs.data<float>()[r * k + i] * rhs.data<float>()[(g * k + i) * n + j];
        out[r * n + j] = static_cast<float>(acc);
      }
    }
    row += sizes[g];
  }
  return out;
}

MeshPosition FsdpOf2() {
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {2};
  p.coords = {0};
  p.rank = 0;
  return p;
}

class ExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = MakeCpuBackend(1); }

  // An executor at `position` whose collectives are a mirror (peers hold the same).
  Executor& Make(const MeshPosition& position, uint64_t next_sequence = 1) {
    executor_ = std::make_unique<Executor>(backend_.get(), &store_);
    auto collectives = std::make_unique<MirrorCollectives>(position);
    mirror_ = collectives.get();
    executor_->Configure(position, std::move(collectives), next_sequence);
    return *executor_;
  }

  v1::Step GemmStep(const HostTensor& lhs, const HostTensor& rhs, const std::vector<int64_t>& sizes) {
    v1::Step step;
    step.set_sequence(next_++);
    v1::GemmStep* g = step.mutable_gemm();
    HostTensorToProto(lhs, g->mutable_lhs());
    HostTensorToProto(rhs, g->mutable_rhs());
    for (int64_t s : sizes) g->add_group_sizes(s);
    g->set_out_dtype(v1::F32);
    g->set_agree(true);
    return step;
  }

  static v1::CollectivePlan Collective(v1::CollectivePhase phase, v1::CollectiveKind kind, v1::TensorRole role,
                                       int dim) {
    v1::CollectivePlan c;
    c.set_phase(phase);
    c.set_kind(kind);
    c.set_tensor(role);
    c.set_dim(dim);
    c.add_axes("fsdp");
    return c;
  }

  std::unique_ptr<Backend> backend_;
  ShardStore store_{int64_t{1} << 30};
  std::unique_ptr<Executor> executor_;
  MirrorCollectives* mirror_ = nullptr;
  uint64_t next_ = 1;
};

TEST_F(ExecutorTest, StepWithoutCollectivesRunsNoAgreement) {
  Executor& e = Make(SingleWorkerPosition());
  const HostTensor lhs = F32({5, 3}, 1), rhs = F32({2, 3, 4}, -1);
  auto result = e.Execute(GemmStep(lhs, rhs, {2, 3}));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->agreements(), 0);
  EXPECT_EQ(mirror_->agreements, 0);
  auto out = HostTensorFromProto(result->out(), "out");
  ASSERT_TRUE(out.ok());
  const std::vector<float> want = RaggedM(lhs, rhs, {2, 3});
  ASSERT_EQ(out->NumElements(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(out->data<float>()[i], want[i]) << i;
}

TEST_F(ExecutorTest, StagedBlocksAreClaimedByTheStepAndAFailedStepDropsThem) {
  StagingArea staging(1 << 20, absl::Seconds(60));
  executor_ = std::make_unique<Executor>(backend_.get(), &store_, &staging);
  executor_->Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  const HostTensor lhs = F32({5, 3}, 1), rhs = F32({2, 3, 4}, -1);
  auto stage = [&](const std::string& ticket, const HostTensor& t) {
    ASSERT_TRUE(staging.Expect(ticket, ExpectedBlock{"", "lhs", t.dtype, t.shape}).ok());
    auto up = staging.BeginStage(ticket, "");
    ASSERT_TRUE(up.ok()) << up.status();
    ASSERT_TRUE((*up)->Append(t.bytes).ok());
    ASSERT_TRUE((*up)->Commit().ok());
  };
  stage("lhs-ticket-0000", lhs);
  v1::Step step = GemmStep(lhs, rhs, {2, 3});
  step.mutable_gemm()->mutable_lhs()->set_staged("lhs-ticket-0000");
  auto result = executor_->Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  auto out = HostTensorFromProto(result->out(), "out");
  ASSERT_TRUE(out.ok());
  const std::vector<float> want = RaggedM(lhs, rhs, {2, 3});
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(out->data<float>()[i], want[i]) << i;
  EXPECT_EQ(staging.held_bytes(), 0);

  // rhs staged, lhs never: the step fails naming lhs, and rhs's block goes with it.
  stage("rhs-ticket-0000", rhs);
  ASSERT_TRUE(staging.Expect("lhs-ticket-0001", ExpectedBlock{"", "lhs", lhs.dtype, lhs.shape}).ok());
  v1::Step missing = GemmStep(lhs, rhs, {2, 3});
  missing.mutable_gemm()->mutable_lhs()->set_staged("lhs-ticket-0001");
  missing.mutable_gemm()->mutable_rhs()->set_staged("rhs-ticket-0000");
  auto failed = executor_->Execute(missing);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(failed.status().message().find("lhs.staged"), absl::string_view::npos) << failed.status();
  EXPECT_EQ(staging.held_bytes(), 0);

  // An output held for a direct fetch: the result carries its header only.
  v1::Step held = GemmStep(lhs, rhs, {2, 3});
  held.mutable_gemm()->mutable_out_staged()->set_ticket("out-ticket-0000");
  auto kept = executor_->Execute(held);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->out().data().empty());
  EXPECT_EQ(staging.held_bytes(), static_cast<int64_t>(want.size() * sizeof(float)));
  auto fetched = staging.BeginFetch("out-ticket-0000", "");
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ((*fetched)->block().bytes, out->bytes);
}

TEST_F(ExecutorTest, WeightGatherCarriesTheStepsAgreement) {
  Executor& e = Make(FsdpOf2());
  const HostTensor lhs = F32({4, 6}, 1), rhs_shard = F32({2, 3, 4}, -1);
  v1::Step step = GemmStep(lhs, rhs_shard, {1, 3});
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_BEFORE, v1::COLLECTIVE_ALL_GATHER, v1::TENSOR_RHS, 1);
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  // Its only collective runs over one group: the status rides along the
  // gather (one round, no separate agreement).
  EXPECT_EQ(result->agreements(), 1);
  EXPECT_EQ(mirror_->agreements, 0);
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_gather"}));
  auto out = HostTensorFromProto(result->out(), "out");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->shape, std::vector<int64_t>({4, 4}));
  // The gathered weight is both peers' copies along K: twice the local K sum.
  const HostTensor lhs_k = F32({4, 6}, 1);
  HostTensor rhs_full = *ZerosTensor(DType::kF32, {2, 6, 4});
  for (int64_t g = 0; g < 2; ++g) {
    for (int64_t k = 0; k < 6; ++k) {
      for (int64_t n = 0; n < 4; ++n) {
        rhs_full.data<float>()[(g * 6 + k) * 4 + n] = rhs_shard.data<float>()[(g * 3 + k % 3) * 4 + n];
      }
    }
  }
  const std::vector<float> want = RaggedM(lhs_k, rhs_full, {1, 3});
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(out->data<float>()[i], want[i]) << i;
}

TEST_F(ExecutorTest, RowParallelStepAgreesOnceAfterItsGemm) {
  Executor& e = Make(FsdpOf2());
  const HostTensor lhs = F32({4, 3}, 1), rhs = F32({2, 3, 5}, 2);
  v1::Step step = GemmStep(lhs, rhs, {2, 2});
  step.mutable_gemm()->set_out_dtype(v1::BF16);
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_AFTER, v1::COLLECTIVE_ALL_REDUCE_SUM, v1::TENSOR_OUT, -1);
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->agreements(), 1);
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_reduce"}));
  // Partial sums were reduced in FP32 (the mirror sums F32 only), then rounded once.
  auto out = HostTensorFromProto(result->out(), "out");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->dtype, DType::kBF16);
  auto f32 = ConvertFloatTensor(*out, DType::kF32);
  ASSERT_TRUE(f32.ok());
  const std::vector<float> want = RaggedM(lhs, rhs, {2, 2});
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(f32->data<float>()[i], 2 * want[i], 2 * std::abs(want[i]) / 128) << i;
}

TEST_F(ExecutorTest, WorkerThatFailsLocallyStillMeetsTheAgreement) {
  Executor& e = Make(FsdpOf2());
  v1::Step step = GemmStep(F32({4, 3}, 1), F32({2, 3, 5}, 2), {2, 2});
  step.mutable_gemm()->mutable_lhs()->set_resident("missing@1");
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_AFTER, v1::COLLECTIVE_ALL_REDUCE_SUM, v1::TENSOR_OUT, -1);
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound) << result.status();
  // Its peers run their GEMM and then the all-reduce that carries the
  // step's agreement: this worker joins it once, with its failure.
  EXPECT_EQ(mirror_->agreements, 0);
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_reduce"}));
  // The turn passed on: the next step runs.
  auto next = e.Execute(GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2}));
  EXPECT_TRUE(next.ok()) << next.status();
}

TEST_F(ExecutorTest, ShapeMismatchFailsBeforeAnyCollective) {
  Executor& e = Make(FsdpOf2());
  // K of lhs (6) is fine after the gather, but the gathered rhs has 3 groups
  // for 2 group sizes: the step alone says so, so every worker refuses it
  // alike before any communicates.
  v1::Step step = GemmStep(F32({4, 6}, 1), F32({3, 3, 4}, 1), {2, 2});
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_BEFORE, v1::COLLECTIVE_ALL_GATHER, v1::TENSOR_RHS, 1);
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_EQ(mirror_->agreements, 0);
  EXPECT_TRUE(mirror_->calls.empty());
}

TEST_F(ExecutorTest, CollectivesOverTwoGroupsAgreeOnceOverTheMesh) {
  MeshPosition p;
  p.axis_names = {"fsdp", "tp"};
  p.axis_sizes = {2, 2};
  p.coords = {0, 0};
  Executor& e = Make(p);
  v1::Step step = GemmStep(F32({4, 6}, 1), F32({2, 3, 4}, -1), {1, 3});
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_BEFORE, v1::COLLECTIVE_ALL_GATHER, v1::TENSOR_RHS, 1);
  v1::CollectivePlan reduce = Collective(v1::PHASE_AFTER, v1::COLLECTIVE_ALL_REDUCE_SUM, v1::TENSOR_OUT, -1);
  reduce.set_axes(0, "tp");
  *step.mutable_gemm()->add_collectives() = reduce;
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->agreements(), 1);
  EXPECT_EQ(mirror_->agreements, 1);
  EXPECT_EQ(mirror_->agreement_axes, std::vector<std::string>({"fsdp", "tp"}));
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_gather", "all_reduce"}));
}

TEST_F(ExecutorTest, InputThatDiffersFromTheStepsDeclarationIsRefused) {
  Executor& e = Make(SingleWorkerPosition());
  ASSERT_TRUE(store_.Put("w@1", F32({2, 3, 5}, 1)).ok());
  v1::Step step = GemmStep(F32({4, 3}, 1), F32({2, 3, 4}, 2), {2, 2});
  step.mutable_gemm()->mutable_rhs()->set_resident("w@1");  // declared [2,3,4], held [2,3,5]
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("declares"), std::string::npos) << result.status();
}

TEST_F(ExecutorTest, CollectiveOnATensorTheStepLacksIsInvalid) {
  Executor& e = Make(FsdpOf2());
  v1::Step step = GemmStep(F32({4, 3}, 1), F32({2, 3, 5}, 2), {2, 2});
  *step.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_BEFORE, v1::COLLECTIVE_ALL_GATHER, v1::TENSOR_AMAX, 0);
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("tensor_amax"), std::string::npos) << result.status();
  EXPECT_TRUE(mirror_->calls.empty());
}

TEST_F(ExecutorTest, ReleasedShardsLeaveWhenTheStepsTurnComes) {
  Executor& e = Make(SingleWorkerPosition());
  ASSERT_TRUE(store_.Put("old@1", F32({2, 3}, 1)).ok());
  v1::Step step = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  step.add_release_shards("old@1");
  step.add_release_shards("never-here@2");  // e.g. a put that failed on this worker
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(store_.Get("old@1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.used_bytes(), 0);
}

TEST_F(ExecutorTest, StepsTheCoordinatorGaveUpOnAreNotWaitedFor) {
  Executor& e = Make(SingleWorkerPosition());
  // Steps 1 and 2 never arrive (their calls were cancelled): step 3 says so.
  v1::Step third = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  third.set_sequence(3);
  third.set_oldest_live_sequence(3);
  auto result = e.Execute(third, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(result.ok()) << result.status();
  // Step 5 waits for step 4, which never comes and is still live: it gives
  // up at its deadline instead of waiting forever.
  v1::Step fifth = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  fifth.set_sequence(5);
  fifth.set_oldest_live_sequence(4);
  const absl::Time start = absl::Now();
  auto late = e.Execute(fifth, start + absl::Milliseconds(200));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Step 6, numbered after the coordinator gave up on 4 and 5, runs.
  v1::Step sixth = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  sixth.set_sequence(6);
  sixth.set_oldest_live_sequence(6);
  EXPECT_TRUE(e.Execute(sixth, absl::Now() + absl::Seconds(10)).ok());
  // Step 4 arriving now is stale: retryable, and nothing runs it.
  v1::Step fourth = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  fourth.set_sequence(4);
  EXPECT_EQ(e.Execute(fourth).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ExecutorTest, AWaitingStepPassedOverByALaterOneIsStale) {
  Executor& e = Make(SingleWorkerPosition());
  v1::Step second = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  second.set_sequence(2);
  second.set_oldest_live_sequence(1);  // step 1 was live when step 2 was numbered
  absl::StatusOr<v1::StepResult> waited = absl::UnknownError("not run");
  std::thread waiting([&] { waited = e.Execute(second, absl::Now() + absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(50));
  // Then the coordinator gave up on 1 and 2; step 3 says so and runs.
  v1::Step third = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  third.set_sequence(3);
  third.set_oldest_live_sequence(3);
  EXPECT_TRUE(e.Execute(third, absl::Now() + absl::Seconds(10)).ok());
  waiting.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();
}

// The worker's shutdown closes the executor: a step waiting for its turn
// (here with no deadline at all) ends at once, and so does a later one.
TEST_F(ExecutorTest, AStepWaitingForItsTurnEndsWhenTheExecutorCloses) {
  Executor& e = Make(SingleWorkerPosition());
  v1::Step second = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  second.set_sequence(2);
  absl::StatusOr<v1::StepResult> waited = absl::UnknownError("not run");
  absl::Notification done;
  std::thread waiting([&] {
    waited = e.Execute(second, absl::InfiniteFuture());
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(done.HasBeenNotified()) << "step 2 waits for step 1";
  e.Close();
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5))) << "the waiting step did not end";
  waiting.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();
  v1::Step first = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  first.set_sequence(1);
  EXPECT_EQ(e.Execute(first, absl::Now() + absl::Seconds(5)).status().code(), absl::StatusCode::kUnavailable);
}

// A worker that registers again with a new coordinator session while a step
// of the old one waits for its turn: the step ends then, not at its
// deadline, even when the new session starts the order where it was.
TEST_F(ExecutorTest, AStepWaitingForItsTurnEndsWhenTheWorkerRegistersAgain) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  executor_->Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()), 1, "session-a");
  v1::Step second = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  second.set_sequence(2);
  second.set_session("session-a");
  absl::StatusOr<v1::StepResult> waited = absl::UnknownError("not run");
  absl::Notification done;
  std::thread waiting([&] {
    waited = executor_->Execute(second, absl::Now() + absl::Seconds(8));
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(50));
  executor_->Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()), 1, "session-b");
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(2))) << "the old session's step waited on";
  waiting.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kFailedPrecondition) << waited.status();
}

TEST_F(ExecutorTest, ExecuteIfItsTurnRunsOnlyAStepThatNeedNotWait) {
  Executor& e = Make(SingleWorkerPosition());
  // Step 2 before step 1: not run, and left as it came for a thread that may wait.
  v1::Step second = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  second.set_sequence(2);
  const std::string before = second.SerializeAsString();
  EXPECT_FALSE(e.ExecuteIfItsTurn(second, absl::Now() + absl::Seconds(10)).has_value());
  EXPECT_EQ(second.SerializeAsString(), before);
  // Step 1 is in turn: it runs at once, and then step 2 does.
  v1::Step first = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  first.set_sequence(1);
  auto ran = e.ExecuteIfItsTurn(first, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(ran.has_value());
  EXPECT_TRUE(ran->ok()) << ran->status();
  ran = e.ExecuteIfItsTurn(second, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(ran.has_value());
  EXPECT_TRUE(ran->ok()) << ran->status();
  // A step it refuses outright (stale) is answered with its error, not passed on.
  v1::Step stale = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  stale.set_sequence(1);
  ran = e.ExecuteIfItsTurn(stale, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(ran.has_value());
  EXPECT_EQ(ran->status().code(), absl::StatusCode::kUnavailable) << ran->status();
}

TEST_F(ExecutorTest, ExecuteIfItsTurnLeavesAStepForAWorkerNotYetJoined) {
  // A worker the coordinator registered builds its collectives before it is
  // configured: a step then waits (Execute), so ExecuteIfItsTurn leaves it.
  Executor unconfigured(backend_.get(), &store_);
  v1::Step step = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  step.set_sequence(1);
  EXPECT_FALSE(unconfigured.ExecuteIfItsTurn(step, absl::Now() + absl::Seconds(10)).has_value());
  EXPECT_TRUE(step.gemm().has_lhs());
}

TEST_F(ExecutorTest, StepNumberedBeforeTheWorkerJoinedIsRetryable) {
  // A worker that (re)joined at step 7 is sent step 5 of a request that
  // started without it: the server's business, not the client's.
  Executor& e = Make(SingleWorkerPosition(), /*next_sequence=*/7);
  v1::Step step = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  step.set_sequence(5);
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  EXPECT_NE(result.status().message().find("retry"), std::string::npos) << result.status();
}

// A worker the coordinator registered answers its calls once it has
// configured itself (it builds its collectives after registering), within
// the call's deadline, rather than refusing the session at once.
TEST_F(ExecutorTest, ASessionCheckWaitsForTheWorkerToJoinWithinItsDeadline) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  EXPECT_FALSE(executor_->IsSession("session-a", absl::Now() + absl::Milliseconds(50))) << "not joined: no session";
  std::thread join([this] {
    absl::SleepFor(absl::Milliseconds(100));
    executor_->Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()), 1, "session-a");
  });
  const bool joined = executor_->IsSession("session-a", absl::Now() + absl::Seconds(10));
  join.join();
  EXPECT_TRUE(joined);
  EXPECT_FALSE(executor_->IsSession("session-old", absl::Now() + absl::Seconds(10)));
}

TEST_F(ExecutorTest, StepsOfAnotherSessionAreRefusedAndRunNothing) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  executor_->Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()), 1, "session-a");
  v1::Step replayed = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  replayed.set_sequence(1);
  replayed.set_session("session-old");
  EXPECT_EQ(executor_->Execute(replayed).status().code(), absl::StatusCode::kFailedPrecondition);
  // The refused step took no turn: this session's step 1 runs.
  v1::Step own = replayed;
  own.set_session("session-a");
  EXPECT_TRUE(executor_->Execute(own, absl::Now() + absl::Seconds(10)).ok());
  // Replayed and duplicated: behind the worker's place in the order.
  EXPECT_EQ(executor_->Execute(own).status().code(), absl::StatusCode::kUnavailable);
}

// A step its coordinator gave up on before it started fails CANCELLED in
// its turn without running its GEMM; with collectives it still meets its
// peers at the step's agreement (with its failure), so they fail too
// instead of waiting in a collective. A cancel of another session's steps,
// or of a step already run, changes nothing.
TEST_F(ExecutorTest, ACancelledStepFailsInItsTurnAndMeetsItsPeersWithTheFailure) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  auto collectives = std::make_unique<MirrorCollectives>(FsdpOf2());
  mirror_ = collectives.get();
  executor_->Configure(FsdpOf2(), std::move(collectives), 1, "session-a");
  v1::Step first = GemmStep(F32({4, 3}, 1), F32({2, 3, 5}, 2), {2, 2});
  first.set_session("session-a");
  *first.mutable_gemm()->add_collectives() =
      Collective(v1::PHASE_AFTER, v1::COLLECTIVE_ALL_REDUCE_SUM, v1::TENSOR_OUT, -1);
  v1::Step second = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  second.set_session("session-a");
  EXPECT_EQ(executor_->Cancel("session-b", {first.sequence()}).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(executor_->Cancel("session-a", {first.sequence()}).ok());
  auto cancelled = executor_->Execute(first);
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled) << cancelled.status();
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_reduce"})) << "the agreement, with its failure";
  // The turn passed on; a cancel for a step already run is ignored.
  ASSERT_TRUE(executor_->Cancel("session-a", {first.sequence()}).ok());
  auto next = executor_->Execute(second);
  EXPECT_TRUE(next.ok()) << next.status();
}

// Mirror collectives whose all-gathers in a step of `blocking_epoch` wait
// (at most 10 s, then UNAVAILABLE) until that epoch is revoked, as a real
// one waits for a peer that never comes; they record every Revoke.
class RevocableCollectives : public MirrorCollectives {
 public:
  RevocableCollectives(MeshPosition position, uint64_t blocking_epoch)
      : MirrorCollectives(std::move(position)), blocking_epoch_(blocking_epoch) {}
  void BeginStep(uint64_t sequence, uint64_t epoch) override {
    absl::MutexLock lock(&mu_);
    step_epoch_ = epoch;
  }
  void Revoke(uint64_t epoch, const std::string& why) override {
    absl::MutexLock lock(&mu_);
    revokes_.push_back({epoch, why});
    newest_ = std::max(newest_, epoch);
  }
  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override {
    {
      absl::MutexLock lock(&mu_);
      ++gathers_;
      auto revoked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return step_epoch_ < newest_; };
      if (step_epoch_ == blocking_epoch_ &&
          !mu_.AwaitWithTimeout(absl::Condition(&revoked), absl::Seconds(10))) {
        return absl::UnavailableError("the peer never came");
      }
      if (revoked()) return RevokedStatus(step_epoch_, newest_, "");
    }
    return MirrorCollectives::AllGather(local, dim, axes);
  }
  bool AwaitGathers(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gathers_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
  }
  std::vector<std::pair<uint64_t, std::string>> revokes() {
    absl::MutexLock lock(&mu_);
    return revokes_;
  }

 private:
  const uint64_t blocking_epoch_;
  absl::Mutex mu_;
  uint64_t step_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t newest_ ABSL_GUARDED_BY(mu_) = 0;
  int gathers_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<uint64_t, std::string>> revokes_ ABSL_GUARDED_BY(mu_);
};

// A step of a newer epoch arriving revokes the older epochs at once, before
// it waits for its turn: the step blocked in an older epoch's collective
// ends now (ABORTED) instead of at its timeout, and the newer one runs.
TEST_F(ExecutorTest, AStepOfANewerEpochEndsTheOlderStepBlockedInACollective) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  auto collectives = std::make_unique<RevocableCollectives>(FsdpOf2(), /*blocking_epoch=*/1);
  RevocableCollectives* fake = collectives.get();
  executor_->Configure(FsdpOf2(), std::move(collectives), 1, "session-a");
  auto gathered = [&](uint64_t epoch) {
    v1::Step step = GemmStep(F32({4, 6}, 1), F32({2, 3, 4}, -1), {1, 3});
    step.set_session("session-a");
    step.set_epoch(epoch);
    *step.mutable_gemm()->add_collectives() =
        Collective(v1::PHASE_BEFORE, v1::COLLECTIVE_ALL_GATHER, v1::TENSOR_RHS, 1);
    return step;
  };
  const v1::Step old_step = gathered(1), new_step = gathered(2);
  absl::StatusOr<v1::StepResult> old_result = absl::UnknownError("not run");
  absl::Duration old_took;
  std::thread running([&] {
    const absl::Time start = absl::Now();
    old_result = executor_->Execute(old_step, absl::Now() + absl::Seconds(30));
    old_took = absl::Now() - start;
  });
  ASSERT_TRUE(fake->AwaitGathers(1, absl::Seconds(5)));
  auto new_result = executor_->Execute(new_step, absl::Now() + absl::Seconds(30));
  running.join();
  EXPECT_EQ(old_result.status().code(), absl::StatusCode::kAborted) << old_result.status();
  EXPECT_LT(old_took, absl::Seconds(5)) << "ended by the newer step, not at a timeout";
  EXPECT_TRUE(new_result.ok()) << new_result.status();
  const auto revokes = fake->revokes();
  EXPECT_TRUE(std::any_of(revokes.begin(), revokes.end(), [](const auto& r) { return r.first == 2; }));
}

// The coordinator's AdvanceEpoch reaches the collectives with its reason;
// another session's, or a step of another session however new its epoch,
// revokes nothing.
TEST_F(ExecutorTest, AdvanceEpochRevokesWithItsReasonOnlyForThisSession) {
  executor_ = std::make_unique<Executor>(backend_.get(), &store_);
  auto collectives = std::make_unique<RevocableCollectives>(FsdpOf2(), /*blocking_epoch=*/0);
  RevocableCollectives* fake = collectives.get();
  executor_->Configure(FsdpOf2(), std::move(collectives), 1, "session-a");
  v1::AdvanceEpochRequest advance;
  advance.set_session("session-b");
  advance.set_epoch(7);
  advance.set_reason(v1::EPOCH_RANK_DOWN);
  advance.set_rank(1);
  EXPECT_EQ(executor_->AdvanceEpoch(advance).code(), absl::StatusCode::kFailedPrecondition);
  v1::Step foreign = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  foreign.set_session("session-old");
  foreign.set_epoch(1000);
  EXPECT_EQ(executor_->Execute(foreign).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fake->revokes().empty());
  advance.set_session("session-a");
  ASSERT_TRUE(executor_->AdvanceEpoch(advance).ok());
  const auto revokes = fake->revokes();
  ASSERT_EQ(revokes.size(), 1u);
  EXPECT_EQ(revokes[0].first, 7u);
  EXPECT_EQ(revokes[0].second, "worker rank 1 is down");
}

TEST_F(ExecutorTest, AStepFarAheadOfTheOrderIsRefusedAtOnce) {
  Executor& e = Make(SingleWorkerPosition());
  v1::Step ahead = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  ahead.set_sequence(1 + Executor::kSequenceWindow + 1);
  const absl::Time start = absl::Now();
  EXPECT_EQ(e.Execute(ahead, absl::Now() + absl::Seconds(30)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "refused without waiting for its turn";
  v1::Step first = GemmStep(F32({2, 3}, 1), F32({1, 3, 2}, 1), {2});
  first.set_sequence(1);
  EXPECT_TRUE(e.Execute(first, absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(ExecutorTest, SharedScalesQuantizeAgreesOnce) {
  Executor& e = Make(FsdpOf2());
  v1::Step step;
  step.set_sequence(1);
  v1::QuantizeStep* q = step.mutable_quantize();
  HostTensorToProto(F32({8, 16}, -1), q->mutable_x());
  for (int64_t s : {3, 5}) q->add_group_sizes(s);
  q->set_out_dtype(v1::F8E4M3);
  q->set_scaling(v1::CURRENT);
  q->set_rowwise(true);
  q->set_flatten_axis(1);
  q->set_agree(true);
  *q->add_collectives() = Collective(v1::PHASE_WITHIN, v1::COLLECTIVE_ALL_REDUCE_MAX, v1::TENSOR_AMAX, -1);
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  // Its one collective carries the agreement: no separate round.
  EXPECT_EQ(result->agreements(), 1);
  EXPECT_EQ(mirror_->agreements, 0);
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_reduce"}));
  std::vector<v1::TensorRole> roles;
  for (const auto& o : result->outputs()) roles.push_back(o.role());
  EXPECT_EQ(roles, std::vector<v1::TensorRole>({v1::TENSOR_ROWWISE_DATA, v1::TENSOR_SCALE_INV, v1::TENSOR_AMAX}));
}

TEST_F(ExecutorTest, QuantizeWorkerWhoseInputIsMissingJoinsTheAmaxReduction) {
  Executor& e = Make(FsdpOf2());
  v1::Step step;
  step.set_sequence(1);
  v1::QuantizeStep* q = step.mutable_quantize();
  q->mutable_x()->set_dtype(v1::F32);
  q->mutable_x()->add_shape(8);
  q->mutable_x()->add_shape(16);
  q->mutable_x()->set_resident("missing@4");
  for (int64_t s : {3, 5}) q->add_group_sizes(s);
  q->set_out_dtype(v1::F8E4M3);
  q->set_scaling(v1::CURRENT);
  q->set_rowwise(true);
  q->set_flatten_axis(1);
  q->set_agree(true);
  *q->add_collectives() = Collective(v1::PHASE_WITHIN, v1::COLLECTIVE_ALL_REDUCE_MAX, v1::TENSOR_AMAX, -1);
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound) << result.status();
  EXPECT_EQ(mirror_->calls, std::vector<std::string>({"all_reduce"}));
  EXPECT_EQ(mirror_->agreements, 0);
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

// A device backend whose device memory is host memory and whose CUDA IPC
// regions are buffers of the test's (named by their handle's bytes): the
// executor's device paths (operands read in place, the output written into
// client memory) run without a GPU. Its GEMM (BF16, ragged M) reads the
// operands and writes the output through the pointers it is given, element
// by element, as a device kernel does.
class HostDeviceBackend : public Backend {
 public:
  class Buffer : public DeviceBuffer {
   public:
    Buffer(char* data, int64_t bytes) : data_(data), bytes_(bytes) {}
    explicit Buffer(int64_t bytes) : owned_(static_cast<size_t>(bytes)), data_(owned_.data()), bytes_(bytes) {}
    void* data() const override { return data_; }
    int64_t bytes() const override { return bytes_; }

   private:
    std::vector<char> owned_;
    char* data_;
    int64_t bytes_;
  };

  std::map<std::string, std::vector<char>*> regions;
  absl::Status refuse_open = absl::OkStatus();  // set: a CUDA region does not open
  bool gathers = false;                         // CanGatherOnDevice

  std::string Name() const override { return "host-device"; }
  std::string Device() const override { return "host memory as a device"; }
  bool KeepsOutputsOnDevice() const override { return true; }
  bool CanGatherOnDevice() const override { return gathers; }
  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm&) override {
    return absl::UnimplementedError("host-device: GroupedGemmToShard only");
  }
  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize&) override {
    return absl::UnimplementedError("host-device: no quantize");
  }

  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> BlockToDevice(const ClientMemory& memory,
                                                                  const platform::TensorBlock& block,
                                                                  absl::string_view field) override {
    if (!refuse_open.ok()) return refuse_open;
    auto it = regions.find(memory.cuda_ipc_handle);
    if (it == regions.end()) return absl::NotFoundError(absl::StrCat(field, ": no such test region"));
    if (auto s = platform::CheckTensorBlock(block, it->second->size(), field); !s.ok()) return s;
    auto pieces = platform::BlockPieces(block);
    int64_t bytes = block.element_bytes;
    for (int64_t d : block.block_shape) bytes *= d;
    if (platform::BlockIsContiguous(block) && !pieces.empty()) {
      return std::shared_ptr<const DeviceBuffer>(
          std::make_shared<Buffer>(it->second->data() + pieces[0].region_offset, bytes));
    }
    auto copy = std::make_shared<Buffer>(bytes);
    Copy(pieces, it->second->data(), static_cast<char*>(copy->data()), false);
    return std::shared_ptr<const DeviceBuffer>(copy);
  }
  absl::Status BlockFromDevice(const DeviceBuffer& source, const ClientMemory& memory,
                               const platform::TensorBlock& block, absl::string_view field) override {
    auto it = regions.find(memory.cuda_ipc_handle);
    if (it == regions.end()) return absl::NotFoundError(absl::StrCat(field, ": no such test region"));
    if (auto s = platform::CheckTensorBlock(block, it->second->size(), field); !s.ok()) return s;
    Copy(platform::BlockPieces(block), it->second->data(), static_cast<char*>(source.data()), true);
    return absl::OkStatus();
  }

  absl::StatusOr<Shard> GroupedGemmToShard(const LocalGemm& g) override {
    if (g.rhs_gather.enabled && g.rhs_gather.agree) {
      if (auto s = g.rhs_gather.collectives->Agree(absl::OkStatus(), g.rhs_gather.agree_axes); !s.ok()) return s;
    }
    ++gemms;
    device_operands += (g.lhs_device != nullptr) + (g.rhs_device != nullptr);
    const int64_t m = g.lhs->shape[0], k = g.lhs->shape[1], n = g.rhs->shape[2];
    const auto* lhs = reinterpret_cast<const uint16_t*>(g.lhs_device ? g.lhs_device->data() : g.lhs->bytes.data());
    const auto* rhs = reinterpret_cast<const uint16_t*>(g.rhs_device ? g.rhs_device->data() : g.rhs->bytes.data());
    std::shared_ptr<const DeviceBuffer> out = g.out_device;
    if (out == nullptr) out = std::make_shared<Buffer>(m * n * 2);
    auto* o = static_cast<uint16_t*>(out->data());
    int64_t row = 0;
    for (size_t group = 0; group < g.group_sizes.size(); ++group) {
      for (int64_t r = row; r < row + g.group_sizes[group]; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          float acc = 0;
          for (int64_t i = 0; i < k; ++i) acc += Float(lhs[r * k + i]) * Float(rhs[(group * k + i) * n + j]);
          o[r * n + j] = Bf16(acc);
        }
      }
      row += g.group_sizes[group];
    }
    Shard shard;
    shard.dtype = g.out_dtype;
    shard.shape = {m, n};
    shard.device = std::move(out);
    return shard;
  }

  static float Float(uint16_t b) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static uint16_t Bf16(float f) {  // the tests' values are exact in BF16
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
  }

  absl::Status CopyToHost(const Shard& shard, char* dst) override {
    if (shard.device == nullptr) return Backend::CopyToHost(shard, dst);
    ++copies_to_host;
    std::memcpy(dst, shard.device->data(), static_cast<size_t>(shard.NumBytes()));
    return absl::OkStatus();
  }

  int gemms = 0;
  int device_operands = 0;  // lhs and rhs the GEMMs read from device memory
  int copies_to_host = 0;

 private:
  static void Copy(const std::vector<platform::BlockPiece>& pieces, char* region, char* local, bool into_region) {
    for (const auto& p : pieces) {
      for (uint64_t r = 0; r < p.rows; ++r) {
        char* at = region + p.region_offset + r * p.region_pitch;
        char* packed = local + p.block_offset + r * p.row_bytes;
        std::memcpy(into_region ? at : packed, into_region ? packed : at, p.row_bytes);
      }
    }
  }
};

class DeviceMirrorCollectives : public MirrorCollectives {
 public:
  using MirrorCollectives::MirrorCollectives;
  bool SupportsDeviceAllGather() const override { return true; }
};

v1::LocalTensor CudaRegionTensor(const std::string& handle, uint64_t offset, std::vector<int64_t> shape,
                                 uint64_t region_bytes) {
  v1::LocalTensor t;
  t.set_dtype(v1::BF16);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  v1::SharedMemoryBlock* b = t.mutable_shared_memory();
  b->mutable_cuda()->set_ipc_handle(handle);
  b->set_offset(offset);
  b->mutable_global_shape()->Assign(shape.begin(), shape.end());
  for (size_t d = 0; d < shape.size(); ++d) b->add_block_offsets(0);
  b->set_region_bytes(region_bytes);
  return t;
}

HostTensor Bf16Tensor(std::vector<int64_t> shape, const std::vector<float>& values) {
  HostTensor t = *ZerosTensor(DType::kBF16, shape);
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    reinterpret_cast<uint16_t*>(t.bytes.data())[i] = HostDeviceBackend::Bf16(values[i % values.size()]);
  }
  return t;
}

// out= the very bytes of lhs in one CUDA region (an in-place call, N == K):
// the GEMM must not write the output over the operand it still reads.
TEST(ExecutorClientMemoryTest, AnOutputOverAnOperandInACudaRegionIsRightAsWithACopy) {
  HostDeviceBackend backend;
  ShardStore store(int64_t{1} << 30);
  Executor e(&backend, &store);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  const std::string handle(64, 'h');
  const HostTensor lhs = Bf16Tensor({4, 4}, {1, 2, -1, 3, 2, 1}), rhs = Bf16Tensor({1, 4, 4}, {1, 0, 2, -1, 1});
  std::vector<char> region(lhs.bytes.begin(), lhs.bytes.end());
  backend.regions[handle] = &region;
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  *g->mutable_lhs() = CudaRegionTensor(handle, 0, {4, 4}, region.size());
  HostTensorToProto(rhs, g->mutable_rhs());
  g->add_group_sizes(4);
  g->set_out_dtype(v1::BF16);
  *g->mutable_out_shared_memory() = CudaRegionTensor(handle, 0, {4, 4}, region.size()).shared_memory();
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(backend.gemms, 1);
  const auto* got = reinterpret_cast<const uint16_t*>(region.data());
  const auto* l = reinterpret_cast<const uint16_t*>(lhs.bytes.data());
  const auto* w = reinterpret_cast<const uint16_t*>(rhs.bytes.data());
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 4; ++j) {
      float want = 0;
      for (int i = 0; i < 4; ++i) want += HostDeviceBackend::Float(l[r * 4 + i]) * HostDeviceBackend::Float(w[i * 4 + j]);
      EXPECT_EQ(HostDeviceBackend::Float(got[r * 4 + j]), want) << r << "," << j;
    }
  }
}

// A contiguous output block elsewhere in the region is still the GEMM's output itself.
TEST(ExecutorClientMemoryTest, AContiguousOutputBlockOfACudaRegionIsWrittenInPlace) {
  HostDeviceBackend backend;
  ShardStore store(int64_t{1} << 30);
  Executor e(&backend, &store);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  const std::string handle(64, 'i');
  const HostTensor lhs = Bf16Tensor({2, 4}, {1, 2, -1, 3}), rhs = Bf16Tensor({1, 4, 3}, {1, 0, 2});
  std::vector<char> region(64, 0);
  std::memcpy(region.data(), lhs.bytes.data(), lhs.bytes.size());
  backend.regions[handle] = &region;
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  *g->mutable_lhs() = CudaRegionTensor(handle, 0, {2, 4}, region.size());
  HostTensorToProto(rhs, g->mutable_rhs());
  g->add_group_sizes(2);
  g->set_out_dtype(v1::BF16);
  *g->mutable_out_shared_memory() = CudaRegionTensor(handle, 32, {2, 3}, region.size()).shared_memory();
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  const auto* got = reinterpret_cast<const uint16_t*>(region.data() + 32);
  const auto* l = reinterpret_cast<const uint16_t*>(lhs.bytes.data());
  const auto* w = reinterpret_cast<const uint16_t*>(rhs.bytes.data());
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < 3; ++j) {
      float want = 0;
      for (int i = 0; i < 4; ++i) want += HostDeviceBackend::Float(l[r * 4 + i]) * HostDeviceBackend::Float(w[i * 3 + j]);
      EXPECT_EQ(HostDeviceBackend::Float(got[r * 3 + j]), want) << r << "," << j;
    }
  }
}

// The device weight gather holds the step's agreement inside the backend:
// an output region that does not open on this worker must still meet it
// (its peers would wait there until the collective timeout).
TEST(ExecutorClientMemoryTest, AnOutputRegionThatDoesNotOpenMeetsTheDeviceGathersAgreement) {
  HostDeviceBackend backend;
  backend.gathers = true;
  backend.refuse_open = absl::FailedPreconditionError("out_shared_memory.cuda: the CUDA IPC handle does not open here");
  ShardStore store(int64_t{1} << 30);
  Executor e(&backend, &store);
  auto collectives = std::make_unique<DeviceMirrorCollectives>(FsdpOf2());
  DeviceMirrorCollectives* mirror = collectives.get();
  e.Configure(FsdpOf2(), std::move(collectives), 1);
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensorToProto(Bf16Tensor({4, 6}, {1, 2}), g->mutable_lhs());
  HostTensorToProto(Bf16Tensor({2, 3, 4}, {1, -1}), g->mutable_rhs());
  g->add_group_sizes(1);
  g->add_group_sizes(3);
  g->set_out_dtype(v1::BF16);
  g->set_agree(true);
  v1::CollectivePlan* c = g->add_collectives();
  c->set_phase(v1::PHASE_BEFORE);
  c->set_kind(v1::COLLECTIVE_ALL_GATHER);
  c->set_tensor(v1::TENSOR_RHS);
  c->set_dim(1);
  c->add_axes("fsdp");
  *g->mutable_out_shared_memory() = CudaRegionTensor(std::string(64, 'j'), 0, {4, 4}, 32).shared_memory();
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_NE(result.status().message().find("out_shared_memory"), std::string::npos) << result.status();
  EXPECT_EQ(mirror->agreements, 1);
  EXPECT_EQ(backend.gemms, 0);
}

// A malformed output block (its rank not the output's) is refused naming
// the field, not read past its vectors.
TEST(ExecutorClientMemoryTest, AnOutputBlockOfAnotherRankIsRefusedNamingTheField) {
  HostDeviceBackend backend;
  ShardStore store(int64_t{1} << 30);
  Executor e(&backend, &store);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  std::vector<char> region(256, 0);
  backend.regions[std::string(64, 'k')] = &region;
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensorToProto(Bf16Tensor({2, 4}, {1}), g->mutable_lhs());
  HostTensorToProto(Bf16Tensor({1, 4, 3}, {1}), g->mutable_rhs());
  g->add_group_sizes(2);
  g->set_out_dtype(v1::BF16);
  *g->mutable_out_shared_memory() = CudaRegionTensor(std::string(64, 'k'), 0, {2, 3, 1, 1}, 256).shared_memory();
  auto result = e.Execute(step);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("out_shared_memory"), std::string::npos) << result.status();
  EXPECT_EQ(backend.gemms, 0);
}

// On a device backend whose staging memory keeps GEMM operands in device
// memory: the step reads them there (no upload), and an output held for a
// direct fetch is copied once from the device into the memory's host block.
TEST(ExecutorStagingMemoryTest, StagedDeviceOperandsReachTheGemmAndItsOutputIsHeldInTheMemorysBlock) {
  HostDeviceBackend backend;
  ShardStore store(int64_t{1} << 30);
  auto memory = std::make_unique<FakeStagingMemory>(/*on_device=*/true);
  std::shared_ptr<FakeStagingMemory::State> fake = memory->state();
  StagingArea staging(1 << 20, absl::Seconds(60), [] { return absl::Now(); }, -1, std::move(memory));
  Executor e(&backend, &store, &staging);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  const HostTensor lhs = Bf16Tensor({3, 4}, {1, 2, -1, 3, 2}), rhs = Bf16Tensor({1, 4, 2}, {1, 0, 2, -1});
  auto stage = [&](const std::string& ticket, const HostTensor& t) {
    ASSERT_TRUE(staging.Expect(ticket, ExpectedBlock{"", "operand", t.dtype, t.shape, true}).ok());
    auto up = staging.BeginStage(ticket, "");
    ASSERT_TRUE(up.ok()) << up.status();
    ASSERT_TRUE((*up)->Append(t.bytes).ok());
    ASSERT_TRUE((*up)->Commit().ok());
  };
  stage("lhs-ticket-0000", lhs);
  stage("rhs-ticket-0000", rhs);
  EXPECT_EQ(fake->live_blocks, 2);
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  for (auto [t, at, ticket] : {std::make_tuple(&lhs, g->mutable_lhs(), "lhs-ticket-0000"),
                               std::make_tuple(&rhs, g->mutable_rhs(), "rhs-ticket-0000")}) {
    at->set_dtype(v1::BF16);
    at->mutable_shape()->Assign(t->shape.begin(), t->shape.end());
    at->set_staged(ticket);
  }
  g->add_group_sizes(3);
  g->set_out_dtype(v1::BF16);
  g->mutable_out_staged()->set_ticket("out-ticket-0000");
  auto result = e.Execute(step);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(backend.gemms, 1);
  EXPECT_EQ(backend.device_operands, 2);  // read where they were staged
  EXPECT_EQ(fake->live_blocks, 0);        // and freed with the step
  EXPECT_EQ(backend.copies_to_host, 1);
  EXPECT_EQ(fake->live_outputs, 1);
  EXPECT_TRUE(result->out().data().empty());
  EXPECT_EQ(staging.held_bytes(), 3 * 2 * 2);
  auto fetched = staging.BeginFetch("out-ticket-0000", "");
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  const absl::string_view got = (*fetched)->bytes();
  ASSERT_EQ(got.size(), 12u);
  const auto* o = reinterpret_cast<const uint16_t*>(got.data());
  const auto* l = reinterpret_cast<const uint16_t*>(lhs.bytes.data());
  const auto* w = reinterpret_cast<const uint16_t*>(rhs.bytes.data());
  for (int r = 0; r < 3; ++r) {
    for (int j = 0; j < 2; ++j) {
      float want = 0;
      for (int i = 0; i < 4; ++i) want += HostDeviceBackend::Float(l[r * 4 + i]) * HostDeviceBackend::Float(w[i * 2 + j]);
      EXPECT_EQ(HostDeviceBackend::Float(o[r * 2 + j]), want) << r << "," << j;
    }
  }
  (*fetched)->Done();
  fetched->reset();
  EXPECT_EQ(fake->live_outputs, 0);
  EXPECT_EQ(staging.held_bytes(), 0);
}

// A put's block the staging memory kept in device memory is stored as a
// device-only shard, against the device budget.
TEST(ExecutorStagingMemoryTest, AStagedPutBlockInDeviceMemoryIsStoredOnTheDevice) {
  HostDeviceBackend backend;
  ShardStore store(int64_t{1} << 30, /*device_budget_bytes=*/1 << 20);
  auto memory = std::make_unique<FakeStagingMemory>(/*on_device=*/true);
  StagingArea staging(1 << 20, absl::Seconds(60), [] { return absl::Now(); }, -1, std::move(memory));
  Executor e(&backend, &store, &staging);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  const HostTensor w = Bf16Tensor({1, 4, 2}, {1, 0, 2, -1});
  ASSERT_TRUE(staging.Expect("put-ticket-0000", ExpectedBlock{"", "w", w.dtype, w.shape}).ok());
  auto up = staging.BeginStage("put-ticket-0000", "");
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(w.bytes).ok());
  ASSERT_TRUE((*up)->Commit().ok());
  v1::Step step;
  step.set_sequence(1);
  v1::StoreShardStep* s = step.mutable_store();
  s->set_name("w@1");
  s->mutable_shard()->set_dtype(v1::BF16);
  s->mutable_shard()->mutable_shape()->Assign(w.shape.begin(), w.shape.end());
  s->mutable_shard()->set_staged("put-ticket-0000");
  ASSERT_TRUE(e.Execute(step).ok());
  auto shard = store.Get("w@1");
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ((*shard)->host, nullptr);
  ASSERT_NE((*shard)->device, nullptr);
  EXPECT_EQ(std::string(static_cast<const char*>((*shard)->device->data()), w.bytes.size()), w.bytes);
  EXPECT_EQ(store.device_used_bytes(), w.NumBytes());
  EXPECT_EQ(store.used_bytes(), 0);
}

TEST(ExecutorStoreTest, AStoreStepKeepsItsShardAndStandbyCopiesAllOrNone) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  ShardStore store(/*budget_bytes=*/60);  // two 24-byte shards, not three
  Executor e(backend.get(), &store);
  e.Configure(SingleWorkerPosition(), std::make_unique<MirrorCollectives>(SingleWorkerPosition()), 1);
  auto store_step = [](uint64_t sequence, int standby_copies) {
    v1::Step step;
    step.set_sequence(sequence);
    v1::StoreShardStep* s = step.mutable_store();
    s->set_name("w@1");
    HostTensorToProto(F32({2, 3}, 1), s->mutable_shard());
    for (int i = 0; i < standby_copies; ++i) {
      v1::NamedShard* copy = s->add_standby();
      copy->set_name("w@1/standby-of-" + std::to_string(i + 1));
      HostTensorToProto(F32({2, 3}, 2.0f + i), copy->mutable_shard());
    }
    return step;
  };
  auto over = e.Execute(store_step(1, 2));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("standby"), std::string::npos) << over.status();
  EXPECT_NE(over.status().message().find("--memory_budget_mb"), std::string::npos) << over.status();
  EXPECT_EQ(store.num_shards(), 0) << "the copies stored before the one that did not fit are gone";
  EXPECT_EQ(store.used_bytes(), 0);
  ASSERT_TRUE(e.Execute(store_step(2, 1)).ok());
  EXPECT_EQ(store.num_shards(), 2);
  auto copy = store.Get("w@1/standby-of-1");
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ((*copy)->host->data<float>()[0], 2.0f);
  // A delete names the standby copies it holds; absent ones are no error.
  v1::Step del;
  del.set_sequence(3);
  del.mutable_delete_shard()->set_name("w@1");
  del.mutable_delete_shard()->add_standby("w@1/standby-of-1");
  del.mutable_delete_shard()->add_standby("w@1/standby-of-7");
  ASSERT_TRUE(e.Execute(del).ok());
  EXPECT_EQ(store.num_shards(), 0);
}

}  // namespace
}  // namespace shardgemm
