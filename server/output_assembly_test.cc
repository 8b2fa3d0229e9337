#include "server/output_assembly.h"

#include <vector>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

// The block rank `r` of a [4, 6] iota tensor split by (dp, tp) holds.
HostTensor Block(const planner::Mesh& mesh, const planner::PartitionSpec& spec, int r) {
  const std::vector<int64_t> shape = {4, 6};
  HostTensor full = *ZerosTensor(DType::kF32, shape);
  for (int64_t i = 0; i < full.NumElements(); ++i) full.data<float>()[i] = static_cast<float>(i);
  auto offsets = planner::BlockOffsets("out", shape, spec, mesh, r);
  auto local = planner::LocalShape("out", shape, spec, mesh);
  return SliceBlock(full, *offsets, *local);
}

TEST(OutputAssemblyTest, BlocksGoBackInPlaceAndEachReplicaIsFetchedOnce) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2,ep=2,tp=3", "");
  const planner::PartitionSpec spec = *planner::ParsePartitionSpec("(dp, tp)");  // replicated over ep
  std::vector<int> fetched;
  auto out = AssembleBlocks(mesh, DType::kF32, {4, 6}, spec, [&](int r) -> absl::StatusOr<HostTensor> {
    fetched.push_back(r);
    return Block(mesh, spec, r);
  });
  ASSERT_TRUE(out.ok()) << out.status();
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(out->data<float>()[i], static_cast<float>(i)) << i;
  // 12 ranks, 6 distinct blocks: the ranks at ep coordinate 0.
  EXPECT_EQ(fetched, std::vector<int>({0, 1, 2, 6, 7, 8}));
}

TEST(OutputAssemblyTest, AWrongBlockNamesTheRank) {
  const planner::Mesh mesh = *planner::ParseMesh("dp=2", "");
  const planner::PartitionSpec spec = *planner::ParsePartitionSpec("(dp, None)");
  auto out = AssembleBlocks(mesh, DType::kF32, {4, 6}, spec, [&](int r) -> absl::StatusOr<HostTensor> {
    if (r == 1) return *ZerosTensor(DType::kF32, {3, 6});
    return Block(mesh, spec, r);
  });
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(out.status().message().find("worker 1"), std::string::npos) << out.status();
  auto failed = AssembleBlocks(mesh, DType::kF32, {4, 6}, spec,
                               [&](int) -> absl::StatusOr<HostTensor> { return absl::UnavailableError("gone"); });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace shardgemm
