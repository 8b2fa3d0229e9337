#include "metrics/metrics.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace shardgemm::metrics {

namespace {

void AtomicAdd(std::atomic<double>* a, double by) {
  double old = a->load(std::memory_order_relaxed);
  while (!a->compare_exchange_weak(old, old + by, std::memory_order_relaxed)) {
  }
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

void Counter::Increment(double by) {
  if (by > 0) AtomicAdd(&value_, by);
}

void Gauge::Add(double by) { AtomicAdd(&value_, by); }

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(bounds), buckets_(new std::atomic<uint64_t>[bounds->size() + 1]) {
  for (size_t i = 0; i <= bounds_->size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_->size() && v > (*bounds_)[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_->size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    out[i] = running;
  }
  return out;
}

std::vector<double> LatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,    0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeHelp(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string FamilyBase::Labels(const std::vector<std::string>& values, const std::string& extra) const {
  if (label_names_.empty() && extra.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < label_names_.size(); ++i) {
    if (i > 0) out += ",";
    absl::StrAppend(&out, label_names_[i], "=\"", EscapeLabelValue(values[i]), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&out, label_names_.empty() ? "" : ",", extra);
  out += "}";
  return out;
}

void FamilyBase::Render(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(out, "# TYPE ", name_, " ", TypeName(type_), "\n");
  RenderSamples(out);
}

template <typename Cell>
Cell* Family<Cell>::With(const std::vector<std::string>& label_values) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> key = label_values;
  key.resize(label_names_.size());
  auto& cell = cells_[key];
  if (cell == nullptr) {
    if constexpr (std::is_same_v<Cell, Histogram>) cell = std::make_unique<Histogram>(&bounds_);
    else cell = std::make_unique<Cell>();
  }
  return cell.get();
}

template <>
void Family<Counter>::RenderSamples(std::string* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, cell] : cells_) {
    absl::StrAppend(out, name_, Labels(labels), " ", FormatValue(cell->Value()), "\n");
  }
}

template <>
void Family<Gauge>::RenderSamples(std::string* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, cell] : cells_) {
    absl::StrAppend(out, name_, Labels(labels), " ", FormatValue(cell->Value()), "\n");
  }
}

template <>
void Family<Histogram>::RenderSamples(std::string* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, cell] : cells_) {
    const std::vector<uint64_t> counts = cell->CumulativeCounts();
    for (size_t i = 0; i < counts.size(); ++i) {
      const std::string le = i < bounds_.size() ? FormatValue(bounds_[i]) : "+Inf";
      absl::StrAppend(out, name_, "_bucket", Labels(labels, absl::StrCat("le=\"", le, "\"")), " ",
                      counts[i], "\n");
    }
    absl::StrAppend(out, name_, "_sum", Labels(labels), " ", FormatValue(cell->Sum()), "\n");
    // The count is the +Inf bucket's, read once, so the two always agree.
    absl::StrAppend(out, name_, "_count", Labels(labels), " ", counts.back(), "\n");
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Family<Counter>* Registry::AddCounter(const std::string& name, const std::string& help,
                                      std::vector<std::string> label_names) {
  auto f = std::make_unique<Family<Counter>>(name, help, MetricType::kCounter, std::move(label_names));
  Family<Counter>* p = f.get();
  absl::MutexLock lock(&mu_);
  families_.push_back(std::move(f));
  return p;
}

Family<Gauge>* Registry::AddGauge(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names) {
  auto f = std::make_unique<Family<Gauge>>(name, help, MetricType::kGauge, std::move(label_names));
  Family<Gauge>* p = f.get();
  absl::MutexLock lock(&mu_);
  families_.push_back(std::move(f));
  return p;
}

Family<Histogram>* Registry::AddHistogram(const std::string& name, const std::string& help,
                                          std::vector<std::string> label_names, std::vector<double> bounds) {
  auto f = std::make_unique<Family<Histogram>>(name, help, MetricType::kHistogram, std::move(label_names),
                                               std::move(bounds));
  Family<Histogram>* p = f.get();
  absl::MutexLock lock(&mu_);
  families_.push_back(std::move(f));
  return p;
}

void Registry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::string Registry::Render() const {
  absl::MutexLock lock(&mu_);
  for (const auto& c : collectors_) c();
  std::string out;
  for (const auto& f : families_) f->Render(&out);
  return out;
}

}  // namespace shardgemm::metrics
