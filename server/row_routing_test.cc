#include "server/row_routing.h"

#include <random>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(RowRoutingTest, ExpertsGoToTheirOwnersAndSplitOverDataAxes) {
  // Rows over (fsdp=2, ep=2): shards 0,2 own experts 0-1, shards 1,3 experts 2-3.
  auto r = *RouteSortedRows({3, 1, 4, 0}, 10, {2, 2}, /*ep_index=*/1);
  EXPECT_EQ(r.num_shards, 4);
  EXPECT_EQ(r.groups_per_shard, 2);
  EXPECT_EQ(r.shard_group_sizes, (std::vector<int64_t>{2, 1, 2, 0, 1, 0, 2, 0}));
  EXPECT_EQ(r.shard_rows, 3);
  // Shard 0: group 0's first 2 rows, group 1's row (source 3).
  EXPECT_EQ(std::vector<int64_t>(r.source_row.begin(), r.source_row.begin() + 3),
            (std::vector<int64_t>{0, 1, 3}));
  // Shard 2 (fsdp=1, ep=0): group 0's third row, then padding.
  EXPECT_EQ(std::vector<int64_t>(r.source_row.begin() + 6, r.source_row.begin() + 9),
            (std::vector<int64_t>{2, -1, -1}));
}

TEST(RowRoutingTest, EveryRowLandsExactlyOnce) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int ep = 1 + rng() % 3, dp = 1 + rng() % 3, g = ep * (1 + rng() % 3);
    std::vector<int64_t> sizes(g);
    int64_t total = 0;
    for (auto& s : sizes) total += (s = rng() % 7);
    auto r = RouteSortedRows(sizes, total + rng() % 3, {dp, ep}, 1);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<int> seen(total, 0);
    for (int64_t src : r->source_row) if (src >= 0) ++seen[src];
    for (int64_t i = 0; i < total; ++i) EXPECT_EQ(seen[i], 1) << "trial " << trial;
  }
}

TEST(RowRoutingTest, RejectsBadSizes) {
  EXPECT_FALSE(RouteSortedRows({3, -1}, 10, {2}, -1).ok());
  EXPECT_FALSE(RouteSortedRows({8, 8}, 10, {2}, -1).ok());
  EXPECT_FALSE(RouteSortedRows({1, 1, 1}, 10, {2}, 0).ok());  // 3 groups over ep=2
}

}  // namespace
}  // namespace shardgemm
