#include "client/connect_flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "proto/transport.h"
#include "security/tls.h"

ABSL_FLAG(std::string, tls_dir, "",
          "the mesh's certificates (ca.crt; client.crt/.key when there): TLS to the coordinator");
ABSL_FLAG(std::string, token_file, "", "the bearer token (default: TLS_DIR/client.token)");
ABSL_FLAG(bool, insecure, false, "plaintext, no token (a coordinator started with --insecure)");
ABSL_FLAG(int64_t, max_message_mb, 2047,
          "the largest message sent or received, MiB (1-2047): a larger inline response fails RESOURCE_EXHAUSTED");

namespace shardgemm {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeClientCredentials(const ClientSecurity& security) {
  if (security.insecure) {
    if (!security.tls_dir.empty()) {
      return absl::InvalidArgumentError("insecure: --insecure and --tls_dir exclude each other");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (security.tls_dir.empty()) {
    return absl::InvalidArgumentError(
        "tls_dir: set --tls_dir to the mesh's certificates (with --token_file), or --insecure");
  }
  grpc::SslCredentialsOptions options;
  auto ca = security::ReadCredentialFile(security.tls_dir + "/ca.crt", "tls_dir");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  auto cert = security::ReadCredentialFile(security.tls_dir + "/client.crt", "tls_dir");
  auto key = security::ReadCredentialFile(security.tls_dir + "/client.key", "tls_dir");
  if (cert.ok() && key.ok()) {
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  std::shared_ptr<grpc::ChannelCredentials> channel = grpc::SslCredentials(options);
  if (security.token.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(security.token));
}

std::shared_ptr<grpc::ChannelCredentials> ClientCredentialsFromFlags(const char* program) {
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
  auto credentials = MakeClientCredentials(security);
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
