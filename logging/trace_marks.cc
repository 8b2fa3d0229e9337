#include "logging/trace_marks.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardgemm::logging {
namespace {

thread_local TraceMarks* current_marks = nullptr;

}  // namespace

void TraceMarks::Mark(absl::string_view label) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  marks_.emplace_back(std::string(label), now);
}

std::vector<std::pair<std::string, absl::Duration>> TraceMarks::Marks() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, absl::Duration>> out;
  out.reserve(marks_.size());
  for (const auto& [label, at] : marks_) out.emplace_back(label, at - start_);
  return out;
}

std::vector<Field> TraceMarks::Fields() const {
  std::vector<Field> fields;
  fields.emplace_back("start_unix_us", absl::ToUnixMicros(start_));
  absl::flat_hash_map<std::string, int> seen;
  for (const auto& [label, since] : Marks()) {
    const int n = ++seen[label];
    std::string key = n == 1 ? absl::StrCat(label, "_us") : absl::StrCat(label, "_", n, "_us");
    fields.emplace_back(std::move(key), absl::ToDoubleMicroseconds(since));
  }
  return fields;
}

ScopedTraceMarks::ScopedTraceMarks(TraceMarks* marks) : previous_(current_marks) { current_marks = marks; }

ScopedTraceMarks::~ScopedTraceMarks() { current_marks = previous_; }

void TraceMark(absl::string_view label) {
  if (current_marks != nullptr) current_marks->Mark(label);
}

}  // namespace shardgemm::logging
