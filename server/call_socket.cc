#include "server/call_socket.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace shardgemm {
namespace {

// Answers a request that names no call this socket serves.
void AnswerNoCall(const v1::CallSocketRequest& request, const FrameSocketServer::Reply& reply) {
  v1::CallSocketReply answer;
  answer.set_call_id(request.call_id());
  answer.set_code(static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  answer.set_message("call: none set; the call socket serves grouped_gemm and grouped_quantize");
  reply(answer);
}

// A request larger than the coordinator takes is answered as gRPC answers
// a message over its limit, and the connection goes on.
void AnswerOversized(const std::string& head, uint64_t payload_bytes, uint64_t max_request_bytes,
                     const FrameSocketServer::Reply& reply) {
  v1::CallSocketReply answer;
  answer.set_call_id(CallIdOfRequestHead(head));
  answer.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  answer.set_message(absl::StrCat("the call of ", payload_bytes, " bytes is more than the ", max_request_bytes,
                                  " the coordinator takes (--max_message_mb)"));
  reply(answer);
}

std::string Refusal(int max_connections) {
  // Call id 0 is no call's: the client takes it for the connection's refusal,
  // and sends its calls in flight on it another way (none of them ran).
  v1::CallSocketReply refusal;
  refusal.set_call_id(0);
  refusal.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  refusal.set_message(absl::StrCat("the call socket serves ", max_connections, " connections at once"));
  return refusal.SerializeAsString();
}

}  // namespace

uint64_t CallIdOfRequestHead(absl::string_view head) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(head.data()),
                                            static_cast<int>(head.size()));
  constexpr uint32_t kCallIdTag = 1u << 3 | 0u;  // field 1, varint
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (tag == kCallIdTag) {
      uint64_t call_id = 0;
      return in.ReadVarint64(&call_id) ? call_id : 0;
    }
    if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) return 0;
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<FrameSocketServer>> StartCallSocket(const std::string& path,
                                                                   ShardGemmService* service,
                                                                   uint64_t max_request_bytes) {
  FrameSocketServer::Options options;
  options.name = "call socket";
  options.max_payload_bytes = max_request_bytes;
  options.oversized = [max_request_bytes](std::string head, uint64_t payload_bytes, FrameSocketServer::Reply reply) {
    AnswerOversized(head, payload_bytes, max_request_bytes, reply);
  };
  options.max_connections = kMaxCallSocketConnections;
  options.refusal = Refusal(options.max_connections);
  options.max_threads = 4 * kMaxCallSocketConnections;
  return FrameSocketServer::Start(
      path, std::move(options), [service](std::string payload, FrameSocketServer::Reply reply) -> absl::Status {
        // Shared: the request and its answer live until the call finishes.
        auto request = std::make_shared<v1::CallSocketRequest>();
        if (!request->ParseFromString(payload)) {
          return absl::DataLossError("a call socket frame's payload is not a CallSocketRequest");
        }
        payload = std::string();  // its bytes are parsed: not held while the GEMM runs
        if (request->call_case() == v1::CallSocketRequest::CALL_NOT_SET) {
          AnswerNoCall(*request, reply);
          return absl::OkStatus();
        }
        ShardGemmService::SocketCall origin;
        origin.token = request->token();
        origin.request_id = request->request_id();
        if (request->deadline_unix_us() != 0) origin.deadline = absl::FromUnixMicros(request->deadline_unix_us());
        auto answer = std::make_shared<v1::CallSocketReply>();
        answer->set_call_id(request->call_id());
        if (request->call_case() == v1::CallSocketRequest::kGroupedQuantize) {
          // On this thread, as gRPC's synchronous handler runs it.
          std::string request_id;
          grpc::Status status = service->GroupedQuantizeFromSocket(
              request->grouped_quantize(), origin, answer->mutable_grouped_quantize(), &request_id);
          answer->set_code(static_cast<int32_t>(status.error_code()));
          answer->set_request_id(request_id);
          if (!status.ok()) {
            answer->set_message(status.error_message());
            answer->clear_grouped_quantize();
          }
          reply(*answer);
          return absl::OkStatus();
        }
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
