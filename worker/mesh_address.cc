#include "worker/mesh_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm {
namespace {

// The canonical text of a binary IPv4 or IPv6 address.
std::string FromSockaddr(const struct sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const struct sockaddr_in*>(sa);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) return "";
    return text;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const struct sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      if (inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], text, sizeof(text)) == nullptr) return "";
      return text;
    }
    if (inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text)) == nullptr) return "";
    return text;
  }
  return "";
}

bool Unspecified(const std::string& canonical) { return canonical == "0.0.0.0" || canonical == "::"; }

int FamilyOf(const std::string& canonical) {
  return canonical.find(':') == std::string::npos ? AF_INET : AF_INET6;
}

std::string Describe(const std::vector<NetInterface>& interfaces) {
  if (interfaces.empty()) return "none";
  return absl::StrJoin(interfaces, ", ", [](std::string* out, const NetInterface& i) {
    absl::StrAppend(out, i.name, " ", i.address);
  });
}

}  // namespace

std::vector<NetInterface> LocalInterfaces() {
  std::vector<NetInterface> out;
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const struct ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || (ifa->ifa_flags & IFF_UP) == 0) continue;
    const int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    std::string address = FromSockaddr(ifa->ifa_addr);
    if (address.empty()) continue;
    out.push_back({ifa->ifa_name, FamilyOf(address), std::move(address)});
  }
  freeifaddrs(list);
  return out;
}

std::string UnbracketHost(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::string(host);
}

std::string CanonicalAddress(absl::string_view address) {
  const std::string text(address);
  struct sockaddr_in in = {};
  if (inet_pton(AF_INET, text.c_str(), &in.sin_addr) == 1) {
    in.sin_family = AF_INET;
    return FromSockaddr(reinterpret_cast<const struct sockaddr*>(&in));
  }
  struct sockaddr_in6 in6 = {};
  if (inet_pton(AF_INET6, text.c_str(), &in6.sin6_addr) == 1) {
    in6.sin6_family = AF_INET6;
    return FromSockaddr(reinterpret_cast<const struct sockaddr*>(&in6));
  }
  return "";
}

absl::StatusOr<NetInterface> InterfaceForAddress(absl::string_view address,
                                                 const std::vector<NetInterface>& interfaces) {
  const std::string canonical = CanonicalAddress(UnbracketHost(address));
  if (canonical.empty()) return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not a numeric address"));
  if (Unspecified(canonical)) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is a wildcard address, not one interface's"));
  }
  for (const NetInterface& i : interfaces) {
    if (CanonicalAddress(i.address) == canonical) return NetInterface{i.name, FamilyOf(canonical), canonical};
  }
  return absl::NotFoundError(absl::StrCat("no interface of this host has the address ", canonical,
                                          " (interfaces: ", Describe(interfaces), ")"));
}

absl::StatusOr<NetInterface> MeshInterface(absl::string_view host, const std::vector<NetInterface>& interfaces) {
  const std::string name = UnbracketHost(host);
  if (name.empty()) return absl::InvalidArgumentError("the mesh host is empty");
  std::vector<std::string> addresses;
  if (std::string literal = CanonicalAddress(name); !literal.empty()) {
    addresses.push_back(std::move(literal));
  } else {
    struct addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo* found = nullptr;
    if (int rc = getaddrinfo(name.c_str(), nullptr, &hints, &found); rc != 0) {
      return absl::UnavailableError(absl::StrCat("the mesh host '", host, "' does not resolve: ", gai_strerror(rc)));
    }
    for (const struct addrinfo* a = found; a != nullptr; a = a->ai_next) {
      std::string address = FromSockaddr(a->ai_addr);
      if (!address.empty() && std::find(addresses.begin(), addresses.end(), address) == addresses.end()) {
        addresses.push_back(std::move(address));
      }
    }
    freeaddrinfo(found);
  }
  for (const std::string& a : addresses) {
    if (Unspecified(a)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the mesh host '", host, "' is a wildcard address (", a, "), not one interface's"));
    }
  }
  for (const std::string& a : addresses) {
    if (auto i = InterfaceForAddress(a, interfaces); i.ok()) return i;
  }
  return absl::NotFoundError(absl::StrCat("the mesh host '", host, "' (", absl::StrJoin(addresses, ", "),
                                          ") is no address of this host's interfaces (", Describe(interfaces),
                                          ")"));
}

std::vector<std::pair<std::string, std::string>> NcclSocketEnvironment(
    const NetInterface& mesh, const std::function<const char*(const char*)>& getenv) {
  auto set = [&](const char* name) {
    const char* v = getenv(name);
    return v != nullptr && v[0] != '\0';
  };
  std::vector<std::pair<std::string, std::string>> env;
  if (set("NCCL_SOCKET_IFNAME")) return env;
  env.emplace_back("NCCL_SOCKET_IFNAME", "=" + mesh.name);  // '=': this interface only, not a prefix
  if (!set("NCCL_SOCKET_FAMILY")) {
    env.emplace_back("NCCL_SOCKET_FAMILY", mesh.family == AF_INET6 ? "AF_INET6" : "AF_INET");
  }
  return env;
}

}  // namespace shardgemm
