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
#include "kernels/dtype.h"

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

bool Replicated(const Resident& r) { return r.info.replicas() >= 2 && !r.block_of_rank.empty(); }

}  // namespace

std::vector<std::string> ShardCopies::StandbyNamesOn(int rank) const {
  std::vector<std::string> names;
  for (const StandbyCopy& c : standby) {
    if (c.holder_rank == rank) names.push_back(StandbyShardName(shard_name, c.block_rank));
  }
  return names;
}

std::vector<std::string> ShardCopies::AllNames() const {
  std::vector<std::string> names;
  if (shard_name.empty()) return names;
  names.push_back(shard_name);
  for (const StandbyCopy& c : standby) {
    std::string name = StandbyShardName(shard_name, c.block_rank);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
  }
  return names;
}

std::vector<std::string> Resident::NamesOn(int rank) const {
  std::vector<std::string> names = {shard_name};
  for (std::string& n : copies().StandbyNamesOn(rank)) names.push_back(std::move(n));
  return names;
}

int64_t Resident::BlockBytes() const {
  if (block_of_rank.empty()) return 0;
  const std::set<int> blocks(block_of_rank.begin(), block_of_rank.end());
  int64_t bytes = DTypeSize(static_cast<DType>(static_cast<int>(info.dtype())));
  for (int64_t d : info.shape()) bytes *= d;
  return bytes / static_cast<int64_t>(blocks.size());
}

absl::StatusOr<const Resident*> ResidentRegistry::FindLocked(const std::string& tenant,
                                                              const std::string& name) const {
  const std::string key = Key(tenant, name);
  auto it = tensors_.find(key);
  if (it == tensors_.end()) return NotFound(name);
  if (it->second.info.lost()) return Lost(it->second);
  if (auto r = restoring_.find(key); r != restoring_.end() && !r->second.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "resident tensor '", name, "' is being restored on worker rank ", r->second.begin()->first,
        " (it took a replaced worker's rank) from its other copies; retry shortly"));
  }
  return &it->second;
}

absl::StatusOr<Resident> ResidentRegistry::Find(const std::string& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto found = FindLocked(tenant, name);
  if (!found.ok()) return found.status();
  return **found;
}

bool ResidentRegistry::IsLost(const std::string& tenant, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  return it != tensors_.end() && it->second.info.lost();
}

std::vector<CopySource> ResidentRegistry::SourcesLocked(
    const std::string& key, const Resident& r, int rank, const std::string& name_on_rank,
    const std::vector<std::set<std::string>>* held_by_rank) const {
  std::vector<CopySource> sources;
  if (!Replicated(r) || rank < 0 || rank >= static_cast<int>(r.block_of_rank.size())) return sources;
  // Which block `name_on_rank` is a copy of: the rank's own, or a standby one.
  int block = -1;
  if (name_on_rank == r.shard_name) {
    block = r.block_of_rank[rank];
  } else {
    for (const StandbyCopy& c : r.standby) {
      if (c.holder_rank == rank && StandbyShardName(r.shard_name, c.block_rank) == name_on_rank) block = c.block_rank;
    }
  }
  if (block < 0) return sources;
  const auto restoring = restoring_.find(key);
  auto has = [&](int q, const std::string& name) {
    if (held_by_rank != nullptr) {
      return q < static_cast<int>(held_by_rank->size()) && (*held_by_rank)[q].count(name) > 0;
    }
    if (restoring == restoring_.end()) return true;
    auto on = restoring->second.find(q);
    return on == restoring->second.end() || on->second.missing.count(name) == 0;
  };
  for (int q = 0; q < static_cast<int>(r.block_of_rank.size()); ++q) {
    if (q != rank && r.block_of_rank[q] == block && has(q, r.shard_name)) sources.push_back({q, r.shard_name});
  }
  const std::string standby_name = StandbyShardName(r.shard_name, block);
  for (const StandbyCopy& c : r.standby) {
    if (c.block_rank == block && c.holder_rank != rank && has(c.holder_rank, standby_name)) {
      sources.push_back({c.holder_rank, standby_name});
    }
  }
  return sources;
}

bool ResidentRegistry::LoseOrRestoreLocked(const std::string& key, Resident& r, int rank,
                                           const std::set<std::string>& missing, uint64_t epoch,
                                           const std::string& why,
                                           const std::vector<std::set<std::string>>* held_by_rank, Rejoin* out) {
  bool restorable = Replicated(r);
  for (const std::string& name : missing) {
    if (!restorable) break;
    restorable = !SourcesLocked(key, r, rank, name, held_by_rank).empty();
  }
  if (!restorable) {
    r.info.set_lost(true);
    r.info.set_lost_reason(Replicated(r) ? absl::StrCat(why, ", and no other worker holds a copy") : why);
    restoring_.erase(key);
    ++out->lost;
    return true;
  }
  restoring_[key][rank] = Restoring{epoch, missing};
  out->restore.push_back(RestoreTask{r.tenant, r.info.name(), r.shard_name, rank, epoch,
                                     std::vector<std::string>(missing.begin(), missing.end())});
  return false;
}

