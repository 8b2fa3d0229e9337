#include "security/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"

namespace shardgemm::security {

absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  return text.str();
}

const char* RoleFileStem(Role role) {
  switch (role) {
    case Role::kCoordinator: return "coordinator";
    case Role::kWorker: return "worker";
    case Role::kClient: return "client";
  }
  return "client";
}

absl::StatusOr<Transport> Transport::FromFlags(const std::string& tls_dir, bool insecure, Role role) {
  if (insecure && !tls_dir.empty()) {
    return absl::InvalidArgumentError("insecure: --insecure and --tls_dir exclude each other");
  }
  if (insecure) return Insecure();
  if (tls_dir.empty()) {
    return absl::InvalidArgumentError(
        "tls_dir: set --tls_dir to a directory of certificates (tools/make_certs.sh DIR makes one), "
        "or --insecure for plaintext");
  }
  Transport t;
  t.insecure_ = false;
  t.role_ = role;
  auto ca = ReadCredentialFile(tls_dir + "/ca.crt", "tls_dir");
  if (!ca.ok()) return ca.status();
  t.ca_ = *ca;
  const std::string stem = RoleFileStem(role);
  auto cert = ReadCredentialFile(absl::StrCat(tls_dir, "/", stem, ".crt"), "tls_dir");
  auto key = ReadCredentialFile(absl::StrCat(tls_dir, "/", stem, ".key"), "tls_dir");
  if (role != Role::kClient) {
    if (!cert.ok()) return cert.status();
    if (!key.ok()) return key.status();
  }
  if (cert.ok() && key.ok()) {
    t.cert_ = *cert;
    t.key_ = *key;
  }
  return t;
}

Transport Transport::Insecure() { return Transport(); }

std::shared_ptr<grpc::ServerCredentials> Transport::ServerCredentials() const {
  if (insecure_) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      role_ == Role::kWorker ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                             : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_;
  options.pem_key_cert_pairs.push_back({key_, cert_});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> Transport::ClientFacingServerCredentials() const {
  if (insecure_) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_;
  options.pem_key_cert_pairs.push_back({key_, cert_});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> Transport::ChannelCredentials() const {
  if (insecure_) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca_;
  options.pem_private_key = key_;
  options.pem_cert_chain = cert_;
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> Transport::LocalServerCredentials() const {
  if (insecure_) return grpc::InsecureServerCredentials();
  return grpc::experimental::LocalServerCredentials(UDS);
}

std::shared_ptr<grpc::ChannelCredentials> Transport::LocalChannelCredentials() const {
  if (insecure_) return grpc::InsecureChannelCredentials();
  return grpc::experimental::LocalCredentials(UDS);
}

bool CallerIsLocalSocketPeer(const grpc::ServerContextBase& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return false;
  for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME)) {
    if (absl::string_view(v.data(), v.size()) == "local") return true;
  }
  return false;
}

std::string PeerCommonName(const grpc::ServerContextBase& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& v : auth->FindPropertyValues("x509_common_name")) {
    return std::string(v.data(), v.size());
  }
  return "";
}

bool Transport::CallerIs(const grpc::ServerContextBase& context, absl::string_view name) const {
  if (insecure_) return true;
  return PeerCommonName(context) == name;
}

}  // namespace shardgemm::security
