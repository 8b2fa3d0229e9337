#include "platform/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

// A shared-memory object of `bytes` for one test, removed after it.
class Object {
 public:
  explicit Object(uint64_t bytes) : key_(absl::StrCat("/shardgemm_test_", getpid(), "_", counter_++)) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    close(fd);
  }
  ~Object() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }

 private:
  static inline int counter_ = 0;
  std::string key_;
};

TEST(SharedMemoryKey, OnlyPortableNames) {
  EXPECT_TRUE(CheckSharedMemoryKey("/a", "key").ok());
  EXPECT_TRUE(CheckSharedMemoryKey("/psm_1f2e", "key").ok());
  for (const std::string& bad : std::vector<std::string>{"", "/", "a", "/a/b", std::string("/a\0b", 4), "/" + std::string(255, 'x')}) {
    auto s = CheckSharedMemoryKey(bad, "key");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("key"), absl::string_view::npos);
  }
}

TEST(SharedMemoryObject, SizeOfAnObjectAndNotFoundForNone) {
  Object object(4096);
  EXPECT_EQ(*SharedMemoryObjectSize(object.key(), "key"), 4096u);
  EXPECT_EQ(SharedMemoryObjectSize("/shardgemm_no_such_object", "key").status().code(), absl::StatusCode::kNotFound);
}

TEST(SharedMemoryMapping, AnObjectSmallerThanRegisteredIsAFailedPrecondition) {
  Object object(100);
  auto m = SharedMemoryMapping::Map(object.key(), 200, false, "region");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
  EXPECT_TRUE(SharedMemoryMapping::Map(object.key(), 100, false, "region").ok());
}

// Every block of a 3-D tensor at an offset in the region, out and back in,
// against a naive index loop.
TEST(SharedMemoryBlocks, BlocksComeOutAndGoInRowMajor) {
  const std::vector<int64_t> shape = {3, 5, 4};
  const uint64_t offset = 24;
  const int64_t n = 3 * 5 * 4;
  Object object(offset + n * sizeof(float) + 16);
  auto writable = SharedMemoryMapping::Map(object.key(), offset + n * sizeof(float), true, "region");
  ASSERT_TRUE(writable.ok()) << writable.status();
  float* tensor = reinterpret_cast<float*>(writable->data() + offset);
  std::iota(tensor, tensor + n, 0.0f);
  auto reader = SharedMemoryMapping::Map(object.key(), offset + n * sizeof(float), false, "region");
  ASSERT_TRUE(reader.ok());
  TensorBlock b{offset, shape, {1, 2, 1}, {2, 3, 2}, sizeof(float)};
  std::vector<float> got(2 * 3 * 2);
  ASSERT_TRUE(CopyBlockOut(*reader, b, reinterpret_cast<char*>(got.data()), "lhs").ok());
  std::vector<float> want;
  for (int i = 1; i < 3; ++i)
    for (int j = 2; j < 5; ++j)
      for (int k = 1; k < 3; ++k) want.push_back(static_cast<float>((i * 5 + j) * 4 + k));
  EXPECT_EQ(got, want);
  std::vector<float> back(got.size());
  for (size_t i = 0; i < back.size(); ++i) back[i] = -got[i];
  ASSERT_TRUE(CopyBlockIn(*writable, b, reinterpret_cast<const char*>(back.data()), "out").ok());
  EXPECT_EQ(tensor[(1 * 5 + 2) * 4 + 1], -static_cast<float>((1 * 5 + 2) * 4 + 1));
  EXPECT_EQ(tensor[0], 0.0f) << "outside the block: untouched";
  // A whole-tensor block and an empty one.
  std::vector<float> all(n);
  ASSERT_TRUE(CopyBlockOut(*reader, {offset, shape, {0, 0, 0}, shape, sizeof(float)},
                           reinterpret_cast<char*>(all.data()), "lhs").ok());
  EXPECT_EQ(all[n - 1], static_cast<float>(n - 1));
  EXPECT_TRUE(CopyBlockOut(*reader, {offset, shape, {0, 0, 0}, {0, 5, 4}, sizeof(float)}, nullptr, "lhs").ok());
}

