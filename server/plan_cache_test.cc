#include "server/plan_cache.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "planner/operand_text.h"

namespace shardgemm {
namespace {

planner::PlanRequest Gemm(int64_t rows, const std::string& lhs_spec = "(ep,None)") {
  planner::PlanRequest r;
  r.mesh = *planner::ParseMesh("ep=2", "");
  r.op = planner::OpKind::kGroupedGemmRaggedM;
  auto add = [&](const std::string& name, const std::string& text, DType dtype) {
    auto o = planner::ParseOperand(name, text, dtype);
    EXPECT_TRUE(o.ok()) << o.status();
    r.operands.push_back(*o);
  };
  add("lhs", absl::StrCat(rows, "x32@", lhs_spec), DType::kBF16);
  add("rhs", "4x32x16@(ep,None,None)", DType::kBF16);
  add("group_sizes", "4@(ep,)", DType::kI32);
  return r;
}

TEST(PlanCacheTest, TheSameRequestGetsTheSamePlanPlannedOnce) {
  PlanCache cache;
  auto first = cache.Get(Gemm(64));
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = cache.Get(Gemm(64));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(first->get(), again->get());  // the kept plan, not a new one
  auto made = planner::MakePlan(Gemm(64));
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(planner::FormatPlanText(**again), planner::FormatPlanText(*made));
  EXPECT_EQ(cache.stats().hits, 1);
  EXPECT_EQ(cache.stats().misses, 1);
}

TEST(PlanCacheTest, ADifferentRequestGetsItsOwnPlan) {
  PlanCache cache;
  auto a = cache.Get(Gemm(64));
  auto b = cache.Get(Gemm(128));
  planner::PlanRequest gathered = Gemm(64);
  gathered.out_spec = *planner::ParsePartitionSpec("(None, None)");  // the output all-gathered
  auto c = cache.Get(gathered);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*a)->operands[0].global_shape[0], 64);
  EXPECT_EQ((*b)->operands[0].global_shape[0], 128);
  EXPECT_NE(planner::FormatPlanText(**a), planner::FormatPlanText(**c));
  EXPECT_EQ(cache.stats().size, 3u);
}

TEST(PlanCacheTest, RefusalsAreNotKeptAndSayWhy) {
  PlanCache cache;
  planner::PlanRequest bad = Gemm(64);
  bad.operands[1].shape[1] = 31;  // K does not match
  for (int i = 0; i < 2; ++i) {
    auto p = cache.Get(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(cache.stats().size, 0u);
  EXPECT_EQ(cache.stats().misses, 2);
}

TEST(PlanCacheTest, TheLeastRecentlyUsedGoesFirst) {
  PlanCache cache(6);  // two plans of 2 workers (3 parts each)
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  ASSERT_TRUE(cache.Get(Gemm(128)).ok());
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());   // 64 is the most recent now
  ASSERT_TRUE(cache.Get(Gemm(256)).ok());  // 128 goes
  EXPECT_EQ(cache.stats().size, 2u);
  EXPECT_EQ(cache.stats().parts, 6u);
  const int64_t misses = cache.stats().misses;
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  EXPECT_EQ(cache.stats().misses, misses);  // kept
  ASSERT_TRUE(cache.Get(Gemm(128)).ok());
  EXPECT_EQ(cache.stats().misses, misses + 1);  // planned again
}

TEST(PlanCacheTest, CapacityZeroKeepsNothing) {
  PlanCache cache(0);
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  EXPECT_EQ(cache.stats().misses, 2);
  EXPECT_EQ(cache.stats().size, 0u);
}

TEST(PlanCacheTest, APlanLargerThanTheCapacityIsNotKept) {
  PlanCache cache(2);  // a 2-worker plan needs 3
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  ASSERT_TRUE(cache.Get(Gemm(64)).ok());
  EXPECT_EQ(cache.stats().size, 0u);
  EXPECT_EQ(cache.stats().misses, 2);
}

TEST(PlanCacheTest, ConcurrentCallersAgree) {
  PlanCache cache(12);  // four plans
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const int64_t rows = 64 * (1 + (i + t) % 6);  // more shapes than it keeps
        auto p = cache.Get(Gemm(rows));
        if (!p.ok() || (*p)->operands[0].global_shape[0] != rows) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(cache.stats().size, 4u);
  EXPECT_LE(cache.stats().parts, 12u);
}

}  // namespace
}  // namespace shardgemm
