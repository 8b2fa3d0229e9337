// The command-line tools' connection flags: --tls_dir (the mesh CA's
// ca.crt, and client.crt / client.key when there), --token_file (default:
// TLS_DIR/client.token) and --insecure (plaintext, no token).
#ifndef SHARDGEMM_CLIENT_CONNECT_FLAGS_H_
#define SHARDGEMM_CLIENT_CONNECT_FLAGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"

namespace shardgemm {

struct ClientSecurity {
  bool insecure = false;
  std::string tls_dir;  // ca.crt, and client.crt/client.key when present
  std::string token;    // the bearer token (sent with every call)
};

// TLS (verifying the coordinator against ca.crt) with the bearer token as
// call credentials, or insecure ones. INVALID_ARGUMENT naming the flag for
// a missing file, or neither TLS nor --insecure.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeClientCredentials(const ClientSecurity& security);

// From the flags; prints the error and exits 2 on bad flags (for mains).
std::shared_ptr<grpc::ChannelCredentials> ClientCredentialsFromFlags(const char* program);

// --max_message_mb in bytes; prints the error and exits 2 when out of range.
int ClientMaxMessageBytesFromFlags(const char* program);

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_CONNECT_FLAGS_H_
