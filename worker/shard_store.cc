#include "worker/shard_store.h"

#include "absl/strings/str_cat.h"

namespace shardgemm {

namespace {
// Names the tensor, not its generation: the random part of a shard's name
// stays inside the mesh.
absl::Status NoShard(const std::string& name) {
  return absl::NotFoundError(
      absl::StrCat("no resident shard of '", name.substr(0, name.rfind('@')), "' on this worker"));
}
}  // namespace

absl::Status ShardStore::Put(const std::string& name, HostTensor shard) {
  return Put(name, Shard::OnHost(std::move(shard)));
}

absl::Status ShardStore::Put(const std::string& name, Shard shard) {
  absl::MutexLock lock(&mu_);
  int64_t replaced = 0, replaced_device = 0;
  auto it = shards_.find(name);
  if (it != shards_.end()) {
    replaced = it->second->HostBytes();
    replaced_device = it->second->DeviceBytes();
  }
  const int64_t after = resident_bytes_ - replaced + shard.HostBytes() + reserved_bytes_;
  if (after > budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard '", name, "' of ", shard.HostBytes(), " bytes does not fit the worker's memory budget (",
        resident_bytes_ + reserved_bytes_, " of ", budget_bytes_, " bytes in use)"));
  }
  const int64_t device_after = device_resident_bytes_ - replaced_device + shard.DeviceBytes();
  if (shard.DeviceBytes() > 0 && device_after > device_budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard '", name, "' of ", shard.DeviceBytes(), " bytes does not fit the worker's device memory budget (",
        device_resident_bytes_, " of ", device_budget_bytes_, " bytes in use)"));
  }
  resident_bytes_ += shard.HostBytes() - replaced;
  device_resident_bytes_ += shard.DeviceBytes() - replaced_device;
  shards_[name] = std::make_shared<const Shard>(std::move(shard));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Shard>> ShardStore::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(name);
  if (it == shards_.end()) {
    return NoShard(name);
  }
  return it->second;
}

absl::Status ShardStore::Delete(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(name);
  if (it == shards_.end()) {
    return NoShard(name);
  }
  resident_bytes_ -= it->second->HostBytes();
  device_resident_bytes_ -= it->second->DeviceBytes();
  shards_.erase(it);
  return absl::OkStatus();
}

absl::Status ShardStore::Reserve(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (resident_bytes_ + reserved_bytes_ + bytes > budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", bytes, " bytes of working memory but the worker's budget is ",
        budget_bytes_, " bytes with ", resident_bytes_ + reserved_bytes_, " in use"));
  }
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

void ShardStore::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= bytes;
}

int64_t ShardStore::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return resident_bytes_ + reserved_bytes_;
}

std::vector<std::string> ShardStore::Names() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const auto& [name, shard] : shards_) names.push_back(name);
  return names;
}

int64_t ShardStore::num_shards() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(shards_.size());
}

int64_t ShardStore::device_used_bytes() const {
  absl::MutexLock lock(&mu_);
  return device_resident_bytes_;
}

}  // namespace shardgemm
