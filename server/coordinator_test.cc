#include "server/coordinator.h"

#include <stdlib.h>

#include <algorithm>
#include <map>
#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host_tensor.h"
#include "proto/tensor_codec.h"
#include "server/fake_worker_channel.h"

namespace shardgemm {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;

#define SG_CONCAT_INNER(a, b) a##b
#define SG_CONCAT(a, b) SG_CONCAT_INNER(a, b)
#define ASSERT_OK(expr)                         \
  do {                                          \
    const absl::Status _s = (expr);             \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s; \
  } while (0)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) ASSERT_OK_AND_ASSIGN_IMPL(SG_CONCAT(_status_or_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status(); \
  lhs = std::move(*tmp)

constexpr int64_t kMiB = 1 << 20;

std::unique_ptr<FakeMesh> MakeMesh(absl::string_view mesh, FakeMesh::Options options = {}) {
  auto made = FakeMesh::Create(mesh, std::move(options));
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? std::move(*made) : nullptr;
}

// Small integers as floats: every product and sum below is exact, so the
// fakes' results can be compared with a reference for equality.
std::vector<float> Ints(int64_t n, int seed) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + seed * 3) % 11 - 5);
  return v;
}

HostTensor F32(std::vector<int64_t> shape, const std::vector<float>& values) {
  HostTensor t = *ZerosTensor(DType::kF32, std::move(shape));
  EXPECT_EQ(t.NumElements(), static_cast<int64_t>(values.size()));
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

v1::Tensor Inline(const HostTensor& t, const std::string& spec = "") {
  v1::Tensor p;
  HostTensorToProto(t, &p);
  p.set_spec(spec);
  return p;
}

v1::Tensor GroupSizes(const std::vector<int64_t>& sizes, const std::string& spec = "") {
  HostTensor t = *ZerosTensor(DType::kI64, {static_cast<int64_t>(sizes.size())});
  std::copy(sizes.begin(), sizes.end(), t.data<int64_t>());
  return Inline(t, spec);
}

std::vector<float> Floats(const HostTensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.NumElements());
}

template <typename Proto>
std::vector<float> Floats(const Proto& t) {
  auto h = HostTensorFromProto(t, "t");
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? Floats(*h) : std::vector<float>();
}

template <typename Proto>
std::vector<int64_t> Shape(const Proto& t) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end());
}

// A ragged-M grouped GEMM under the per-shard semantics: lhs [m, k] is
// `shards` row blocks, each its own ragged array over all G groups, whose
// sizes are sizes[s*G .. (s+1)*G); rows past a block's groups are zero.
struct Gemm {
  int64_t m, k, n, g, shards;
  std::vector<int64_t> sizes;
  std::vector<float> lhs, rhs;

  Gemm(int64_t m_, int64_t k_, int64_t n_, std::vector<int64_t> sizes_, int64_t shards_, int seed = 1)
      : m(m_), k(k_), n(n_), g(static_cast<int64_t>(sizes_.size()) / shards_), shards(shards_),
        sizes(std::move(sizes_)), lhs(Ints(m * k, seed)), rhs(Ints(g * k * n, seed + 1)) {}

  v1::GroupedGemmRequest Request(const std::string& lhs_spec = "", const std::string& sizes_spec = "") const {
    v1::GroupedGemmRequest r;
    *r.mutable_lhs() = Inline(F32({m, k}, lhs), lhs_spec);
    *r.mutable_rhs() = Inline(F32({g, k, n}, rhs));
    *r.mutable_group_sizes() = GroupSizes(sizes, sizes_spec);
    return r;
  }

  std::vector<float> Reference() const { return ReferenceWith(rhs); }
  std::vector<float> ReferenceWith(const std::vector<float>& w) const {
    std::vector<float> out(m * n, 0.0f);
    const int64_t shard_rows = m / shards;
    for (int64_t s = 0; s < shards; ++s) {
      int64_t row = s * shard_rows;
      for (int64_t e = 0; e < g; ++e) {
        for (int64_t i = row; i < row + sizes[s * g + e]; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            float acc = 0;
            for (int64_t kk = 0; kk < k; ++kk) acc += lhs[i * k + kk] * w[(e * k + kk) * n + j];
            out[i * n + j] = acc;
          }
        }
        row += sizes[s * g + e];
      }
    }
    return out;
  }
};

// The mesh-wide totals of the fakes' steps, for "nothing was dispatched".
int TotalSteps(FakeMesh& mesh, int workers) {
  int total = 0;
  for (int r = 0; r < workers; ++r) total += mesh.worker(r).num_steps();
  return total;
}

// ------------------------------------------------------- the fake itself --
// The double is only as good as its contract: answers at most once, late
// answers harmless, delays on its own thread.

TEST(FakeWorkerChannelTest, HeldStepIsAnsweredOnceAndOnlyWhenReleased) {
  FakeWorkerChannel fake;
  fake.SetNeverAnswer(true);
  auto calls = std::make_shared<std::atomic<int>>(0);
  v1::Step step;
  step.set_sequence(1);
  step.mutable_store()->set_name("s");
  step.mutable_store()->mutable_shard()->set_dtype(v1::F32);
  step.mutable_store()->mutable_shard()->set_data("");
  fake.ExecuteAsync(step, absl::Now(), [calls](absl::StatusOr<v1::StepResult>) { ++*calls; });
  EXPECT_EQ(*calls, 0);
  EXPECT_EQ(fake.num_held(), 1);
  EXPECT_EQ(fake.AnswerHeld(), 1);
  EXPECT_EQ(fake.AnswerHeld(), 0);
  EXPECT_EQ(*calls, 1);
  EXPECT_THAT(fake.shard_names(), ElementsAre("s"));
}

TEST(FakeWorkerChannelTest, StepsStillHeldWhenTheFakeGoesAreCancelledOnce) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto code = std::make_shared<absl::StatusCode>(absl::StatusCode::kOk);
  {
    FakeWorkerChannel fake;
    fake.SetNeverAnswer(true);
    fake.ExecuteAsync(v1::Step(), absl::Now(), [calls, code](absl::StatusOr<v1::StepResult> r) {
      ++*calls;
      *code = r.status().code();
    });
  }
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(*code, absl::StatusCode::kCancelled);
}

TEST(FakeWorkerChannelTest, DelayedAnswerComesLaterFromAnotherThread) {
  FakeWorkerChannel fake;
  fake.SetAnswerDelay(absl::Milliseconds(50));
  absl::Notification answered;
  std::thread::id answered_on;
  const absl::Time start = absl::Now();
  v1::Step step;
  step.mutable_delete_shard()->set_name("absent");
  fake.ExecuteAsync(step, absl::InfiniteFuture(), [&](absl::StatusOr<v1::StepResult> r) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
    answered_on = std::this_thread::get_id();
    answered.Notify();
  });
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_NE(answered_on, std::this_thread::get_id());
}

// ---------------------------------------------------------- registration --

TEST(CoordinatorRegistrationTest, RanksAreRowMajorInRegistrationOrder) {
  FakeMesh::Options options;
  options.workers = 0;
  auto mesh = MakeMesh("dp=2,tp=2", options);
  // Addresses out of lexical order: the rank is the order of registration.
  const std::vector<std::string> addresses = {"fake:c", "fake:a", "fake:d", "fake:b"};
  std::string session;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(v1::RegisterResponse r, mesh->Register(addresses[i], 100 + i));
    EXPECT_EQ(r.rank(), i);
    ASSERT_EQ(r.mesh().axes_size(), 2);
    EXPECT_EQ(r.mesh().axes(0).name(), "dp");
    if (i == 0) session = r.session();
    EXPECT_EQ(r.session(), session);  // one session names the whole mesh's rendezvous keys
  }
  v1::ClusterInfo info = mesh->coordinator().ClusterInfo();
  ASSERT_EQ(info.workers_size(), 4);
  const std::vector<std::vector<int64_t>> coords = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};  // last axis fastest
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(info.workers(i).rank(), i);
    EXPECT_EQ(info.workers(i).address(), addresses[i]);
    EXPECT_EQ(info.workers(i).memory_budget_bytes(), 100 + i);
    EXPECT_THAT(info.workers(i).coords(), ElementsAreArray(coords[i]));
  }
}

TEST(CoordinatorRegistrationTest, ReRegisteringWorkerGetsItsRankBack) {
  FakeMesh::Options options;
  options.workers = 2;
  auto mesh = MakeMesh("dp=4", options);
  // While the mesh is incomplete a restart takes no new rank...
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse again, mesh->Register("fake:1"));
  EXPECT_EQ(again.rank(), 1);
  EXPECT_EQ(mesh->coordinator().ClusterInfo().workers_size(), 2);
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse third, mesh->Register("fake:new"));
  EXPECT_EQ(third.rank(), 2);
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse fourth, mesh->Register("fake:3"));
  EXPECT_EQ(fourth.rank(), 3);
  EXPECT_TRUE(mesh->coordinator().ClusterInfo().ready());
  // ...nor once it is complete, and the Coordinator reconnects to it.
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse restarted, mesh->Register("fake:new", 7));
  EXPECT_EQ(restarted.rank(), 2);
  EXPECT_EQ(mesh->connects("fake:new"), 2);
  v1::ClusterInfo info = mesh->coordinator().ClusterInfo();
  EXPECT_TRUE(info.ready());
  ASSERT_EQ(info.workers_size(), 4);
  EXPECT_EQ(info.workers(2).address(), "fake:new");
  EXPECT_EQ(info.workers(2).memory_budget_bytes(), 7);
}

TEST(CoordinatorRegistrationTest, WorkerPastTheMeshSizeIsResourceExhausted) {
  auto mesh = MakeMesh("dp=2,tp=2");
  auto fifth = mesh->Register("fake:4");
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted) << fifth.status();
  EXPECT_THAT(std::string(fifth.status().message()), HasSubstr("4 workers"));
  v1::ClusterInfo info = mesh->coordinator().ClusterInfo();
  ASSERT_EQ(info.workers_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(info.workers(i).address(), FakeMesh::Address(i));
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse back, mesh->Register("fake:3"));  // a restart still fits
  EXPECT_EQ(back.rank(), 3);
}

TEST(CoordinatorRegistrationTest, ReadyOnlyWhenCompleteAndRequestsUnavailableBefore) {
  FakeMesh::Options options;
  options.workers = 3;
  auto mesh = MakeMesh("dp=2,tp=2", options);
  Coordinator& c = mesh->coordinator();
  v1::ClusterInfo info = c.ClusterInfo();
  EXPECT_FALSE(info.ready());
  EXPECT_EQ(info.workers_expected(), 4);
  EXPECT_EQ(info.workers_size(), 3);

  const Gemm gemm(4, 2, 3, {2, 2}, 1);
  auto unavailable = [](const absl::Status& s, const char* what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("1 of 4 workers have not registered")) << what;
  };
  unavailable(c.GroupedGemm(gemm.Request()).status(), "GroupedGemm");
  v1::GroupedQuantizeRequest quantize;
  *quantize.mutable_x() = Inline(F32({4, 2}, Ints(8, 0)));
  *quantize.mutable_group_sizes() = GroupSizes({4});
  quantize.set_out_dtype(v1::F8E4M3);
  unavailable(c.GroupedQuantize(quantize).status(), "GroupedQuantize");
  unavailable(c.PutTensor("w", F32({2}, {1, 2}), "", false).status(), "PutTensor");
  unavailable(c.GetTensor("w").status(), "GetTensor");
  unavailable(c.DeleteTensor("w"), "DeleteTensor");
  unavailable(c.CheckTensorFits("w", 8), "CheckTensorFits");
  EXPECT_EQ(TotalSteps(*mesh, 3), 0);

  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse last, mesh->Register(FakeMesh::Address(3)));
  EXPECT_EQ(last.rank(), 3);
  EXPECT_TRUE(c.ClusterInfo().ready());
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse r, c.GroupedGemm(gemm.Request()));
  EXPECT_EQ(Floats(r.out()), gemm.Reference());
}

// -------------------------------------------------------------- dispatch --

TEST(CoordinatorDispatchTest, OneSequenceNumberPerRequestOnEveryWorkerIncreasing) {
  FakeMesh::Options options;
  options.workers = 0;
  auto mesh = MakeMesh("dp=2", options);
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse r0, mesh->Register(FakeMesh::Address(0)));
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse r1, mesh->Register(FakeMesh::Address(1)));
  EXPECT_EQ(r0.next_sequence(), r1.next_sequence());
  Coordinator& c = mesh->coordinator();
  const Gemm gemm(8, 4, 3, {1, 2, 3, 0}, 2);
  ASSERT_OK(c.GroupedGemm(gemm.Request("(dp, None)", "(dp,)")).status());
  ASSERT_OK(c.PutTensor("w", F32({2, 3}, Ints(6, 2)), "(dp, None)", false).status());
  ASSERT_OK(c.GroupedGemm(gemm.Request("(dp, None)", "(dp,)")).status());
  ASSERT_OK(c.DeleteTensor("w"));

  const std::vector<v1::Step> a = mesh->worker(0).steps(), b = mesh->worker(1).steps();
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  const v1::Step::OpCase kinds[] = {v1::Step::kGemm, v1::Step::kStore, v1::Step::kGemm,
                                    v1::Step::kDeleteShard};
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].sequence(), b[i].sequence()) << "request " << i;
    EXPECT_EQ(a[i].op_case(), kinds[i]);
    EXPECT_EQ(b[i].op_case(), kinds[i]);
    if (i > 0) {
      EXPECT_GT(a[i].sequence(), a[i - 1].sequence());
    }
  }
  // A worker's first step is the one registration told it to expect, and
  // one that rejoins is told where the order stands now.
  EXPECT_EQ(a[0].sequence(), r0.next_sequence());
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse rejoined, mesh->Register(FakeMesh::Address(1)));
  EXPECT_EQ(rejoined.next_sequence(), a.back().sequence() + 1);
}

TEST(CoordinatorDispatchTest, ConcurrentRequestsReachEveryWorkerWithDistinctNumbers) {
  auto mesh = MakeMesh("dp=2,tp=2");
  for (int r = 0; r < 4; ++r) mesh->worker(r).SetAnswerDelay(absl::Milliseconds(1));
  const Gemm gemm(8, 4, 3, {1, 2, 3, 0}, 2);
  constexpr int kThreads = 8, kEach = 5;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        auto r = mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)"));
        if (!r.ok() || Floats(r->out()) != gemm.Reference()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures, 0);
  // Arrival order may differ between workers; the numbers may not.
  std::set<uint64_t> first;
  for (int r = 0; r < 4; ++r) {
    std::set<uint64_t> seen;
    for (const v1::Step& s : mesh->worker(r).steps()) {
      EXPECT_TRUE(seen.insert(s.sequence()).second) << "worker " << r << " got " << s.sequence() << " twice";
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(kThreads * kEach)) << "worker " << r;
    if (r == 0) first = seen;
    EXPECT_EQ(seen, first) << "worker " << r;
  }
}

// --------------------------------------------------- slicing and assembly --

// A request whose lhs and rhs are to be staged: dtype, shape and spec, no data.
v1::GroupedGemmRequest StagingRequest(const Gemm& gemm, const std::string& lhs_spec, const std::string& sizes_spec) {
  v1::GroupedGemmRequest r = gemm.Request(lhs_spec, sizes_spec);
  r.mutable_lhs()->clear_data();
  r.mutable_rhs()->clear_data();
  return r;
}

v1::StagingPlanRequest PlanOf(const v1::GroupedGemmRequest& r) {
  v1::StagingPlanRequest p;
  *p.mutable_grouped_gemm() = r;
  return p;
}

TEST(CoordinatorStagingTest, EachDistinctBlockGoesToEveryRankThatNeedsItUnderItsOwnTicket) {
  FakeMesh::Options options;
  options.staging = true;
  auto mesh = MakeMesh("dp=2,tp=2", options);
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  ASSERT_OK_AND_ASSIGN(v1::StagingPlan plan,
                       mesh->coordinator().PlanStaging(PlanOf(StagingRequest(gemm, "(dp, None)", "(dp,)")),
                                                       absl::InfiniteFuture(), CallContext{"alice", "", nullptr}));
  EXPECT_EQ(plan.staging_id().size(), 32u);
  ASSERT_EQ(plan.operands_size(), 2);
  const v1::StagedOperand& lhs = plan.operands(0);
  EXPECT_EQ(lhs.role(), v1::TENSOR_LHS);
  ASSERT_EQ(lhs.blocks_size(), 2);  // a row block per dp coordinate, each for both tp ranks
  std::set<std::string> tickets;
  for (int b = 0; b < 2; ++b) {
    EXPECT_THAT(lhs.blocks(b).offsets(), ElementsAre(4 * b, 0));
    EXPECT_THAT(lhs.blocks(b).shape(), ElementsAre(4, 4));
    ASSERT_EQ(lhs.blocks(b).destinations_size(), 2);
    for (const v1::StagingDestination& d : lhs.blocks(b).destinations()) {
      EXPECT_EQ(d.rank() / 2, b);
      EXPECT_EQ(d.address(), absl::StrCat("staging:", d.rank()));
      tickets.insert(d.ticket());
    }
  }
  const v1::StagedOperand& rhs = plan.operands(1);
  ASSERT_EQ(rhs.blocks_size(), 1);  // replicated: one block, every rank its copy
  EXPECT_EQ(rhs.blocks(0).destinations_size(), 4);
  for (const v1::StagingDestination& d : rhs.blocks(0).destinations()) tickets.insert(d.ticket());
  EXPECT_EQ(tickets.size(), 8u);  // one per rank per operand, none shared
  for (int rank = 0; rank < 4; ++rank) {
    const std::vector<v1::ExpectStagedRequest> told = mesh->worker(rank).expected_staged();
    ASSERT_EQ(told.size(), 1u);
    EXPECT_EQ(told[0].session(), mesh->coordinator().session());
    ASSERT_EQ(told[0].tickets_size(), 2);
    EXPECT_EQ(told[0].tickets(0).tenant(), "alice");
    EXPECT_EQ(told[0].tickets(0).role(), v1::TENSOR_LHS);
    EXPECT_THAT(told[0].tickets(0).shape(), ElementsAre(4, 4));
    EXPECT_THAT(told[0].tickets(1).shape(), ElementsAre(3, 4, 5));
    EXPECT_TRUE(tickets.count(told[0].tickets(0).ticket()));
  }
}

TEST(CoordinatorStagingTest, AStagedRequestNamesEachRanksTicketAndIsUsedOnceByItsTenant) {
  FakeMesh::Options options;
  options.staging = true;
  auto mesh = MakeMesh("dp=2", options);
  const CallContext alice{"alice", "", nullptr}, bob{"bob", "", nullptr};
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const v1::GroupedGemmRequest meta = StagingRequest(gemm, "(dp, None)", "(dp,)");
  ASSERT_OK_AND_ASSIGN(v1::StagingPlan plan,
                       mesh->coordinator().PlanStaging(PlanOf(meta), absl::InfiniteFuture(), alice));
  for (int rank = 0; rank < 2; ++rank) {  // the fakes answer a header: the output stays on them
    mesh->worker(rank).SetHandler([](const v1::Step& step) -> absl::StatusOr<v1::StepResult> {
      v1::StepResult r;
      r.mutable_out()->set_dtype(v1::F32);
      r.mutable_out()->add_shape(4);
      r.mutable_out()->add_shape(5);
      return r;
    });
  }
  v1::GroupedGemmRequest submit = meta;
  submit.mutable_lhs()->set_staged(plan.staging_id());
  submit.mutable_rhs()->set_staged(plan.staging_id());
  submit.set_direct_output(true);

  v1::GroupedGemmRequest wrong = submit;
  wrong.mutable_lhs()->set_shape(0, 16);
  EXPECT_EQ(mesh->coordinator().GroupedGemm(wrong, absl::InfiniteFuture(), alice).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto foreign = mesh->coordinator().GroupedGemm(submit, absl::InfiniteFuture(), bob);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(foreign.status().message(), HasSubstr("lhs.staged"));
  v1::GroupedGemmRequest unknown = submit;
  unknown.mutable_lhs()->set_staged(std::string(32, '0'));
  EXPECT_EQ(mesh->coordinator().GroupedGemm(unknown, absl::InfiniteFuture(), alice).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(mesh->worker(0).num_steps(), 0);  // nothing of them reached a worker

  const int64_t inline_before = mesh->coordinator().ClusterInfo().inline_activation_bytes();
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse r, mesh->coordinator().GroupedGemm(submit, absl::InfiniteFuture(), alice));
  for (int rank = 0; rank < 2; ++rank) {
    const v1::GemmStep step = mesh->worker(rank).steps().at(0).gemm();
    const v1::ExpectStagedRequest told = mesh->worker(rank).expected_staged().at(0);
    EXPECT_EQ(step.lhs().staged(), told.tickets(0).ticket());
    EXPECT_EQ(step.rhs().staged(), told.tickets(1).ticket());
    EXPECT_TRUE(step.lhs().data().empty());
    EXPECT_EQ(step.out_staged().tenant(), "alice");  // each rank holds its own output block
  }
  EXPECT_TRUE(r.out().data().empty());
  EXPECT_THAT(Shape(r.out()), ElementsAre(8, 5));
  ASSERT_EQ(r.out_blocks_size(), 2);
  EXPECT_EQ(r.out_blocks(1).destinations(0).address(), "staging:1");
  EXPECT_THAT(r.out_blocks(1).offsets(), ElementsAre(4, 0));
  EXPECT_EQ(mesh->coordinator().ClusterInfo().inline_activation_bytes(), inline_before);
  EXPECT_EQ(mesh->coordinator().ClusterInfo().direct_activation_bytes(), 0);

  auto again = mesh->coordinator().GroupedGemm(submit, absl::InfiniteFuture(), alice);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("used already"));
}

TEST(CoordinatorStagingTest, ARequestRefusedBeforeItsStepsLeavesItsPlanUnused) {
  FakeMesh::Options options;
  options.staging = true;
  auto mesh = MakeMesh("dp=2", options);
  const CallContext alice{"alice", "", nullptr};
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const v1::GroupedGemmRequest meta = StagingRequest(gemm, "(dp, None)", "(dp,)");
  ASSERT_OK_AND_ASSIGN(v1::StagingPlan plan,
                       mesh->coordinator().PlanStaging(PlanOf(meta), absl::InfiniteFuture(), alice));
  for (int rank = 0; rank < 2; ++rank) {
    mesh->worker(rank).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
      v1::StepResult r;
      r.mutable_out()->set_dtype(v1::F32);
      r.mutable_out()->add_shape(4);
      r.mutable_out()->add_shape(5);
      return r;
    });
  }
  v1::GroupedGemmRequest submit = meta;
  submit.mutable_lhs()->set_staged(plan.staging_id());
  submit.mutable_rhs()->set_staged(plan.staging_id());
  submit.set_direct_output(true);
  v1::GroupedGemmRequest too_many_rows = submit;
  *too_many_rows.mutable_group_sizes() = GroupSizes({4, 2, 0, 3, 0, 1}, "(dp,)");  // 6 rows of shard 0's 4
  auto refused = mesh->coordinator().GroupedGemm(too_many_rows, absl::InfiniteFuture(), alice);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(TotalSteps(*mesh, 2), 0);
  auto fixed = mesh->coordinator().GroupedGemm(submit, absl::InfiniteFuture(), alice);
  EXPECT_TRUE(fixed.ok()) << fixed.status();
}

