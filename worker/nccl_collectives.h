// Collectives for the CUDA backend: NCCL, one communicator per mesh-axis
// group, created the first time a step needs it (every member reaches that
// step at the same place in the global order). The group's first member
// makes the ncclUniqueId and hands it out through the coordinator's
// rendezvous store. Asynchronous errors are watched: a collective that does
// not finish within the timeout aborts its communicator and fails the step.
#ifndef SHARDGEMM_WORKER_NCCL_COLLECTIVES_H_
#define SHARDGEMM_WORKER_NCCL_COLLECTIVES_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/collectives.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardgemm {

// How a communicator's members exchange its unique id.
struct IdExchange {
  std::function<absl::Status(const std::string& key, const std::string& value)> set;
  std::function<absl::StatusOr<std::string>(const std::string& key)> get;  // waits
  // Deletes a key this member set, once every member has it (optional).
  std::function<void(const std::string& key)> forget;
};

// Through the coordinator's rendezvous store, over `coordinator` (a channel
// with this worker's credentials).
IdExchange CoordinatorIdExchange(std::shared_ptr<grpc::Channel> coordinator, const std::string& prefix);

std::unique_ptr<Collectives> MakeNcclCollectives(const MeshPosition& position, int device,
                                                 IdExchange exchange,
                                                 std::chrono::milliseconds timeout);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_NCCL_COLLECTIVES_H_
