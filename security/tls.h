// Transport security for every hop: TLS from the certificates in a
// directory (tools/make_certs.sh makes them), mutual TLS inside the mesh, or
// plaintext only when asked for with --insecure.
//
// The directory holds ca.crt (the mesh CA, which also verifies client
// certificates) and ROLE.crt / ROLE.key for this process's role. The
// coordinator's certificate has CN shardgemm-coordinator, a worker's
// shardgemm-worker: a process's identity on the mesh is its certificate, not
// its address.
#ifndef SHARDGEMM_SECURITY_TLS_H_
#define SHARDGEMM_SECURITY_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace shardgemm::security {

enum class Role { kCoordinator, kWorker, kClient };
const char* RoleFileStem(Role role);  // "coordinator", "worker", "client"

inline constexpr char kCoordinatorName[] = "shardgemm-coordinator";
inline constexpr char kWorkerName[] = "shardgemm-worker";

class Transport {
 public:
  // From the flags: `tls_dir` for TLS, or `insecure` (and no tls_dir) for
  // plaintext; neither, or both, is INVALID_ARGUMENT naming the flags. A
  // missing or unreadable file is INVALID_ARGUMENT naming it.
  static absl::StatusOr<Transport> FromFlags(const std::string& tls_dir, bool insecure, Role role);
  static Transport Insecure();

  bool insecure() const { return insecure_; }
  // This process's server credentials. The coordinator asks clients for a
  // certificate and verifies one that is sent (mesh members send theirs;
  // clients may use tokens instead); a worker requires one.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // For a port clients call (a worker's staging port): this process's
  // certificate, and a client certificate verified only when one is sent
  // (clients authenticate with bearer tokens), as the coordinator's port.
  std::shared_ptr<grpc::ServerCredentials> ClientFacingServerCredentials() const;
  // For calls this process makes: verifies the server against the mesh CA
  // (and its address against the certificate's names) and presents this
  // process's certificate where it has one.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // True when the caller presented a certificate of the mesh CA with common
  // name `name` (always true when insecure: plaintext has no identities).
  bool CallerIs(const grpc::ServerContextBase& context, absl::string_view name) const;

  // The same-host hop (a worker's Unix socket in a directory only its user
  // can enter): gRPC's local credentials, which accept only a Unix-socket
  // connection and need no encryption, the bytes never leaving the kernel;
  // plaintext when insecure.
  std::shared_ptr<grpc::ServerCredentials> LocalServerCredentials() const;
  std::shared_ptr<grpc::ChannelCredentials> LocalChannelCredentials() const;

 private:
  bool insecure_ = true;
  Role role_ = Role::kClient;
  std::string ca_, cert_, key_;
};

// A certificate, key or token file's contents; INVALID_ARGUMENT naming
// `flag` and the path when it cannot be read or is empty.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, absl::string_view flag);

// The common name of the caller's verified certificate; empty without one.
std::string PeerCommonName(const grpc::ServerContextBase& context);

// Whether the call came over a port with local credentials (a Unix socket).
// On a worker's socket (a 0700 directory) the caller runs as this process's
// user on this host; a coordinator's --client_socket may admit others (its
// mode), so the coordinator never treats this as an identity.
bool CallerIsLocalSocketPeer(const grpc::ServerContextBase& context);

}  // namespace shardgemm::security

#endif  // SHARDGEMM_SECURITY_TLS_H_