TEST(CoordinatorStagingTest, APlanPastTheCapIsRefusedBeforeTheWorkersHearOfItsTickets) {
  FakeMesh::Options options;
  options.staging = true;
  options.coordinator.max_staging_plans = 1;
  auto mesh = MakeMesh("dp=2", options);
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const v1::StagingPlanRequest request = PlanOf(StagingRequest(gemm, "(dp, None)", "(dp,)"));
  ASSERT_TRUE(mesh->coordinator().PlanStaging(request).ok());
  auto refused = mesh->coordinator().PlanStaging(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(mesh->worker(rank).expected_staged().size(), 1u) << rank;
}

TEST(CoordinatorStagingTest, NoPlanWithoutEveryWorkersStagingAddressOrAnOperandToStage) {
  auto plain = MakeMesh("dp=2");
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  auto refused = plain->coordinator().PlanStaging(PlanOf(StagingRequest(gemm, "(dp, None)", "(dp,)")));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("rank 0 serves no staging"));
  FakeMesh::Options options;
  options.staging = true;
  auto mesh = MakeMesh("dp=2", options);
  auto nothing = mesh->coordinator().PlanStaging(PlanOf(gemm.Request("(dp, None)", "(dp,)")));
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nothing.status().message(), HasSubstr("no operand to stage"));
  v1::GroupedGemmRequest direct = gemm.Request("(dp, None)", "(dp,)");
  direct.set_direct_output(true);
  direct.set_keep_output_as("y");
  EXPECT_EQ(mesh->coordinator().GroupedGemm(direct).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CoordinatorSlicingTest, RowBlocksGoToTheirWorkersAndComeBackInRowOrder) {
  auto mesh = MakeMesh("dp=2");
  // G = 3; shard 0: 1, 2, 0 rows and one padding row; shard 1: 3, 0, 1 rows.
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse r,
                       mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)")));
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<v1::Step> steps = mesh->worker(rank).steps();
    ASSERT_EQ(steps.size(), 1u);
    const v1::GemmStep& step = steps[0].gemm();
    EXPECT_THAT(Shape(step.lhs()), ElementsAre(4, 4)) << "rank " << rank;
    EXPECT_EQ(Floats(step.lhs()),
              std::vector<float>(gemm.lhs.begin() + rank * 16, gemm.lhs.begin() + (rank + 1) * 16));
    EXPECT_THAT(step.group_sizes(),
                ElementsAreArray(std::vector<int64_t>(gemm.sizes.begin() + rank * 3, gemm.sizes.begin() + rank * 3 + 3)));
    EXPECT_THAT(Shape(step.rhs()), ElementsAre(3, 4, 5));  // replicated: the whole of it
    EXPECT_EQ(Floats(step.rhs()), gemm.rhs);
    EXPECT_EQ(step.collectives_size(), 0);
  }
  EXPECT_THAT(Shape(r.out()), ElementsAre(8, 5));
  EXPECT_EQ(r.out().dtype(), v1::F32);
  const std::vector<float> out = Floats(r.out());
  EXPECT_EQ(out, gemm.Reference());
  EXPECT_EQ(std::vector<float>(out.begin() + 3 * 5, out.begin() + 4 * 5), std::vector<float>(5, 0.0f))
      << "shard 0's padding row";
}

TEST(CoordinatorSlicingTest, RanksThatShareARowBlockGetTheSameRows) {
  auto mesh = MakeMesh("dp=2,tp=2");
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse r,
                       mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)")));
  for (int rank = 0; rank < 4; ++rank) {
    const int block = rank / 2;  // dp coordinate
    const v1::GemmStep step = mesh->worker(rank).steps().at(0).gemm();
    EXPECT_EQ(Floats(step.lhs()),
              std::vector<float>(gemm.lhs.begin() + block * 16, gemm.lhs.begin() + (block + 1) * 16))
        << "rank " << rank;
  }
  EXPECT_EQ(Floats(r.out()), gemm.Reference());
}

TEST(CoordinatorSlicingTest, PutShardsBySpecAndGetReassembles) {
  auto mesh = MakeMesh("dp=2");
  const HostTensor w = F32({4, 3}, Ints(12, 4));
  ASSERT_OK(mesh->coordinator().PutTensor("w", w, "(dp, None)", false).status());
  const std::vector<float> all = Floats(w);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<std::string> names = mesh->worker(rank).shard_names();
    ASSERT_EQ(names.size(), 1u);
    EXPECT_EQ(Floats(*mesh->worker(rank).shard(names[0])),
              std::vector<float>(all.begin() + rank * 6, all.begin() + (rank + 1) * 6));
  }
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched back, mesh->coordinator().GetTensor("w"));
  EXPECT_EQ(back.tensor.shape, w.shape);
  EXPECT_EQ(Floats(back.tensor), Floats(w));
  EXPECT_EQ(back.info.spec(), "(dp, None)");
}

// --------------------------------------------------------------- deadline --

FakeMesh::Options ShortGrace() {
  FakeMesh::Options options;
  options.coordinator.dispatch_grace = absl::Milliseconds(100);
  return options;
}

// What the scheduler may add to a wait, on a loaded test machine.
constexpr absl::Duration kSlack = absl::Milliseconds(150);

TEST(CoordinatorDeadlineTest, HungWorkerGivesDeadlineExceededNamingItThenTheMeshRecovers) {
  auto mesh = MakeMesh("dp=2", ShortGrace());
  FakeWorkerChannel hung = mesh->worker(1);
  hung.SetNeverAnswer(true);
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Milliseconds(200);
  auto r = mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)"), deadline);
  const absl::Time returned = absl::Now();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker 1"));
  // It waits for the deadline, then no longer than the grace.
  EXPECT_GE(returned, deadline);
  EXPECT_LT(returned - start, absl::Milliseconds(200) + absl::Milliseconds(100) + kSlack)
      << "returned " << (returned - deadline) << " past the deadline";

  // The late answer lands on a dispatch that gave up: harmless.
  hung.SetNeverAnswer(false);
  EXPECT_EQ(hung.AnswerHeld(), 1);
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse next,
                       mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)"),
                                                       absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(Floats(next.out()), gemm.Reference());
  const std::vector<v1::Step> steps = hung.steps();
  ASSERT_EQ(steps.size(), 2u);  // the hung worker is still sent every step
  EXPECT_EQ(steps[1].sequence(), steps[0].sequence() + 1);
}

TEST(CoordinatorDeadlineTest, SlowWorkerIsNotWaitedForPastTheGrace) {
  auto mesh = MakeMesh("dp=2", ShortGrace());
  mesh->worker(0).SetAnswerDelay(absl::Seconds(5));  // answers, but far too late
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const absl::Time start = absl::Now();
  auto r = mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)"),
                                           start + absl::Milliseconds(200));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker 0"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(300) + kSlack);
}

// BUG (server/coordinator.cc, GroupedGemmPerShard's and PutTensor's failure
// paths): after a failed dispatch the new generation is deleted with
// DeleteShardsBestEffort, which dispatches and waits with no deadline of the
// caller's (StepDeadline(InfiniteFuture) = now + step_timeout). A hung worker
// holds that delete too, so the request returns step_timeout + grace after
// its deadline (120 s by default) instead of about the grace. Enable when fixed.
TEST(CoordinatorDeadlineTest, HungWorkerDoesNotHoldAKeptOutputOrPutPastTheDeadline) {
  FakeMesh::Options options = ShortGrace();
  options.coordinator.step_timeout = absl::Seconds(2);
  auto mesh = MakeMesh("dp=2", options);
  mesh->worker(1).SetNeverAnswer(true);
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("y");
  absl::Time deadline = absl::Now() + absl::Milliseconds(200);
  auto r = mesh->coordinator().GroupedGemm(keep, deadline);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  // The grace for the request, and at most once more for a cleanup bounded by it.
  EXPECT_LT(absl::Now() - deadline, 2 * absl::Milliseconds(100) + kSlack);

  deadline = absl::Now() + absl::Milliseconds(200);
  auto put = mesh->coordinator().PutTensor("w", F32({2}, {1, 2}), "", false, deadline);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kDeadlineExceeded) << put.status();
  EXPECT_LT(absl::Now() - deadline, 2 * absl::Milliseconds(100) + kSlack);
}

// A worker that answers after the caller's deadline (within the grace):
// the request fails as the caller saw it, and nothing is kept.
TEST(CoordinatorDeadlineTest, AKeptOutputOrPutWhoseDeadlinePassedIsNotKept) {
  FakeMesh::Options options = ShortGrace();
  auto mesh = MakeMesh("dp=2", options);
  Coordinator& c = mesh->coordinator();
  mesh->worker(0).SetAnswerDelay(absl::Milliseconds(100));  // past a 50 ms deadline, within the grace
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("y");
  auto r = c.GroupedGemm(keep, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not kept"));
  auto put = c.PutTensor("w", F32({2}, {1, 2}), "", false, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kDeadlineExceeded) << put.status();
  EXPECT_TRUE(c.ListTensors().tensors().empty()) << "nothing kept";
  // A cancelled caller likewise.
  mesh->worker(0).SetAnswerDelay(absl::ZeroDuration());
  CallContext gone;
  gone.cancelled = [] { return true; };
  auto cancelled = c.GroupedGemm(keep, absl::InfiniteFuture(), gone);
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled) << cancelled.status();
  EXPECT_TRUE(c.ListTensors().tensors().empty());
  ASSERT_OK(c.GroupedGemm(keep).status());  // and the name is free
  EXPECT_EQ(c.ListTensors().tensors_size(), 1);
}

