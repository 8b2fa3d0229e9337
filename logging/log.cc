#include "logging/log.h"

#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <cmath>
#include <cstdio>

namespace shardgemm::logging {

absl::StatusOr<Format> ParseFormat(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "text") return Format::kText;
  if (t == "json") return Format::kJson;
  if (t == "logfmt") return Format::kLogfmt;
  return absl::InvalidArgumentError(absl::StrCat("log_format: '", text, "' is not text, json or logfmt"));
}

absl::StatusOr<Level> ParseLevel(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "debug") return Level::kDebug;
  if (t == "info") return Level::kInfo;
  if (t == "warning" || t == "warn") return Level::kWarning;
  if (t == "error") return Level::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("log_level: '", text, "' is not debug, info, warning or error"));
}

const char* LevelName(Level level) {
  switch (level) {
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarning: return "warning";
    case Level::kError: return "error";
  }
  return "info";
}

namespace {

std::string ValueText(const Field::Value& v) {
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  if (const auto* i = std::get_if<int64_t>(&v)) return absl::StrCat(*i);
  if (const auto* d = std::get_if<double>(&v)) return absl::StrCat(*d);
  return std::get<bool>(v) ? "true" : "false";
}

// logfmt quotes a value with spaces, quotes, '=' or control characters.
std::string LogfmtValue(const std::string& v) {
  bool quote = v.empty();
  for (char c : v) {
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20) quote = true;
  }
  if (!quote) return v;
  std::string out = "\"";
  for (char c : v) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20) absl::StrAppend(&out, "\\u00", absl::Hex(c, absl::kZeroPad2));
    else out += c;
  }
  return out + "\"";
}

// JSON string contents (RFC 8259): quotes, backslashes and control
// characters escaped, invalid UTF-8 replaced by U+FFFD. Written out by hand:
// a request's line is on its hot path, and building a JSON object to dump
// it cost 3.4 us a line (logging/log_benchmark).
void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      switch (c) {
        case '"': out->append("\\\""); break;
        case '\\': out->append("\\\\"); break;
        case '\n': out->append("\\n"); break;
        case '\r': out->append("\\r"); break;
        case '\t': out->append("\\t"); break;
        default:
          if (c < 0x20) {
            absl::StrAppend(out, "\\u00", absl::Hex(c, absl::kZeroPad2));
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
      ++i;
      continue;
    }
    // A well-formed multi-byte sequence is copied; anything else is U+FFFD.
    size_t len = 0;
    uint32_t min = 0;
    if ((c & 0xE0) == 0xC0) len = 2, min = 0x80;
    else if ((c & 0xF0) == 0xE0) len = 3, min = 0x800;
    else if ((c & 0xF8) == 0xF0) len = 4, min = 0x10000;
    bool ok = len > 0 && i + len <= n;
    uint32_t cp = len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (p[i + k] & 0xC0) == 0x80;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      out->append(s.data() + i, len);
      i += len;
    } else {
      out->append("\xEF\xBF\xBD");
      ++i;
    }
  }
  out->push_back('"');
}

void AppendJsonValue(std::string* out, const Field::Value& v) {
  if (const auto* s = std::get_if<std::string>(&v)) {
    AppendJsonString(out, *s);
  } else if (const auto* i = std::get_if<int64_t>(&v)) {
    absl::StrAppend(out, *i);
  } else if (const auto* d = std::get_if<double>(&v)) {
    if (!std::isfinite(*d)) {
      out->append("null");
      return;
    }
    char buf[32];
    const int len = std::snprintf(buf, sizeof buf, "%.6g", *d);
    out->append(buf, static_cast<size_t>(len));
  } else {
    out->append(std::get<bool>(v) ? "true" : "false");
  }
}

// "2026-12-01T11:35:56.935235Z": the date and seconds formatted once a
// second per thread, the microseconds appended.
std::string Timestamp() {
  thread_local int64_t cached_second = -1;
  thread_local std::string cached;
  const absl::Time now = absl::Now();
  const int64_t micros = absl::ToUnixMicros(now);
  const int64_t second = micros / 1000000;
  if (second != cached_second) {
    cached = absl::FormatTime("%Y-%m-%dT%H:%M:%S", absl::FromUnixSeconds(second), absl::UTCTimeZone());
    cached_second = second;
  }
  char buf[16];
  std::snprintf(buf, sizeof buf, ".%06dZ", static_cast<int>(micros % 1000000));
  return cached + buf;
}

}  // namespace

