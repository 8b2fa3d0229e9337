// The gRPC face of a worker: translates Worker RPCs into Executor calls.
#ifndef SHARDGEMM_WORKER_WORKER_SERVICE_H_
#define SHARDGEMM_WORKER_WORKER_SERVICE_H_

#include "proto/shardgemm.grpc.pb.h"
#include "worker/executor.h"

namespace shardgemm {

class WorkerServiceImpl final : public v1::Worker::Service {
 public:
  WorkerServiceImpl(Executor* executor, ShardStore* store, Backend* backend)
      : executor_(executor), store_(store), backend_(backend) {}

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
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_WORKER_SERVICE_H_
