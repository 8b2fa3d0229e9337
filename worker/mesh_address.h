// The worker's mesh address: the host part of the address it registers with,
// as the local address its collectives bind. Gloo's TCP device is created
// with that address (numeric), and NCCL's bootstrap and socket transport are
// pinned to the interface that holds it (NCCL_SOCKET_IFNAME), so neither
// listens on another interface.
#ifndef SHARDGEMM_WORKER_MESH_ADDRESS_H_
#define SHARDGEMM_WORKER_MESH_ADDRESS_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardgemm {

// One address of a network interface.
struct NetInterface {
  std::string name;     // "lo", "eth0"
  int family = 0;       // AF_INET or AF_INET6
  std::string address;  // numeric, canonical ("127.0.0.1", "::1")
};

// The IPv4 and IPv6 addresses of this host's interfaces that are up
// (getifaddrs), in its order.
std::vector<NetInterface> LocalInterfaces();

// `host` without the brackets of an IPv6 literal: "[::1]" -> "::1".
std::string UnbracketHost(absl::string_view host);

// A numeric address's canonical text (an IPv4-mapped IPv6 address as IPv4:
// "::ffff:10.0.0.6" -> "10.0.0.6"); empty when `address` is not numeric.
std::string CanonicalAddress(absl::string_view address);

// The interface that holds `address` (numeric, any spelling): the first in
// `interfaces`. INVALID_ARGUMENT for a wildcard (0.0.0.0, ::) or a name;
// NOT_FOUND, naming the interfaces' addresses, when none holds it.
absl::StatusOr<NetInterface> InterfaceForAddress(absl::string_view address,
                                                 const std::vector<NetInterface>& interfaces);

// The mesh host (a name, or an address, IPv6 in brackets or not) as a local
// address: resolved (getaddrinfo), the first of its addresses that one of
// `interfaces` holds. INVALID_ARGUMENT when it is or resolves to a wildcard;
// UNAVAILABLE when it does not resolve; NOT_FOUND when none of its
// addresses is this host's.
absl::StatusOr<NetInterface> MeshInterface(absl::string_view host, const std::vector<NetInterface>& interfaces);

// The environment NCCL needs to bind its bootstrap and socket transport to
// `mesh` only: NCCL_SOCKET_IFNAME=<exact name> and NCCL_SOCKET_FAMILY of its
// address. Nothing when the operator set NCCL_SOCKET_IFNAME (their choice,
// the family with it); the family alone is not overridden. `getenv` reads
// the environment (std::getenv outside tests).
std::vector<std::pair<std::string, std::string>> NcclSocketEnvironment(
    const NetInterface& mesh, const std::function<const char*(const char*)>& getenv);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_MESH_ADDRESS_H_
