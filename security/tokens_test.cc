#include "security/tokens.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm::security {
namespace {

using ::testing::HasSubstr;

std::string WriteTokens(const std::string& text) {
  char path[] = "/tmp/shardgemm_tokens_XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(TokensTest, Sha256MatchesTheStandardVector) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(TokensTest, RandomHexIsHexOfTheBytesAskedAndNeverRepeats) {
  const std::string a = RandomHex(16), b = RandomHex(16);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

TEST(TokensTest, AKnownTokenGivesItsTenantAnUnknownOneIsUnauthenticated) {
  const std::string path =
      WriteTokens("# comment\n\nsha256:" + Sha256Hex("s3cret") + " alice\nsha256:" + Sha256Hex("other") + " bob\n");
  auto file = TokenFile::Load(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->TenantOf("s3cret")->tenant, "alice");
  EXPECT_EQ((*file)->TenantOf("other")->tenant, "bob");
  EXPECT_EQ((*file)->TenantOf("s3cre").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*file)->TenantOf("").status().code(), absl::StatusCode::kUnauthenticated);
  std::remove(path.c_str());
}

TEST(TokensTest, ARemovedLineRevokesItsTokenOnceTheFileChanges) {
  const std::string path = WriteTokens("sha256:" + Sha256Hex("t1") + " alice\nsha256:" + Sha256Hex("t2") + " bob\n");
  auto file = TokenFile::Load(path);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->TenantOf("t1").ok());
  absl::SleepFor(absl::Milliseconds(1100));  // past the reload interval, and a new mtime
  std::ofstream(path) << "sha256:" + Sha256Hex("t2") + " bob\n";
  EXPECT_EQ((*file)->TenantOf("t1").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*file)->TenantOf("t2")->tenant, "bob");
  std::remove(path.c_str());
}

TEST(TokensTest, MalformedFilesAreRefusedNamingTheLine) {
  for (const std::string& bad : std::vector<std::string>{"sha256:abc alice\n", "md5:" + std::string(64, 'a') + " alice\n",
                                 "sha256:" + std::string(64, 'a') + " bad/tenant\n",
                                 "sha256:" + std::string(64, 'a') + "\n"}) {
    const std::string path = WriteTokens("# ok\n" + bad);
    auto file = TokenFile::Load(path);
    ASSERT_FALSE(file.ok()) << bad;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(file.status().message()), HasSubstr("line 2"));
    std::remove(path.c_str());
  }
  EXPECT_EQ(TokenFile::Load("/nonexistent/tokens").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokensTest, GrantsDefaultToAllAndOtherwiseAreWhatTheLineSays) {
  const std::string path = WriteTokens("sha256:" + Sha256Hex("all") + " alice\nsha256:" + Sha256Hex("ro") +
                                       " alice read,compute\n");
  auto file = TokenFile::Load(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto all = (*file)->TenantOf("all");
  EXPECT_TRUE(all->Has(Grant::kWrite) && all->Has(Grant::kRead) && all->Has(Grant::kCompute));
  auto ro = (*file)->TenantOf("ro");
  EXPECT_EQ(ro->tenant, "alice");
  EXPECT_TRUE(ro->Has(Grant::kRead) && ro->Has(Grant::kCompute));
  EXPECT_FALSE(ro->Has(Grant::kWrite));
  std::remove(path.c_str());
  const std::string bad = WriteTokens("sha256:" + Sha256Hex("x") + " alice read,admin\n");
  EXPECT_EQ(TokenFile::Load(bad).status().code(), absl::StatusCode::kInvalidArgument);
  std::remove(bad.c_str());
}

TEST(TokensTest, TenantNames) {
  EXPECT_TRUE(ValidTenant("team-a.prod_1"));
  EXPECT_FALSE(ValidTenant(""));
  EXPECT_FALSE(ValidTenant("a/b"));
  EXPECT_FALSE(ValidTenant(std::string(65, 'a')));
}

}  // namespace
}  // namespace shardgemm::security
