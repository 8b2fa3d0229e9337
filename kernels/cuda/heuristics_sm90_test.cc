#include "kernels/cuda/heuristics_sm90.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace cuda {
namespace {

ShapeInfo Preset(int64_t g, int64_t m, int64_t k, int64_t n, bool host) {
  ShapeInfo s;
  s.num_groups = g;
  s.m = g * m;
  s.k = k;
  s.n = n;
  s.rhs_transposed = true;
  s.has_host_sizes = host;
  s.equal_groups = host;
  s.max_group = host ? m : 0;
  s.eligible = 0x3e;  // every strategy
  return s;
}

TEST(HeuristicsSm90, NoHostSizesTakesTheDeviceKernel) {
  EXPECT_EQ(ChooseSm90(Preset(16, 512, 2048, 1536, false)).strategy, Strategy::kSm90);
  EXPECT_EQ(ChooseSm90(Preset(64, 64, 1024, 1024, false)).strategy, Strategy::kSm90);
}

TEST(HeuristicsSm90, NoHostSizesButBigGroupsLoop) {
  EXPECT_EQ(ChooseSm90(Preset(8, 2048, 4096, 14336, false)).strategy, Strategy::kLtLoop);
}

TEST(HeuristicsSm90, BigGroupsLoopOverCublasLt) {
  EXPECT_EQ(ChooseSm90(Preset(8, 2048, 4096, 14336, true)).strategy, Strategy::kLtLoop);
  EXPECT_EQ(ChooseSm90(Preset(8, 2048, 4096, 14336, true)).lt_streams, 1);
  EXPECT_EQ(ChooseSm90(Preset(8, 2048, 2048, 7168, true)).strategy, Strategy::kLtLoop);
}

TEST(HeuristicsSm90, SmallEqualGroupsBatch) {
  EXPECT_EQ(ChooseSm90(Preset(128, 128, 2048, 1536, true)).strategy, Strategy::kLtBatched);
  EXPECT_EQ(ChooseSm90(Preset(16, 512, 2048, 1536, true)).strategy, Strategy::kLtBatched);
}

TEST(HeuristicsSm90, SmallRaggedGroupsTakeTheDeviceKernel) {
  ShapeInfo s = Preset(64, 64, 1024, 1024, true);
  s.equal_groups = false;
  Choice c = ChooseSm90(s);
  EXPECT_EQ(c.strategy, Strategy::kSm90);
  EXPECT_EQ(c.sm90_tile_m, 64);
  s = Preset(16, 512, 2048, 1536, true);
  s.equal_groups = false;
  c = ChooseSm90(s);
  EXPECT_EQ(c.strategy, Strategy::kSm90);
  EXPECT_EQ(c.sm90_tile_m, 128);
  EXPECT_EQ(c.sm90_tile_n, 128);  // (64 + 16) x 6 = 480 tiles of 256 columns: < 4 waves
}

TEST(HeuristicsSm90, WithoutTheKernelRaggedGroupsUseGroupedBatched) {
  ShapeInfo s = Preset(128, 128, 2048, 1536, true);
  s.eligible &= ~(1u << static_cast<int>(Strategy::kSm90));
  s.equal_groups = false;
  EXPECT_EQ(ChooseSm90(s).strategy, Strategy::kGroupedBatched);
}

TEST(HeuristicsSm90, RaggedK) {
  ShapeInfo s = Preset(8, 2048, 2048, 7168, true);
  s.ragged_k = true;
  EXPECT_EQ(ChooseSm90(s).strategy, Strategy::kLtBatched);
  s.equal_groups = false;
  EXPECT_EQ(ChooseSm90(s).strategy, Strategy::kLtLoop);
}

TEST(HeuristicsSm90, Names) { EXPECT_EQ(StrategyName(Strategy::kSm90), "sm90"); }

}  // namespace
}  // namespace cuda
}  // namespace shardgemm
