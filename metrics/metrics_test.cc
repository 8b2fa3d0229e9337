#include "metrics/metrics.h"

#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm::metrics {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, CounterFamilyRendersHelpTypeAndLabelledSamples) {
  Registry r;
  auto* requests = r.AddCounter("shardgemm_requests_total", "Requests by op and status.", {"op", "code"});
  requests->With({"grouped_gemm", "OK"})->Increment();
  requests->With({"grouped_gemm", "OK"})->Increment(2);
  requests->With({"put_tensor", "INVALID_ARGUMENT"})->Increment();
  EXPECT_EQ(r.Render(),
            "# HELP shardgemm_requests_total Requests by op and status.\n"
            "# TYPE shardgemm_requests_total counter\n"
            "shardgemm_requests_total{op=\"grouped_gemm\",code=\"OK\"} 3\n"
            "shardgemm_requests_total{op=\"put_tensor\",code=\"INVALID_ARGUMENT\"} 1\n");
}

TEST(MetricsTest, CounterIgnoresNegativeIncrements) {
  Counter c;
  c.Increment(5);
  c.Increment(-3);
  EXPECT_EQ(c.Value(), 5);
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  Registry r;
  auto* h = r.AddHistogram("latency_seconds", "Latency.", {}, {0.1, 1});
  auto* cell = h->With({});
  cell->Observe(0.05);
  cell->Observe(0.1);  // bounds are inclusive
  cell->Observe(0.5);
  cell->Observe(7);
  EXPECT_EQ(r.Render(),
            "# HELP latency_seconds Latency.\n"
            "# TYPE latency_seconds histogram\n"
            "latency_seconds_bucket{le=\"0.10000000000000001\"} 2\n"
            "latency_seconds_bucket{le=\"1\"} 3\n"
            "latency_seconds_bucket{le=\"+Inf\"} 4\n"
            "latency_seconds_sum 7.6500000000000004\n"
            "latency_seconds_count 4\n");
}

TEST(MetricsTest, HistogramWithLabelsPutsLeLast) {
  Registry r;
  auto* h = r.AddHistogram("step_seconds", "Step.", {"phase"}, {1});
  h->With({"kernel"})->Observe(0.5);
  EXPECT_THAT(r.Render(), HasSubstr("step_seconds_bucket{phase=\"kernel\",le=\"1\"} 1\n"));
  EXPECT_THAT(r.Render(), HasSubstr("step_seconds_count{phase=\"kernel\"} 1\n"));
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  Registry r;
  auto* g = r.AddGauge("g", "a \\ b\nc", {"name"});
  g->With({"x\"y\\z\nw"})->Set(1.5);
  EXPECT_EQ(r.Render(),
            "# HELP g a \\\\ b\\nc\n"
            "# TYPE g gauge\n"
            "g{name=\"x\\\"y\\\\z\\nw\"} 1.5\n");
}

TEST(MetricsTest, FormatsSpecialValues) {
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(-2), "-2");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatValue(0.0 / 0.0), "NaN");
}

TEST(MetricsTest, CollectorsRefreshGaugesBeforeRendering) {
  Registry r;
  auto* g = r.AddGauge("memory_bytes", "Memory.", {"kind"});
  int calls = 0;
  r.AddCollector([&] {
    ++calls;
    g->With({"used"})->Set(100 * calls);
  });
  EXPECT_THAT(r.Render(), HasSubstr("memory_bytes{kind=\"used\"} 100\n"));
  EXPECT_THAT(r.Render(), HasSubstr("memory_bytes{kind=\"used\"} 200\n"));
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  Registry r;
  auto* c = r.AddCounter("c_total", "C.", {"t"});
  auto* h = r.AddHistogram("h", "H.", {}, LatencyBuckets());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c->With({t % 2 == 0 ? "a" : "b"})->Increment();
        h->With({})->Observe(0.001);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c->With({"a"})->Value() + c->With({"b"})->Value(), 40000);
  EXPECT_EQ(h->With({})->Count(), 40000u);
  EXPECT_EQ(h->With({})->CumulativeCounts().back(), 40000u);
}

}  // namespace
}  // namespace shardgemm::metrics
