#include "server/block_runs.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/host_tensor.h"

namespace shardgemm {
namespace {

// The block's bytes as the pieces give them, the tensor sent in chunks of the given sizes.
std::string Gathered(BlockRuns runs, const std::string& bytes, const std::vector<int64_t>& chunks) {
  std::string out;
  int64_t from = 0;
  for (int64_t c : chunks) {
    runs.Take(from, absl::string_view(bytes).substr(from, c), [&](absl::string_view p) { out.append(p.data(), p.size()); });
    from += c;
  }
  EXPECT_TRUE(runs.done());
  return out;
}

HostTensor Counting(const std::vector<int64_t>& shape) {
  HostTensor t;
  t.dtype = DType::kF32;
  t.shape = shape;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.bytes.resize(n * 4);
  for (int64_t i = 0; i < n * 4; ++i) t.bytes[i] = static_cast<char>(i * 7 + i / 251);
  return t;
}

TEST(BlockRunsTest, ABlockSplitOnlyOnDimZeroIsOneRun) {
  auto runs = BlockRuns::Make({8, 4}, {2, 0}, {3, 4}, 4);
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_EQ(runs->num_runs(), 1);
  EXPECT_EQ(runs->run_bytes(), 3 * 4 * 4);
  const HostTensor t = Counting({8, 4});
  // Every piece is a view of the chunk: the whole block comes as one piece from one chunk.
  std::vector<absl::string_view> pieces;
  runs->Take(0, t.bytes, [&](absl::string_view p) { pieces.push_back(p); });
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].data(), t.bytes.data() + 2 * 16);
  EXPECT_TRUE(runs->done());
}

TEST(BlockRunsTest, AColumnBlockIsARunPerRow) {
  auto runs = BlockRuns::Make({3, 6}, {0, 2}, {3, 2}, 4);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(runs->num_runs(), 3);
  EXPECT_EQ(runs->run_bytes(), 8);
  const HostTensor t = Counting({3, 6});
  EXPECT_EQ(Gathered(*runs, t.bytes, {static_cast<int64_t>(t.bytes.size())}),
            SliceBlock(t, {0, 2}, {3, 2}).bytes);
}

TEST(BlockRunsTest, EveryBlockOfRandomShapesInRandomChunksIsItsSlice) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    std::vector<int64_t> shape(rank), offsets(rank), extent(rank);
    for (int d = 0; d < rank; ++d) {
      shape[d] = 1 + static_cast<int64_t>(rng() % 6);
      extent[d] = rng() % 3 == 0 ? shape[d] : static_cast<int64_t>(rng() % (shape[d] + 1));
      offsets[d] = static_cast<int64_t>(rng() % (shape[d] - extent[d] + 1));
    }
    const HostTensor t = Counting(shape);
    std::vector<int64_t> chunks;
    for (int64_t left = static_cast<int64_t>(t.bytes.size()); left > 0;) {
      const int64_t c = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng() % 40));
      chunks.push_back(c);
      left -= c;
    }
    auto runs = BlockRuns::Make(shape, offsets, extent, 4);
    ASSERT_TRUE(runs.ok()) << runs.status();
    EXPECT_EQ(Gathered(*runs, t.bytes, chunks), SliceBlock(t, offsets, extent).bytes)
        << "trial " << trial << " shape " << ShapeToString(shape) << " at " << ShapeToString(offsets) << " size "
        << ShapeToString(extent);
  }
}

TEST(BlockRunsTest, ABlockOutsideTheTensorIsRefusedNamingTheDimension) {
  auto runs = BlockRuns::Make({4, 4}, {0, 3}, {4, 2}, 4);
  ASSERT_FALSE(runs.ok());
  EXPECT_EQ(runs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(runs.status().message().find("dim 1"), std::string::npos) << runs.status();
  EXPECT_FALSE(BlockRuns::Make({4, 4}, {0}, {4}, 4).ok());
}

TEST(BlockRunsTest, AScalarIsOneRunOfOneElement) {
  auto runs = BlockRuns::Make({}, {}, {}, 2);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(runs->block_bytes(), 2);
  EXPECT_EQ(Gathered(*runs, "ab", {1, 1}), "ab");
}

}  // namespace
}  // namespace shardgemm
