#include "server/request_observer.h"

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardgemm {

const char* RequestOpName(RequestOp op) {
  switch (op) {
    case RequestOp::kGetClusterInfo: return "get_cluster_info";
    case RequestOp::kPlan: return "plan";
    case RequestOp::kGroupedGemm: return "grouped_gemm";
    case RequestOp::kGroupedQuantize: return "grouped_quantize";
    case RequestOp::kPutTensor: return "put_tensor";
    case RequestOp::kGetTensor: return "get_tensor";
    case RequestOp::kDeleteTensor: return "delete_tensor";
    case RequestOp::kListTensors: return "list_tensors";
    case RequestOp::kRegisterSharedMemory: return "register_shared_memory";
    case RequestOp::kUnregisterSharedMemory: return "unregister_shared_memory";
    case RequestOp::kRenewSharedMemory: return "renew_shared_memory";
    case RequestOp::kPlanStaging: return "plan_staging";
    case RequestOp::kPutStaged: return "put_staged";
    case RequestOp::kPlanFetch: return "plan_fetch";
    case RequestOp::kReleaseStaging: return "release_staging";
  }
  return "unknown";
}

bool ValidRequestId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '/' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string MakeRequestId() {
  thread_local absl::BitGen gen;
  return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
}

RequestObserver::RequestObserver(const Coordinator* coordinator, metrics::Registry* registry,
                                 logging::Logger* logger)
    : logger_(logger) {
  if (registry == nullptr) return;
  requests_ = registry->AddCounter("shardgemm_requests_total", "Requests answered, by op and status code.",
                                   {"op", "code"});
  latency_ = registry->AddHistogram("shardgemm_request_duration_seconds",
                                    "Time from a request's arrival to its answer, by op.", {"op"},
                                    metrics::LatencyBuckets());
  bytes_ = registry->AddCounter(
      "shardgemm_request_bytes_total",
      "Request and response bytes, by direction (in, out) and path (inline in the message, or stream).",
      {"direction", "path"});
  in_progress_ = registry->AddGauge("shardgemm_requests_in_progress",
                                    "Requests received and not yet answered (the coordinator's queue).")
                     ->With({});
  auto* in_flight = registry->AddGauge("shardgemm_steps_in_flight",
                                       "Steps sent to the workers and not yet answered or given up on.");
  auto* workers = registry->AddGauge("shardgemm_workers", "Workers the mesh expects and has registered.",
                                     {"state"});
  auto* ready = registry->AddGauge("shardgemm_mesh_ready",
                                   "1 when every rank of the mesh has registered and answers its heartbeat.");
  auto* up = registry->AddGauge("shardgemm_worker_up",
                                "By rank: 1 while registered and answering the heartbeat, 0 when missing or down.",
                                {"rank"});
  auto* epoch = registry->AddGauge("shardgemm_mesh_epoch",
                                   "The mesh epoch: advances when a rank goes down or joins, and when a step fails "
                                   "in a way that may leave a collective half done (the workers rebuild their "
                                   "communicators).");
  auto* tensors = registry->AddGauge("shardgemm_resident_tensors", "Resident tensors in the registry.");
  auto* resident_bytes =
      registry->AddGauge("shardgemm_resident_bytes", "Logical bytes of the resident tensors (before sharding).");
  auto* failed = registry->AddCounter("shardgemm_worker_call_failures_total",
                                      "Worker calls that failed, by rank and status code (a worker down shows "
                                      "here as UNAVAILABLE or DEADLINE_EXCEEDED).",
                                      {"rank", "code"});
  auto* standby = registry->AddGauge(
      "shardgemm_standby_bytes",
      "By rank: bytes of the standby copies of other ranks' blocks placed there (--replicas), within its memory "
      "budget.",
      {"rank"});
  auto* restoring = registry->AddGauge(
      "shardgemm_resident_tensors_restoring",
      "Resident tensors whose copies on a replacement worker are being restored (UNAVAILABLE until they are).");
  auto* restores = registry->AddCounter(
      "shardgemm_restores_total",
      "A replacement worker's copies of one tensor, by result: restored, or failed (the tensor lost).", {"result"});
  auto* restored_bytes =
      registry->AddCounter("shardgemm_restored_bytes_total", "Bytes copied onto replacement workers by restores.");
  auto* activation_bytes = registry->AddCounter(
      "shardgemm_coordinator_activation_bytes_total",
      "Operand and output bytes of GEMM and quantize requests the coordinator decoded or encoded itself, by the "
      "request's path: inline, or direct (staged operands, direct output: 0 unless some operand was inline).",
      {"path"});
  registry->AddCollector([=] {
    const Coordinator::Stats stats = coordinator->GetStats();
    activation_bytes->With({"inline"})->RaiseTo(static_cast<double>(stats.inline_activation_bytes));
    activation_bytes->With({"direct"})->RaiseTo(static_cast<double>(stats.direct_activation_bytes));
    in_flight->With({})->Set(static_cast<double>(stats.dispatch.steps_in_flight));
    workers->With({"expected"})->Set(stats.workers_expected);
    workers->With({"registered"})->Set(stats.workers_registered);
    ready->With({})->Set(stats.ready ? 1 : 0);
    epoch->With({})->Set(static_cast<double>(stats.dispatch.epoch));
    for (size_t r = 0; r < stats.up.size(); ++r) up->With({std::to_string(r)})->Set(stats.up[r] ? 1 : 0);
    tensors->With({})->Set(static_cast<double>(stats.resident_tensors));
    resident_bytes->With({})->Set(static_cast<double>(stats.resident_bytes));
    for (size_t r = 0; r < stats.standby_bytes.size(); ++r) {
      standby->With({std::to_string(r)})->Set(static_cast<double>(stats.standby_bytes[r]));
    }
    restoring->With({})->Set(static_cast<double>(stats.restoring_tensors));
    restores->With({"restored"})->RaiseTo(static_cast<double>(stats.restored));
    restores->With({"failed"})->RaiseTo(static_cast<double>(stats.restore_failures));
    restored_bytes->With({})->RaiseTo(static_cast<double>(stats.restored_bytes));
    for (const auto& [key, count] : stats.dispatch.failed_calls) {
      metrics::Counter* c = failed->With({std::to_string(key.first), absl::StatusCodeToString(key.second)});
      c->RaiseTo(static_cast<double>(count));
    }
  });
}

RequestRecord RequestObserver::Begin(RequestOp op, const std::string& client_request_id) {
  RequestRecord record;
  record.op = op;
  record.start = absl::Now();
  record.request_id = ValidRequestId(client_request_id) ? client_request_id : MakeRequestId();
  if (in_progress_ != nullptr) in_progress_->Add(1);
  return record;
}

RequestRecord RequestObserver::Begin(RequestOp op, grpc::ServerContextBase* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(kRequestIdKey);
  RequestRecord record =
      Begin(op, it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size()));
  context->AddInitialMetadata(kRequestIdKey, record.request_id);
  return record;
}

