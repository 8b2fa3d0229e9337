#include "platform/huge_pages.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

TEST(HugePagesTest, SmallBuffersAreLeftAlone) {
  std::string small(kHugePageAdviceMinBytes - 1, '\0');
  EXPECT_FALSE(AdviseHugePages(small.data(), small.size()));
  EXPECT_FALSE(AdviseHugePages(nullptr, size_t{64} << 20));
}

TEST(HugePagesTest, AnAdvisedBufferHoldsWhatIsWritten) {
  std::string buffer;
  buffer.reserve(size_t{16} << 20);
  AdviseHugePages(buffer.data(), buffer.capacity());  // refused on kernels without THP: either way it works
  const std::string pattern(size_t{16} << 20, '\x5a');
  buffer.append(pattern);
  EXPECT_EQ(buffer, pattern);
}

}  // namespace
}  // namespace shardgemm::platform
