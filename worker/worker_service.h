// The gRPC face of a worker: translates Worker RPCs into Executor calls.
#ifndef SHARDGEMM_WORKER_WORKER_SERVICE_H_
#define SHARDGEMM_WORKER_WORKER_SERVICE_H_

#include "proto/shardgemm.grpc.pb.h"
#include "worker/executor.h"
#include "worker/step_observer.h"

namespace shardgemm {

class WorkerServiceImpl final : public v1::Worker::Service {
 public:
  // `observer` (may be null) sees every step answered.
  WorkerServiceImpl(Executor* executor, ShardStore* store, Backend* backend,
                    StepObserver* observer = nullptr)
      : executor_(executor), store_(store), backend_(backend), observer_(observer) {}

  grpc::Status Execute(grpc::ServerContext* context, const v1::Step* step,
                       v1::StepResult* result) override;
  grpc::Status GetShard(grpc::ServerContext* context, const v1::GetShardRequest* request,
                        v1::LocalTensor* shard) override;
  grpc::Status Status(grpc::ServerContext* context, const v1::WorkerStatusRequest* request,
                      v1::WorkerStatus* status) override;

 private:
  Executor* executor_;
  ShardStore* store_;
  Backend* backend_;
  StepObserver* observer_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_WORKER_SERVICE_H_
