#include "client/connect_flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "proto/transport.h"
#include "security/tls.h"

ABSL_FLAG(std::string, tls_dir, "",
          "the mesh's certificates (ca.crt; client.crt/.key when there): TLS to the coordinator");
ABSL_FLAG(std::string, token_file, "", "the bearer token (default: TLS_DIR/client.token)");
ABSL_FLAG(bool, insecure, false, "plaintext, no token (a coordinator started with --insecure)");
ABSL_FLAG(int64_t, max_message_mb, 2047,
          "the largest message sent or received, MiB (1-2047): a larger inline response fails RESOURCE_EXHAUSTED");

namespace shardgemm {

bool IsUnixSocketTarget(absl::string_view target) { return absl::StartsWith(target, "unix:"); }

namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentials(const std::string& tls_dir) {
  grpc::SslCredentialsOptions options;
  auto ca = security::ReadCredentialFile(tls_dir + "/ca.crt", "tls_dir");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  auto cert = security::ReadCredentialFile(tls_dir + "/client.crt", "tls_dir");
  auto key = security::ReadCredentialFile(tls_dir + "/client.key", "tls_dir");
  if (cert.ok() && key.ok()) {
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> WithToken(std::shared_ptr<grpc::ChannelCredentials> channel,
                                                    const std::string& token) {
  if (channel == nullptr || token.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(token));
}

}  // namespace

absl::StatusOr<ClientCredentials> MakeClientCredentials(const ClientSecurity& security,
                                                        absl::string_view coordinator_target) {
  if (security.insecure) {
    if (!security.tls_dir.empty()) {
      return absl::InvalidArgumentError("insecure: --insecure and --tls_dir exclude each other");
    }
    return ClientCredentials(grpc::InsecureChannelCredentials());
  }
  const bool unix_socket = IsUnixSocketTarget(coordinator_target);
  if (security.tls_dir.empty() && !unix_socket) {
    return absl::InvalidArgumentError(
        "tls_dir: set --tls_dir to the mesh's certificates (with --token_file), or --insecure");
  }
  std::shared_ptr<grpc::ChannelCredentials> tls;
  if (!security.tls_dir.empty()) {
    auto made = TlsCredentials(security.tls_dir);
    if (!made.ok()) return made.status();
    tls = *std::move(made);
  }
  // The socket's peer is checked by the kernel (a Unix socket only), so the
  // token needs no encryption there; gRPC sends call credentials over it.
  std::shared_ptr<grpc::ChannelCredentials> coordinator = unix_socket ? grpc::experimental::LocalCredentials(UDS) : tls;
  ClientCredentials credentials(WithToken(coordinator, security.token), WithToken(tls, security.token));
  credentials.token = security.token;
  return credentials;
}

ClientCredentials ClientCredentialsFromFlags(const char* program, absl::string_view coordinator_target) {
  ClientSecurity security;
  security.insecure = absl::GetFlag(FLAGS_insecure);
  security.tls_dir = absl::GetFlag(FLAGS_tls_dir);
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty() && !security.tls_dir.empty()) token_file = security.tls_dir + "/client.token";
  if (!security.insecure && !token_file.empty()) {
    auto token = security::ReadCredentialFile(token_file, "token_file");
    if (!token.ok()) {
      std::cerr << program << ": " << token.status().message() << "\n";
      std::exit(2);
    }
    security.token = std::string(absl::StripAsciiWhitespace(*token));
  }
  auto credentials = MakeClientCredentials(security, coordinator_target);
  if (!credentials.ok()) {
    std::cerr << program << ": " << credentials.status().message() << "\n";
    std::exit(2);
  }
  return *credentials;
}

int ClientMaxMessageBytesFromFlags(const char* program) {
  auto bytes = MaxMessageBytesFromMiB(absl::GetFlag(FLAGS_max_message_mb), "--max_message_mb");
  if (!bytes.ok()) {
    std::cerr << program << ": " << bytes.status().message() << "\n";
    std::exit(2);
  }
  return *bytes;
}

}  // namespace shardgemm