// GroupedGemmAsync: no thread waits on the workers. Its callback comes with
// the right answer once they reply; a pushed cancellation (the callback
// API's OnCancel) ends a request held by a stuck worker at once, keeps
// nothing, and frees the name; and a failure before dispatch calls back
// inline.
TEST(CoordinatorAsyncTest, TheCallbackCarriesTheAnswerAndACancellationEndsItAtOnce) {
  auto mesh = MakeMesh("dp=2", ShortGrace());
  Coordinator& c = mesh->coordinator();
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const v1::GroupedGemmRequest request = gemm.Request("(dp, None)", "(dp,)");
  absl::Notification answered;
  absl::StatusOr<v1::GroupedGemmResponse> got = absl::UnknownError("no answer");
  c.GroupedGemmAsync(request, absl::Now() + absl::Seconds(10), {}, [&](absl::StatusOr<v1::GroupedGemmResponse> r) {
    got = std::move(r);
    answered.Notify();
  });
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_OK(got.status());
  EXPECT_EQ(Floats(got->out()), gemm.Reference());

  mesh->worker(1).SetNeverAnswer(true);
  v1::GroupedGemmRequest keep = request;
  keep.set_keep_output_as("y");
  CallContext call;
  call.cancellation = std::make_shared<Cancellation>();
  call.cancelled = [cancellation = call.cancellation] { return cancellation->cancelled(); };
  absl::Notification cancelled;
  absl::Status status;
  c.GroupedGemmAsync(keep, absl::Now() + absl::Seconds(30), call, [&](absl::StatusOr<v1::GroupedGemmResponse> r) {
    status = r.status();
    cancelled.Notify();
  });
  ASSERT_TRUE(mesh->worker(1).AwaitHeld(1, absl::Seconds(5)));
  EXPECT_FALSE(cancelled.HasBeenNotified());
  const absl::Time start = absl::Now();
  call.cancellation->Cancel();
  ASSERT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100)) << "at once, not when the worker answers";
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE(c.ListTensors().tensors().empty()) << "nothing kept";
  mesh->worker(1).SetNeverAnswer(false);
  mesh->worker(1).AnswerHeld();
  ASSERT_OK(c.GroupedGemm(keep).status());  // the name is free
  EXPECT_EQ(c.ListTensors().tensors_size(), 1);

  v1::GroupedGemmRequest bad = request;
  bad.mutable_lhs()->set_spec("(nope, None)");
  bool inline_answer = false;
  c.GroupedGemmAsync(bad, absl::Now() + absl::Seconds(5), {}, [&](absl::StatusOr<v1::GroupedGemmResponse> r) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    inline_answer = true;
  });
  EXPECT_TRUE(inline_answer);
}

// A coordinator going away answers the requests still waiting on their
// workers (UNAVAILABLE, saying why), while what their completion touches is
// still there.
TEST(CoordinatorAsyncTest, ARequestStillWaitingIsAnsweredWhenTheCoordinatorGoes) {
  auto mesh = MakeMesh("dp=2", ShortGrace());
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("y");
  mesh->worker(1).SetNeverAnswer(true);
  absl::Notification answered;
  absl::Status status;
  mesh->coordinator().GroupedGemmAsync(keep, absl::Now() + absl::Seconds(60), {},
                                       [&](absl::StatusOr<v1::GroupedGemmResponse> r) {
                                         status = r.status();
                                         answered.Notify();
                                       });
  ASSERT_TRUE(mesh->worker(1).AwaitHeld(1, absl::Seconds(5)));
  FakeWorkerChannel stuck = mesh->worker(1);
  mesh.reset();
  ASSERT_TRUE(answered.HasBeenNotified());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("shutting down"));
  stuck.SetNeverAnswer(false);
  stuck.AnswerHeld();
}

// --------------------------------------------------------- keep_output_as --

// Dispatches one small step on a dp=2 mesh: retired shards ride on it.
void RunAnyStep(Coordinator& c) {
  const Gemm any(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  ASSERT_OK(c.GroupedGemm(any.Request("(dp, None)", "(dp,)")).status());
}

TEST(CoordinatorResidentTest, KeepingOntoAResidentNameNeedsOverwriteOutput) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  const Gemm first(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2, /*seed=*/1);
  v1::GroupedGemmRequest keep = first.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("y");
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse kept, c.GroupedGemm(keep));
  EXPECT_EQ(kept.out().resident(), "y");
  EXPECT_THAT(Shape(kept.out()), ElementsAre(8, 5));
  const std::vector<std::string> old_shards = mesh->worker(0).shard_names();
  ASSERT_EQ(old_shards.size(), 1u);

  // A different output (other rows, other values) under the same name.
  const Gemm second(4, 4, 5, {2, 0, 0, 1, 1, 0}, 2, /*seed=*/5);
  v1::GroupedGemmRequest again = second.Request("(dp, None)", "(dp,)");
  again.set_keep_output_as("y");
  const int steps_before = TotalSteps(*mesh, 2);
  auto refused = c.GroupedGemm(again);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("overwrite_output"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("'y'"));
  EXPECT_EQ(TotalSteps(*mesh, 2), steps_before) << "a refused request must not run";
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched unchanged, c.GetTensor("y"));
  EXPECT_EQ(unchanged.tensor.shape, (std::vector<int64_t>{8, 5}));
  EXPECT_EQ(Floats(unchanged.tensor), first.Reference());

  again.set_overwrite_output(true);
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse replaced, c.GroupedGemm(again));
  EXPECT_THAT(Shape(replaced.out()), ElementsAre(4, 5));
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched now, c.GetTensor("y"));
  EXPECT_EQ(now.tensor.shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(Floats(now.tensor), second.Reference());
  v1::ListTensorsResponse list = c.ListTensors();
  ASSERT_EQ(list.tensors_size(), 1);
  EXPECT_THAT(list.tensors(0).shape(), ElementsAre(4, 5));
  // The replaced generation leaves the workers with the next step.
  RunAnyStep(c);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<std::string> names = mesh->worker(rank).shard_names();
    ASSERT_EQ(names.size(), 1u) << "rank " << rank;
    EXPECT_NE(names[0], old_shards[0]);
  }
}

TEST(CoordinatorResidentTest, PutOntoAResidentNameNeedsOverwrite) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  const HostTensor v1_tensor = F32({2, 3}, Ints(6, 1));
  const HostTensor v2_tensor = F32({4}, Ints(4, 9));
  ASSERT_OK(c.PutTensor("w", v1_tensor, "", false).status());
  auto refused = c.PutTensor("w", v2_tensor, "", false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("overwrite"));
  // keep_output_as shares the namespace.
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("w");
  EXPECT_EQ(c.GroupedGemm(keep).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched unchanged, c.GetTensor("w"));
  EXPECT_EQ(unchanged.tensor.shape, v1_tensor.shape);
  EXPECT_EQ(Floats(unchanged.tensor), Floats(v1_tensor));

  ASSERT_OK(c.PutTensor("w", v2_tensor, "", true).status());
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched replaced, c.GetTensor("w"));
  EXPECT_EQ(replaced.tensor.shape, v2_tensor.shape);
  EXPECT_EQ(Floats(replaced.tensor), Floats(v2_tensor));
}

TEST(CoordinatorResidentTest, ReplacedTensorStaysUntilTheRequestUsingItIsDone) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  ASSERT_OK(c.PutTensor("w", F32({3, 4, 5}, gemm.rhs), "", false).status());
  const std::string old_shard = mesh->worker(0).shard_names().at(0);
  for (int r = 0; r < 2; ++r) mesh->worker(r).SetHoldIf([](const v1::Step& s) { return s.has_gemm(); });
  v1::GroupedGemmRequest uses = gemm.Request("(dp, None)", "(dp,)");
  uses.mutable_rhs()->Clear();
  uses.mutable_rhs()->set_resident("w");
  absl::StatusOr<v1::GroupedGemmResponse> result;
  std::thread request([&] { result = c.GroupedGemm(uses, absl::Now() + absl::Seconds(30)); });
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(mesh->worker(r).AwaitHeld(1, absl::Seconds(10))) << "rank " << r;

  std::vector<float> doubled = gemm.rhs;
  for (float& x : doubled) x *= 2;
  ASSERT_OK(c.PutTensor("w", F32({3, 4, 5}, doubled), "", true).status());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(mesh->worker(r).shard(old_shard).has_value()) << "rank " << r << ": deleted from under a request";
    mesh->worker(r).SetHoldIf(nullptr);
    mesh->worker(r).AnswerHeld();
  }
  request.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(Floats(result->out()), gemm.Reference());  // the generation it resolved
  RunAnyStep(c);  // the retired generation leaves with the next step
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(mesh->worker(r).shard(old_shard).has_value()) << "rank " << r << ": never deleted";
    EXPECT_EQ(mesh->worker(r).shard_names().size(), 1u);
  }
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched now, c.GetTensor("w"));
  EXPECT_EQ(Floats(now.tensor), doubled);
}

