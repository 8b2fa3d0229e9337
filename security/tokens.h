// Bearer tokens for clients. The coordinator reads a tokens file (a
// Kubernetes Secret mounts one): one line per token, its SHA-256 (the file
// holds no token itself) and the tenant it acts for:
//
//   sha256:<64 hex digits> TENANT
//
// Lines starting with '#' and blank lines are skipped. The file is read
// again when it changes (checked at most once a second), so a token is
// revoked by deleting its line.
#ifndef SHARDGEMM_SECURITY_TOKENS_H_
#define SHARDGEMM_SECURITY_TOKENS_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace shardgemm::security {

// A tenant name: 1-64 characters of [A-Za-z0-9._-].
bool ValidTenant(const std::string& tenant);
// Lowercase hex SHA-256 of `text`.
std::string Sha256Hex(const std::string& text);

class TokenFile {
 public:
  // INVALID_ARGUMENT naming the file and line for a malformed one.
  static absl::StatusOr<std::unique_ptr<TokenFile>> Load(const std::string& path);

  // The tenant of the caller's "authorization: Bearer TOKEN" metadata:
  // UNAUTHENTICATED without one or for a token not in the file.
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context);
  absl::StatusOr<std::string> TenantOf(const std::string& token);

 private:
  explicit TokenFile(std::string path) : path_(std::move(path)) {}
  absl::Status Reload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  std::map<std::string, std::string> tenant_by_hash_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace shardgemm::security

#endif  // SHARDGEMM_SECURITY_TOKENS_H_
