// The coordinator's registry of resident tensors: name -> its info, spec and
// the generation its shards carry on the workers ("name@generation"), with
// the pins of running requests and the names requests are about to make.
// No gRPC and no I/O: the decisions it returns ("delete these shards now")
// are the caller's to carry out.
#ifndef SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_
#define SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "planner/spec.h"
#include "proto/shardgemm.pb.h"
#include "server/replica_placement.h"

namespace shardgemm {

// Resident tensor names (PutTensor's name, keep_output_as): 1 to
// kMaxResidentNameBytes bytes, no '@' (it separates the generation on the
// workers) and no control characters; INVALID_ARGUMENT naming `field` otherwise.
constexpr size_t kMaxResidentNameBytes = 256;
absl::Status ValidateResidentName(absl::string_view field, absl::string_view name);

// Every copy of one generation on the workers: each rank's own block under
// `shard_name`, and the standby copies under StandbyShardName.
struct ShardCopies {
  std::string shard_name;  // empty: none
  std::vector<StandbyCopy> standby;

  bool empty() const { return shard_name.empty(); }
  // The standby copies `rank` holds, by their names there.
  std::vector<std::string> StandbyNamesOn(int rank) const;
  // Every name the generation has on some worker, shard_name first.
  std::vector<std::string> AllNames() const;
};

// A replaced worker's copies of one tensor being restored from the others.
struct RestoreTask {
  std::string tenant;
  std::string name;
  std::string shard_name;  // the generation: a replaced or deleted one is not restored
  int rank = 0;
  uint64_t epoch = 0;                // the rank's registration it is for
  std::vector<std::string> missing;  // the names the copies have on `rank`
};

// Where a copy can be read: a rank and its name there.
struct CopySource {
  int rank = 0;
  std::string shard_name;
};

struct Resident {
  std::string tenant;  // whose it is: only that tenant finds, lists, replaces or deletes it
  v1::ResidentTensorInfo info;  // info.replicas: copies of each block (0 or 1: one)
  planner::PartitionSpec spec;
  std::string shard_name;  // name@generation on the workers (the generation is random: not guessable)
  // Where its copies are: for each rank, the lowest rank holding the same
  // block (BlockOwners; empty in a registry from before replicas), and the
  // standby copies (--replicas).
  std::vector<int> block_of_rank;
  std::vector<StandbyCopy> standby;

  ShardCopies copies() const { return {shard_name, standby}; }
  // What `rank` holds of it: its own block, then its standby copies.
  std::vector<std::string> NamesOn(int rank) const;
  // Bytes of one block (every block of a tensor has the same shape); 0
  // without block_of_rank.
  int64_t BlockBytes() const;
};

// Names are per tenant: each tenant (a token's; "" with --insecure) has its
// own namespace, and another tenant's tensor is NOT_FOUND, as if absent.
class ResidentRegistry {
 public:
  // Durable from here on: every change to the tensors is written to `path`
  // (a new file fsync'd and renamed over the old) before it returns; what
  // the file holds now is loaded first. INVALID_ARGUMENT naming the file
  // when it cannot be read or parsed.
  absl::Status MakeDurable(const std::string& path);

  absl::StatusOr<Resident> Find(const std::string& tenant, const std::string& name) const;
  // Find, and pin the generation found: it stays on the workers until Unpin.
  // UNAVAILABLE while its copies are being restored, DATA_LOSS when lost.
  absl::StatusOr<Resident> FindAndPin(const std::string& tenant, const std::string& name,
                                      std::vector<std::string>* pins);
  // Pins a generation whatever its state (a restore reading and writing it).
  void Pin(const std::string& shard_name, std::vector<std::string>* pins);
  // The generations whose last pin this was and that were retired
  // meanwhile: the caller deletes them from the workers.
  std::vector<ShardCopies> Unpin(const std::vector<std::string>& pins);

  // Claims `name` for a request that will register it, and gives the
  // workers' name of its new generation. ALREADY_EXISTS when it is resident
  // or claimed by a running request, unless `overwrite`. Release the claim
  // with Register or Release.
  // `max_per_tenant` > 0: RESOURCE_EXHAUSTED when a new name would give the
  // tenant more tensors (resident or being made) than that, counted under
  // the same lock as the claim.
  absl::StatusOr<std::string> Claim(const std::string& tenant, const std::string& name, bool overwrite,
                                    int64_t max_per_tenant = 0);
  void Release(const std::string& tenant, const std::string& name);
  // Registers `resident` under its tenant and name, releasing the claim.
  // Returns the generation it replaced (empty if none): the caller retires
  // it. When durable and the file cannot be written: UNAVAILABLE, and
  // nothing changed.
  absl::StatusOr<ShardCopies> Register(Resident resident);
  // Registers all of `residents` or none (one durable write), releasing
  // their claims either way; returns the generations they replaced (empty
  // for new names), in order.
  absl::StatusOr<std::vector<ShardCopies>> RegisterAll(std::vector<Resident> residents);

