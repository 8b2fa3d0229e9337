// The coordinator's registry of resident tensors: name -> its info, spec and
// the generation its shards carry on the workers ("name@generation"), with
// the pins of running requests and the names requests are about to make.
// No gRPC and no I/O: the decisions it returns ("delete these shards now")
// are the caller's to carry out.
#ifndef SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_
#define SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include <set>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "planner/spec.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

// Resident tensor names (PutTensor's name, keep_output_as): 1 to
// kMaxResidentNameBytes bytes, no '@' (it separates the generation on the
// workers) and no control characters; INVALID_ARGUMENT naming `field` otherwise.
constexpr size_t kMaxResidentNameBytes = 256;
absl::Status ValidateResidentName(absl::string_view field, absl::string_view name);

struct Resident {
  std::string tenant;  // whose it is: only that tenant finds, lists, replaces or deletes it
  v1::ResidentTensorInfo info;
  planner::PartitionSpec spec;
  std::string shard_name;  // name@generation on the workers (the generation is random: not guessable)
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
  absl::StatusOr<Resident> FindAndPin(const std::string& tenant, const std::string& name,
                                      std::vector<std::string>* pins);
  // The shards whose last pin this was and that were retired meanwhile:
  // the caller deletes them from the workers.
  std::vector<std::string> Unpin(const std::vector<std::string>& pins);

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
  // Returns the generation it replaced, if any: the caller retires it. When
  // durable and the file cannot be written: UNAVAILABLE, and nothing changed.
  absl::StatusOr<std::string> Register(Resident resident);
  // Registers all of `residents` or none (one durable write), releasing
  // their claims either way; returns the generations they replaced (empty
  // strings for new names), in order.
  absl::StatusOr<std::vector<std::string>> RegisterAll(std::vector<Resident> residents);

  // Whether `name` is resident and lost.
  bool IsLost(const std::string& tenant, const std::string& name) const;
  // Removes `name`, lost or not; returns its generation (NOT_FOUND if absent;
  // UNAVAILABLE, and it stays, when a durable registry cannot be written).
  absl::StatusOr<std::string> Remove(const std::string& tenant, const std::string& name);
  // Whether `shard_name` can leave the workers now (no pins); otherwise it
  // is marked, and Unpin hands it back with the last pin.
  bool Retire(const std::string& shard_name);

  std::vector<v1::ResidentTensorInfo> List(const std::string& tenant) const;  // by name
  // Every tenant's (the metrics).
  std::vector<v1::ResidentTensorInfo> ListAll() const;
  // A worker (re)joined holding only `held`: every tensor whose shard it
  // lacks is lost (`why` says where). Returns how many were marked.
  int MarkLostUnlessHeld(const std::set<std::string>& held, const std::string& why);
  // After a restart, once every rank has registered with the shards it
  // holds: tensors some rank lacks a shard of are lost; `orphans` gets the
  // shards no tensor owns (the workers drop them). Returns how many were lost.
  int Reconcile(const std::vector<std::set<std::string>>& held_by_rank, std::vector<std::string>* orphans);
  // How many tensors `tenant` holds (resident or being made).
  int64_t Count(const std::string& tenant) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Resident> tensors_ ABSL_GUARDED_BY(mu_);

  absl::flat_hash_map<std::string, int> pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> retired_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> claims_ ABSL_GUARDED_BY(mu_);
  std::string state_path_ ABSL_GUARDED_BY(mu_);
  // Writes the tensors to state_path_ (when durable).
  absl::Status Persist() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t CountLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_RESIDENT_REGISTRY_H_
