#include "server/rendezvous_store.h"

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::Status RendezvousStore::Abandoned(uint64_t epoch) const {
  return absl::AbortedError(absl::StrCat("the rendezvous is for mesh epoch ", epoch, ", and the mesh is at epoch ",
                                         epoch_, ": its communicator was revoked"));
}

absl::Status RendezvousStore::Set(const std::string& key, std::string value, uint64_t epoch) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key: ", key.size(), " bytes; a rendezvous key has 1 to ",
                                                   kMaxKeyBytes));
  }
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("value: ", value.size(), " bytes; a rendezvous value has at most ",
                                                   kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  if (Older(epoch)) return Abandoned(epoch);
  auto it = values_.find(key);
  const size_t replaced = it == values_.end() ? 0 : key.size() + it->second.value.size();
  if (it == values_.end() && values_.size() >= kMaxKeys) {
    return absl::ResourceExhaustedError(absl::StrCat("the rendezvous store holds its limit of ", kMaxKeys, " keys"));
  }
  if (total_bytes_ - replaced + key.size() + value.size() > kMaxTotalBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the rendezvous store holds its limit of ", kMaxTotalBytes, " bytes"));
  }
  total_bytes_ = total_bytes_ - replaced + key.size() + value.size();
  values_[key] = Entry{std::move(value), epoch};
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Get(const std::vector<std::string>& keys,
                                                              absl::Duration timeout, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  auto all_present = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (const auto& k : keys) {
      if (!values_.contains(k)) return false;
    }
    return true;
  };
  auto present_or_abandoned = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return Older(epoch) || all_present(); };
  mu_.AwaitWithTimeout(absl::Condition(&present_or_abandoned), timeout);
  if (!all_present()) {
    if (Older(epoch)) return Abandoned(epoch);
    for (const auto& k : keys) {
      if (!values_.contains(k)) {
        return absl::DeadlineExceededError(
            absl::StrCat("rendezvous key '", k, "' not set within ", absl::FormatDuration(timeout)));
      }
    }
  }
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(values_[k].value);
  return out;
}

void RendezvousStore::Erase(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  for (const std::string& k : keys) {
    auto it = values_.find(k);
    if (it == values_.end()) continue;
    total_bytes_ -= k.size() + it->second.value.size();
    values_.erase(it);
  }
}

void RendezvousStore::AdvanceEpoch(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (epoch <= epoch_) return;
  epoch_ = epoch;
  for (auto it = values_.begin(); it != values_.end();) {
    if (Older(it->second.epoch)) {
      total_bytes_ -= it->first.size() + it->second.value.size();
      values_.erase(it++);
    } else {
      ++it;
    }
  }
}

uint64_t RendezvousStore::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
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
