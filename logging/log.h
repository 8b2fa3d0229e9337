// Structured log lines: one event a line, as JSON objects or logfmt
// key=value pairs (--log_format), or plain text for a terminal; lines below
// --log_level are dropped. Servers write one line per request (coordinator)
// and per step (worker), carrying the request id that joins them.
#ifndef SHARDGEMM_LOGGING_LOG_H_
#define SHARDGEMM_LOGGING_LOG_H_

#include <cstdint>
#include <iosfwd>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardgemm::logging {

enum class Format { kText, kJson, kLogfmt };
enum class Level { kDebug, kInfo, kWarning, kError };

// Parse the flags' values; INVALID_ARGUMENT naming the flag otherwise.
absl::StatusOr<Format> ParseFormat(absl::string_view text);
absl::StatusOr<Level> ParseLevel(absl::string_view text);
const char* LevelName(Level level);

struct Field {
  using Value = std::variant<std::string, int64_t, double, bool>;
  Field(std::string k, std::string v) : key(std::move(k)), value(std::move(v)) {}
  Field(std::string k, const char* v) : key(std::move(k)), value(std::string(v)) {}
  Field(std::string k, absl::string_view v) : key(std::move(k)), value(std::string(v)) {}
  Field(std::string k, int64_t v) : key(std::move(k)), value(v) {}
  Field(std::string k, int v) : key(std::move(k)), value(static_cast<int64_t>(v)) {}
  Field(std::string k, uint64_t v) : key(std::move(k)), value(static_cast<int64_t>(v)) {}
  Field(std::string k, double v) : key(std::move(k)), value(v) {}
  Field(std::string k, bool v) : key(std::move(k)), value(v) {}
  std::string key;
  Value value;
};

class Logger {
 public:
  // Writes to `out` (not owned), whole lines under a lock. `background`:
  // lines below kWarning are queued, and a thread of the logger's own
  // writes them at most kBackgroundWrite later, so a request's line costs
  // its formatting and not a write to a file or pipe on the request's path;
  // a warning or error (and Flush, and the destructor) writes what is
  // queued first, then itself.
  Logger(Format format, Level min_level, std::ostream* out, bool background = false);
  ~Logger();
  Logger(const Logger&) = delete;
  Logger& operator=(const Logger&) = delete;

  static constexpr absl::Duration kBackgroundWrite = absl::Milliseconds(5);

  bool Enabled(Level level) const { return level >= min_level_; }
  // One line: time, level, the component ("coordinator", "worker"), the
  // event name, then `fields` in order.
  void Log(Level level, absl::string_view event, const std::vector<Field>& fields);
  // The line Log would write (without its newline), for tests.
  std::string FormatLine(Level level, absl::string_view event, const std::vector<Field>& fields) const;

  void set_component(std::string component) { component_ = std::move(component); }

  // Writes the queued lines now (background loggers; otherwise a no-op).
  void Flush();

 private:
  void WriteQueuedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteInBackground();

  const Format format_;
  const Level min_level_;
  std::ostream* out_;
  std::string component_;
  absl::Mutex mu_;
  std::string queued_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;  // background loggers only
};

// The process's logger, set up once from the flags in main (text, info, to
// stderr until then).
Logger& ProcessLogger();
// `background`: see Logger (the servers' choice; queued lines are written
// at exit too).
void ConfigureProcessLogger(Format format, Level min_level, std::string component, bool background = false);
// The same from the --log_format and --log_level flags' text;
// INVALID_ARGUMENT naming the flag, and nothing changed, for a bad one.
absl::Status ConfigureProcessLogger(absl::string_view format, absl::string_view level, std::string component,
                                    bool background = false);

}  // namespace shardgemm::logging

#endif  // SHARDGEMM_LOGGING_LOG_H_