ResidentRegistry::Rejoin ResidentRegistry::Rejoined(int rank, const std::set<std::string>& held, uint64_t epoch,
                                                    const std::string& why) {
  absl::MutexLock lock(&mu_);
  Rejoin out;
  for (auto& [key, resident] : tensors_) {
    if (resident.info.lost()) continue;
    std::set<std::string> missing;
    for (const std::string& name : resident.NamesOn(rank)) {
      if (held.count(name) == 0) missing.insert(name);
    }
    if (missing.empty()) continue;
    (void)LoseOrRestoreLocked(key, resident, rank, missing, epoch, why, nullptr, &out);
  }
  if (out.lost > 0) (void)Persist();  // a failure is logged; a restart marks them again
  return out;
}

ResidentRegistry::Rejoin ResidentRegistry::Reconcile(const std::vector<std::set<std::string>>& held_by_rank,
                                                     const std::vector<uint64_t>& epochs,
                                                     std::vector<std::string>* orphans) {
  absl::MutexLock lock(&mu_);
  Rejoin out;
  std::set<std::string> owned;
  for (auto& [key, resident] : tensors_) {
    for (const std::string& name : resident.copies().AllNames()) owned.insert(name);
    if (resident.info.lost()) continue;
    const size_t restores_before = out.restore.size();
    for (size_t r = 0; r < held_by_rank.size(); ++r) {
      std::set<std::string> missing;
      for (const std::string& name : resident.NamesOn(static_cast<int>(r))) {
        if (held_by_rank[r].count(name) == 0) missing.insert(name);
      }
      if (missing.empty()) continue;
      const std::string why = absl::StrCat("worker rank ", r, " did not have its shard when the coordinator restarted");
      if (LoseOrRestoreLocked(key, resident, static_cast<int>(r), missing, r < epochs.size() ? epochs[r] : 0, why,
                              &held_by_rank, &out)) {
        out.restore.resize(restores_before);  // lost as a whole: nothing of it to restore
        break;
      }
    }
  }
  std::set<std::string> orphan_set;
  for (const auto& held : held_by_rank) {
    for (const std::string& shard : held) {
      if (owned.count(shard) == 0) orphan_set.insert(shard);
    }
  }
  orphans->assign(orphan_set.begin(), orphan_set.end());
  if (out.lost > 0) (void)Persist();
  return out;
}

absl::StatusOr<std::vector<CopySource>> ResidentRegistry::RestoreSources(const RestoreTask& task,
                                                                         const std::string& missing_name) const {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(task.tenant, task.name);
  auto it = tensors_.find(key);
  auto restoring = restoring_.find(key);
  if (it == tensors_.end() || it->second.shard_name != task.shard_name || restoring == restoring_.end() ||
      !restoring->second.count(task.rank) || restoring->second.at(task.rank).epoch != task.epoch) {
    return absl::NotFoundError(absl::StrCat("'", task.name, "' is no longer restoring on rank ", task.rank));
  }
  return SourcesLocked(key, it->second, task.rank, missing_name, nullptr);
}

bool ResidentRegistry::FinishRestoring(const RestoreTask& task) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(task.tenant, task.name);
  auto it = tensors_.find(key);
  auto restoring = restoring_.find(key);
  if (it == tensors_.end() || it->second.shard_name != task.shard_name || restoring == restoring_.end()) return false;
  auto on = restoring->second.find(task.rank);
  if (on == restoring->second.end() || on->second.epoch != task.epoch) return false;
  restoring->second.erase(on);
  if (!restoring->second.empty()) return false;
  restoring_.erase(restoring);
  return true;
}

void ResidentRegistry::FailRestoring(const RestoreTask& task, const std::string& why) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(task.tenant, task.name);
  auto it = tensors_.find(key);
  auto restoring = restoring_.find(key);
  if (it == tensors_.end() || it->second.shard_name != task.shard_name || restoring == restoring_.end()) return;
  auto on = restoring->second.find(task.rank);
  if (on == restoring->second.end() || on->second.epoch != task.epoch) return;
  restoring_.erase(restoring);
  it->second.info.set_lost(true);
  it->second.info.set_lost_reason(why);
  (void)Persist();  // a failure is logged; a restart finds the copies missing again
}

std::vector<int64_t> ResidentRegistry::ResidentBytesByRank(int ranks) const {
  std::vector<int64_t> bytes(ranks, 0);
  absl::MutexLock lock(&mu_);
  for (const auto& [key, r] : tensors_) {
    const int64_t block = r.BlockBytes();
    for (int q = 0; q < ranks && q < static_cast<int>(r.block_of_rank.size()); ++q) bytes[q] += block;
    for (const StandbyCopy& c : r.standby) {
      if (c.holder_rank >= 0 && c.holder_rank < ranks) bytes[c.holder_rank] += block;
    }
  }
  return bytes;
}

