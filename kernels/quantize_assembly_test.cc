#include "kernels/quantize_assembly.h"

#include <random>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

struct Outputs {
  HostTensor data, colwise_data, scale_inv, colwise_scale_inv;
};

// The CPU reference kernel on x [m, k] (F32).
Outputs Quantize(ScalingMode mode, const std::vector<float>& x, int64_t m, int64_t k,
                 const std::vector<int64_t>& sizes, bool rowwise, bool colwise) {
  auto layout = BlockLayout(mode, m, k, rowwise, colwise, sizes);
  EXPECT_TRUE(layout.ok()) << layout.status();
  const DType sdt = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
  Outputs o;
  o.data = *ZerosTensor(DType::kF8E4M3, {m, k});
  o.colwise_data = *ZerosTensor(DType::kF8E4M3, {m, k});
  o.scale_inv = *ZerosTensor(sdt, {layout->rowwise_scale_elems});
  o.colwise_scale_inv = *ZerosTensor(sdt, {layout->colwise_scale_elems});
  GroupedQuantizeArgs a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.m = m;
  a.k = k;
  a.group_sizes = sizes.data();
  a.num_groups = static_cast<int64_t>(sizes.size());
  a.mode = mode;
  a.rowwise = rowwise;
  a.colwise = colwise;
  a.rowwise_data = o.data.data<uint8_t>();
  a.colwise_data = o.colwise_data.data<uint8_t>();
  a.rowwise_scale_inv = o.scale_inv.data<uint8_t>();
  a.colwise_scale_inv = o.colwise_scale_inv.data<uint8_t>();
  std::vector<float> amax(sizes.size());
  a.amax = amax.data();
  EXPECT_TRUE(cpu::GroupedQuantize(a).ok());
  return o;
}

// Row shards of `shard_rows` rows each; shard r holds groups
// first_group[r] .. with sizes[r * local_groups ..]; the rest of its rows
// are padding. Quantizes each shard, assembles, and compares with the
// unsharded quantize of every group's rows gathered in row-shard order.
void ExpectAssembledEqualsUnsharded(ScalingMode mode, bool rowwise, bool colwise, int64_t k,
                                    int64_t shard_rows, const std::vector<int64_t>& sizes,
                                    const std::vector<int64_t>& first_group, int64_t num_groups) {
  const int64_t shards_n = static_cast<int64_t>(first_group.size());
  const int64_t local_groups = static_cast<int64_t>(sizes.size()) / shards_n;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> x(shards_n * shard_rows * k);
  for (float& v : x) v = normal(rng);

  std::vector<RowShard> shards;
  for (int64_t r = 0; r < shards_n; ++r) shards.push_back({r * local_groups, first_group[r]});
  auto groups = MakeGlobalGroups(sizes, shards, local_groups, num_groups);
  ASSERT_TRUE(groups.ok()) << groups.status();
  ASSERT_TRUE(CheckBlockAligned(sizes, *groups, ScaleRowBlock(mode, rowwise, colwise), "s").ok());

  // Unsharded input: each group's rows from every shard, in shard order.
  const int64_t m = shards_n * shard_rows;
  std::vector<float> x_global;
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t r = 0; r < shards_n; ++r) {
      if (g < first_group[r] || g >= first_group[r] + local_groups) continue;
      int64_t row = r * shard_rows;
      for (int64_t j = 0; j < g - first_group[r]; ++j) row += sizes[r * local_groups + j];
      const int64_t n = sizes[r * local_groups + g - first_group[r]];
      x_global.insert(x_global.end(), x.begin() + row * k, x.begin() + (row + n) * k);
    }
  }
  x_global.resize(m * k, 0.f);
  Outputs want = Quantize(mode, x_global, m, k, groups->sizes, rowwise, colwise);

  std::vector<Outputs> local(shards_n);
  std::vector<ShardBlockOutputs> outs;
  for (int64_t r = 0; r < shards_n; ++r) {
    std::vector<float> xs(x.begin() + r * shard_rows * k, x.begin() + (r + 1) * shard_rows * k);
    std::vector<int64_t> ls(sizes.begin() + r * local_groups, sizes.begin() + (r + 1) * local_groups);
    local[r] = Quantize(mode, xs, shard_rows, k, ls, rowwise, colwise);
    outs.push_back({shards[r], shard_rows, &local[r].scale_inv, &local[r].colwise_scale_inv,
                    &local[r].colwise_data});
  }
  BlockQuantize q;
  q.mode = mode;
  q.m = m;
  q.k = k;
  q.rowwise = rowwise;
  q.colwise = colwise;
  auto got = AssembleBlockOutputs(q, sizes, local_groups, *groups, outs);
  ASSERT_TRUE(got.ok()) << got.status();
  if (rowwise) {
    EXPECT_EQ(got->scale_inv.bytes, want.scale_inv.bytes);
    EXPECT_GT(got->scale_inv.NumElements(), 0);
  }
  if (colwise) {
    EXPECT_EQ(got->colwise_scale_inv.bytes, want.colwise_scale_inv.bytes);
  }
  if (colwise && mode != ScalingMode::kMxfp8) {
    EXPECT_EQ(got->colwise_data.bytes, want.colwise_data.bytes);
  }
}

