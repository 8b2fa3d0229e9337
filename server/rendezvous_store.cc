#include "server/rendezvous_store.h"

#include "absl/strings/str_cat.h"

namespace shardgemm {

void RendezvousStore::Set(const std::string& key, std::string value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::move(value);
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Get(const std::vector<std::string>& keys,
                                                              absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all_present = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (const auto& k : keys) {
      if (!values_.contains(k)) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all_present), timeout)) {
    for (const auto& k : keys) {
      if (!values_.contains(k)) {
        return absl::DeadlineExceededError(
            absl::StrCat("rendezvous key '", k, "' not set within ", absl::FormatDuration(timeout)));
      }
    }
  }
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(values_[k]);
  return out;
}

}  // namespace shardgemm
