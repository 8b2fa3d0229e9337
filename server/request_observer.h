// What the coordinator tells its operator about the requests it serves:
// Prometheus metrics (requests by op and status code, their latency, bytes in
// and out by path, requests in progress, steps in flight, workers registered
// and ready, resident tensors and bytes, failed worker calls by rank) and one
// log line per request, carrying its id (the client's x-request-id metadata,
// or one made here) which every step of the request carries to the workers.
#ifndef SHARDGEMM_SERVER_REQUEST_OBSERVER_H_
#define SHARDGEMM_SERVER_REQUEST_OBSERVER_H_

#include <string>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "logging/log.h"
#include "metrics/metrics.h"
#include "server/coordinator.h"

namespace shardgemm {

enum class RequestOp {
  kGetClusterInfo,
  kPlan,
  kGroupedGemm,
  kGroupedQuantize,
  kPutTensor,
  kGetTensor,
  kDeleteTensor,
  kListTensors,
  kRegisterSharedMemory,
  kUnregisterSharedMemory,
  kRenewSharedMemory,
  kPlanStaging,
  kPutStaged,
  kPlanFetch,
  kReleaseStaging,
};
const char* RequestOpName(RequestOp op);  // "grouped_gemm", ...

// How a request's bytes travelled: in the request or response message
// (inline), or streamed in chunks (PutTensor / GetTensor).
enum class BytePath { kInline, kStream };

// How the request came: a gRPC call, or a frame on the call socket.
enum class RequestTransport { kGrpc, kCallSocket };

// The metadata key of a request's id.
inline constexpr char kRequestIdKey[] = "x-request-id";

// A request being served: Begin makes it, the handler fills in what it
// learns, End records it.
struct RequestRecord {
  RequestOp op = RequestOp::kGetClusterInfo;
  std::string request_id;
  std::string tenant;  // the caller's, from its token (empty with --insecure)
  absl::Time start;
  BytePath path = BytePath::kInline;
  RequestTransport transport = RequestTransport::kGrpc;
  int64_t bytes_in = 0, bytes_out = 0;
  std::string tensor;        // the resident tensor a put/get/delete names
  std::string plan_summary;  // GEMM / quantize: planner::PlanSummary
  double server_seconds = 0, worker_seconds = 0;
  int64_t host_to_device_bytes = 0, device_to_host_bytes = 0;
};

class RequestObserver {
 public:
  // `registry` null: no metrics (no --metrics_listen). `coordinator` and
  // `logger` must outlive the observer.
  RequestObserver(const Coordinator* coordinator, metrics::Registry* registry, logging::Logger* logger);

  // Takes the request id from the client's metadata (a valid one: 1 to 128
  // characters of [A-Za-z0-9._:/-]) or makes one, and sends it back in the
  // response's initial metadata.
  RequestRecord Begin(RequestOp op, grpc::ServerContextBase* context);
  // The same for a call that came another way (the call socket): the
  // client's id, if valid, or one made here; the caller sends it back.
  RequestRecord Begin(RequestOp op, const std::string& client_request_id);
  void End(const RequestRecord& record, const grpc::Status& status);

 private:
  logging::Logger* logger_;
  metrics::Family<metrics::Counter>* requests_ = nullptr;
  metrics::Family<metrics::Histogram>* latency_ = nullptr;
  metrics::Family<metrics::Counter>* bytes_ = nullptr;
  metrics::Gauge* in_progress_ = nullptr;
};

// A request id from a client is used when it is 1-128 characters of
// [A-Za-z0-9._:/-]; otherwise the coordinator makes one.
bool ValidRequestId(const std::string& id);
std::string MakeRequestId();

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_REQUEST_OBSERVER_H_
