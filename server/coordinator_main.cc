// shardgemm-coordinator: owns the mesh, plans requests and dispatches them to
// the workers that register with it.
#include <csignal>
#include <iostream>
#include <memory>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/coordinator.h"
#include "proto/transport.h"
#include "server/service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to serve clients and workers on");
ABSL_FLAG(std::string, mesh, "dp=1", "mesh axes and sizes, e.g. 'dp=2,fsdp=2,ep=2'");
ABSL_FLAG(std::string, roles, "",
          "which axis plays dp/fsdp/ep/tp, e.g. 'dp=data,ep=expert'; axes named dp, fsdp, ep, "
          "tp play their own role by default");

ABSL_FLAG(double, step_timeout_s, 120,
          "the longest a request's steps may take on the workers (queueing included) when the "
          "client sets no earlier deadline");

namespace shardgemm {
namespace {

int Run() {
  auto mesh = planner::ParseMesh(absl::GetFlag(FLAGS_mesh), absl::GetFlag(FLAGS_roles));
  if (!mesh.ok()) {
    std::cerr << "shardgemm-coordinator: --mesh/--roles: " << mesh.status().message() << "\n";
    return 2;
  }
  if (!(absl::GetFlag(FLAGS_step_timeout_s) > 0)) {
    std::cerr << "shardgemm-coordinator: --step_timeout_s must be positive\n";
    return 2;
  }
  CoordinatorOptions options;
  options.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  Coordinator coordinator(*mesh, MakeGrpcWorkerChannel, options);
  ShardGemmService service(&coordinator);
  RendezvousStore rendezvous;
  CoordinationService coordination(&coordinator, &rendezvous);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  ConfigureTensorServer(&builder);
  builder.RegisterService(&service);
  builder.RegisterService(&coordination);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "shardgemm-coordinator: cannot listen on " << absl::GetFlag(FLAGS_listen) << "\n";
    return 1;
  }
  std::cerr << "shardgemm-coordinator: mesh " << planner::FormatMesh(*mesh) << " ("
            << planner::NumWorkers(*mesh) << " workers expected), serving on port " << port
            << "\n";

  ServeUntilSignalled(server.get());
  std::cerr << "shardgemm-coordinator: stopped\n";
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("shardgemm-coordinator --mesh='dp=2,ep=2' [--listen=HOST:PORT]");
  absl::ParseCommandLine(argc, argv);
  return shardgemm::Run();
}
