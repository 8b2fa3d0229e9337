#include "worker/collectives.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

MeshPosition Position(int rank) {
  MeshPosition p;
  p.axis_names = {"dp", "fsdp", "ep"};
  p.axis_sizes = {2, 2, 2};
  p.rank = rank;
  int64_t rest = rank;
  p.coords.assign(3, 0);
  for (int d = 2; d >= 0; --d) {
    p.coords[d] = rest % 2;
    rest /= 2;
  }
  return p;
}

TEST(MeshPositionTest, GroupsFollowFirstAxisMajor) {
  MeshPosition p = Position(5);  // coords (1, 0, 1)
  EXPECT_EQ(*p.GroupSize({"fsdp", "ep"}), 4);
  EXPECT_EQ(*p.GroupIndex({"fsdp", "ep"}), 1);
  EXPECT_EQ(*p.GroupIndex({"ep", "fsdp"}), 2);
  EXPECT_EQ(*p.GroupRanks({"fsdp", "ep"}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(*p.GroupRanks({"ep", "fsdp"}), (std::vector<int>{4, 6, 5, 7}));
  EXPECT_EQ(*p.GroupRanks({"dp"}), (std::vector<int>{1, 5}));
  EXPECT_FALSE(p.GroupSize({"tp"}).ok());
}

TEST(CollectivesTest, LocalCollectivesRefuseRealGroups) {
  auto c = MakeLocalCollectives(Position(0));
  auto t = *ZerosTensor(DType::kF32, {4});
  EXPECT_EQ(c->AllReduce(&t, ReduceOp::kSum, {"dp"}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(MakeLocalCollectives(SingleWorkerPosition())->AllReduce(&t, ReduceOp::kSum, {}).ok());
}

TEST(CollectivesTest, TakePiece) {
  auto t = *ZerosTensor(DType::kF32, {4, 2});
  for (int i = 0; i < 8; ++i) t.data<float>()[i] = static_cast<float>(i);
  auto piece = *TakePiece(t, 0, 1, 2, "x");
  EXPECT_EQ(piece.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(piece.data<float>()[0], 4.0f);
  EXPECT_FALSE(TakePiece(t, 1, 0, 3, "x").ok());
}

}  // namespace
}  // namespace shardgemm
