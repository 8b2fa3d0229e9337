#include "server/request_observer.h"

#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/fake_worker_channel.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(RequestObserverTest, RequestIdsFromClientsAreCheckedBeforeUse) {
  EXPECT_TRUE(ValidRequestId("moe-layer-3.step_41:a/b"));
  EXPECT_FALSE(ValidRequestId(""));
  EXPECT_FALSE(ValidRequestId("has space"));
  EXPECT_FALSE(ValidRequestId("quote\""));
  EXPECT_FALSE(ValidRequestId(std::string(129, 'a')));
  EXPECT_TRUE(ValidRequestId(std::string(128, 'a')));
  const std::string made = MakeRequestId();
  EXPECT_EQ(made.size(), 16u);
  EXPECT_TRUE(ValidRequestId(made));
  EXPECT_NE(made, MakeRequestId());
}

TEST(RequestObserverTest, EndCountsByOpAndCodeAndLogsOneLine) {
  auto mesh = FakeMesh::Create("ep=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  metrics::Registry registry;
  std::ostringstream log;
  logging::Logger logger(logging::Format::kJson, logging::Level::kInfo, &log);
  RequestObserver observer(&(*mesh)->coordinator(), &registry, &logger);

  grpc::ServerContext context;
  RequestRecord ok = observer.Begin(RequestOp::kGroupedGemm, &context);
  EXPECT_TRUE(ValidRequestId(ok.request_id));
  EXPECT_THAT(registry.Render(), HasSubstr("shardgemm_requests_in_progress 1\n"));
  ok.bytes_in = 1000;
  ok.bytes_out = 400;
  ok.plan_summary = "grouped_gemm_ragged_m m k, g k n, g -> m n; out (ep, None)";
  ok.server_seconds = 0.002;
  observer.End(ok, grpc::Status::OK);
  grpc::ServerContext context2;
  RequestRecord bad = observer.Begin(RequestOp::kPutTensor, &context2);
  bad.path = BytePath::kStream;
  bad.bytes_in = 64;
  bad.tensor = "w";
  observer.End(bad, grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "resident tensor 'w' exists"));

  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("shardgemm_requests_total{op=\"grouped_gemm\",code=\"OK\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_requests_total{op=\"put_tensor\",code=\"ALREADY_EXISTS\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_request_bytes_total{direction=\"in\",path=\"inline\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_request_bytes_total{direction=\"in\",path=\"stream\"} 64\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_requests_in_progress 0\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_workers{state=\"expected\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_workers{state=\"registered\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_mesh_ready 1\n"));
  EXPECT_THAT(text, HasSubstr("shardgemm_resident_tensors 0\n"));

  std::istringstream lines(log.str());
  std::string first, second, extra;
  ASSERT_TRUE(std::getline(lines, first));
  ASSERT_TRUE(std::getline(lines, second));
  EXPECT_FALSE(std::getline(lines, extra));
  auto a = nlohmann::json::parse(first);
  EXPECT_EQ(a["request_id"], ok.request_id);
  EXPECT_EQ(a["op"], "grouped_gemm");
  EXPECT_EQ(a["code"], "OK");
  EXPECT_EQ(a["plan"], ok.plan_summary);
  EXPECT_DOUBLE_EQ(a["server_ms"].get<double>(), 2.0);
  auto b = nlohmann::json::parse(second);
  EXPECT_EQ(b["level"], "warning");
  EXPECT_EQ(b["tensor"], "w");
  EXPECT_EQ(b["message"], "resident tensor 'w' exists");
}

TEST(RequestObserverTest, FailedWorkerCallsAreCountedByRankAndCode) {
  auto mesh = FakeMesh::Create("dp=2");
  ASSERT_TRUE(mesh.ok());
  metrics::Registry registry;
  RequestObserver observer(&(*mesh)->coordinator(), &registry, nullptr);
  FakeWorkerChannel gone = (*mesh)->worker(1);
  gone.SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
    return absl::UnavailableError("worker 1 is gone");
  });
  HostTensor w = *ZerosTensor(DType::kF32, {4, 2});
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE((*mesh)->coordinator().PutTensor(absl::StrCat("w", i), w, "(dp, None)", false).ok());
  }
  EXPECT_THAT(registry.Render(),
              HasSubstr("shardgemm_worker_call_failures_total{rank=\"1\",code=\"UNAVAILABLE\"} 2\n"));
  EXPECT_THAT(registry.Render(), Not(HasSubstr("shardgemm_worker_call_failures_total{rank=\"0\"")));
  EXPECT_THAT(registry.Render(), HasSubstr("shardgemm_worker_up{rank=\"1\"} 1\n")) << "failed calls are not a heartbeat";
  gone.SetHandler(nullptr);
}

}  // namespace
}  // namespace shardgemm
