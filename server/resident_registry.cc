#include "server/resident_registry.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>

#include "absl/strings/escaping.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"

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
  if (marked > 0) (void)Persist();  // a failure is logged; a restart marks them again
  return marked;
}

int ResidentRegistry::Reconcile(const std::vector<std::set<std::string>>& held_by_rank,
                                std::vector<std::string>* orphans) {
  absl::MutexLock lock(&mu_);
  int lost = 0;
  std::set<std::string> owned;
  for (auto& [key, resident] : tensors_) {
    owned.insert(resident.shard_name);
    if (resident.info.lost()) continue;
    for (size_t r = 0; r < held_by_rank.size(); ++r) {
      if (held_by_rank[r].count(resident.shard_name) > 0) continue;
      resident.info.set_lost(true);
      resident.info.set_lost_reason(
          absl::StrCat("worker rank ", r, " did not have its shard when the coordinator restarted"));
      ++lost;
      break;
    }
  }
  std::set<std::string> orphan_set;
  for (const auto& held : held_by_rank) {
    for (const std::string& shard : held) {
      if (owned.count(shard) == 0) orphan_set.insert(shard);
    }
  }
  orphans->assign(orphan_set.begin(), orphan_set.end());
  if (lost > 0) (void)Persist();
  return lost;
}

absl::Status ResidentRegistry::MakeDurable(const std::string& path) {
  absl::MutexLock lock(&mu_);
  std::ifstream in(path, std::ios::binary);
  if (!in && errno != ENOENT) {
    return absl::InvalidArgumentError(absl::StrCat("state_dir: cannot read ", path, ": ", std::strerror(errno)));
  }
  absl::flat_hash_map<std::string, Resident> loaded;
  if (in) {
    v1::RegistryState state;
    if (!state.ParseFromIstream(&in)) {
      return absl::InvalidArgumentError(absl::StrCat("state_dir: ", path, " is not a registry state file"));
    }
    for (const v1::RegistryState::Entry& e : state.entries()) {
      Resident r;
      r.tenant = e.tenant();
      r.info = e.info();
      r.shard_name = e.shard_name();
      auto spec = planner::ParsePartitionSpec(r.info.spec());
      if (!spec.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("state_dir: ", path, ": tensor '", r.info.name(),
                                                       "' has the spec '", r.info.spec(), "'"));
      }
      r.spec = *spec;
      loaded[Key(r.tenant, r.info.name())] = std::move(r);
    }
  }
  for (auto& [key, resident] : loaded) tensors_[key] = std::move(resident);
  state_path_ = path;
  return Persist();  // proves the directory is writable now, not at the first put
}

absl::Status ResidentRegistry::Persist() {
  if (state_path_.empty()) return absl::OkStatus();
  v1::RegistryState state;
  for (const auto& [key, resident] : tensors_) {
    v1::RegistryState::Entry* e = state.add_entries();
    e->set_tenant(resident.tenant);
    *e->mutable_info() = resident.info;
    e->set_shard_name(resident.shard_name);
  }
  const std::string bytes = state.SerializeAsString();
  const std::string tmp = state_path_ + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  bool ok = fd >= 0;
  int error = ok ? 0 : errno;
  size_t written = 0;
  while (ok && written < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + written, bytes.size() - written);
    if (n <= 0) {
      ok = false;
      error = errno;
    } else {
      written += static_cast<size_t>(n);
    }
  }
  if (ok && fsync(fd) != 0) ok = false, error = errno;
  if (fd >= 0) close(fd);
  if (ok && rename(tmp.c_str(), state_path_.c_str()) != 0) ok = false, error = errno;
  if (ok) {
    const std::string dir = state_path_.substr(0, state_path_.rfind('/') == std::string::npos ? 0 : state_path_.rfind('/'));
    const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      (void)fsync(dfd);
      close(dfd);
    }
  }
  if (!ok) {
    (void)unlink(tmp.c_str());
    const std::string why =
        absl::StrCat("state_dir: cannot write the registry to ", state_path_, ": ", std::strerror(error));
    std::cerr << "shardgemm-coordinator: " << why << "\n";
    return absl::UnavailableError(why);
  }
  return absl::OkStatus();
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
                                                    bool overwrite, int64_t max_per_tenant) {
  const std::string key = Key(tenant, name);
  absl::MutexLock lock(&mu_);
  if (max_per_tenant > 0 && !tensors_.contains(key) && !claims_.contains(key) &&
      CountLocked(tenant) >= max_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        tenant.empty() ? "this tenant" : absl::StrCat("tenant '", tenant, "'"), " holds its limit of ",
        max_per_tenant, " resident tensors (--max_tensors_per_tenant); delete one first"));
  }
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

absl::StatusOr<std::string> ResidentRegistry::Register(Resident resident) {
  std::vector<Resident> one;
  one.push_back(std::move(resident));
  auto replaced = RegisterAll(std::move(one));
  if (!replaced.ok()) return replaced.status();
  return std::move(replaced->front());
}

absl::StatusOr<std::vector<std::string>> ResidentRegistry::RegisterAll(std::vector<Resident> residents) {
  std::vector<std::pair<std::string, std::string>> names;  // tenant, name
  for (const Resident& r : residents) names.emplace_back(r.tenant, r.info.name());
  std::vector<std::string> replaced(residents.size());
  absl::Status persisted;
  {
    absl::MutexLock lock(&mu_);
    std::vector<absl::optional<Resident>> before(residents.size());
    for (size_t i = 0; i < residents.size(); ++i) {
      const std::string key = Key(names[i].first, names[i].second);
      auto it = tensors_.find(key);
      if (it != tensors_.end()) {
        replaced[i] = it->second.shard_name;
        before[i] = it->second;
      }
      tensors_[key] = std::move(residents[i]);
    }
    persisted = Persist();
    if (!persisted.ok()) {  // not kept: as it was
      for (size_t i = residents.size(); i-- > 0;) {
        const std::string key = Key(names[i].first, names[i].second);
        if (before[i].has_value()) tensors_[key] = std::move(*before[i]);
        else tensors_.erase(key);
      }
    }
  }
  for (const auto& [tenant, name] : names) Release(tenant, name);
  if (!persisted.ok()) return persisted;
  return replaced;
}

absl::StatusOr<std::string> ResidentRegistry::Remove(const std::string& tenant, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  if (it == tensors_.end()) return NotFound(name);
  std::string shard = it->second.shard_name;
  Resident removed = std::move(it->second);
  tensors_.erase(it);
  if (absl::Status s = Persist(); !s.ok()) {
    tensors_[Key(tenant, name)] = std::move(removed);  // not deleted
    return s;
  }
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
  absl::MutexLock lock(&mu_);
  return CountLocked(tenant);
}

int64_t ResidentRegistry::CountLocked(const std::string& tenant) const {
  const std::string prefix = Key(tenant, "");
  int64_t n = 0;
  for (const auto& [key, resident] : tensors_) n += resident.tenant == tenant;
  for (const auto& [key, claims] : claims_) {
    if (key.compare(0, prefix.size(), prefix) == 0 && !tensors_.contains(key)) ++n;
  }
  return n;
}

}  // namespace shardgemm
