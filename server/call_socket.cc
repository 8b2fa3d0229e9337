#include "server/call_socket.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format.h"

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
// a message over its limit, and the connection goes on. One whose call id
// is not in its head ends the connection: an answer under id 0 would read
// as the connection's refusal, and its client would send again calls that
// may have run.
absl::Status AnswerOversized(const std::string& head, uint64_t payload_bytes, uint64_t max_request_bytes,
                             const FrameSocketServer::Reply& reply) {
  const uint64_t call_id = CallIdOfRequestHead(head);
  if (call_id == 0) {
    return absl::DataLossError(absl::StrCat("a call of ", payload_bytes, " bytes, more than the ", max_request_bytes,
                                            " taken, whose call_id is not in its first ",
                                            FrameSocketServer::kOversizedHeadBytes, " bytes"));
  }
  v1::CallSocketReply answer;
  answer.set_call_id(call_id);
  answer.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  answer.set_message(absl::StrCat("the call of ", payload_bytes, " bytes is more than the ", max_request_bytes,
                                  " the coordinator takes (--max_message_mb)"));
  reply(answer);
  return absl::OkStatus();
}

// `answer` with the status a gRPC call would have ended with; a failed
// call's answer carries no response.
const v1::CallSocketReply& Finished(v1::CallSocketReply* answer, const grpc::Status& status,
                                    const std::string& request_id) {
  answer->set_code(static_cast<int32_t>(status.error_code()));
  answer->set_request_id(request_id);
  if (!status.ok()) {
    answer->set_message(status.error_message());
    answer->clear_answer();
  }
  return *answer;
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
    if (!google::protobuf::internal::WireFormat::SkipField(&in, tag, nullptr)) return 0;
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
    return AnswerOversized(head, payload_bytes, max_request_bytes, reply);
  };
  options.max_connections = kMaxCallSocketConnections;
  options.refusal = Refusal(options.max_connections);
  options.max_threads = 4 * kMaxCallSocketConnections;
  // A quantize holds its handler's thread while it runs: at most this many
  // at once, so the pool keeps threads for reading and for the replies.
  auto quantizes_running = std::make_shared<std::atomic<int>>(0);
  return FrameSocketServer::Start(
      path, std::move(options),
      [service, quantizes_running](std::string payload, FrameSocketServer::Reply reply) -> absl::Status {
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
          if (quantizes_running->fetch_add(1) >= kMaxCallSocketQuantizes) {
            quantizes_running->fetch_sub(1);
            answer->set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
            answer->set_message(absl::StrCat("the call socket runs at most ", kMaxCallSocketQuantizes,
                                             " GroupedQuantize calls at once; retry, or call on gRPC"));
            reply(*answer);
            return absl::OkStatus();
          }
          // On this thread, as gRPC's synchronous handler runs it.
          std::string request_id;
          grpc::Status status = service->GroupedQuantizeFromSocket(
              request->grouped_quantize(), origin, answer->mutable_grouped_quantize(), &request_id);
          quantizes_running->fetch_sub(1);
          reply(Finished(answer.get(), status, request_id));
          return absl::OkStatus();
        }
        service->GroupedGemmFromSocket(
            request->grouped_gemm(), origin, answer->mutable_grouped_gemm(),
            [request, answer, reply = std::move(reply)](grpc::Status status, const std::string& request_id) {
              reply(Finished(answer.get(), status, request_id));
            });
        return absl::OkStatus();
      });
}

}  // namespace shardgemm
