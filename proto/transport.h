// gRPC settings every shardgemm channel and server share: tensors are large,
// and peers on loopback start together.
#ifndef SHARDGEMM_PROTO_TRANSPORT_H_
#define SHARDGEMM_PROTO_TRANSPORT_H_

#include <chrono>

#include <functional>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace shardgemm {

inline constexpr int kMaxMessageBytes = 2047 * 1024 * 1024;

// Message limits near 2 GiB, a wide HTTP/2 window with big frames (so large
// transfers do not stall on flow control), and quick reconnects.
grpc::ChannelArguments TensorChannelArguments();
void ConfigureTensorServer(grpc::ServerBuilder* builder);

// A plaintext server with only gRPC health checking (EnableDefaultHealthCheckService
// must be on), for probes that speak no TLS (Kubernetes' native gRPC probes);
// nullptr when it cannot listen.
std::unique_ptr<grpc::Server> StartHealthOnlyServer(const std::string& address, int* port);

// Blocks until SIGINT or SIGTERM, then shuts the server down cleanly.
// `before_shutdown` (optional) runs once the signal came, before the server
// shuts down (to answer the calls still waiting on other processes).
void ServeUntilSignalled(grpc::Server* server, std::function<void()> before_shutdown = nullptr);
// Ends ServeUntilSignalled as SIGTERM would (from any thread).
void StopServing();

// A call's deadline as absl::Time and back (gRPC's "none" is the far future).
absl::Time DeadlineOf(const grpc::ServerContextBase* context);
std::chrono::system_clock::time_point ToGrpcDeadline(absl::Time deadline);

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_TRANSPORT_H_