Logger::Logger(Format format, Level min_level, std::ostream* out, bool background)
    : format_(format), min_level_(min_level), out_(out) {
  if (background && out_ != nullptr) writer_ = std::thread([this] { WriteInBackground(); });
}

Logger::~Logger() {
  if (writer_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    writer_.join();
  }
  Flush();
}

void Logger::WriteQueuedLocked() {
  if (queued_.empty()) return;
  out_->write(queued_.data(), static_cast<std::streamsize>(queued_.size()));
  out_->flush();
  queued_.clear();
}

void Logger::WriteInBackground() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    // Woken by the timeout (or the stop), not by each line: a line's writer
    // pays no wake-up.
    mu_.AwaitWithTimeout(absl::Condition(&stop_), kBackgroundWrite);
    WriteQueuedLocked();
  }
}

void Logger::Flush() {
  if (out_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  WriteQueuedLocked();
}

std::string Logger::FormatLine(Level level, absl::string_view event, const std::vector<Field>& fields) const {
  const std::string time = Timestamp();
  switch (format_) {
    case Format::kJson: {
      std::string line;
      line.reserve(256);
      absl::StrAppend(&line, "{\"time\":\"", time, "\",\"level\":\"", LevelName(level), "\"");
      if (!component_.empty()) {
        line.append(",\"component\":");
        AppendJsonString(&line, component_);
      }
      line.append(",\"event\":");
      AppendJsonString(&line, event);
      for (const Field& f : fields) {
        line.push_back(',');
        AppendJsonString(&line, f.key);
        line.push_back(':');
        AppendJsonValue(&line, f.value);
      }
      line.push_back('}');
      return line;
    }
    case Format::kLogfmt: {
      std::string line = absl::StrCat("time=", time, " level=", LevelName(level));
      if (!component_.empty()) absl::StrAppend(&line, " component=", LogfmtValue(component_));
      absl::StrAppend(&line, " event=", LogfmtValue(std::string(event)));
      for (const Field& f : fields) absl::StrAppend(&line, " ", f.key, "=", LogfmtValue(ValueText(f.value)));
      return line;
    }
    case Format::kText:
      break;
  }
  std::string line = absl::StrCat(time, " ", LevelName(level), " ", component_.empty() ? "" : component_ + ": ",
                                  event);
  for (const Field& f : fields) absl::StrAppend(&line, " ", f.key, "=", LogfmtValue(ValueText(f.value)));
  return line;
}

void Logger::Log(Level level, absl::string_view event, const std::vector<Field>& fields) {
  if (!Enabled(level)) return;
  std::string line = FormatLine(level, event, fields);
  line += '\n';
  absl::MutexLock lock(&mu_);
  if (writer_.joinable() && level < Level::kWarning) {
    queued_.append(line);
    return;
  }
  WriteQueuedLocked();  // what came before it, first
  out_->write(line.data(), static_cast<std::streamsize>(line.size()));
  out_->flush();
}

namespace {
std::unique_ptr<Logger>& ProcessLoggerSlot() {
  static auto* slot = new std::unique_ptr<Logger>(new Logger(Format::kText, Level::kInfo, &std::cerr));
  return *slot;
}
}  // namespace

Logger& ProcessLogger() { return *ProcessLoggerSlot(); }

void ConfigureProcessLogger(Format format, Level min_level, std::string component, bool background) {
  auto logger = std::make_unique<Logger>(format, min_level, &std::cerr, background);
  logger->set_component(std::move(component));
  ProcessLoggerSlot() = std::move(logger);
  if (background) {
    // The slot outlives main (it is never destroyed): its queue is written at exit.
    static std::once_flag at_exit;
    std::call_once(at_exit, [] { std::atexit([] { ProcessLogger().Flush(); }); });
  }
}

absl::Status ConfigureProcessLogger(absl::string_view format, absl::string_view level, std::string component,
                                    bool background) {
  auto f = ParseFormat(format);
  if (!f.ok()) return f.status();
  auto l = ParseLevel(level);
  if (!l.ok()) return l.status();
  ConfigureProcessLogger(*f, *l, std::move(component), background);
  return absl::OkStatus();
}

}  // namespace shardgemm::logging
