#include "security/tokens.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace shardgemm::security {

const char* GrantName(Grant grant) {
  switch (grant) {
    case Grant::kCompute: return "compute";
    case Grant::kRead: return "read";
    case Grant::kWrite: return "write";
  }
  return "unknown";
}

bool ValidTenant(const std::string& tenant) {
  if (tenant.empty() || tenant.size() > 64) return false;
  for (char c : tenant) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

std::string Sha256Hex(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(text.data(), text.size(), digest, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) absl::StrAppend(&hex, absl::Hex(digest[i], absl::kZeroPad2));
  return hex;
}

std::string RandomHex(int bytes) {
  std::vector<unsigned char> raw(static_cast<size_t>(bytes));
  if (RAND_bytes(raw.data(), bytes) != 1) {
    // No secret can be made without the generator; a guessable one must not be.
    std::abort();
  }
  std::string hex;
  for (unsigned char b : raw) absl::StrAppend(&hex, absl::Hex(b, absl::kZeroPad2));
  return hex;
}

namespace {

int64_t MtimeNs(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::Load(const std::string& path) {
  std::unique_ptr<TokenFile> file(new TokenFile(path));
  absl::MutexLock lock(&file->mu_);
  if (auto s = file->Reload(); !s.ok()) return s;
  return file;
}

absl::Status TokenFile::Reload() {
  // The time first: a write landing while the file is read shows as a newer
  // time at the next check, and is read then.
  const int64_t mtime = MtimeNs(path_);
  std::ifstream in(path_);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("tokens_file: cannot read ", path_));
  std::map<std::string, Principal> principals;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> words = absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const auto bad = [&] {
      return absl::InvalidArgumentError(absl::StrCat("tokens_file: ", path_, " line ", number,
                                                     " is not 'sha256:<64 hex digits> TENANT [compute,read,write]'"));
    };
    if (words.size() < 2 || words.size() > 3 || !absl::StartsWith(words[0], "sha256:") ||
        words[0].size() != 7 + 64 || !ValidTenant(words[1])) {
      return bad();
    }
    Principal p;
    p.tenant = words[1];
    if (words.size() == 3) {
      p.grants = 0;
      for (absl::string_view g : absl::StrSplit(words[2], ',')) {
        if (g == "compute") p.grants |= static_cast<uint8_t>(Grant::kCompute);
        else if (g == "read") p.grants |= static_cast<uint8_t>(Grant::kRead);
        else if (g == "write") p.grants |= static_cast<uint8_t>(Grant::kWrite);
        else return bad();
      }
    }
    principals[absl::AsciiStrToLower(words[0].substr(7))] = std::move(p);
  }
  principal_by_hash_ = std::move(principals);
  mtime_ns_ = mtime;
  return absl::OkStatus();
}

void TokenFile::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now - checked_ < absl::Seconds(1)) return;
  checked_ = now;
  if (MtimeNs(path_) != mtime_ns_) {
    // A file mid-rewrite (or gone) keeps the last good set, but not forever:
    // one that cannot be read revokes every token.
    if (!Reload().ok()) principal_by_hash_.clear();
  }
}

absl::StatusOr<Principal> TokenFile::TenantOf(const std::string& token) {
  const std::string hash = Sha256Hex(token);
  absl::MutexLock lock(&mu_);
  MaybeReload();
  for (const auto& [stored, principal] : principal_by_hash_) {
    if (CRYPTO_memcmp(stored.data(), hash.data(), hash.size()) == 0) return principal;
  }
  return absl::UnauthenticatedError("the bearer token is not valid");
}

absl::StatusOr<Principal> TokenFile::Authenticate(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("no bearer token: send 'authorization: Bearer TOKEN' metadata");
  }
  absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(value, kBearer) || value.size() == kBearer.size()) {
    return absl::UnauthenticatedError("the authorization metadata is not 'Bearer TOKEN'");
  }
  return TenantOf(std::string(value.substr(kBearer.size())));
}

}  // namespace shardgemm::security