std::vector<int64_t> ResidentRegistry::StandbyBytesByRank(int ranks) const {
  std::vector<int64_t> bytes(ranks, 0);
  absl::MutexLock lock(&mu_);
  for (const auto& [key, r] : tensors_) {
    const int64_t block = r.BlockBytes();
    for (const StandbyCopy& c : r.standby) {
      if (c.holder_rank >= 0 && c.holder_rank < ranks) bytes[c.holder_rank] += block;
    }
  }
  return bytes;
}

int64_t ResidentRegistry::RestoringCount() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [key, on] : restoring_) n += !on.empty();
  return n;
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
      r.block_of_rank.assign(e.block_of_rank().begin(), e.block_of_rank().end());
      for (const v1::StandbyCopy& c : e.standby()) r.standby.push_back({c.block_rank(), c.holder_rank()});
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
    e->mutable_block_of_rank()->Assign(resident.block_of_rank.begin(), resident.block_of_rank.end());
    for (const StandbyCopy& c : resident.standby) {
      v1::StandbyCopy* copy = e->add_standby();
      copy->set_block_rank(c.block_rank);
      copy->set_holder_rank(c.holder_rank);
    }
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
  auto found = FindLocked(tenant, name);
  if (!found.ok()) return found.status();
  ++pins_[(*found)->shard_name];
  pins->push_back((*found)->shard_name);
  return **found;
}

void ResidentRegistry::Pin(const std::string& shard_name, std::vector<std::string>* pins) {
  absl::MutexLock lock(&mu_);
  ++pins_[shard_name];
  pins->push_back(shard_name);
}

std::vector<ShardCopies> ResidentRegistry::Unpin(const std::vector<std::string>& pins) {
  std::vector<ShardCopies> to_delete;
  absl::MutexLock lock(&mu_);
  for (const std::string& shard : pins) {
    if (--pins_[shard] > 0) continue;
    pins_.erase(shard);
    if (auto it = retired_.find(shard); it != retired_.end()) {
      to_delete.push_back(std::move(it->second));
      retired_.erase(it);
    }
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

absl::StatusOr<ShardCopies> ResidentRegistry::Register(Resident resident) {
  std::vector<Resident> one;
  one.push_back(std::move(resident));
  auto replaced = RegisterAll(std::move(one));
  if (!replaced.ok()) return replaced.status();
  return std::move(replaced->front());
}

absl::StatusOr<std::vector<ShardCopies>> ResidentRegistry::RegisterAll(std::vector<Resident> residents) {
  std::vector<std::pair<std::string, std::string>> names;  // tenant, name
  for (const Resident& r : residents) names.emplace_back(r.tenant, r.info.name());
  std::vector<ShardCopies> replaced(residents.size());
  absl::Status persisted;
  {
    absl::MutexLock lock(&mu_);
    std::vector<absl::optional<Resident>> before(residents.size());
    for (size_t i = 0; i < residents.size(); ++i) {
      const std::string key = Key(names[i].first, names[i].second);
      auto it = tensors_.find(key);
      if (it != tensors_.end()) {
        replaced[i] = it->second.copies();
        before[i] = it->second;
      }
      tensors_[key] = std::move(residents[i]);
    }
    persisted = Persist();
    if (persisted.ok()) {
      // A new generation is whole on every rank: whatever the old one was missing is moot.
      for (const auto& [tenant, name] : names) restoring_.erase(Key(tenant, name));
    } else {  // not kept: as it was
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

absl::StatusOr<ShardCopies> ResidentRegistry::Remove(const std::string& tenant, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(Key(tenant, name));
  if (it == tensors_.end()) return NotFound(name);
  ShardCopies shard = it->second.copies();
  Resident removed = std::move(it->second);
  tensors_.erase(it);
  if (absl::Status s = Persist(); !s.ok()) {
    tensors_[Key(tenant, name)] = std::move(removed);  // not deleted
    return s;
  }
  restoring_.erase(Key(tenant, name));
  return shard;
}

bool ResidentRegistry::Retire(const ShardCopies& copies) {
  absl::MutexLock lock(&mu_);
  if (pins_.contains(copies.shard_name)) {
    retired_[copies.shard_name] = copies;  // requests still use it: deleted after the last one
    return false;
  }
  return true;
}

std::vector<v1::ResidentTensorInfo> ResidentRegistry::List(const std::string& tenant) const {
  std::vector<v1::ResidentTensorInfo> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, resident] : tensors_) {
      if (resident.tenant != tenant) continue;
      out.push_back(resident.info);
      out.back().set_restoring(restoring_.contains(key));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name() < b.name(); });
  return out;
}

std::vector<v1::ResidentTensorInfo> ResidentRegistry::ListAll() const {
  std::vector<v1::ResidentTensorInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, resident] : tensors_) {
    out.push_back(resident.info);
    out.back().set_restoring(restoring_.contains(key));
  }
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
