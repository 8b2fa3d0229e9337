#include "metrics/http_exporter.h"

#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm::metrics {
namespace {

using ::testing::HasSubstr;

TEST(HttpExporterTest, ServesTheExpositionOnGetMetrics) {
  Registry r;
  r.AddCounter("hits_total", "Hits.")->With({})->Increment(7);
  auto exporter = HttpExporter::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  ASSERT_GT((*exporter)->port(), 0);
  httplib::Client client("127.0.0.1", (*exporter)->port());
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_THAT(res->get_header_value("Content-Type"), HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(res->body, HasSubstr("# TYPE hits_total counter\nhits_total 7\n"));
  auto missing = client.Get("/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
}

TEST(HttpExporterTest, RefusesABadAddressNamingTheFlag) {
  Registry r;
  auto exporter = HttpExporter::Start("no-port-here", &r);
  ASSERT_FALSE(exporter.ok());
  EXPECT_EQ(exporter.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(exporter.status().message()), HasSubstr("metrics_listen"));
}

TEST(HttpExporterTest, ReportsAPortInUse) {
  Registry r;
  auto first = HttpExporter::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(first.ok());
  auto second = HttpExporter::Start(absl::StrCat("127.0.0.1:", (*first)->port()), &r);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace shardgemm::metrics
