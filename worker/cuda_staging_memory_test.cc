// Needs a GPU (skips without one): staged blocks reach device memory intact
// through the pinned ring, outputs come from pinned memory, the bounds hold.
#include "worker/cuda_staging_memory.h"

#include <cuda_runtime_api.h>

#include <string>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or found none)"

ExpectedBlock Operand(DType dtype, std::vector<int64_t> shape) {
  ExpectedBlock b;
  b.operand = "the TENSOR_LHS block";
  b.dtype = dtype;
  b.shape = std::move(shape);
  b.gemm_operand = true;
  return b;
}

std::string Pattern(int64_t bytes) {
  std::string s(static_cast<size_t>(bytes), '\0');
  for (int64_t i = 0; i < bytes; ++i) s[i] = static_cast<char>((i * 131 + i / 4093) & 0xff);
  return s;
}

TEST(CudaStagingMemoryTest, AGemmOperandArrivesInDeviceMemoryIntactInUnevenPieces) {
  SKIP_WITHOUT_GPU();
  CudaStagingOptions options;
  options.chunk_bytes = 64 << 10;  // a small ring, reused many times over
  options.chunks = 3;
  auto memory = MakeCudaStagingMemory(options);
  ASSERT_TRUE(memory.ok()) << memory.status();
  const int64_t bytes = (int64_t{3} << 20) + 1234;  // BF16 [.., 1] by count, any size does
  const std::string data = Pattern(bytes);
  auto writer = (*memory)->BeginBlock(Operand(DType::kBF16, {bytes / 2, 1}), bytes);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (int64_t at = 0, piece = 1; at < bytes; at += piece, piece = piece * 3 + 7) {
    piece = std::min(piece, bytes - at);
    ASSERT_TRUE((*writer)->Append(absl::string_view(data).substr(at, piece)).ok()) << at;
  }
  auto staged = (*writer)->Finish();
  ASSERT_TRUE(staged.ok()) << staged.status();
  ASSERT_NE(staged->device, nullptr);
  EXPECT_TRUE(staged->host.empty());
  std::string back(static_cast<size_t>(bytes), '\0');
  ASSERT_EQ(cudaMemcpy(&back[0], staged->device->data(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(back == data);
}

TEST(CudaStagingMemoryTest, OtherBlocksStayInHostMemory) {
  SKIP_WITHOUT_GPU();
  auto memory = MakeCudaStagingMemory(CudaStagingOptions());
  ASSERT_TRUE(memory.ok()) << memory.status();
  ExpectedBlock put = Operand(DType::kBF16, {8});
  put.gemm_operand = false;
  for (const ExpectedBlock& b : {put, Operand(DType::kF32, {4}), Operand(DType::kF8E4M3, {16})}) {
    auto writer = (*memory)->BeginBlock(b, 16);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(std::string(16, 'h')).ok());
    auto staged = (*writer)->Finish();
    ASSERT_TRUE(staged.ok()) << staged.status();
    EXPECT_EQ(staged->device, nullptr);
    EXPECT_EQ(staged->host, std::string(16, 'h'));
  }
}

TEST(CudaStagingMemoryTest, ABlockPastTheDevicesMemoryIsResourceExhaustedNamingItsBytes) {
  SKIP_WITHOUT_GPU();
  CudaStagingOptions options;
  options.device_name = "cuda:0 test";
  auto memory = MakeCudaStagingMemory(options);
  ASSERT_TRUE(memory.ok()) << memory.status();
  const int64_t huge = int64_t{1} << 50;
  auto writer = (*memory)->BeginBlock(Operand(DType::kBF16, {huge / 2}), huge);
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kResourceExhausted) << writer.status();
  EXPECT_NE(writer.status().message().find(std::to_string(huge)), absl::string_view::npos);
  EXPECT_NE(writer.status().message().find("cuda:0 test"), absl::string_view::npos);
  auto after = (*memory)->BeginBlock(Operand(DType::kBF16, {8}), 16);  // and the device still serves
  EXPECT_TRUE(after.ok()) << after.status();
}

bool IsPinned(const void* p) {
  cudaPointerAttributes a;
  const bool pinned = cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeHost;
  cudaGetLastError();
  return pinned;
}

TEST(CudaStagingMemoryTest, OutputsArePinnedReusedAndPageablePastTheBound) {
  SKIP_WITHOUT_GPU();
  CudaStagingOptions options;
  options.pinned_output_bytes = 3 << 20;
  auto memory = MakeCudaStagingMemory(options);
  ASSERT_TRUE(memory.ok()) << memory.status();
  const int64_t bytes = 2 << 20;
  const void* first_at = nullptr;
  {
    auto first = (*memory)->OutputBlock(DType::kBF16, {bytes / 2}, bytes);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ((*first)->NumBytes(), bytes);
    EXPECT_EQ((*first)->shape, (std::vector<int64_t>{bytes / 2}));
    EXPECT_TRUE(IsPinned((*first)->bytes.data()));
    first_at = (*first)->bytes.data();
    // A second one at the same time does not fit the bound: pageable.
    auto second = (*memory)->OutputBlock(DType::kBF16, {bytes / 2}, bytes);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ((*second)->NumBytes(), bytes);
    EXPECT_FALSE(IsPinned((*second)->bytes.data()));
  }
  auto again = (*memory)->OutputBlock(DType::kF32, {bytes / 8}, bytes / 2);  // the pooled one, smaller
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->bytes.data(), first_at);
  EXPECT_EQ((*again)->NumBytes(), bytes / 2);
  auto small = (*memory)->OutputBlock(DType::kF32, {4}, 16);  // too small to pin
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(IsPinned((*small)->bytes.data()));
}

}  // namespace
}  // namespace shardgemm
