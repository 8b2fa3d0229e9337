// gRPC settings every shardgemm channel and server share: tensors are large,
// and peers on loopback start together.
#ifndef SHARDGEMM_PROTO_TRANSPORT_H_
#define SHARDGEMM_PROTO_TRANSPORT_H_

#include <chrono>
#include <cstdint>

#include <functional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace shardgemm {

// gRPC's own ceiling (a message's length is a signed 32-bit count).
inline constexpr int kMaxMessageBytes = 2047 * 1024 * 1024;

// The data of one PutTensor / GetTensor stream message: with its header it
// fits the smallest message limit (1 MiB).
inline constexpr int64_t kTensorChunkBytes = (1 << 20) - 4096;

// Worker.StageShard: the worker's initial metadata carries this key once it
// has reserved the block's bytes in its staging area, so the coordinator
// learns of a refusal (its --staging_budget taken) before it forwards any
// bytes, while it can still take the assembled path.
inline constexpr char kStageReservedMetadataKey[] = "x-shardgemm-stage-reserved";

// Message limits (`max_message_bytes` each way, at most kMaxMessageBytes; a
// larger tensor goes in chunks: PutTensor, GetTensor), a wide HTTP/2 window
// with big frames (so large transfers do not stall on flow control), and
// quick reconnects.
grpc::ChannelArguments TensorChannelArguments(int max_message_bytes = kMaxMessageBytes);
void ConfigureTensorServer(grpc::ServerBuilder* builder, int max_message_bytes = kMaxMessageBytes);

// --max_message_mb's value in bytes: INVALID_ARGUMENT naming `flag` unless
// within 1 and 2047 MiB.
absl::StatusOr<int> MaxMessageBytesFromMiB(int64_t mib, absl::string_view flag);

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
