// Named instants in one unit of work (a worker's step, a coordinator's
// request), to find where a fixed cost goes: the servers' --trace_steps /
// --trace_requests log them, one line per unit, as microseconds from its
// start beside the start's wall-clock time. The processes of one host share
// that clock, so a request's lines from the coordinator and from its workers
// line up on one time axis (tools/trace_timeline.py joins them).
#ifndef SHARDGEMM_LOGGING_TRACE_MARKS_H_
#define SHARDGEMM_LOGGING_TRACE_MARKS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "logging/log.h"

namespace shardgemm::logging {

class TraceMarks {
 public:
  TraceMarks() : start_(absl::Now()) {}
  explicit TraceMarks(absl::Time start) : start_(start) {}

  // Safe from any thread (a request's answers arrive on gRPC's threads).
  void Mark(absl::string_view label);

  absl::Time start() const { return start_; }
  // (label, time since start) in the order marked.
  std::vector<std::pair<std::string, absl::Duration>> Marks() const;
  // The log line's fields: start_unix_us, then one `<label>_us` per mark
  // (a label marked again gets `_2`, `_3`, ... so no field repeats).
  std::vector<Field> Fields() const;

 private:
  const absl::Time start_;
  mutable absl::Mutex mu_;
  std::vector<std::pair<std::string, absl::Time>> marks_ ABSL_GUARDED_BY(mu_);
};

// The marks the current thread writes to while it lives: a worker's step
// runs on one thread, so its backend marks without being handed them.
// Nests (the previous marks come back at its end); null marks: none.
class ScopedTraceMarks {
 public:
  explicit ScopedTraceMarks(TraceMarks* marks);
  ~ScopedTraceMarks();
  ScopedTraceMarks(const ScopedTraceMarks&) = delete;
  ScopedTraceMarks& operator=(const ScopedTraceMarks&) = delete;

 private:
  TraceMarks* previous_;
};

// A mark on the current thread's marks; nothing without (one thread-local
// load, so the call sites stay in when tracing is off).
void TraceMark(absl::string_view label);

}  // namespace shardgemm::logging

#endif  // SHARDGEMM_LOGGING_TRACE_MARKS_H_