TEST(SharedMemoryBlocks, BlocksOutsideTheTensorOrTheRegionAreRefusedNamingTheField) {
  const std::vector<int64_t> shape = {4, 4};
  Object object(64);
  auto m = SharedMemoryMapping::Map(object.key(), 64, false, "region");
  ASSERT_TRUE(m.ok());
  std::vector<char> dst(64);
  const TensorBlock bad[] = {
      {0, shape, {3, 0}, {2, 4}, 4},          // past dim 0
      {0, shape, {-1, 0}, {1, 4}, 4},         // negative offset
      {4, shape, {0, 0}, {1, 4}, 4},          // the tensor runs past the region
      {0, {int64_t{1} << 62, 4}, {0, 0}, {1, 1}, 4},  // overflow
      {0, shape, {0}, {1, 4}, 4},             // rank mismatch
  };
  for (const TensorBlock& b : bad) {
    absl::Status s = CopyBlockOut(*m, b, dst.data(), "lhs.shared_memory");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("lhs.shared_memory"), absl::string_view::npos) << s;
  }
}

// A cached mapping is reused while the name opens the same object, and
// replaced when the client recreates it (no stale bytes).
TEST(SharedMemoryMappings, ReusedForTheSameObjectAndRemadeForARecreatedOne) {
  SharedMemoryMappings cache(2);
  auto object = std::make_unique<Object>(64);
  const std::string key = object->key();
  auto first = cache.Get(key, 64, true, "region");
  ASSERT_TRUE(first.ok()) << first.status();
  (*first)->data()[0] = 7;
  auto again = cache.Get(key, 64, true, "region");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(first->get(), again->get()) << "the same mapping";
  // Recreated under the same name: another object, another mapping.
  shm_unlink(key.c_str());
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);
  close(fd);
  auto fresh = cache.Get(key, 64, true, "region");
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(fresh->get(), first->get());
  EXPECT_EQ((*fresh)->data()[0], 0) << "the new object's bytes, not the old one's";
  EXPECT_EQ((*first)->data()[0], 7) << "a holder keeps the old mapping alive";
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.Get(key, 128, false, "region").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.Get("/shardgemm_none_here", 8, false, "region").status().code(), absl::StatusCode::kNotFound);
}

TEST(SharedMemoryMappings, AForgottenObjectIsRemappedAndOnlyItsMappingsGo) {
  SharedMemoryMappings cache(4);
  Object a(64), b(64);
  auto read_a = cache.Get(a.key(), 64, false, "region");
  auto write_a = cache.Get(a.key(), 64, true, "region");
  auto of_b = cache.Get(b.key(), 64, false, "region");
  ASSERT_TRUE(read_a.ok() && write_a.ok() && of_b.ok());
  ASSERT_EQ(cache.size(), 3u);
  std::vector<std::shared_ptr<const SharedMemoryMapping>> forgotten = cache.Forget(a.key());
  ASSERT_EQ(forgotten.size(), 2u) << "its read-only and writable mappings";
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_TRUE(cache.Forget(a.key()).empty()) << "said once";
  auto again = cache.Get(a.key(), 64, false, "region");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->get(), read_a->get()) << "mapped afresh";
  auto still_b = cache.Get(b.key(), 64, false, "region");
  ASSERT_TRUE(still_b.ok());
  EXPECT_EQ(still_b->get(), of_b->get()) << "another object's mapping is kept";
}