TEST(CoordinatorResidentTest, PutFailingOnOneWorkerLeavesTheOldTensorAndNoNewShards) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  const HostTensor old_w = F32({2, 3}, Ints(6, 1));
  ASSERT_OK(c.PutTensor("w", old_w, "", false).status());
  const std::vector<std::string> old_shards = mesh->worker(0).shard_names();
  FakeWorkerChannel full = mesh->worker(1);
  full.SetHandler([full](const v1::Step& s) mutable -> absl::StatusOr<v1::StepResult> {
    if (s.has_store()) return absl::ResourceExhaustedError("over the memory budget");
    return full.RunTrivialWorker(s);
  });
  auto put = c.PutTensor("w", F32({2, 3}, Ints(6, 8)), "", true);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted) << put.status();
  EXPECT_THAT(std::string(put.status().message()), HasSubstr("worker 1"));
  RunAnyStep(c);  // the failed put's leftovers leave with the next step
  EXPECT_EQ(mesh->worker(0).shard_names(), old_shards) << "the new generation is deleted where it landed";
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched back, c.GetTensor("w"));
  EXPECT_EQ(Floats(back.tensor), Floats(old_w));
  full.SetHandler(nullptr);  // the handler holds a handle to its own fake
}

// ------------------------------------------------------------------ names --

struct BadName {
  const char* what;
  std::string name;
};

class CoordinatorNameTest : public ::testing::TestWithParam<BadName> {};

TEST_P(CoordinatorNameTest, BadResidentNameIsInvalidArgumentNamingTheField) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as(GetParam().name);
  absl::Status s = c.GroupedGemm(keep).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("keep_output_as"));
  s = c.PutTensor(GetParam().name, F32({2}, {1, 2}), "", false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("name"));
  EXPECT_EQ(TotalSteps(*mesh, 2), 0);
  EXPECT_EQ(c.ListTensors().tensors_size(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Names, CoordinatorNameTest,
    ::testing::Values(BadName{"TooLong", std::string(kMaxResidentNameBytes + 1, 'a')},
                      BadName{"At", "y@1"}, BadName{"Newline", "y\nz"}, BadName{"Nul", std::string("y\0z", 3)},
                      BadName{"Del", "y\x7f"}),
    [](const ::testing::TestParamInfo<BadName>& info) { return info.param.what; });

TEST(CoordinatorNameTest, LongestNameIsAccepted) {
  auto mesh = MakeMesh("dp=2");
  const std::string longest(kMaxResidentNameBytes, 'a');
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as(longest);
  ASSERT_OK(mesh->coordinator().GroupedGemm(keep).status());
  ASSERT_OK(mesh->coordinator().PutTensor(std::string(kMaxResidentNameBytes, 'b'), F32({2}, {1, 2}), "", false)
                .status());
}

// ------------------------------------------------------------------ enums --

struct BadEnum {
  const char* field;
  std::function<void(v1::GroupedGemmRequest*)> set;
};

class CoordinatorEnumTest : public ::testing::TestWithParam<BadEnum> {};

TEST_P(CoordinatorEnumTest, OutOfRangeEnumIsRefusedBeforeAnyWorkerRuns) {
  auto mesh = MakeMesh("dp=2");
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  v1::GroupedGemmRequest request = gemm.Request("(dp, None)", "(dp,)");
  GetParam().set(&request);
  absl::Status s = mesh->coordinator().GroupedGemm(request).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith(GetParam().field));
  EXPECT_EQ(TotalSteps(*mesh, 2), 0);
  v1::PlanRequest plan;
  *plan.mutable_grouped_gemm() = request;
  s = mesh->coordinator().Plan(plan).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith(GetParam().field));
}

INSTANTIATE_TEST_SUITE_P(
    Enums, CoordinatorEnumTest,
    ::testing::Values(
        BadEnum{"ragged", [](v1::GroupedGemmRequest* r) { r->set_ragged(static_cast<v1::GroupedGemmRequest::Ragged>(7)); }},
        BadEnum{"layout", [](v1::GroupedGemmRequest* r) { r->set_layout(static_cast<v1::GroupedGemmRequest::Layout>(9)); }},
        BadEnum{"compat", [](v1::GroupedGemmRequest* r) { r->set_compat(static_cast<v1::Compat>(5)); }}),
    [](const ::testing::TestParamInfo<BadEnum>& info) { return std::string(info.param.field); });

TEST(CoordinatorEnumTest, QuantizeCompatOutOfRangeIsRefused) {
  auto mesh = MakeMesh("dp=2");
  v1::GroupedQuantizeRequest q;
  *q.mutable_x() = Inline(F32({4, 2}, Ints(8, 0)), "(dp, None)");
  *q.mutable_group_sizes() = GroupSizes({2, 2}, "(dp,)");
  q.set_out_dtype(v1::F8E4M3);
  q.set_compat(static_cast<v1::Compat>(5));
  absl::Status s = mesh->coordinator().GroupedQuantize(q).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("compat"));
  EXPECT_EQ(TotalSteps(*mesh, 2), 0);
}

// -------------------------------------------------------- CheckTensorFits --

// Hopper has no MXFP8 GEMM: a mesh with a CUDA worker refuses it before
// any worker is sent a step (nothing held is touched).
TEST(CoordinatorFp8Test, Mxfp8GemmOnACudaMeshIsUnimplementedBeforeDispatch) {
  FakeMesh::Options options;
  options.backend = "cuda";
  auto mesh = MakeMesh("dp=1", options);
  const int64_t m = 32, k = 64, n = 16;
  v1::GroupedGemmRequest r;
  HostTensorToProto(*ZerosTensor(DType::kF8E4M3, {m, k}), r.mutable_lhs());
  HostTensorToProto(*ZerosTensor(DType::kF8E4M3, {1, n, k}), r.mutable_rhs());
  r.set_rhs_transposed(true);
  HostTensor sizes = *ZerosTensor(DType::kI64, {1});
  sizes.data<int64_t>()[0] = m;
  HostTensorToProto(sizes, r.mutable_group_sizes());
  HostTensorToProto(*ZerosTensor(DType::kE8M0, {m, k / 32}), r.mutable_lhs_scale_inv());
  HostTensorToProto(*ZerosTensor(DType::kE8M0, {1, n, k / 32}), r.mutable_rhs_scale_inv());
  r.set_scaling(v1::MXFP8);
  auto out = mesh->coordinator().GroupedGemm(r, absl::InfiniteFuture(), CallContext());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnimplemented) << out.status();
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("MXFP8"));
  EXPECT_EQ(mesh->worker(0).num_steps(), 0);
}

TEST(CoordinatorBudgetTest, TensorMustFitTheWorkersBudgetsTogether) {
  FakeMesh::Options options;
  options.memory_budget_bytes = kMiB;
  auto mesh = MakeMesh("dp=2,tp=2", options);
  Coordinator& c = mesh->coordinator();
  ASSERT_OK(c.CheckTensorFits("t", 4 * kMiB));  // fully sharded, it fits exactly
  ASSERT_OK(c.CheckTensorFits("t", 1));
  absl::Status s = c.CheckTensorFits("t", 4 * kMiB + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'t'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(4 * kMiB)));
  s = c.CheckTensorFits("t", int64_t{1} << 62);  // a [2^40, 2^20] f32 claim
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
}

// BUG (server/coordinator.cc, CheckTensorFits): the budgets are summed in an
// int64 without an overflow check; budgets whose sum passes 2^63 wrap
// negative (undefined behaviour), and then every tensor is refused. Enable
// when fixed.
TEST(CoordinatorBudgetTest, HugeBudgetsDoNotOverflowTheirSum) {
  FakeMesh::Options options;
  options.memory_budget_bytes = int64_t{1} << 62;
  auto mesh = MakeMesh("dp=2", options);
  ASSERT_OK(mesh->coordinator().CheckTensorFits("t", 1));
}

