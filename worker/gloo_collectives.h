// Collectives for the CPU backend: Gloo over TCP, one Gloo context per
// mesh-axis group and mesh epoch, created the first time a step of the epoch
// needs it. Every member of a group reaches that step at the same place in
// the global order, so lazy creation lines up; rendezvous goes through the
// coordinator's store, whose waits end once their epoch is revoked. A revoke
// (Collectives::Revoke) fails every pair of the older epochs' contexts: a
// collective blocked on one ends at once, here and on its peers.
#ifndef SHARDGEMM_WORKER_GLOO_COLLECTIVES_H_
#define SHARDGEMM_WORKER_GLOO_COLLECTIVES_H_

#include <chrono>
#include <memory>
#include <string>

#include "worker/collectives.h"

namespace gloo {
namespace rendezvous {
class Store;
}  // namespace rendezvous
}  // namespace gloo

namespace grpc {
class Channel;
}  // namespace grpc

namespace shardgemm {

// A Gloo rendezvous store backed by the coordinator's Coordination service,
// over `coordinator` (a channel with this worker's credentials).
// `timeout` bounds every wait for a key.
std::shared_ptr<gloo::rendezvous::Store> MakeCoordinatorStore(std::shared_ptr<grpc::Channel> coordinator,
                                                              const std::string& namespace_prefix,
                                                              std::chrono::milliseconds timeout);

// `hostname`: the mesh address, numeric (MeshInterface): the device binds it
// and nothing else, and peers reach this worker there. `timeout` bounds every
// collective: a peer that never arrives is an error, not a hang.
std::unique_ptr<Collectives> MakeGlooCollectives(const MeshPosition& position,
                                                 std::shared_ptr<gloo::rendezvous::Store> store,
                                                 const std::string& hostname,
                                                 std::chrono::milliseconds timeout);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_GLOO_COLLECTIVES_H_
