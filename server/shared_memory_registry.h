// The shared-memory regions same-host clients registered, by tenant and
// name: what a request's SharedMemoryRef resolves to, bounds-checked.
#ifndef SHARDGEMM_SERVER_SHARED_MEMORY_REGISTRY_H_
#define SHARDGEMM_SERVER_SHARED_MEMORY_REGISTRY_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

struct SharedMemoryRegion {
  std::string key;              // a POSIX object's shm_open name, or
  std::string cuda_ipc_handle;  // a CUDA allocation's IPC handle
  uint64_t byte_size = 0;       // what the service may use of it
  absl::Duration lease = absl::ZeroDuration();  // zero: held until unregistered
  absl::Time expires = absl::InfiniteFuture();  // dropped then unless renewed
  // The region's object, `offset` and size as a worker's block names them.
  v1::SharedMemoryBlock Block(uint64_t offset) const;
};

// A cudaIpcMemHandle_t's size (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(int max_regions_per_tenant = 64) : max_per_tenant_(max_regions_per_tenant) {}

  // INVALID_ARGUMENT for a bad name, key, CUDA IPC handle or size;
  // NOT_FOUND when no object of that key exists on this host;
  // INVALID_ARGUMENT when it is smaller than byte_size (a CUDA allocation's
  // size is checked where a worker opens it); ALREADY_EXISTS for a name the tenant registered;
  // RESOURCE_EXHAUSTED past the tenant's limit.
  // With lease_ms the region lapses at the time returned unless renewed
  // (INVALID_ARGUMENT for a lease under 100 ms or over 7 days); without,
  // InfiniteFuture.
  absl::StatusOr<absl::Time> Register(const std::string& tenant, const v1::RegisterSharedMemoryRequest& request,
                                      absl::Time now = absl::Now());
  // NOT_FOUND unless the tenant registered `name` (and its lease holds).
  absl::Status Unregister(const std::string& tenant, const std::string& name, absl::Time now = absl::Now());
  // Extends the leases of the tenant's regions `names` by their lease from
  // `now`; returns those of the names not registered (lapsed included).
  std::vector<std::string> Renew(const std::string& tenant, const std::vector<std::string>& names,
                                 absl::Time now = absl::Now());
  // The region `ref` names and a check that `bytes` at its offset lie in it
  // and are what it says: INVALID_ARGUMENT naming `field` otherwise,
  // NOT_FOUND for a name the tenant has not registered (another tenant's
  // included).
  // The objects of the regions unregistered or lapsed since the last call
  // (lapses found by `now`) that no region still registered names: what
  // the workers may close (their mappings of a POSIX object, their opened
  // IPC handles of a CUDA allocation), so a client's memory is freed when
  // it frees it. Each object is returned once.
  struct GoneObjects {
    std::vector<std::string> keys;
    std::vector<std::string> cuda_ipc_handles;
    bool empty() const { return keys.empty() && cuda_ipc_handles.empty(); }
  };
  GoneObjects TakeGone(absl::Time now = absl::Now());

  absl::StatusOr<SharedMemoryRegion> Resolve(const std::string& tenant, const v1::SharedMemoryRef& ref,
                                             int64_t bytes, const std::string& field,
                                             absl::Time now = absl::Now()) const;

 private:
  // Forgets every region whose lease lapsed by `now`.
  void DropLapsed(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases `it` (unregistered or lapsed) and remembers its object for TakeGone.
  void Erase(std::map<std::pair<std::string, std::string>, SharedMemoryRegion>::iterator it) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const int max_per_tenant_;
  mutable absl::Mutex mu_;
  mutable std::map<std::pair<std::string, std::string>, SharedMemoryRegion> regions_ ABSL_GUARDED_BY(mu_);
  mutable std::map<std::string, int> per_tenant_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<SharedMemoryRegion> gone_ ABSL_GUARDED_BY(mu_);  // since the last TakeGone
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_SHARED_MEMORY_REGISTRY_H_