// --------------------------------------------------------- failing workers --

class CoordinatorFailureTest : public ::testing::TestWithParam<int> {};

TEST_P(CoordinatorFailureTest, TheWorkerThatFailedSaysWhyNotTheAbortedOnes) {
  const int failing = GetParam();
  auto mesh = MakeMesh("dp=4");
  for (int r = 0; r < 4; ++r) {
    mesh->worker(r).SetHandler([r, failing](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
      if (r == failing) return absl::NotFoundError("no resident shard 'x@7' on this worker");
      return absl::AbortedError("another worker failed the step");
    });
  }
  const Gemm gemm(8, 4, 5, {1, 1, 0, 2, 2, 0, 0, 1}, 4);
  absl::Status s = mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith(absl::StrCat("worker ", failing, ": ")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("x@7"));
  for (int r = 0; r < 4; ++r) mesh->worker(r).SetHandler(nullptr);
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse next,
                       mesh->coordinator().GroupedGemm(gemm.Request("(dp, None)", "(dp,)")));
  EXPECT_EQ(Floats(next.out()), gemm.Reference());
}

INSTANTIATE_TEST_SUITE_P(FailingRank, CoordinatorFailureTest, ::testing::Values(0, 2, 3));

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

// ------------------------------------------------------------- liveness --

TEST(CoordinatorLivenessTest, AWorkerMissingItsHeartbeatsIsDownAndRequestsFailAtOnceNamingIt) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  FakeWorkerChannel gone = mesh->worker(1);
  gone.SetPing(absl::UnavailableError("connection refused"));
  c.Heartbeat();
  c.Heartbeat();
  EXPECT_TRUE(c.ClusterInfo().ready()) << "two misses of three: still up";
  c.Heartbeat();
  const v1::ClusterInfo info = c.ClusterInfo();
  EXPECT_FALSE(info.ready());
  ASSERT_EQ(info.workers_size(), 2);
  EXPECT_TRUE(info.workers(1).down());
  EXPECT_THAT(info.workers(1).down_reason(), HasSubstr("connection refused"));
  EXPECT_FALSE(info.workers(0).down());
  const int steps_before = gone.num_steps();
  const Gemm any(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  const absl::Time start = absl::Now();
  auto r = c.GroupedGemm(any.Request("(dp, None)", "(dp,)"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker rank 1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "failed at once, not at a deadline";
  EXPECT_EQ(gone.num_steps(), steps_before) << "nothing was sent to the mesh";
  // It answers again: up, and requests run.
  gone.SetPing(absl::OkStatus());
  c.Heartbeat();
  EXPECT_TRUE(c.ClusterInfo().ready());
  RunAnyStep(c);
}

TEST(CoordinatorLivenessTest, AWorkerRegisteringFromAnotherAddressTakesTheRankThatIsDown) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  // While every rank answers, a third worker is refused.
  EXPECT_EQ(mesh->Register("fake:spare").status().code(), absl::StatusCode::kResourceExhausted);
  mesh->worker(0).SetPing(absl::DeadlineExceededError("no answer"));
  for (int i = 0; i < 3; ++i) c.Heartbeat();
  ASSERT_FALSE(c.ClusterInfo().ready());
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse joined, mesh->Register("fake:restarted"));
  EXPECT_EQ(joined.rank(), 0);
  const v1::ClusterInfo info = c.ClusterInfo();
  EXPECT_TRUE(info.ready());
  EXPECT_EQ(info.workers(0).address(), "fake:restarted");
  EXPECT_FALSE(info.workers(0).down());
  const int before = mesh->fake("fake:restarted").num_steps();
  RunAnyStep(c);
  EXPECT_EQ(mesh->fake("fake:restarted").num_steps(), before + 1) << "rank 0's steps go to the new worker";
}

TEST(CoordinatorLivenessTest, TheHeartbeatThreadMarksAWorkerDownByItself) {
  FakeMesh::Options options;
  options.coordinator.heartbeat_interval = absl::Milliseconds(20);
  options.coordinator.heartbeat_misses = 2;
  auto mesh = MakeMesh("dp=2", options);
  Coordinator& c = mesh->coordinator();
  mesh->worker(1).SetPing(absl::UnavailableError("gone"));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (c.ClusterInfo().ready() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(c.ClusterInfo().ready());
  mesh->worker(1).SetPing(absl::OkStatus());
  while (!c.ClusterInfo().ready() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(c.ClusterInfo().ready());
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(CoordinatorRestartTest, ShardsReportedForAnotherRankDoNotCountAndTheTensorIsLost) {
  // A restarted coordinator whose registry says "w" has shard w@1 on every rank.
  char dir[] = "/tmp/shardgemm_coord_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  {
    ResidentRegistry registry;
    ASSERT_TRUE(registry.MakeDurable(std::string(dir) + "/registry.pb").ok());
    Resident w;
    w.info.set_name("w");
    w.info.set_spec("(dp, None)");
    w.info.set_dtype(v1::F32);
    w.info.add_shape(4);
    w.info.add_shape(2);
    w.shard_name = "w@1";
    (void)registry.Register(w);
  }
  FakeMesh::Options options;
  options.workers = 0;
  auto mesh = MakeMesh("dp=2", options);
  Coordinator& c = mesh->coordinator();
  ASSERT_TRUE(c.MakeDurable(dir).ok());
  // Both workers held rank 0 before (one of them is wrong about it): the second is given rank 1,
  // where its w@1 is rank 0's block, not rank 1's.
  for (const char* address : {"fake:a", "fake:b"}) {
    v1::RegisterRequest r;
    r.set_address(address);
    r.set_previous_rank(0);
    r.add_shards("w@1");
    ASSERT_OK(c.Register(r).status());
  }
  ASSERT_TRUE(c.ClusterInfo().ready());
  const v1::ListTensorsResponse listed = c.ListTensors();
  ASSERT_EQ(listed.tensors_size(), 1);
  EXPECT_TRUE(listed.tensors(0).lost()) << "never assembled from two copies of rank 0's block";
  EXPECT_EQ(c.GetTensor("w").status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

// --------------------------------------------------------------- replicas --

FakeMesh::Options WithReplicas(int replicas) {
  FakeMesh::Options options;
  options.coordinator.replicas = replicas;
  return options;
}

// Until no tensor is restoring (at most 10 s); false on timeout.
bool AwaitRestored(Coordinator& c) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    bool restoring = false;
    const v1::ListTensorsResponse listed = c.ListTensors();
    for (const v1::ResidentTensorInfo& t : listed.tensors()) restoring |= t.restoring();
    if (!restoring) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// Rank `rank`'s worker stops answering and one at `address` takes its rank.
void Replace(FakeMesh& mesh, int rank, const std::string& address) {
  Coordinator& c = mesh.coordinator();
  mesh.worker(rank).SetPing(absl::UnavailableError("connection refused"));
  for (int i = 0; i < 3; ++i) c.Heartbeat();
  ASSERT_FALSE(c.ClusterInfo().ready());
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse joined, mesh.Register(address));
  ASSERT_EQ(joined.rank(), rank);
}

std::set<std::string> Names(const FakeWorkerChannel& worker) {
  const std::vector<std::string> names = worker.shard_names();
  return std::set<std::string>(names.begin(), names.end());
}

TEST(CoordinatorReplicasTest, EveryBlockHasAStandbyCopyOnAnotherWorker) {
  auto mesh = MakeMesh("dp=4", WithReplicas(2));
  Coordinator& c = mesh->coordinator();
  const HostTensor w = F32({8, 3}, Ints(24, 2));
  ASSERT_OK(c.PutTensor("w", w, "(dp, None)", false).status());
  const std::vector<float> all = Floats(w);
  std::map<std::string, int> holders;  // every name, counted over the workers
  for (int r = 0; r < 4; ++r) {
    const std::vector<std::string> names = mesh->worker(r).shard_names();
    ASSERT_EQ(names.size(), 2u) << "rank " << r << ": its block and one standby copy";
    for (const std::string& name : names) {
      ++holders[name];
      const size_t at = name.find("/standby-of-");
      const int block = at == std::string::npos ? r : std::stoi(name.substr(at + 12));
      EXPECT_NE(at == std::string::npos, block != r) << name;
      EXPECT_EQ(Floats(*mesh->worker(r).shard(name)),
                std::vector<float>(all.begin() + block * 6, all.begin() + (block + 1) * 6))
          << "rank " << r << " " << name;
    }
  }
  EXPECT_EQ(holders.size(), 5u) << "the shard name and four standby names";
  const v1::ClusterInfo info = c.ClusterInfo();
  EXPECT_EQ(info.replicas(), 2);
  for (const v1::WorkerInfo& worker : info.workers()) EXPECT_EQ(worker.standby_bytes(), 24) << worker.rank();
  ASSERT_EQ(c.ListTensors().tensors(0).replicas(), 2);
  // A replicated tensor is on every rank already: no standby copy.
  ASSERT_OK(c.PutTensor("everywhere", F32({2, 3}, Ints(6, 3)), "", false).status());
  for (int r = 0; r < 4; ++r) EXPECT_EQ(mesh->worker(r).shard_names().size(), 3u);
  // A delete takes every copy.
  ASSERT_OK(c.DeleteTensor("w"));
  ASSERT_OK(c.DeleteTensor("everywhere"));
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(mesh->worker(r).shard_names().empty()) << "rank " << r;
  const v1::ClusterInfo emptied = c.ClusterInfo();
  for (const v1::WorkerInfo& worker : emptied.workers()) EXPECT_EQ(worker.standby_bytes(), 0);
}

TEST(CoordinatorReplicasTest, AReplacementWorkerGetsItsCopiesBackAndEveryTensorIsServedAgain) {
  auto mesh = MakeMesh("dp=4", WithReplicas(2));
  Coordinator& c = mesh->coordinator();
  const HostTensor w = F32({8, 3}, Ints(24, 2));
  ASSERT_OK(c.PutTensor("w", w, "(dp, None)", false).status());
  const Gemm gemm(8, 4, 5, {1, 0, 1, 0, 2, 0, 1, 1, 0, 0, 0, 2}, 4);
  ASSERT_OK(c.PutTensor("experts", F32({3, 4, 5}, gemm.rhs), "", false).status());
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.mutable_rhs()->Clear();
  keep.mutable_rhs()->set_resident("experts");
  keep.set_keep_output_as("y");
  ASSERT_OK(c.GroupedGemm(keep).status());
  const std::set<std::string> held_by_2 = Names(mesh->worker(2));
  EXPECT_EQ(held_by_2.size(), 5u) << "w, experts, y and the standby copies of w's and y's blocks";

  Replace(*mesh, 2, "fake:new");
  ASSERT_TRUE(AwaitRestored(c));
  EXPECT_EQ(Names(mesh->fake("fake:new")), held_by_2) << "the same copies, under the same names";
  for (const std::string& name : held_by_2) {
    EXPECT_EQ(Floats(*mesh->fake("fake:new").shard(name)), Floats(*mesh->worker(2).shard(name))) << name;
  }
  const v1::ListTensorsResponse listed = c.ListTensors();
  for (const v1::ResidentTensorInfo& t : listed.tensors()) EXPECT_FALSE(t.lost()) << t.name();
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched back, c.GetTensor("w"));
  EXPECT_EQ(Floats(back.tensor), Floats(w));
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched y, c.GetTensor("y"));
  EXPECT_EQ(Floats(y.tensor), gemm.Reference());
  v1::GroupedGemmRequest uses = gemm.Request("(dp, None)", "(dp,)");
  uses.mutable_rhs()->Clear();
  uses.mutable_rhs()->set_resident("experts");
  ASSERT_OK_AND_ASSIGN(v1::GroupedGemmResponse out, c.GroupedGemm(uses));
  EXPECT_EQ(Floats(out.out()), gemm.Reference());
  const Coordinator::Stats stats = c.GetStats();
  EXPECT_EQ(stats.restored, 3);
  EXPECT_EQ(stats.restore_failures, 0);
  EXPECT_GT(stats.restored_bytes, 0);

  // Another worker goes after the restore (its block's other copy was on the new one): still nothing lost.
  Replace(*mesh, 3, "fake:newer");
  ASSERT_TRUE(AwaitRestored(c));
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched again, c.GetTensor("w"));
  EXPECT_EQ(Floats(again.tensor), Floats(w));
  ASSERT_OK_AND_ASSIGN(Coordinator::Fetched y_again, c.GetTensor("y"));
  EXPECT_EQ(Floats(y_again.tensor), gemm.Reference());
}

