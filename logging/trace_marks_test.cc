#include "logging/trace_marks.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm::logging {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> Keys(const std::vector<Field>& fields) {
  std::vector<std::string> keys;
  for (const Field& f : fields) keys.push_back(f.key);
  return keys;
}

TEST(TraceMarksTest, MarksInOrderWithRepeatsNumbered) {
  TraceMarks marks(absl::Now() - absl::Milliseconds(1));
  marks.Mark("decoded");
  marks.Mark("sent");
  marks.Mark("sent");
  EXPECT_THAT(Keys(marks.Fields()), ElementsAre("start_unix_us", "decoded_us", "sent_us", "sent_2_us"));
  auto m = marks.Marks();
  ASSERT_EQ(m.size(), 3u);
  EXPECT_GE(m[0].second, absl::Milliseconds(1));  // from the given start
  EXPECT_LE(m[0].second, m[1].second);
  EXPECT_LE(m[1].second, m[2].second);
  EXPECT_EQ(std::get<int64_t>(marks.Fields()[0].value), absl::ToUnixMicros(marks.start()));
}

TEST(TraceMarksTest, ThreadMarksGoWhereTheScopeSays) {
  TraceMark("nowhere");  // no marks active: nothing, no crash
  TraceMarks outer, inner;
  {
    ScopedTraceMarks a(&outer);
    TraceMark("one");
    {
      ScopedTraceMarks b(&inner);
      TraceMark("two");
      std::thread other([] { TraceMark("other thread"); });  // its own (none)
      other.join();
    }
    TraceMark("three");
  }
  TraceMark("after");
  EXPECT_THAT(Keys(outer.Fields()), ElementsAre("start_unix_us", "one_us", "three_us"));
  EXPECT_THAT(Keys(inner.Fields()), ElementsAre("start_unix_us", "two_us"));
}

TEST(TraceMarksTest, MarkFromManyThreads) {
  TraceMarks marks;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) marks.Mark("answer");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(marks.Marks().size(), 400u);
  EXPECT_EQ(marks.Fields().back().key, "answer_400_us");
}

}  // namespace
}  // namespace shardgemm::logging
