#include "planner/spec.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace planner {
namespace {

PartitionSpec Spec(std::vector<std::vector<std::string>> dims) { return PartitionSpec{dims}; }

TEST(SpecTest, ParsesJaxStyles) {
  struct Case {
    const char* text;
    PartitionSpec want;
    const char* canonical;
  } cases[] = {
      {"(('fsdp','ep'), None, 'tp')", Spec({{"fsdp", "ep"}, {}, {"tp"}}), "((fsdp, ep), None, tp)"},
      {"((fsdp,ep),None,tp)", Spec({{"fsdp", "ep"}, {}, {"tp"}}), "((fsdp, ep), None, tp)"},
      {"(ep,)", Spec({{"ep"}}), "(ep,)"},
      {"( \"ep\" , )", Spec({{"ep"}}), "(ep,)"},
      {"()", Spec({}), "()"},
      {"", Spec({}), "()"},
      {"  ", Spec({}), "()"},
      {"(None, None)", Spec({{}, {}}), "(None, None)"},
      {"(('ep',), ())", Spec({{"ep"}, {}}), "(ep, None)"},
      {"((dp, fsdp,), tp)", Spec({{"dp", "fsdp"}, {"tp"}}), "((dp, fsdp), tp)"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(c.text);
    ASSERT_TRUE(spec.ok()) << c.text << ": " << spec.status();
    EXPECT_EQ(*spec, c.want) << c.text;
    EXPECT_EQ(FormatPartitionSpec(*spec), c.canonical);
    absl::StatusOr<PartitionSpec> again = ParsePartitionSpec(FormatPartitionSpec(*spec));
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *spec);
  }
}

TEST(SpecTest, RejectsBadSyntax) {
  for (const char* text : {"(", ")", "(ep", "(ep,,)", "((ep)", "(1ep)", "('ep)", "ep",
                           "(ep) x", "(,)", "((,))", "(ep;dp)", "(-)"}) {
    absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(text);
    EXPECT_FALSE(spec.ok()) << text;
    if (!spec.ok()) {
      EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(SpecTest, ValidateNamesTensorDimAndAxis) {
  Mesh mesh = *ParseMesh("dp=2,fsdp=2,ep=2", "");
  EXPECT_TRUE(ValidatePartitionSpec("lhs", {8, 4}, Spec({{"dp", "fsdp"}}), mesh).ok());
  absl::Status s = ValidatePartitionSpec("lhs", {8, 4}, Spec({{"dp"}, {"zz"}}), mesh);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lhs dim 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("zz"), std::string::npos) << s;
  s = ValidatePartitionSpec("rhs", {8, 4}, Spec({{"dp"}, {"dp"}}), mesh);
  EXPECT_NE(s.message().find("used twice"), std::string::npos) << s;
  s = ValidatePartitionSpec("rhs", {8, 4}, Spec({{}, {}, {}}), mesh);
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  s = ValidatePartitionSpec("x", {6, 4}, Spec({{"dp", "fsdp"}}), mesh);
  EXPECT_NE(s.message().find("x dim 0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("not divisible by 4"), std::string::npos) << s;
}

TEST(SpecTest, GeometryFirstAxisMajor) {
  Mesh mesh = *ParseMesh("dp=2,fsdp=2,ep=2", "");
  PartitionSpec spec = Spec({{"ep", "dp"}, {}, {"fsdp"}});
  std::vector<int64_t> shape = {8, 3, 4};
  EXPECT_EQ(*LocalShape("t", shape, spec, mesh), (std::vector<int64_t>{2, 3, 2}));
  // rank 5 = (dp 1, fsdp 0, ep 1): dim 0 block = ep*2 + dp = 3.
  EXPECT_EQ(*BlockOffsets("t", shape, spec, mesh, 5), (std::vector<int64_t>{6, 0, 0}));
  // rank 2 = (0, 1, 0): dim 0 block 0, dim 2 block 1.
  EXPECT_EQ(*BlockOffsets("t", shape, spec, mesh, 2), (std::vector<int64_t>{0, 0, 2}));
  EXPECT_FALSE(BlockOffsets("t", shape, spec, mesh, 8).ok());
}

TEST(SpecTest, PeerRanksOrderedByPiece) {
  Mesh mesh = *ParseMesh("dp=2,fsdp=2,ep=2", "");
  // rank 5 = (1, 0, 1); peers over (ep, fsdp): pieces ep-major.
  absl::StatusOr<std::vector<int64_t>> peers = PeerRanks(mesh, {"ep", "fsdp"}, 5);
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_EQ(*peers, (std::vector<int64_t>{4, 6, 5, 7}));
  EXPECT_EQ((*peers)[BlockIndex(mesh, {"ep", "fsdp"}, *RankToCoords(mesh, 5))], 5);
  EXPECT_EQ(*PeerRanks(mesh, {}, 3), (std::vector<int64_t>{3}));
  EXPECT_EQ(*PeerRanks(mesh, {"dp"}, 3), (std::vector<int64_t>{3, 7}));
  EXPECT_FALSE(PeerRanks(mesh, {"zz"}, 0).ok());
  EXPECT_FALSE(PeerRanks(mesh, {"dp", "dp"}, 0).ok());
  EXPECT_FALSE(PeerRanks(mesh, {"dp"}, 8).ok());
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm
