// Drives the quantize fuzzing entry point with a bounded number of random
// requests so it runs in CI with g++ (the libFuzzer build with ASan and UBSan
// is tools/run_fuzz.sh). Most requests are shaped to pass validation, so the
// quantize and its invariants run; the rest exercise the rejections.
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quantize_fuzz_entry.h"

namespace shardgemm {
namespace cpu {
namespace {

// One request in FuzzQuantizeOnce's encoding.
std::vector<uint8_t> RandomRequest(std::mt19937_64& rng) {
  auto u = [&](uint32_t n) { return static_cast<uint32_t>(rng() % n); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  std::vector<uint8_t> b;
  auto u16 = [&](uint32_t v) {
    b.push_back(static_cast<uint8_t>(v & 0xff));
    b.push_back(static_cast<uint8_t>(v >> 8));
  };
  b.push_back(static_cast<uint8_t>(coin(0.03) ? 255 : u(5)));  // mode
  uint8_t flags = static_cast<uint8_t>(u(256));
  if (coin(0.9)) flags = static_cast<uint8_t>((flags & ~0x06) | (u(3) << 1));  // a valid input dtype
  if (coin(0.9)) flags |= static_cast<uint8_t>(1 << (3 + u(2)));               // rowwise or colwise
  if (coin(0.8)) flags &= 0x7f;                                                // amax given
  b.push_back(flags);
  const uint32_t m = u(300);
  u16(coin(0.03) ? 0x8000 | u(4) : m);
  const uint32_t k = coin(0.5) ? 32 * (1 + u(16)) : 1 + u(519);
  u16(coin(0.03) ? 0x8000 | u(4) : k);
  const uint32_t groups = u(10);
  b.push_back(static_cast<uint8_t>(coin(0.02) ? 255 : groups));
  // Group sizes that fit in m, some empty, now and then a bad one.
  uint32_t left = m;
  for (uint32_t g = 0; g < groups; ++g) {
    uint32_t s = coin(0.2) ? 0 : (left ? u(left + 1) : 0);
    if (coin(0.5) && g + 1 == groups) s = left;
    left -= s;
    uint32_t enc = s + 40;        // the entry point reads (v % 400) - 40
    if (coin(0.02)) enc = u(40);  // negative
    if (coin(0.02)) enc = 399;    // likely past m
    u16(enc);
  }
  b.push_back(static_cast<uint8_t>(coin(0.02) ? 0x3f : 0));  // group_sizes null
  b.push_back(static_cast<uint8_t>(coin(0.1) ? u(64) : 0));  // null pointers
  const size_t rest = 4 * static_cast<size_t>(m) * k + 4 * groups + 8;
  for (size_t i = 0; i < rest; ++i) b.push_back(static_cast<uint8_t>(rng()));
  return b;
}

TEST(QuantizeFuzzTest, RandomRequestsKeepTheInvariants) {
  std::mt19937_64 rng(20261129);
  int ran = 0;
  const int kRequests = 600;
  for (int i = 0; i < kRequests; ++i) {
    const std::vector<uint8_t> b = RandomRequest(rng);
    ran += FuzzQuantizeOnce(b.data(), b.size());  // aborts on a broken invariant
  }
  // Most requests are shaped to be valid: the quantize itself must have run.
  EXPECT_GT(ran, kRequests / 3);
  EXPECT_LT(ran, kRequests);
}

// Inputs libFuzzer found (run under tools/run_fuzz.sh's sanitizers they were
// failures; here they must keep the invariants).
TEST(QuantizeFuzzTest, FoundInputs) {
  // 1x128 scaling, 182 rows and no groups, a null rowwise scale pointer for
  // the empty scale tensor: the reference passed it to memset (UB).
  const std::vector<uint8_t> null_empty_scale = {0x08, 0x29, 0x02, 0x1e, 0x39, 0x29, 0x0a, 0x08};
  EXPECT_EQ(FuzzQuantizeOnce(null_empty_scale.data(), null_empty_scale.size()), 1);
}

TEST(QuantizeFuzzTest, ShortAndEmptyInputs) {
  for (size_t n = 0; n < 12; ++n) {
    std::vector<uint8_t> b(n, 0x11);
    FuzzQuantizeOnce(b.data(), b.size());
  }
  FuzzQuantizeOnce(nullptr, 0);
}

}  // namespace
}  // namespace cpu
}  // namespace shardgemm
