// Plans per second through the Plan RPC on loopback: an in-process
// coordinator service (Plan needs no workers) and client threads calling it.
//
//   bazel run -c opt //server:plan_rpc_benchmark -- --threads=4 --seconds=5
#include <atomic>
#include <functional>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "server/coordinator.h"
#include "server/service.h"

ABSL_FLAG(int, threads, 4, "client threads, each with its own channel");
ABSL_FLAG(double, seconds, 5, "how long to run");
ABSL_FLAG(std::string, mesh, "dp=2,fsdp=2,ep=2", "mesh");
ABSL_FLAG(bool, omit_text, false, "ask for the plan without its text table");
ABSL_FLAG(int, outstanding, 0,
          "if > 0: one client thread on gRPC's callback API keeping this many Plan calls in flight "
          "(less client CPU than blocking threads)");
ABSL_FLAG(bool, empty_rpc, false, "call GetClusterInfo instead: the RPC floor without planning");

namespace shardgemm {
namespace {

v1::PlanRequest Request() {
  v1::PlanRequest r;
  v1::GroupedGemmRequest* g = r.mutable_grouped_gemm();
  g->mutable_lhs()->set_dtype(v1::BF16);
  for (int64_t d : {4096, 7168}) g->mutable_lhs()->add_shape(d);
  g->mutable_lhs()->set_spec("((dp, fsdp, ep), None)");
  g->mutable_rhs()->set_dtype(v1::BF16);
  for (int64_t d : {8, 7168, 2048}) g->mutable_rhs()->add_shape(d);
  g->mutable_rhs()->set_spec("(ep, fsdp, None)");
  g->mutable_group_sizes()->set_dtype(v1::I32);
  g->mutable_group_sizes()->add_shape(32);
  g->mutable_group_sizes()->set_spec("((dp, fsdp, ep),)");
  r.set_omit_text(absl::GetFlag(FLAGS_omit_text));
  return r;
}

int Run() {
  auto mesh = planner::ParseMesh(absl::GetFlag(FLAGS_mesh), "");
  if (!mesh.ok()) {
    std::cerr << mesh.status() << "\n";
    return 1;
  }
  Coordinator coordinator(*mesh, [](const std::string&) { return nullptr; });
  ShardGemmService service(&coordinator);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  const std::string address = absl::StrFormat("127.0.0.1:%d", port);

  const v1::PlanRequest request = Request();
  std::atomic<int64_t> done{0}, failed{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  const int outstanding = absl::GetFlag(FLAGS_outstanding);
  std::unique_ptr<v1::ShardGemm::Stub> async_stub;
  struct Call {
    grpc::ClientContext ctx;
    v1::PlanResponse response;
  };
  std::function<void()> issue;
  absl::Mutex in_flight_mu;
  int in_flight = 0;
  if (outstanding > 0) {
    async_stub = v1::ShardGemm::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    issue = [&] {
      auto* call = new Call;
      async_stub->async()->Plan(&call->ctx, &request, &call->response, [&, call](grpc::Status s) {
        if (s.ok()) ++done;
        else ++failed;
        delete call;
        if (!stop) {
          issue();
        } else {
          absl::MutexLock lock(&in_flight_mu);
          --in_flight;
        }
      });
    };
    {
      absl::MutexLock lock(&in_flight_mu);
      in_flight = outstanding;
    }
    for (int i = 0; i < outstanding; ++i) issue();
  }
  for (int t = 0; outstanding == 0 && t < absl::GetFlag(FLAGS_threads); ++t) {
    threads.emplace_back([&, t] {
      grpc::ChannelArguments args;
      args.SetInt("shardgemm.bench.channel", t);  // a distinct channel per thread
      auto stub = v1::ShardGemm::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      while (!stop) {
        grpc::ClientContext ctx;
        grpc::Status s;
        if (absl::GetFlag(FLAGS_empty_rpc)) {
          v1::ClusterInfo info;
          s = stub->GetClusterInfo(&ctx, v1::ClusterInfoRequest(), &info);
        } else {
          v1::PlanResponse response;
          s = stub->Plan(&ctx, request, &response);
        }
        if (s.ok()) ++done;
        else ++failed;
      }
    });
  }
  const absl::Time start = absl::Now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  stop = true;
  for (auto& t : threads) t.join();
  if (outstanding > 0) {
    absl::MutexLock lock(&in_flight_mu);
    in_flight_mu.Await(absl::Condition(+[](int* n) { return *n == 0; }, &in_flight));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::cout << absl::StrFormat(
      "plan_rpc  mesh %s  threads %d  plans %d  failed %d  seconds %.2f  plans/s %.0f\n",
      absl::GetFlag(FLAGS_mesh), absl::GetFlag(FLAGS_threads), done.load(), failed.load(), seconds,
      done / seconds);
  server->Shutdown();
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardgemm::Run();
}