  // Whether `name` is resident and lost.
  bool IsLost(const std::string& tenant, const std::string& name) const;
  // Removes `name`, lost, restoring or not; returns its generation
  // (NOT_FOUND if absent; UNAVAILABLE, and it stays, when a durable
  // registry cannot be written).
  absl::StatusOr<ShardCopies> Remove(const std::string& tenant, const std::string& name);
  // Whether `copies` can leave the workers now (no pins); otherwise they
  // are marked, and Unpin hands them back with the last pin.
  bool Retire(const ShardCopies& copies);

  std::vector<v1::ResidentTensorInfo> List(const std::string& tenant) const;  // by name
  // Every tenant's (the metrics).
  std::vector<v1::ResidentTensorInfo> ListAll() const;
  // What a worker's (re)registration, or a restarted coordinator's
  // reconciliation, found: tensors lost, and copies to restore.
  struct Rejoin {
    int lost = 0;
    std::vector<RestoreTask> restore;
  };
  // Worker `rank` (re)joined holding only `held` (`epoch` names this
  // registration). A tensor of one copy per block whose copy it lacks is
  // lost (`why` says where); one of several (--replicas) whose other copies
  // the remaining ranks hold is restoring on `rank` (UNAVAILABLE until
  // FinishRestoring) and comes back as a task; one whose every copy is gone
  // is lost.
  Rejoin Rejoined(int rank, const std::set<std::string>& held, uint64_t epoch, const std::string& why);
  // After a restart, once every rank has registered with the shards it
  // holds (`epochs`: their registrations): as Rejoined for each rank, the
  // sources being what the ranks reported; `orphans` gets the shards no
  // tensor owns (the workers drop them).
  Rejoin Reconcile(const std::vector<std::set<std::string>>& held_by_rank, const std::vector<uint64_t>& epochs,
                   std::vector<std::string>* orphans);
  // Where `task`'s copy `missing_name` can be read now: the other ranks
  // that hold a copy of the same block and are not restoring it, their own
  // blocks first. NOT_FOUND when the task's generation is gone (deleted or
  // replaced) or no longer restoring for this epoch.
  absl::StatusOr<std::vector<CopySource>> RestoreSources(const RestoreTask& task,
                                                         const std::string& missing_name) const;
  // The task's copies are back: returns whether the tensor is whole again
  // (false also when the task was overtaken: another registration, a
  // replacement, a delete).
  bool FinishRestoring(const RestoreTask& task);
  // The task's copies could not be restored: the tensor is lost, `why`.
  void FailRestoring(const RestoreTask& task, const std::string& why);
  // Per rank, bytes of the blocks placed on it: its own and standby (the
  // placement's load), and of standby copies alone.
  std::vector<int64_t> ResidentBytesByRank(int ranks) const;
  std::vector<int64_t> StandbyBytesByRank(int ranks) const;
  // Tensors being restored.
  int64_t RestoringCount() const;
  // How many tensors `tenant` holds (resident or being made).
  int64_t Count(const std::string& tenant) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Resident> tensors_ ABSL_GUARDED_BY(mu_);

  // A tensor's copies being restored on a rank: for which registration,
  // and which of its names there are still missing.
  struct Restoring {
    uint64_t epoch = 0;
    std::set<std::string> missing;
  };
  // By tensor key, then rank. Not written to disk: a restarted coordinator
  // finds what is missing again when the ranks register.
  absl::flat_hash_map<std::string, std::map<int, Restoring>> restoring_ ABSL_GUARDED_BY(mu_);

  absl::flat_hash_map<std::string, int> pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, ShardCopies> retired_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> claims_ ABSL_GUARDED_BY(mu_);
  std::string state_path_ ABSL_GUARDED_BY(mu_);
  // Writes the tensors to state_path_ (when durable).
  absl::Status Persist() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t CountLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Find's answer, pointing into tensors_.
  absl::StatusOr<const Resident*> FindLocked(const std::string& tenant, const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ranks other than `rank` with a copy of the block `name_on_rank` is
  // a copy of, and that copy's name there, skipping those whose copy is
  // missing (restoring, or not in `held_by_rank` when given).
  std::vector<CopySource> SourcesLocked(const std::string& key, const Resident& r, int rank,
                                        const std::string& name_on_rank,
                                        const std::vector<std::set<std::string>>* held_by_rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rejoined's decision for one tensor and rank: lost (true) or restoring.
  bool LoseOrRestoreLocked(const std::string& key, Resident& r, int rank, const std::set<std::string>& missing,
                           uint64_t epoch, const std::string& why,
                           const std::vector<std::set<std::string>>* held_by_rank, Rejoin* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_