void RequestObserver::End(const RequestRecord& record, const grpc::Status& status) {
  const absl::Duration elapsed = absl::Now() - record.start;
  const std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
  const char* op = RequestOpName(record.op);
  if (requests_ != nullptr) {
    in_progress_->Add(-1);
    requests_->With({op, code})->Increment();
    latency_->With({op})->Observe(absl::ToDoubleSeconds(elapsed));
    const char* path = record.path == BytePath::kStream ? "stream" : "inline";
    bytes_->With({"in", path})->Increment(static_cast<double>(record.bytes_in));
    bytes_->With({"out", path})->Increment(static_cast<double>(record.bytes_out));
  }
  // Cheap reads (cluster info, listings) log at debug; the rest at info, failures at warning.
  const bool routine = record.op == RequestOp::kGetClusterInfo || record.op == RequestOp::kListTensors;
  const logging::Level level = !status.ok() ? logging::Level::kWarning
                               : routine    ? logging::Level::kDebug
                                            : logging::Level::kInfo;
  if (logger_ == nullptr || !logger_->Enabled(level)) return;
  std::vector<logging::Field> fields = {
      {"request_id", record.request_id},
      {"op", op},
      {"code", code},
      {"elapsed_ms", absl::ToDoubleMilliseconds(elapsed)},
  };
  if (!record.tenant.empty()) fields.push_back({"tenant", record.tenant});
  if (record.transport == RequestTransport::kCallSocket) fields.push_back({"transport", "call_socket"});
  if (!record.tensor.empty()) fields.push_back({"tensor", record.tensor});
  if (!record.plan_summary.empty()) fields.push_back({"plan", record.plan_summary});
  if (record.server_seconds > 0) fields.push_back({"server_ms", record.server_seconds * 1e3});
  if (record.worker_seconds > 0) fields.push_back({"worker_ms", record.worker_seconds * 1e3});
  fields.push_back({"bytes_in", record.bytes_in});
  fields.push_back({"bytes_out", record.bytes_out});
  if (record.host_to_device_bytes > 0 || record.device_to_host_bytes > 0) {
    fields.push_back({"host_to_device_bytes", record.host_to_device_bytes});
    fields.push_back({"device_to_host_bytes", record.device_to_host_bytes});
  }
  if (!status.ok()) fields.push_back({"message", status.error_message()});
  logger_->Log(level, "request", fields);
}

}  // namespace shardgemm
