// Collectives for the CUDA backend: NCCL, one communicator per mesh-axis
// group and mesh epoch, created the first time a step of the epoch needs it
// (every member reaches that step at the same place in the global order).
// The group's first member makes the ncclUniqueId and hands it out through
// the coordinator's rendezvous store. Communicators are nonblocking and
// every wait (joining one, a collective) polls: a collective that does not
// finish within the timeout aborts its communicator and fails the step, and
// one whose epoch was revoked (Collectives::Revoke) is aborted (ncclCommAbort)
// at once. NCCL's collectives carry no tags: the epoch is what keeps a step
// one member missed from pairing with another step's collective (a missed
// step advances it before any member can run a later step).
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

// How a communicator's members exchange its unique id. `epoch`: the mesh
// epoch of the communicator (a store may end a wait once it is revoked,
// ABORTED).
struct IdExchange {
  std::function<absl::Status(const std::string& key, const std::string& value, uint64_t epoch)> set;
  std::function<absl::StatusOr<std::string>(const std::string& key, uint64_t epoch)> get;  // waits
  // Deletes a key this member set, once every member has it (optional).
  std::function<void(const std::string& key)> forget;
};

// Through the coordinator's rendezvous store, over `coordinator` (a channel
// with this worker's credentials); a get waits at most `timeout`.
IdExchange CoordinatorIdExchange(std::shared_ptr<grpc::Channel> coordinator, const std::string& prefix,
                                 std::chrono::milliseconds timeout);

std::unique_ptr<Collectives> MakeNcclCollectives(const MeshPosition& position, int device,
                                                 IdExchange exchange,
                                                 std::chrono::milliseconds timeout);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_NCCL_COLLECTIVES_H_
