#include "server/replica_placement.h"

#include <map>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

planner::Mesh MeshOf(const char* text) {
  auto mesh = planner::ParseMesh(text, "");
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return *mesh;
}

std::vector<int> Owners(const planner::Mesh& mesh, const char* spec, std::vector<int64_t> shape) {
  auto parsed = planner::ParsePartitionSpec(spec);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  auto owners = BlockOwners(mesh, "t", shape, *parsed);
  EXPECT_TRUE(owners.ok()) << owners.status();
  return owners.ok() ? *owners : std::vector<int>();
}

// Every block's holders (its own ranks and its standby copies), by block rank.
std::map<int, std::multiset<int>> Holders(const std::vector<int>& owners, const std::vector<StandbyCopy>& standby) {
  std::map<int, std::multiset<int>> holders;
  for (int r = 0; r < static_cast<int>(owners.size()); ++r) holders[owners[r]].insert(r);
  for (const StandbyCopy& c : standby) holders[c.block_rank].insert(c.holder_rank);
  return holders;
}

TEST(ReplicaPlacementTest, RanksSharingABlockHaveOneOwner) {
  const planner::Mesh mesh = MeshOf("ep=2,fsdp=2");  // rank = ep * 2 + fsdp
  EXPECT_EQ(Owners(mesh, "(ep, None)", {4, 4}), (std::vector<int>{0, 0, 2, 2}));
  EXPECT_EQ(Owners(mesh, "(fsdp, None)", {4, 4}), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(Owners(mesh, "((ep, fsdp), None)", {4, 4}), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(Owners(mesh, "", {4, 4}), (std::vector<int>{0, 0, 0, 0}));
}

TEST(ReplicaPlacementTest, NoBlocksCopiesShareAWorkerAndEveryBlockHasItsReplicas) {
  const planner::Mesh mesh = MeshOf("ep=2,fsdp=2");
  for (const char* spec : {"((ep, fsdp), None)", "(ep, None)", "(fsdp, None)", ""}) {
    const std::vector<int> owners = Owners(mesh, spec, {8, 4});
    for (int replicas = 1; replicas <= 4; ++replicas) {
      auto standby = PlaceStandbyCopies(owners, replicas, 100, std::vector<int64_t>(4, 0));
      ASSERT_TRUE(standby.ok()) << standby.status();
      for (const auto& [block, holders] : Holders(owners, *standby)) {
        const std::set<int> distinct(holders.begin(), holders.end());
        EXPECT_EQ(distinct.size(), holders.size()) << spec << " replicas " << replicas << ": block " << block
                                                   << " has two copies on one worker";
        EXPECT_GE(static_cast<int>(holders.size()), replicas) << spec << ": block " << block;
        EXPECT_EQ(CopiesOfBlock(owners, *standby, block), static_cast<int>(holders.size()));
      }
      // Only the copies the spec does not give already.
      for (const StandbyCopy& c : *standby) {
        EXPECT_LT(CopiesOfBlock(owners, {}, c.block_rank), replicas) << spec;
        EXPECT_NE(owners[c.holder_rank], c.block_rank) << "a standby copy on a rank that holds the block itself";
      }
    }
  }
}

TEST(ReplicaPlacementTest, ABlockTheSpecGivesEnoughRanksNeedsNoStandbyCopy) {
  const planner::Mesh mesh = MeshOf("ep=2,fsdp=2");
  auto replicated = PlaceStandbyCopies(Owners(mesh, "", {8, 4}), 4, 100, std::vector<int64_t>(4, 0));
  ASSERT_TRUE(replicated.ok());
  EXPECT_TRUE(replicated->empty()) << "a replicated tensor is on every rank already";
  auto twice = PlaceStandbyCopies(Owners(mesh, "(ep, None)", {8, 4}), 2, 100, std::vector<int64_t>(4, 0));
  ASSERT_TRUE(twice.ok());
  EXPECT_TRUE(twice->empty()) << "each ep block is on both fsdp ranks";
  auto sharded = PlaceStandbyCopies(Owners(mesh, "((ep, fsdp), None)", {8, 4}), 2, 100, std::vector<int64_t>(4, 0));
  ASSERT_TRUE(sharded.ok());
  EXPECT_EQ(sharded->size(), 4u) << "one standby copy per block";
}

TEST(ReplicaPlacementTest, CopiesGoToTheLeastLoadedWorkersAndSpreadOut) {
  const std::vector<int> owners = {0, 1, 2, 3};
  auto even = PlaceStandbyCopies(owners, 2, 100, std::vector<int64_t>(4, 0));
  ASSERT_TRUE(even.ok());
  std::vector<int> per_holder(4, 0);
  for (const StandbyCopy& c : *even) ++per_holder[c.holder_rank];
  EXPECT_EQ(per_holder, (std::vector<int>{1, 1, 1, 1})) << "each worker holds one other's block";
  // Rank 1 already holds much more: block 0's copy goes to rank 2, though rank 1 comes first after it.
  auto loaded = PlaceStandbyCopies({0, 1, 2}, 2, 100, {0, 1000, 0});
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 3u);
  EXPECT_EQ((*loaded)[0], (StandbyCopy{0, 2}));
  EXPECT_EQ((*loaded)[1], (StandbyCopy{1, 0})) << "rank 2 has block 0's copy now; rank 0 is the lighter";
  auto skewed = PlaceStandbyCopies(owners, 2, 100, {0, 5000, 0, 0});
  ASSERT_TRUE(skewed.ok());
  for (const StandbyCopy& c : *skewed) EXPECT_NE(c.holder_rank, 1) << "the loaded rank gets no copy";
}

TEST(ReplicaPlacementTest, ReplicasOutsideTheMeshAreRefusedNamingTheFlag) {
  for (int replicas : {0, 5}) {
    auto placed = PlaceStandbyCopies({0, 1, 2, 3}, replicas, 1, std::vector<int64_t>(4, 0));
    EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(placed.status().message().find("--replicas"), std::string::npos) << placed.status();
  }
}

TEST(ReplicaPlacementTest, StandbyNamesKeepTheGenerationAndTheBlock) {
  EXPECT_EQ(StandbyShardName("w@0123", 3), "w@0123/standby-of-3");
  EXPECT_NE(StandbyShardName("w@0123", 1), StandbyShardName("w@0123", 2));
}

}  // namespace
}  // namespace shardgemm
