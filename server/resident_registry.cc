#include "server/resident_registry.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::Status ValidateResidentName(absl::string_view field, absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  if (name.size() > kMaxResidentNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", name.size(), " bytes long; at most ",
                                                   kMaxResidentNameBytes, " are allowed"));
  }
  for (char c : name) {
    if (c == '@' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", absl::CHexEscape(name), "' must not contain '@' or control characters"));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status NotFound(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("no resident tensor named '", name, "'"));
}

// Names carry no control characters, so the separator keeps tenants apart.
std::string Key(const std::string& tenant, const std::string& name) { return absl::StrCat(tenant, "\x1f", name); }

std::string RandomGeneration() {
  thread_local absl::BitGen gen;
  return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
}

absl::Status Lost(const Resident& r) {
  return absl::DataLossError(absl::StrCat("resident tensor '", r.info.name(), "' is lost: ", r.info.lost_reason(),
                                          "; delete it and put it again"));
}

}  // namespace

absl::StatusOr<Resident> ResidentRegistry::Find(const std::string& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  if (it == tensors_.end()) return NotFound(name);
  if (it->second.info.lost()) return Lost(it->second);
  return it->second;
}

bool ResidentRegistry::IsLost(const std::string& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  return it != tensors_.end() && it->second.info.lost();
}

int ResidentRegistry::MarkLostUnlessHeld(const std::set<std::string>& held, const std::string& why) {
  absl::MutexLock lock(&mu_);
  int marked = 0;
  for (auto& [key, resident] : tensors_) {
    if (resident.info.lost() || held.count(resident.shard_name) > 0) continue;
    resident.info.set_lost(true);
    resident.info.set_lost_reason(why);
    ++marked;
  }
  return marked;
}

absl::StatusOr<Resident> ResidentRegistry::FindAndPin(const std::string& tenant, const std::string& name,
                                                      std::vector<std::string>* pins) {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  if (it == tensors_.end()) return NotFound(name);
  if (it->second.info.lost()) return Lost(it->second);
  ++pins_[it->second.shard_name];
  pins->push_back(it->second.shard_name);
  return it->second;
}

std::vector<std::string> ResidentRegistry::Unpin(const std::vector<std::string>& pins) {
  std::vector<std::string> to_delete;
  absl::MutexLock lock(&mu_);
  for (const std::string& shard : pins) {
    if (--pins_[shard] > 0) continue;
    pins_.erase(shard);
    if (retired_.erase(shard) > 0) to_delete.push_back(shard);
  }
  return to_delete;
}

absl::StatusOr<std::string> ResidentRegistry::Claim(const std::string& tenant, const std::string& name,
                                                    bool overwrite) {
  const std::string key = Key(tenant, name);
  absl::MutexLock lock(&mu_);
  if (!overwrite && tensors_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat("resident tensor '", name, "' exists"));
  }
  if (!overwrite && claims_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat("resident tensor '", name, "' is being made by another request"));
  }
  ++claims_[key];
  return absl::StrCat(name, "@", RandomGeneration());
}

void ResidentRegistry::Release(const std::string& tenant, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = claims_.find(Key(tenant, name));
  if (it != claims_.end() && --it->second <= 0) claims_.erase(it);
}

std::string ResidentRegistry::Register(Resident resident) {
  const std::string tenant = resident.tenant;
  const std::string name = resident.info.name();
  std::string replaced;
  {
    absl::MutexLock lock(&mu_);
    auto it = tensors_.find(Key(tenant, name));
    if (it != tensors_.end()) replaced = it->second.shard_name;
    tensors_[Key(tenant, name)] = std::move(resident);
  }
  Release(tenant, name);
  return replaced;
}

absl::StatusOr<std::string> ResidentRegistry::Remove(const std::string& tenant, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  if (it == tensors_.end()) return NotFound(name);
  std::string shard = it->second.shard_name;
  tensors_.erase(it);
  return shard;
}

bool ResidentRegistry::Retire(const std::string& shard_name) {
  absl::MutexLock lock(&mu_);
  if (pins_.contains(shard_name)) {
    retired_.insert(shard_name);  // requests still use it: deleted after the last one
    return false;
  }
  return true;
}

std::vector<v1::ResidentTensorInfo> ResidentRegistry::List(const std::string& tenant) const {
  std::vector<v1::ResidentTensorInfo> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, resident] : tensors_) {
      if (resident.tenant == tenant) out.push_back(resident.info);
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name() < b.name(); });
  return out;
}

std::vector<v1::ResidentTensorInfo> ResidentRegistry::ListAll() const {
  std::vector<v1::ResidentTensorInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, resident] : tensors_) out.push_back(resident.info);
  return out;
}

int64_t ResidentRegistry::Count(const std::string& tenant) const {
  const std::string prefix = Key(tenant, "");
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [key, resident] : tensors_) n += resident.tenant == tenant;
  for (const auto& [key, claims] : claims_) {
    if (key.compare(0, prefix.size(), prefix) == 0 && !tensors_.contains(key)) ++n;
  }
  return n;
}

}  // namespace shardgemm
