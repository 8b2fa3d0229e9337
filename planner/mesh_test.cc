#include "planner/mesh.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace planner {
namespace {

TEST(MeshTest, ParsesAxesAndDefaultRoles) {
  absl::StatusOr<Mesh> mesh = ParseMesh("dp=2, fsdp=2,ep=2", "");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  ASSERT_EQ(mesh->axes.size(), 3u);
  EXPECT_EQ(mesh->axes[1].name, "fsdp");
  EXPECT_EQ(mesh->axes[1].size, 2);
  EXPECT_EQ(mesh->roles.dp, "dp");
  EXPECT_EQ(mesh->roles.fsdp, "fsdp");
  EXPECT_EQ(mesh->roles.ep, "ep");
  EXPECT_EQ(mesh->roles.tp, "");
  EXPECT_EQ(NumWorkers(*mesh), 8);
  EXPECT_EQ(FormatMesh(*mesh), "dp=2,fsdp=2,ep=2");
}

TEST(MeshTest, ExplicitRoles) {
  absl::StatusOr<Mesh> mesh = ParseMesh("data=2,expert=4,tp=1", "dp=data,ep=expert");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->roles.dp, "data");
  EXPECT_EQ(mesh->roles.ep, "expert");
  EXPECT_EQ(mesh->roles.tp, "tp");
  EXPECT_EQ(RoleOf(*mesh, "expert"), Role::kEp);
  EXPECT_EQ(RoleOf(*mesh, "nope"), Role::kNone);
  EXPECT_EQ(FormatRoles(mesh->roles), "dp=data,ep=expert,tp=tp");
}

TEST(MeshTest, ExplicitRoleTakesSameNamedAxis) {
  // 'ep' is bound to dp explicitly, so the ep role does not default to it.
  absl::StatusOr<Mesh> mesh = ParseMesh("ep=2,x=2", "dp=ep");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->roles.dp, "ep");
  EXPECT_EQ(mesh->roles.ep, "");
}

TEST(MeshTest, RankCoordsRoundTripRowMajor) {
  absl::StatusOr<Mesh> mesh = ParseMesh("a=2,b=3,c=2", "");
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(*RankToCoords(*mesh, 0), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(*RankToCoords(*mesh, 1), (std::vector<int64_t>{0, 0, 1}));
  EXPECT_EQ(*RankToCoords(*mesh, 2), (std::vector<int64_t>{0, 1, 0}));
  EXPECT_EQ(*RankToCoords(*mesh, 11), (std::vector<int64_t>{1, 2, 1}));
  for (int64_t r = 0; r < NumWorkers(*mesh); ++r) {
    EXPECT_EQ(*CoordsToRank(*mesh, *RankToCoords(*mesh, r)), r);
  }
  EXPECT_FALSE(RankToCoords(*mesh, 12).ok());
  EXPECT_FALSE(RankToCoords(*mesh, -1).ok());
  EXPECT_FALSE(CoordsToRank(*mesh, {0, 3, 0}).ok());
  EXPECT_FALSE(CoordsToRank(*mesh, {0, 0}).ok());
}

TEST(MeshTest, Rejects) {
  const char* bad[][2] = {
      {"", ""},           {"dp", ""},          {"dp=0", ""},
      {"dp=-1", ""},      {"dp=x", ""},        {"dp=2,dp=2", ""},
      {"1x=2", ""},       {"dp=2", "dp=nope"}, {"dp=2", "zz=dp"},
      {"dp=2", "dp=dp,fsdp=dp"}, {"a=4096,b=2", ""}, {"dp=2", "dp"},
      {"dp=2", "dp=dp,dp=dp"},   {"dp=99999999999999999999", ""},
  };
  for (const auto& b : bad) {
    absl::StatusOr<Mesh> mesh = ParseMesh(b[0], b[1]);
    EXPECT_FALSE(mesh.ok()) << b[0] << " / " << b[1];
    if (!mesh.ok()) {
      EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_FALSE(mesh.status().message().empty());
    }
  }
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm
