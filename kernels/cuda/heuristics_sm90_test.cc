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

TEST(HeuristicsSm90, BigEqualGroupsTimeBothRoutes) {
  EXPECT_TRUE(ChooseSm90(Preset(8, 2048, 4096, 14336, true)).time_routes);
  ShapeInfo s = Preset(8, 2048, 4096, 14336, true);
  s.equal_groups = false;
  EXPECT_FALSE(ChooseSm90(s).time_routes);
  EXPECT_FALSE(ChooseSm90(Preset(8, 2048, 4096, 14336, false)).time_routes);
  EXPECT_FALSE(ChooseSm90(Preset(16, 512, 2048, 1536, true)).time_routes);  // batched by rule 3 already
}

TEST(HeuristicsSm90, TuneLevels) {
  EXPECT_EQ(ChooseLtTune(1e9, true), LtTune::kNone);
  EXPECT_EQ(ChooseLtTune(240e9, false), LtTune::kNarrow);  // unequal groups: each size its own problem
  EXPECT_EQ(ChooseLtTune(240e9, true), LtTune::kWide);     // a mixtral group
  EXPECT_EQ(ChooseLtTune(8.6e9, true), LtTune::kNarrow);   // small-decode's batched call
  EXPECT_LE(WideLtTunePolicy().max_candidates, 48);
}

TEST(HeuristicsSm90, CublasLtNames) {
  int r, c;
  LtTileDims(23, &r, &c);  // CUBLASLT_MATMUL_TILE_128x256
  EXPECT_EQ(r, 128);
  EXPECT_EQ(c, 256);
  EXPECT_EQ(LtTileName(24), "256x128");
  EXPECT_EQ(LtTileName(0), "undefined");
  EXPECT_EQ(LtTileName(100000), "tile#100000");
  EXPECT_EQ(LtStagesName(35), "64xAUTO");
  EXPECT_EQ(LtStagesName(29), "stages#29");
  EXPECT_EQ(LtClusterName(3), "2x1x1");
  EXPECT_EQ(LtClusterName(0), "auto");
  // Fuller last wave first, then the larger tile.
  EXPECT_GT(LtEnumRank(20, 6.9f), LtEnumRank(23, 6.2f));
  EXPECT_GT(LtEnumRank(23, 3.0f), LtEnumRank(20, 3.0f));
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
