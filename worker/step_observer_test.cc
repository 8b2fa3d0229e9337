#include "worker/step_observer.h"

#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

class StepObserverTest : public ::testing::Test {
 protected:
  StepObserverTest() : backend_(MakeCpuBackend(1)), store_(1 << 20), executor_(backend_.get(), &store_) {}
  std::unique_ptr<Backend> backend_;
  ShardStore store_;
  Executor executor_;
  metrics::Registry registry_;
  std::ostringstream log_;
  logging::Logger logger_{logging::Format::kJson, logging::Level::kInfo, &log_};
};

TEST_F(StepObserverTest, CountsStepsByOpAndCodeAndSplitsTheTimeByPhase) {
  StepObserver observer(&executor_, &store_, backend_.get(), &registry_, &logger_);
  v1::Step gemm;
  gemm.mutable_gemm();
  gemm.set_sequence(7);
  gemm.set_request_id("req-1");
  v1::StepResult result;
  result.set_compute_seconds(0.010);
  result.set_kernel_seconds(0.006);
  result.set_collective_seconds(0.003);
  result.set_host_to_device_bytes(100);
  observer.Record(gemm, absl::Milliseconds(12), absl::OkStatus(), &result, 500, 300);
  observer.Record(gemm, absl::Milliseconds(1), absl::InvalidArgumentError("lhs: bad"), nullptr, 500, 0);

  const std::string text = registry_.Render();
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_steps_total{op=\"gemm\",code=\"OK\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_steps_total{op=\"gemm\",code=\"INVALID_ARGUMENT\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_step_duration_seconds_count{op=\"gemm\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_step_phase_seconds_sum{phase=\"kernel\"} 0.0060000000000000001\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_step_phase_seconds_count{phase=\"transfer\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_step_bytes_total{direction=\"received\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_transfer_bytes_total{direction=\"host_to_device\"} 100\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_memory_bytes{memory=\"host\",kind=\"budget\"} 1048576\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_worker_steps_waiting 0\n"));

  std::istringstream lines(log_.str());
  std::string first, second;
  std::getline(lines, first);
  std::getline(lines, second);
  auto ok = nlohmann::json::parse(first);
  EXPECT_EQ(ok["event"], "step");
  EXPECT_EQ(ok["request_id"], "req-1");
  EXPECT_EQ(ok["sequence"], 7);
  EXPECT_EQ(ok["op"], "gemm");
  EXPECT_DOUBLE_EQ(ok["kernel_ms"].get<double>(), 6.0);
  EXPECT_NEAR(ok["transfer_ms"].get<double>(), 1.0, 1e-9);
  auto failed = nlohmann::json::parse(second);
  EXPECT_EQ(failed["level"], "warning");
  EXPECT_EQ(failed["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(failed["message"], "lhs: bad");
}

TEST_F(StepObserverTest, WithoutARegistryItOnlyLogs) {
  StepObserver observer(&executor_, &store_, backend_.get(), nullptr, &logger_);
  v1::Step store;
  store.mutable_store();
  observer.Record(store, absl::Milliseconds(1), absl::OkStatus(), nullptr, 10, 0);
  EXPECT_EQ(registry_.Render(), "");
  EXPECT_THAT(log_.str(), HasSubstr("\"op\":\"store\""));
}

}  // namespace
}  // namespace shardgemm