TEST(CoordinatorReplicasTest, APutWhoseStandbyCopiesDoNotFitKeepsNothing) {
  auto mesh = MakeMesh("dp=2", WithReplicas(2));
  Coordinator& c = mesh->coordinator();
  for (int r = 0; r < 2; ++r) mesh->worker(r).SetMemoryBudget(30);  // one 24-byte block, not two
  auto put = c.PutTensor("w", F32({4, 3}, Ints(12, 1)), "(dp, None)", false);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted) << put.status();
  EXPECT_THAT(std::string(put.status().message()), HasSubstr("budget"));
  EXPECT_TRUE(c.ListTensors().tensors().empty());
  RunAnyStep(c);  // what landed leaves with the next step
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mesh->worker(r).shard_names().empty()) << "rank " << r;
  for (int r = 0; r < 2; ++r) mesh->worker(r).SetMemoryBudget(48);
  ASSERT_OK(c.PutTensor("w", F32({4, 3}, Ints(12, 1)), "(dp, None)", false).status());  // the name is free
  // The mesh's budgets together must hold both copies.
  EXPECT_EQ(c.CheckTensorFits("big", (1 << 30) + 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(c.CheckTensorFits("big", (1 << 30) + 1).message()), HasSubstr("--replicas"));
}

TEST(CoordinatorReplicasTest, AKeptOutputWhoseStandbyCopiesDoNotFitIsNotKept) {
  auto mesh = MakeMesh("dp=2", WithReplicas(2));
  Coordinator& c = mesh->coordinator();
  const Gemm gemm(8, 4, 5, {1, 2, 0, 3, 0, 1}, 2);
  for (int r = 0; r < 2; ++r) mesh->worker(r).SetMemoryBudget(4 * 5 * 4 + 10);  // its own output block only
  v1::GroupedGemmRequest keep = gemm.Request("(dp, None)", "(dp,)");
  keep.set_keep_output_as("y");
  auto kept = c.GroupedGemm(keep);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kResourceExhausted) << kept.status();
  EXPECT_THAT(std::string(kept.status().message()), HasSubstr("keep_output_as"));
  EXPECT_TRUE(c.ListTensors().tensors().empty());
  RunAnyStep(c);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mesh->worker(r).shard_names().empty()) << "rank " << r;
}

TEST(CoordinatorReplicasTest, ARestoreTheNewWorkerRefusesLosesTheTensorSayingWhy) {
  auto mesh = MakeMesh("dp=2", WithReplicas(2));
  Coordinator& c = mesh->coordinator();
  ASSERT_OK(c.PutTensor("w", F32({4, 3}, Ints(12, 1)), "(dp, None)", false).status());
  mesh->fake("fake:small").SetPutShardStatus(absl::ResourceExhaustedError("over its memory budget"));
  Replace(*mesh, 1, "fake:small");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!c.ListTensors().tensors(0).lost() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  const v1::ResidentTensorInfo info = c.ListTensors().tensors(0);
  ASSERT_TRUE(info.lost());
  EXPECT_THAT(info.lost_reason(), HasSubstr("could not be restored"));
  EXPECT_THAT(info.lost_reason(), HasSubstr("over its memory budget"));
  EXPECT_EQ(c.GetTensor("w").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c.GetStats().restore_failures, 1);
}

TEST(CoordinatorReplicasTest, WithOneReplicaAReplacedWorkersTensorsAreLostAsBefore) {
  auto mesh = MakeMesh("dp=2");
  Coordinator& c = mesh->coordinator();
  ASSERT_OK(c.PutTensor("everywhere", F32({2, 3}, Ints(6, 1)), "", false).status());
  Replace(*mesh, 0, "fake:new");
  const v1::ResidentTensorInfo info = c.ListTensors().tensors(0);
  EXPECT_TRUE(info.lost()) << "never restored from the other rank's copy";
  EXPECT_FALSE(info.restoring());
  EXPECT_EQ(mesh->fake("fake:new").num_put_shards(), 0);
}

}  // namespace
}  // namespace shardgemm