TEST(QuantizeAssemblyTest, Mxfp8TwoShardsAlignedEqualsUnsharded) {
  // Group 0: 32 rows on shard 0 (a whole block), 9 on shard 1; group 2 empty
  // on shard 0; group 3 only on shard 0.
  ExpectAssembledEqualsUnsharded(ScalingMode::kMxfp8, true, true, 64, 80,
                                 {32, 30, 0, 11, 9, 0, 40, 0}, {0, 0}, 4);
}

TEST(QuantizeAssemblyTest, RowwiseOnlyNeedsNoAlignment) {
  for (ScalingMode mode : {ScalingMode::kMxfp8, ScalingMode::kBlock1x128}) {
    ExpectAssembledEqualsUnsharded(mode, true, false, 256, 40, {7, 13, 20, 5, 1, 3}, {0, 0}, 3);
  }
}

TEST(QuantizeAssemblyTest, Block1x128FourShards) {
  ExpectAssembledEqualsUnsharded(ScalingMode::kBlock1x128, true, true, 200, 300,
                                 {128, 3, 0, 256, 0, 0, 128, 0, 128, 0, 0, 200}, {0, 0, 0, 0}, 3);
}

TEST(QuantizeAssemblyTest, Block128x128WholeGroupsPerShard) {
  ExpectAssembledEqualsUnsharded(ScalingMode::kBlock128x128, true, true, 256, 200,
                                 {130, 0, 0, 199}, {0, 0}, 2);
}

TEST(QuantizeAssemblyTest, ExpertShardsHoldDifferentGroups) {
  // (fsdp=2, ep=2) on the rows: shards 0 and 2 hold groups 0-1, 1 and 3 groups 2-3.
  ExpectAssembledEqualsUnsharded(ScalingMode::kMxfp8, true, true, 32, 64,
                                 {32, 5, 32, 30, 3, 0, 1, 0}, {0, 2, 0, 2}, 4);
}

TEST(QuantizeAssemblyTest, MisalignedPieceIsRejectedNamingTheEntry) {
  const std::vector<int64_t> sizes = {40, 8, 10, 30};  // group 0's second piece starts at row 40
  auto groups = MakeGlobalGroups(sizes, {{0, 0}, {2, 0}}, 2, 2);
  ASSERT_TRUE(groups.ok());
  EXPECT_EQ(groups->sizes, (std::vector<int64_t>{50, 38}));
  absl::Status s = CheckBlockAligned(sizes, *groups, 32, "mxfp8 colwise scales");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("group_sizes[2]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("32-row blocks"), std::string::npos) << s;
  EXPECT_TRUE(CheckBlockAligned(sizes, *groups, 1, "mxfp8 scales").ok());
  // An empty piece never starts inside a block.
  EXPECT_TRUE(CheckBlockAligned({40, 0, 0, 30}, *MakeGlobalGroups({40, 0, 0, 30}, {{0, 0}, {2, 0}}, 2, 2),
                                32, "x").ok());
}

TEST(QuantizeAssemblyTest, ScaleRowBlocks) {
  EXPECT_EQ(ScaleRowBlock(ScalingMode::kMxfp8, true, false), 1);
  EXPECT_EQ(ScaleRowBlock(ScalingMode::kMxfp8, true, true), 32);
  EXPECT_EQ(ScaleRowBlock(ScalingMode::kBlock1x128, true, false), 1);
  EXPECT_EQ(ScaleRowBlock(ScalingMode::kBlock1x128, false, true), 128);
  EXPECT_EQ(ScaleRowBlock(ScalingMode::kBlock128x128, true, false), 128);
}

TEST(QuantizeAssemblyTest, WrongShardTensorIsAnInternalError) {
  const std::vector<int64_t> sizes = {4, 4};
  auto groups = MakeGlobalGroups(sizes, {{0, 0}, {1, 0}}, 1, 1);
  ASSERT_TRUE(groups.ok());
  HostTensor short_scales = *ZerosTensor(DType::kE8M0, {3});
  BlockQuantize q;
  q.m = 8;
  q.k = 32;
  auto got = AssembleBlockOutputs(q, sizes, 1, *groups,
                                  {{{0, 0}, 4, &short_scales, nullptr, nullptr},
                                   {{1, 0}, 4, &short_scales, nullptr, nullptr}});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace shardgemm
