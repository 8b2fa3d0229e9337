// The command-line tools' connection flags: --tls_dir (the mesh CA's
// ca.crt, and client.crt / client.key when there), --token_file (default:
// TLS_DIR/client.token) and --insecure (plaintext, no token). A
// coordinator target of unix:PATH (its --client_socket) is called with
// gRPC's local credentials and the token; the workers' staging ports keep
// TLS.
#ifndef SHARDGEMM_CLIENT_CONNECT_FLAGS_H_
#define SHARDGEMM_CLIENT_CONNECT_FLAGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "grpcpp/security/credentials.h"

namespace shardgemm {

struct ClientSecurity {
  bool insecure = false;
  std::string tls_dir;  // ca.crt, and client.crt/client.key when present
  std::string token;    // the bearer token (sent with every call)
};

// Whether `target` names a Unix socket (gRPC's unix:PATH or unix://PATH).
bool IsUnixSocketTarget(absl::string_view target);

// For the coordinator at `coordinator_target`: TLS (verifying it against
// ca.crt) with the bearer token as call credentials, or, for a unix: target,
// gRPC's local credentials with the token (--tls_dir then optional: without
// it the client has no credentials for the workers' staging ports); or
// insecure ones for both. INVALID_ARGUMENT naming the flag for a missing
// file, or neither TLS nor --insecure.
absl::StatusOr<ClientCredentials> MakeClientCredentials(const ClientSecurity& security,
                                                        absl::string_view coordinator_target);

// From the flags; prints the error and exits 2 on bad flags (for mains).
ClientCredentials ClientCredentialsFromFlags(const char* program, absl::string_view coordinator_target);

// --max_message_mb in bytes; prints the error and exits 2 when out of range.
int ClientMaxMessageBytesFromFlags(const char* program);

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_CONNECT_FLAGS_H_
