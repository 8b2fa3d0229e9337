#include "logging/log.h"

#include <iostream>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

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

}  // namespace

Logger::Logger(Format format, Level min_level, std::ostream* out)
    : format_(format), min_level_(min_level), out_(out) {}

std::string Logger::FormatLine(Level level, absl::string_view event, const std::vector<Field>& fields) const {
  const std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  switch (format_) {
    case Format::kJson: {
      nlohmann::ordered_json j;
      j["time"] = time;
      j["level"] = LevelName(level);
      if (!component_.empty()) j["component"] = component_;
      j["event"] = std::string(event);
      for (const Field& f : fields) {
        std::visit([&](const auto& v) { j[f.key] = v; }, f.value);
      }
      // Invalid UTF-8 from a client (a request id, a name) is replaced, not thrown on.
      return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
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

void ConfigureProcessLogger(Format format, Level min_level, std::string component) {
  auto logger = std::make_unique<Logger>(format, min_level, &std::cerr);
  logger->set_component(std::move(component));
  ProcessLoggerSlot() = std::move(logger);
}

}  // namespace shardgemm::logging
