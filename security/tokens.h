// Bearer tokens for clients. The coordinator reads a tokens file (a
// Kubernetes Secret mounts one): one line per token, its SHA-256 (the file
// holds no token itself), the tenant it acts for, and optionally what it may
// do (default: all of it):
//
//   sha256:<64 hex digits> TENANT [compute,read,write]
//
// compute: GEMM, quantize and plan requests; read: get, list and cluster
// info; write: put, delete, shared-memory registration, and any output kept
// resident (a GEMM's keep_output_as, a quantize's keep).
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
// `bytes` bytes from the system's cryptographic generator, in lowercase hex:
// a secret a peer cannot guess (staging tickets).
std::string RandomHex(int bytes);

enum class Grant : uint8_t { kCompute = 1, kRead = 2, kWrite = 4 };
const char* GrantName(Grant grant);

// Who a valid token speaks for, and what it may do.
struct Principal {
  std::string tenant;
  uint8_t grants = 7;
  bool Has(Grant g) const { return (grants & static_cast<uint8_t>(g)) != 0; }
};

class TokenFile {
 public:
  // INVALID_ARGUMENT naming the file and line for a malformed one.
  static absl::StatusOr<std::unique_ptr<TokenFile>> Load(const std::string& path);

  // The tenant of the caller's "authorization: Bearer TOKEN" metadata:
  // UNAUTHENTICATED without one or for a token not in the file.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& context);
  absl::StatusOr<Principal> TenantOf(const std::string& token);

 private:
  explicit TokenFile(std::string path) : path_(std::move(path)) {}
  absl::Status Reload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  std::map<std::string, Principal> principal_by_hash_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace shardgemm::security

#endif  // SHARDGEMM_SECURITY_TOKENS_H_
