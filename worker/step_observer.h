// What a worker tells its operator about the steps it runs: Prometheus
// metrics (steps by op and status, their time split into kernel, collective
// and transfer, the queue of steps waiting for their turn, memory against
// the budgets, resident shards, host<->device bytes, collective failures)
// and one log line per step carrying the request's id.
#ifndef SHARDGEMM_WORKER_STEP_OBSERVER_H_
#define SHARDGEMM_WORKER_STEP_OBSERVER_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "logging/log.h"
#include "metrics/metrics.h"
#include "proto/shardgemm.pb.h"
#include "worker/backend.h"
#include "worker/executor.h"
#include "worker/shard_store.h"
#include "worker/staging_area.h"

namespace shardgemm {

class StepObserver {
 public:
  // `registry` null: no metrics (the worker has no --metrics_listen).
  // Everything passed in must outlive the observer.
  StepObserver(const Executor* executor, const ShardStore* store, const Backend* backend,
               metrics::Registry* registry, logging::Logger* logger);

  // Adds the staging area's gauges to `registry` (null: none): bytes
  // staged or held for fetch, and the budget. `staging` must outlive it.
  static void WatchStaging(metrics::Registry* registry, const StagingArea* staging);

  // What the record names of a step: taken before the executor consumes the
  // step (it moves the inline operands' bytes out).
  struct StepIdentity {
    v1::Step::OpCase op = v1::Step::OP_NOT_SET;
    std::string request_id;
    uint64_t sequence = 0;
    static StepIdentity Of(const v1::Step& step) { return {step.op_case(), step.request_id(), step.sequence()}; }
  };

  // One step answered: `result` when it succeeded; `bytes_in`/`bytes_out`
  // are the step's and the result's encoded sizes.
  void Record(const StepIdentity& step, absl::Duration elapsed, const absl::Status& status,
              const v1::StepResult* result, int64_t bytes_in, int64_t bytes_out);
  void Record(const v1::Step& step, absl::Duration elapsed, const absl::Status& status,
              const v1::StepResult* result, int64_t bytes_in, int64_t bytes_out) {
    Record(StepIdentity::Of(step), elapsed, status, result, bytes_in, bytes_out);
  }

 private:
  logging::Logger* logger_;
  metrics::Family<metrics::Counter>* steps_ = nullptr;
  metrics::Family<metrics::Histogram>* step_seconds_ = nullptr;
  metrics::Family<metrics::Histogram>* phase_seconds_ = nullptr;
  metrics::Family<metrics::Counter>* step_bytes_ = nullptr;
  metrics::Family<metrics::Counter>* transfer_bytes_ = nullptr;
};

// The step's op as metrics and logs name it: "gemm", "quantize", "store", "delete_shard".
const char* StepOpName(const v1::Step& step);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STEP_OBSERVER_H_
