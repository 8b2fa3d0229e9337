#include "proto/transport.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {
std::atomic<bool> g_stop{false};
}  // namespace

grpc::ChannelArguments TensorChannelArguments(int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 << 20);
  // Quick reconnects: the first retry soon, none later than a second apart. Not
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC takes it as the least time a connection attempt
  // gets (its min connect timeout, 20 s by default): at 50 it gave about 0.1 s, and a server
  // slower to send its first frame (a loaded machine) failed the call at once.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

absl::StatusOr<int> MaxMessageBytesFromMiB(int64_t mib, absl::string_view flag) {
  constexpr int64_t kMaxMiB = kMaxMessageBytes / (1024 * 1024);
  if (mib < 1 || mib > kMaxMiB) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", mib, ": a message limit is 1 to ", kMaxMiB, " MiB (larger tensors go in chunks)"));
  }
  return static_cast<int>(mib * 1024 * 1024);
}

void ConfigureTensorServer(grpc::ServerBuilder* builder, int max_message_bytes) {
  builder->SetMaxReceiveMessageSize(max_message_bytes);
  builder->SetMaxSendMessageSize(max_message_bytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 << 20);
  // No SO_REUSEPORT: a second process must not bind a server's port beside it
  // and take part of its calls.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

absl::Time DeadlineOf(const grpc::ServerContextBase* context) {
  const auto d = context->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

std::chrono::system_clock::time_point ToGrpcDeadline(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return std::chrono::system_clock::time_point::max();
  return absl::ToChronoTime(deadline);
}

std::unique_ptr<grpc::Server> StartHealthOnlyServer(const std::string& address, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) return nullptr;
  return server;
}

void StopServing() { g_stop = true; }

void ServeUntilSignalled(grpc::Server* server, std::function<void()> before_shutdown) {
  std::signal(SIGINT, [](int) { g_stop = true; });
  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::thread waiter([server, before_shutdown = std::move(before_shutdown)] {
    while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (before_shutdown) before_shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  });
  server->Wait();
  g_stop = true;
  waiter.join();
}

}  // namespace shardgemm
