#include "worker/staging_memory.h"

#include <string>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(HostStagingMemoryTest, ABlockIsItsAppendsInOrderInHostMemory) {
  auto memory = MakeHostStagingMemory();
  ExpectedBlock block;
  block.dtype = DType::kBF16;
  block.shape = {2, 3};
  block.gemm_operand = true;  // the host memory keeps every block on the host
  auto writer = memory->BeginBlock(block, 12);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Append("abcd").ok());
  ASSERT_TRUE((*writer)->Append("").ok());
  ASSERT_TRUE((*writer)->Append("efghijkl").ok());
  auto staged = (*writer)->Finish();
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->device, nullptr);
  EXPECT_EQ(staged->host, "abcdefghijkl");
}

TEST(HostStagingMemoryTest, AnOutputBlockHasItsDtypeShapeAndBytes) {
  auto memory = MakeHostStagingMemory();
  auto out = memory->OutputBlock(DType::kF32, {3, 2}, 24);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)->dtype, DType::kF32);
  EXPECT_EQ((*out)->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ((*out)->NumBytes(), 24);
}

}  // namespace
}  // namespace shardgemm
