// The shards of resident tensors a worker holds, under a host memory budget
// and, on a device backend, a device memory budget.
#ifndef SHARDGEMM_WORKER_SHARD_STORE_H_
#define SHARDGEMM_WORKER_SHARD_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/host_tensor.h"
#include "worker/shard.h"

namespace shardgemm {

class ShardStore {
 public:
  explicit ShardStore(int64_t budget_bytes, int64_t device_budget_bytes = 0)
      : budget_bytes_(budget_bytes), device_budget_bytes_(device_budget_bytes) {}

  // Stores (or replaces) a shard. RESOURCE_EXHAUSTED, naming the shard and
  // the bytes, when it would not fit a budget (host bytes count against the
  // host budget, device bytes against the device's), counting the working
  // memory running steps hold; then nothing already stored changes.
  absl::Status Put(const std::string& name, HostTensor shard);
  absl::Status Put(const std::string& name, Shard shard);
  // Shared so a running step keeps its input alive across a concurrent delete.
  absl::StatusOr<std::shared_ptr<const Shard>> Get(const std::string& name) const;
  absl::Status Delete(const std::string& name);

  // Reserves room for a request's transient host buffers; RESOURCE_EXHAUSTED
  // when resident + reserved would pass the budget.
  absl::Status Reserve(int64_t bytes);
  void Release(int64_t bytes);

  int64_t used_bytes() const;
  int64_t device_used_bytes() const;
  int64_t num_shards() const;
  std::vector<std::string> Names() const;

  // Holds `bytes` reserved (when `held`) until destroyed or Release()d.
  class ScopedReservation {
   public:
    ScopedReservation(ShardStore* store, int64_t bytes, bool held)
        : store_(store), bytes_(bytes), held_(held) {}
    ~ScopedReservation() { Release(); }
    void Release() {
      if (held_) store_->Release(bytes_);
      held_ = false;
    }

   private:
    ShardStore* store_;
    int64_t bytes_;
    bool held_;
  };
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t device_budget_bytes() const { return device_budget_bytes_; }

 private:
  const int64_t budget_bytes_;
  const int64_t device_budget_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Shard>> shards_ ABSL_GUARDED_BY(mu_);
  int64_t resident_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t device_resident_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_SHARD_STORE_H_
