// A key-value map the workers rendezvous through (Gloo's Store, NCCL unique
// ids): set once, read by everyone, waiting until a key appears.
#ifndef SHARDGEMM_SERVER_RENDEZVOUS_STORE_H_
#define SHARDGEMM_SERVER_RENDEZVOUS_STORE_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardgemm {

// Bounded: only mesh members reach it (the Coordination service checks their
// certificates), and a member that floods it still cannot exhaust the
// coordinator's memory.
class RendezvousStore {
 public:
  static constexpr size_t kMaxKeyBytes = 512;
  static constexpr size_t kMaxValueBytes = 1 << 20;
  static constexpr size_t kMaxKeys = 1 << 16;
  static constexpr size_t kMaxTotalBytes = size_t{256} << 20;

  // `epoch` (Set and Get): the mesh epoch of the communicator the keys
  // build, 0 for none. Communicators of an epoch older than the store's are
  // given up by their members (the coordinator revoked them): a Set for one
  // is refused and a Get ends at once, ABORTED.

  // INVALID_ARGUMENT for a key or value past its limit, RESOURCE_EXHAUSTED
  // when the store holds kMaxKeys keys or kMaxTotalBytes bytes already.
  absl::Status Set(const std::string& key, std::string value, uint64_t epoch = 0);
  // The values of `keys`, waiting up to `timeout` for all of them;
  // DEADLINE_EXCEEDED naming a missing key otherwise, ABORTED once `epoch`
  // is older than the store's (at once, or when the epoch advances while
  // this waits) unless every key is set.
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout, uint64_t epoch = 0);
  // Forgets `keys` (those absent are skipped): members delete theirs once
  // their communicator is built.
  void Erase(const std::vector<std::string>& keys);
  // The mesh epoch is `epoch` now (the coordinator's, which only grows):
  // waits for keys of older epochs end, and their keys are forgotten.
  void AdvanceEpoch(uint64_t epoch);
  uint64_t epoch() const;
  size_t num_keys() const;
  size_t num_bytes() const;

 private:
  struct Entry {
    std::string value;
    uint64_t epoch = 0;
  };
  // ABORTED for a communicator of `epoch`, older than the store's.
  absl::Status Abandoned(uint64_t epoch) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Older(uint64_t epoch) const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return epoch != 0 && epoch < epoch_; }

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> values_ ABSL_GUARDED_BY(mu_);
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_RENDEZVOUS_STORE_H_
