#include "logging/log.h"

#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardgemm::logging {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(LogTest, JsonLineIsOneParsableObjectWithFieldsInOrder) {
  std::ostringstream out;
  Logger logger(Format::kJson, Level::kInfo, &out);
  logger.set_component("coordinator");
  logger.Log(Level::kInfo, "request",
             {{"request_id", "abc"}, {"op", "grouped_gemm"}, {"bytes_in", int64_t{42}},
              {"server_ms", 1.5}, {"ok", true}, {"message", "quote \" and\nnewline"}});
  const std::string line = out.str();
  ASSERT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1);  // one line
  auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["component"], "coordinator");
  EXPECT_EQ(j["event"], "request");
  EXPECT_EQ(j["request_id"], "abc");
  EXPECT_EQ(j["bytes_in"], 42);
  EXPECT_EQ(j["server_ms"], 1.5);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["message"], "quote \" and\nnewline");
  EXPECT_LT(line.find("\"request_id\""), line.find("\"op\""));
}

TEST(LogTest, JsonReplacesInvalidUtf8AndEscapesControlCharacters) {
  Logger logger(Format::kJson, Level::kInfo, nullptr);
  const std::string text = std::string("a\xff") + "\xc3\xa9" + "\xe2\x82" + "\x01\t\"\\" + "\xf0\x9f\x98\x80" +
                           "\xed\xa0\x80" + "\xc0\xaf";
  const std::string line = logger.FormatLine(Level::kInfo, "request", {{"name", text}, {"nan", 0.0 / 0.0}});
  auto j = nlohmann::json::parse(line);  // throws on invalid JSON or UTF-8
  EXPECT_EQ(j["name"].get<std::string>(),
            "a\xef\xbf\xbd" "\xc3\xa9" "\xef\xbf\xbd\xef\xbf\xbd" "\x01\t\"\\" "\xf0\x9f\x98\x80"
            "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd" "\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_TRUE(j["nan"].is_null());
  EXPECT_NE(line.find("\\u0001"), std::string::npos);
}

TEST(LogTest, LogfmtQuotesWhatNeedsQuoting) {
  Logger logger(Format::kLogfmt, Level::kInfo, nullptr);
  const std::string line =
      logger.FormatLine(Level::kWarning, "step", {{"request_id", "r-1"}, {"message", "a b=\"c\""}, {"n", 3}});
  EXPECT_THAT(line, StartsWith("time="));
  EXPECT_THAT(line, HasSubstr(" level=warning event=step request_id=r-1 message=\"a b=\\\"c\\\"\" n=3"));
}

TEST(LogTest, LinesBelowTheLevelAreDropped) {
  std::ostringstream out;
  Logger logger(Format::kLogfmt, Level::kWarning, &out);
  logger.Log(Level::kInfo, "request", {});
  logger.Log(Level::kDebug, "request", {});
  EXPECT_EQ(out.str(), "");
  logger.Log(Level::kError, "request", {});
  EXPECT_THAT(out.str(), HasSubstr("level=error"));
}

TEST(LogTest, FlagValuesParseOrNameTheFlag) {
  EXPECT_EQ(*ParseFormat("JSON"), Format::kJson);
  EXPECT_EQ(*ParseFormat("logfmt"), Format::kLogfmt);
  EXPECT_EQ(*ParseLevel("warn"), Level::kWarning);
  auto bad = ParseFormat("xml");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("log_format"));
  EXPECT_THAT(std::string(ParseLevel("loud").status().message()), HasSubstr("log_level"));
}

}  // namespace
}  // namespace shardgemm::logging
