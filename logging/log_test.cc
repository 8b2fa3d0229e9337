#include "logging/log.h"

#include <mutex>
#include <sstream>
#include <streambuf>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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


// An ostream target the test may read while the logger's thread writes.
class LockedSink : public std::streambuf {
 public:
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }
  int writes() {
    std::lock_guard<std::mutex> lock(mu_);
    return writes_;
  }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    std::lock_guard<std::mutex> lock(mu_);
    text_.append(s, static_cast<size_t>(n));
    ++writes_;
    return n;
  }
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    char ch = static_cast<char>(c);
    return xsputn(&ch, 1) == 1 ? c : traits_type::eof();
  }

 private:
  std::mutex mu_;
  std::string text_;
  int writes_ = 0;
};

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(LogTest, BackgroundLinesAreWrittenSoonInOneWrite) {
  LockedSink sink;
  std::ostream out(&sink);
  Logger logger(Format::kLogfmt, Level::kInfo, &out, /*background=*/true);
  for (int i = 0; i < 3; ++i) logger.Log(Level::kInfo, "request", {{"n", i}});
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (Lines(sink.text()).size() < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  const std::vector<std::string> lines = Lines(sink.text());
  ASSERT_EQ(lines.size(), 3u) << sink.text();
  for (int i = 0; i < 3; ++i) EXPECT_THAT(lines[i], ::testing::HasSubstr(absl::StrCat("n=", i)));
  EXPECT_LE(sink.writes(), 3);  // batched (one write when they queued together)
}

TEST(LogTest, AWarningWritesWhatIsQueuedFirstAndItselfAtOnce) {
  LockedSink sink;
  std::ostream out(&sink);
  Logger logger(Format::kLogfmt, Level::kInfo, &out, /*background=*/true);
  logger.Log(Level::kInfo, "first", {});
  logger.Log(Level::kWarning, "second", {});
  // No waiting: the warning's call wrote both before it returned.
  const std::vector<std::string> lines = Lines(sink.text());
  ASSERT_EQ(lines.size(), 2u) << sink.text();
  EXPECT_THAT(lines[0], ::testing::HasSubstr("event=first"));
  EXPECT_THAT(lines[1], ::testing::HasSubstr("event=second"));
}

TEST(LogTest, FlushAndTheEndWriteTheQueue) {
  LockedSink sink;
  std::ostream out(&sink);
  {
    Logger logger(Format::kLogfmt, Level::kInfo, &out, /*background=*/true);
    logger.Log(Level::kInfo, "flushed", {});
    logger.Flush();
    EXPECT_THAT(sink.text(), ::testing::HasSubstr("event=flushed"));
    logger.Log(Level::kInfo, "at_end", {});
  }
  EXPECT_THAT(sink.text(), ::testing::HasSubstr("event=at_end"));
  EXPECT_EQ(Lines(sink.text()).size(), 2u);
}

TEST(LogTest, ManyThreadsLoseNoLine) {
  LockedSink sink;
  std::ostream out(&sink);
  {
    Logger logger(Format::kJson, Level::kInfo, &out, /*background=*/true);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 250; ++i) logger.Log(Level::kInfo, "step", {{"t", t}, {"i", i}});
      });
    }
    for (auto& th : threads) th.join();
  }
  const std::vector<std::string> lines = Lines(sink.text());
  ASSERT_EQ(lines.size(), 1000u);
  for (const std::string& line : lines) EXPECT_EQ(nlohmann::json::parse(line)["event"], "step");
}

}  // namespace
}  // namespace shardgemm::logging
