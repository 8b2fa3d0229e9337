#include "server/shared_memory_registry.h"

#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "platform/shared_memory.h"
#include "server/resident_registry.h"

namespace shardgemm {

absl::StatusOr<absl::Time> SharedMemoryRegistry::Register(const std::string& tenant,
                                                          const v1::RegisterSharedMemoryRequest& request,
                                                          absl::Time now) {
  if (auto s = ValidateResidentName("name", request.name()); !s.ok()) return s;
  if (request.byte_size() == 0) return absl::InvalidArgumentError("byte_size: a region of 0 bytes");
  SharedMemoryRegion region;
  region.byte_size = request.byte_size();
  if (request.lease_ms() > 0) {
    constexpr uint64_t kShortestMs = 100, kLongestMs = uint64_t{7} * 24 * 3600 * 1000;
    if (request.lease_ms() < kShortestMs || request.lease_ms() > kLongestMs) {
      return absl::InvalidArgumentError(absl::StrCat("lease_ms: ", request.lease_ms(),
                                                     "; a lease is 100 ms to 7 days, or 0 for none"));
    }
    region.lease = absl::Milliseconds(static_cast<int64_t>(request.lease_ms()));
    region.expires = now + region.lease;
  }
  if (request.object_case() == v1::RegisterSharedMemoryRequest::kCuda) {
    if (request.cuda().ipc_handle().size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.ipc_handle: ", request.cuda().ipc_handle().size(),
                                                     " bytes; a cudaIpcMemHandle_t has ", kCudaIpcHandleBytes));
    }
    region.cuda_ipc_handle = request.cuda().ipc_handle();
  } else {
    if (auto s = platform::CheckSharedMemoryKey(request.key(), "key"); !s.ok()) return s;
    auto size = platform::SharedMemoryObjectSize(request.key(), "key");
    if (!size.ok()) return size.status();
    if (*size < request.byte_size()) {
      return absl::InvalidArgumentError(absl::StrCat("byte_size: ", request.byte_size(), " bytes, but '",
                                                     request.key(), "' has ", *size));
    }
    region.key = request.key();
  }
  absl::MutexLock lock(&mu_);
  DropLapsed(now);
  const auto id = std::make_pair(tenant, request.name());
  if (regions_.count(id) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: a shared-memory region '", request.name(),
                                                 "' is registered; unregister it first"));
  }
  if (max_per_tenant_ > 0 && per_tenant_[tenant] >= max_per_tenant_) {
    return absl::ResourceExhaustedError(absl::StrCat("this tenant has ", max_per_tenant_,
                                                     " shared-memory regions registered, its limit"));
  }
  const absl::Time expires = region.expires;
  regions_[id] = std::move(region);
  ++per_tenant_[tenant];
  return expires;
}

void SharedMemoryRegistry::Erase(std::map<std::pair<std::string, std::string>, SharedMemoryRegion>::iterator it) const {
  if (--per_tenant_[it->first.first] <= 0) per_tenant_.erase(it->first.first);
  // The coordinator takes them at once (an unregister) or at its next
  // heartbeat (a lapse); bounded for a coordinator without heartbeats (the
  // workers' caches close what is not said, oldest first, as they fill).
  constexpr size_t kMaxGone = 4096;
  if (gone_.size() < kMaxGone) gone_.push_back(std::move(it->second));
  regions_.erase(it);
}

void SharedMemoryRegistry::DropLapsed(absl::Time now) const {
  for (auto it = regions_.begin(); it != regions_.end();) {
    auto next = std::next(it);
    if (it->second.expires <= now) Erase(it);
    it = next;
  }
}

SharedMemoryRegistry::GoneObjects SharedMemoryRegistry::TakeGone(absl::Time now) {
  absl::MutexLock lock(&mu_);
  DropLapsed(now);
  std::set<std::string> live_keys, live_handles;
  for (const auto& [id, region] : regions_) {
    (region.cuda_ipc_handle.empty() ? live_keys : live_handles)
        .insert(region.cuda_ipc_handle.empty() ? region.key : region.cuda_ipc_handle);
  }
  GoneObjects gone;
  std::set<std::string> said;
  for (SharedMemoryRegion& region : gone_) {
    const bool cuda = !region.cuda_ipc_handle.empty();
    std::string& object = cuda ? region.cuda_ipc_handle : region.key;
    if ((cuda ? live_handles : live_keys).count(object) > 0) continue;  // another region still names it
    if (!said.insert(absl::StrCat(cuda ? "c" : "k", object)).second) continue;
    (cuda ? gone.cuda_ipc_handles : gone.keys).push_back(std::move(object));
  }
  gone_.clear();
  return gone;
}

std::vector<std::string> SharedMemoryRegistry::Renew(const std::string& tenant, const std::vector<std::string>& names,
                                                     absl::Time now) {
  std::vector<std::string> lapsed;
  absl::MutexLock lock(&mu_);
  DropLapsed(now);
  for (const std::string& name : names) {
    auto it = regions_.find({tenant, name});
    if (it == regions_.end()) {
      lapsed.push_back(name);
    } else if (it->second.lease > absl::ZeroDuration()) {
      it->second.expires = now + it->second.lease;
    }
  }
  return lapsed;
}

v1::SharedMemoryBlock SharedMemoryRegion::Block(uint64_t offset) const {
  v1::SharedMemoryBlock block;
  if (!cuda_ipc_handle.empty()) {
    block.mutable_cuda()->set_ipc_handle(cuda_ipc_handle);
  } else {
    block.set_key(key);
  }
  block.set_offset(offset);
  block.set_region_bytes(byte_size);
  return block;
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& tenant, const std::string& name, absl::Time now) {
  absl::MutexLock lock(&mu_);
  DropLapsed(now);
  auto it = regions_.find({tenant, name});
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("name: no shared-memory region '", name, "' is registered"));
  }
  Erase(it);
  return absl::OkStatus();
}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegistry::Resolve(const std::string& tenant,
                                                                 const v1::SharedMemoryRef& ref, int64_t bytes,
                                                                 const std::string& field, absl::Time now) const {
  SharedMemoryRegion region;
  {
    absl::MutexLock lock(&mu_);
    DropLapsed(now);
    auto it = regions_.find({tenant, ref.region()});
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat(field, ".region: no shared-memory region '", ref.region(),
                       "' is registered (never, unregistered, or its lease lapsed)"));
    }
    region = it->second;
  }
  if (bytes < 0 || ref.byte_size() != static_cast<uint64_t>(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size is ", ref.byte_size(),
                                                   " but the tensor's shape and dtype need ", bytes));
  }
  if (ref.offset() > region.byte_size || ref.byte_size() > region.byte_size - ref.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", ref.byte_size(), " bytes at offset ", ref.offset(),
                                                   " run past region '", ref.region(), "' (", region.byte_size,
                                                   " bytes)"));
  }
  return region;
}

}  // namespace shardgemm
