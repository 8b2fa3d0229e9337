#include "server/call_socket.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace shardgemm {
namespace {

// Answers a request that names no call this socket serves.
void AnswerNoCall(const v1::CallSocketRequest& request, const FrameSocketServer::Reply& reply) {
  v1::CallSocketReply answer;
  answer.set_call_id(request.call_id());
  answer.set_code(static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  answer.set_message("call: none set; the call socket serves grouped_gemm");
  reply(answer);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FrameSocketServer>> StartCallSocket(const std::string& path,
                                                                   ShardGemmService* service,
                                                                   uint64_t max_request_bytes) {
  FrameSocketServer::Options options;
  options.name = "call socket";
  options.max_payload_bytes = max_request_bytes;
  return FrameSocketServer::Start(
      path, std::move(options), [service](std::string payload, FrameSocketServer::Reply reply) -> absl::Status {
        // Shared: the request and its answer live until the call finishes.
        auto request = std::make_shared<v1::CallSocketRequest>();
        if (!request->ParseFromString(payload)) {
          return absl::DataLossError("a call socket frame's payload is not a CallSocketRequest");
        }
        payload = std::string();  // its bytes are parsed: not held while the GEMM runs
        if (request->call_case() != v1::CallSocketRequest::kGroupedGemm) {
          AnswerNoCall(*request, reply);
          return absl::OkStatus();
        }
        ShardGemmService::SocketCall origin;
        origin.token = request->token();
        origin.request_id = request->request_id();
        if (request->deadline_unix_us() != 0) origin.deadline = absl::FromUnixMicros(request->deadline_unix_us());
        auto answer = std::make_shared<v1::CallSocketReply>();
        answer->set_call_id(request->call_id());
        service->GroupedGemmFromSocket(
            request->grouped_gemm(), origin, answer->mutable_grouped_gemm(),
            [request, answer, reply = std::move(reply)](grpc::Status status, const std::string& request_id) {
              answer->set_code(static_cast<int32_t>(status.error_code()));
              answer->set_request_id(request_id);
              if (!status.ok()) {
                answer->set_message(status.error_message());
                answer->clear_grouped_gemm();
              }
              reply(*answer);
            });
        return absl::OkStatus();
      });
}

}  // namespace shardgemm