// The 2-D pieces a device copy takes hold the same bytes, in the same
// order, as the host copy's runs, for blocks of every rank and split.
TEST(SharedMemoryBlocks, PiecesCopyWhatTheRunsCopy) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    TensorBlock block;
    block.element_bytes = 1 + static_cast<int64_t>(rng() % 4);
    block.offset = rng() % 16;
    int64_t elements = 1;
    for (int d = 0; d < rank; ++d) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 5);
      const int64_t at = static_cast<int64_t>(rng() % n);
      block.global_shape.push_back(n);
      block.block_offsets.push_back(rng() % 3 == 0 ? 0 : at);
      const int64_t left = n - block.block_offsets.back();
      block.block_shape.push_back(rng() % 3 == 0 ? left : 1 + static_cast<int64_t>(rng() % left));
      elements *= n;
    }
    const uint64_t region_bytes = block.offset + static_cast<uint64_t>(elements * block.element_bytes);
    Object object(region_bytes);
    auto mapping = SharedMemoryMapping::Map(object.key(), region_bytes, true, "region");
    ASSERT_TRUE(mapping.ok()) << mapping.status();
    for (uint64_t i = 0; i < region_bytes; ++i) mapping->data()[i] = static_cast<char>(i * 7 + 3);
    int64_t block_bytes = block.element_bytes;
    for (int64_t d : block.block_shape) block_bytes *= d;
    std::string want(static_cast<size_t>(block_bytes), '\0'), got(static_cast<size_t>(block_bytes), '\x55');
    ASSERT_TRUE(CopyBlockOut(*mapping, block, &want[0], "region").ok());
    uint64_t covered = 0;
    for (const BlockPiece& p : BlockPieces(block)) {
      for (uint64_t r = 0; r < p.rows; ++r) {
        ASSERT_LE(p.region_offset + r * p.region_pitch + p.row_bytes, region_bytes);
        ASSERT_LE(p.block_offset + (r + 1) * p.row_bytes, static_cast<uint64_t>(block_bytes));
        std::memcpy(&got[p.block_offset + r * p.row_bytes], mapping->data() + p.region_offset + r * p.region_pitch,
                    p.row_bytes);
      }
      covered += p.rows * p.row_bytes;
    }
    EXPECT_EQ(covered, static_cast<uint64_t>(block_bytes)) << trial;
    EXPECT_EQ(got, want) << "trial " << trial << " block [" << absl::StrJoin(block.block_offsets, ",") << "] + ["
                         << absl::StrJoin(block.block_shape, ",") << "] of [" << absl::StrJoin(block.global_shape, ",")
                         << "]";
  }
}

TEST(SharedMemoryBlocks, RowBlocksAreOneContiguousPieceAndColumnBlocksOneStridedPiece) {
  TensorBlock rows{/*offset=*/64, {8, 6}, {2, 0}, {3, 6}, 2};
  ASSERT_EQ(BlockPieces(rows).size(), 1u);
  EXPECT_TRUE(BlockIsContiguous(rows));
  EXPECT_EQ(BlockPieces(rows)[0].region_offset, 64u + 2 * 6 * 2);
  EXPECT_EQ(BlockPieces(rows)[0].row_bytes, 3u * 6 * 2);
  TensorBlock columns{0, {8, 6}, {0, 2}, {8, 3}, 2};
  auto pieces = BlockPieces(columns);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_FALSE(BlockIsContiguous(columns));
  EXPECT_EQ(pieces[0].rows, 8u);
  EXPECT_EQ(pieces[0].region_pitch, 12u);
  EXPECT_EQ(pieces[0].row_bytes, 6u);
  TensorBlock one_row{0, {8, 6}, {5, 1}, {1, 4}, 2};
  EXPECT_TRUE(BlockIsContiguous(one_row));
  TensorBlock experts{0, {4, 8, 6}, {1, 0, 0}, {2, 8, 6}, 2};  // EP: whole experts
  EXPECT_TRUE(BlockIsContiguous(experts));
  TensorBlock tp{0, {4, 8, 6}, {0, 0, 3}, {4, 8, 3}, 2};  // TP on the last dim: one strided piece
  EXPECT_EQ(BlockPieces(tp).size(), 1u);
  EXPECT_EQ(BlockPieces(tp)[0].rows, 32u);
  TensorBlock tp_mid{0, {4, 8, 6}, {0, 4, 0}, {4, 4, 6}, 2};  // a split in the middle dim: a piece per expert
  EXPECT_EQ(BlockPieces(tp_mid).size(), 1u);
  EXPECT_EQ(BlockPieces(tp_mid)[0].rows, 4u);
}

}  // namespace
}  // namespace shardgemm::platform
