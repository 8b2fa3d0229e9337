#include "server/rendezvous_store.h"

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::Status RendezvousStore::Set(const std::string& key, std::string value) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key: ", key.size(), " bytes; a rendezvous key has 1 to ",
                                                   kMaxKeyBytes));
  }
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("value: ", value.size(), " bytes; a rendezvous value has at most ",
                                                   kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  const size_t replaced = it == values_.end() ? 0 : key.size() + it->second.size();
  if (it == values_.end() && values_.size() >= kMaxKeys) {
    return absl::ResourceExhaustedError(absl::StrCat("the rendezvous store holds its limit of ", kMaxKeys, " keys"));
  }
  if (total_bytes_ - replaced + key.size() + value.size() > kMaxTotalBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the rendezvous store holds its limit of ", kMaxTotalBytes, " bytes"));
  }
  total_bytes_ = total_bytes_ - replaced + key.size() + value.size();
  values_[key] = std::move(value);
  return absl::OkStatus();
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

void RendezvousStore::Erase(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  for (const std::string& k : keys) {
    auto it = values_.find(k);
    if (it == values_.end()) continue;
    total_bytes_ -= k.size() + it->second.size();
    values_.erase(it);
  }
}

size_t RendezvousStore::num_keys() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

size_t RendezvousStore::num_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

}  // namespace shardgemm
