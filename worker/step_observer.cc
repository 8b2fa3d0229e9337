#include "worker/step_observer.h"

#include <algorithm>

#include "absl/status/status.h"

namespace shardgemm {

const char* StepOpName(v1::Step::OpCase op) {
  switch (op) {
    case v1::Step::kGemm: return "gemm";
    case v1::Step::kQuantize: return "quantize";
    case v1::Step::kStore: return "store";
    case v1::Step::kDeleteShard: return "delete_shard";
    case v1::Step::OP_NOT_SET: break;
  }
  return "none";
}

StepObserver::StepObserver(const Executor* executor, const ShardStore* store, const Backend* backend,
                           metrics::Registry* registry, logging::Logger* logger)
    : logger_(logger) {
  if (registry == nullptr) return;
  steps_ = registry->AddCounter("shardgemm_worker_steps_total", "Steps this worker answered, by op and status code.",
                                {"op", "code"});
  step_seconds_ = registry->AddHistogram("shardgemm_worker_step_duration_seconds",
                                         "Time from a step's arrival to its answer (its turn's wait included).",
                                         {"op"}, metrics::LatencyBuckets());
  phase_seconds_ = registry->AddHistogram(
      "shardgemm_worker_step_phase_seconds",
      "A successful step's time by phase: kernel (the local op), collective (agreements included), "
      "transfer (decoding inputs, host<->device copies, encoding outputs).",
      {"phase"}, metrics::LatencyBuckets());
  step_bytes_ = registry->AddCounter("shardgemm_worker_step_bytes_total",
                                     "Encoded bytes of steps received and results sent.", {"direction"});
  transfer_bytes_ = registry->AddCounter("shardgemm_worker_transfer_bytes_total",
                                         "Bytes steps copied between host and device memory.", {"direction"});
  auto* waiting = registry->AddGauge("shardgemm_worker_steps_waiting",
                                     "Steps that arrived and wait for their turn in the global order.");
  auto* memory = registry->AddGauge("shardgemm_worker_memory_bytes",
                                    "Memory for resident shards and working buffers, used and budget.",
                                    {"memory", "kind"});
  auto* shards = registry->AddGauge("shardgemm_worker_resident_shards", "Shards this worker holds.");
  auto* failures = registry->AddCounter("shardgemm_worker_collective_failures_total",
                                        "Collective calls that failed (transport errors, timeouts).");
  auto* info = registry->AddGauge("shardgemm_worker_info", "Constant 1, labelled with the worker's rank and backend.",
                                  {"rank", "backend"});
  auto* device_healthy = registry->AddGauge(
      "shardgemm_worker_device_healthy",
      "1 while the device can run work; 0 once a sticky CUDA error has lost its context (the worker then exits).");
  registry->AddCollector([=] {
    waiting->With({})->Set(static_cast<double>(executor->steps_waiting()));
    memory->With({"host", "used"})->Set(static_cast<double>(store->used_bytes()));
    memory->With({"host", "budget"})->Set(static_cast<double>(store->budget_bytes()));
    memory->With({"device", "used"})->Set(static_cast<double>(store->device_used_bytes()));
    memory->With({"device", "budget"})->Set(static_cast<double>(store->device_budget_bytes()));
    shards->With({})->Set(static_cast<double>(store->num_shards()));
    failures->With({})->RaiseTo(static_cast<double>(executor->collective_failures()));
    info->With({std::to_string(executor->position().rank), backend->Name()})->Set(1);
    device_healthy->With({})->Set(backend->DeviceHealth().ok() ? 1 : 0);
  });
}

void StepObserver::WatchStaging(metrics::Registry* registry, const StagingArea* staging) {
  if (registry == nullptr) return;
  auto* bytes = registry->AddGauge("shardgemm_worker_staged_bytes",
                                   "Bytes of blocks clients staged here (or are staging) and outputs held for "
                                   "their direct fetch, and the --staging_budget.",
                                   {"kind"});
  registry->AddCollector([=] {
    bytes->With({"used"})->Set(static_cast<double>(staging->held_bytes()));
    bytes->With({"budget"})->Set(static_cast<double>(staging->budget_bytes()));
  });
}

void StepObserver::Record(const StepIdentity& step, absl::Duration elapsed, const absl::Status& status,
                          const v1::StepResult* result, int64_t bytes_in, int64_t bytes_out) {
  const char* op = StepOpName(step.op);
  const std::string code = absl::StatusCodeToString(status.code());
  // What is neither kernel nor collective moved the step's bytes.
  const double transfer = result == nullptr ? 0.0
                          : std::max(0.0, result->compute_seconds() - result->kernel_seconds() -
                                              result->collective_seconds());
  if (steps_ != nullptr) {
    steps_->With({op, code})->Increment();
    step_seconds_->With({op})->Observe(absl::ToDoubleSeconds(elapsed));
    step_bytes_->With({"received"})->Increment(static_cast<double>(bytes_in));
    step_bytes_->With({"sent"})->Increment(static_cast<double>(bytes_out));
    const bool computes = step.op == v1::Step::kGemm || step.op == v1::Step::kQuantize;
    if (result != nullptr && computes) {
      const double kernel = result->kernel_seconds(), collective = result->collective_seconds();
      phase_seconds_->With({"kernel"})->Observe(kernel);
      phase_seconds_->With({"collective"})->Observe(collective);
      phase_seconds_->With({"transfer"})->Observe(transfer);
      transfer_bytes_->With({"host_to_device"})->Increment(static_cast<double>(result->host_to_device_bytes()));
      transfer_bytes_->With({"device_to_host"})->Increment(static_cast<double>(result->device_to_host_bytes()));
    }
  }
  const logging::Level level = status.ok() ? logging::Level::kInfo : logging::Level::kWarning;
  if (logger_ == nullptr || !logger_->Enabled(level)) return;
  std::vector<logging::Field> fields = {
      {"request_id", step.request_id},
      {"sequence", step.sequence},
      {"op", op},
      {"code", code},
      {"step_ms", absl::ToDoubleMilliseconds(elapsed)},
  };
  if (result != nullptr) {
    fields.push_back({"compute_ms", result->compute_seconds() * 1e3});
    fields.push_back({"kernel_ms", result->kernel_seconds() * 1e3});
    fields.push_back({"collective_ms", result->collective_seconds() * 1e3});
    fields.push_back({"transfer_ms", transfer * 1e3});
    fields.push_back({"host_to_device_bytes", result->host_to_device_bytes()});
    fields.push_back({"device_to_host_bytes", result->device_to_host_bytes()});
  }
  fields.push_back({"bytes_in", bytes_in});
  fields.push_back({"bytes_out", bytes_out});
  if (!status.ok()) fields.push_back({"message", std::string(status.message())});
  logger_->Log(level, "step", fields);
}

}  // namespace shardgemm
