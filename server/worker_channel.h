// How the coordinator reaches one worker. The gRPC implementation is the real
// one; tests may substitute in-process workers.
#ifndef SHARDGEMM_SERVER_WORKER_CHANNEL_H_
#define SHARDGEMM_SERVER_WORKER_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

class WorkerChannel {
 public:
  virtual ~WorkerChannel() = default;
  virtual absl::StatusOr<v1::StepResult> Execute(const v1::Step& step) = 0;
  virtual absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name) = 0;
};

std::unique_ptr<WorkerChannel> MakeGrpcWorkerChannel(const std::string& address);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_WORKER_CHANNEL_H_
