// Prometheus metrics: counters, gauges and histograms in labelled families,
// and their text exposition (format 0.0.4). No Prometheus C++ client is
// packaged in Debian; this follows the text format exactly: HELP and TYPE
// lines, counters named *_total, histograms as cumulative _bucket{le=...}
// series with _sum and _count.
//
// Updates are lock-free on a cell once it is looked up: a caller on a hot
// path keeps the cell pointer (cells live as long as the registry).
#ifndef SHARDGEMM_METRICS_METRICS_H_
#define SHARDGEMM_METRICS_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace shardgemm::metrics {

// A monotonically increasing value.
class Counter {
 public:
  void Increment(double by = 1.0);
  // For a counter kept elsewhere (read by a collector): up to `total`,
  // never down.
  void RaiseTo(double total) { Increment(total - Value()); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into buckets with inclusive upper bounds.
class Histogram {
 public:
  explicit Histogram(const std::vector<double>* bounds);
  void Observe(double v);
  // Cumulative counts per bound (the last is +Inf), the sum and the count.
  std::vector<uint64_t> CumulativeCounts() const;
  double Sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t Count() const { return count_.load(std::memory_order_relaxed); }

 private:
  const std::vector<double>* bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_->size() + 1 (+Inf)
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Bucket bounds for latencies from 50 us to 60 s.
std::vector<double> LatencyBuckets();

template <typename Cell>
class Family;

enum class MetricType { kCounter, kGauge, kHistogram };

class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), type_(type), label_names_(std::move(label_names)) {}
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  void Render(std::string* out) const;

 protected:
  virtual void RenderSamples(std::string* out) const = 0;
  std::string Labels(const std::vector<std::string>& values, const std::string& extra = "") const;

  const std::string name_, help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// Cells of one metric by label values.
template <typename Cell>
class Family : public FamilyBase {
 public:
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::vector<double> bounds = {})
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
        bounds_(std::move(bounds)) {}

  // The cell for these label values (one per label name), made on first use.
  Cell* With(const std::vector<std::string>& label_values);

 protected:
  void RenderSamples(std::string* out) const override;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Cell>> cells_ ABSL_GUARDED_BY(mu_);
};

// Every metric of a process, rendered together. Collectors run before each
// rendering to refresh gauges whose values live elsewhere (memory in use,
// workers registered).
class Registry {
 public:
  Family<Counter>* AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>* AddGauge(const std::string& name, const std::string& help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>* AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names, std::vector<double> bounds);
  void AddCollector(std::function<void()> collect);

  // The text exposition of every family, in the order they were added.
  std::string Render() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
};

// Escapes a label value (backslash, double quote, newline) or HELP text
// (backslash, newline) as the text format asks.
std::string EscapeLabelValue(const std::string& v);
std::string EscapeHelp(const std::string& v);
// A sample value: integers without a fraction, +Inf/-Inf/NaN by name.
std::string FormatValue(double v);

}  // namespace shardgemm::metrics

#endif  // SHARDGEMM_METRICS_METRICS_H_
