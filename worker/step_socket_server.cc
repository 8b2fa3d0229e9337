#include "worker/step_socket_server.h"

#include <utility>

#include "proto/step_frame.h"

namespace shardgemm {

absl::StatusOr<std::unique_ptr<StepSocketServer>> StepSocketServer::Start(const std::string& path,
                                                                          Handler handler) {
  FrameSocketServer::Options options;
  options.name = "step socket";
  options.max_payload_bytes = kMaxStepSocketRequestBytes;
  options.max_connections = kMaxConnections;
  options.max_threads = kMaxThreads;
  auto frames = FrameSocketServer::Start(
      path, std::move(options),
      [handler = std::move(handler)](std::string payload, FrameSocketServer::Reply reply) -> absl::Status {
        auto request = std::make_unique<v1::StepSocketRequest>();
        if (!request->ParseFromString(payload)) return absl::DataLossError("a step frame's payload does not parse");
        payload = std::string();  // its bytes are parsed: not held while the step runs
        handler(std::move(request), [reply = std::move(reply)](v1::StepSocketReply r) { reply(r); });
        return absl::OkStatus();
      });
  if (!frames.ok()) return frames.status();
  return std::unique_ptr<StepSocketServer>(new StepSocketServer(*std::move(frames)));
}

}  // namespace shardgemm
