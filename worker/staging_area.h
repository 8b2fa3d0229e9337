// Blocks clients stream to this worker directly (the data plane's staging,
// docs/architecture.md "Data paths"), and output blocks kept for a client's
// direct fetch, each under a ticket the coordinator issued. A small library:
// no gRPC, no threads of its own (the worker's sweeper calls Sweep).
//
// A ticket's life: expected (the coordinator said so) -> being staged (one
// stream at a time) -> staged -> claimed by a step (used); or, for an
// output: held -> being fetched -> fetched (used). Every held byte counts
// against the budget; anything not claimed or fetched within the TTL
// expires and frees its bytes. A used ticket is remembered until its
// expiry, so a second use is told apart from an unknown ticket. Where the
// bytes live is the injected StagingMemory's choice (worker/staging_memory.h):
// host memory by default; on a CUDA worker a staged GEMM operand is in
// device memory once committed, and an output held for fetch in pinned host
// memory.
#ifndef SHARDGEMM_WORKER_STAGING_AREA_H_
#define SHARDGEMM_WORKER_STAGING_AREA_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/host_tensor.h"
#include "worker/shard.h"
#include "worker/staging_memory.h"

namespace shardgemm {

// A staged block a step claimed: `tensor` has its dtype and shape, and its
// bytes unless `device` holds them (a device staging memory's; `tensor` is
// then a header without bytes, as a device-only shard's).
struct StagedBlock {
  HostTensor tensor;
  std::shared_ptr<const DeviceBuffer> device;
};

class StagingArea {
 public:
  using Clock = std::function<absl::Time()>;
  // `budget_bytes` (--staging_budget): bytes staged, being staged and held
  // for fetch together. `ttl` (--staged_block_ttl): how long a ticket or its
  // block waits to be used. `tenant_limit_bytes` (--staging_tenant_share of
  // the budget): what one named tenant may hold of it; negative: no bound.
  // The anonymous tenant (a mesh without tokens, where every client is the
  // same one) is bounded by the budget alone. `memory` keeps the blocks'
  // bytes (null: host memory); the budget counts them wherever they are.
  StagingArea(int64_t budget_bytes, absl::Duration ttl, Clock now = [] { return absl::Now(); },
              int64_t tenant_limit_bytes = -1, std::unique_ptr<StagingMemory> memory = nullptr);

  // How errors name this worker (its staging address); "this worker" until set.
  void set_worker_name(std::string name);

  // The coordinator issued `ticket` for `block` on this worker.
  // INVALID_ARGUMENT for a malformed block; ALREADY_EXISTS for a ticket known already.
  absl::Status Expect(const std::string& ticket, ExpectedBlock block);

  // One Stage stream. Destroyed without Commit (the client went away, or
  // sent a wrong size): nothing is held, and the ticket may be staged again.
  class Upload {
   public:
    ~Upload();
    Upload(const Upload&) = delete;
    Upload& operator=(const Upload&) = delete;
    // INVALID_ARGUMENT past the ticket's bytes. The staging memory's error
    // as it is (its block is freed then, the reservation given back, and the
    // ticket may be staged again; this upload fails from then on).
    // With StageTtl::kFromLastData (empty `data` too: a keep-alive), NOT_FOUND
    // once the ticket expired (nothing arrived for its bound),
    // FAILED_PRECONDITION once it was discarded.
    absl::Status Append(absl::string_view data);
    // The block is staged: INVALID_ARGUMENT unless exactly the ticket's
    // bytes arrived; NOT_FOUND if the ticket expired meanwhile;
    // FAILED_PRECONDITION if it was discarded meanwhile; the staging
    // memory's error (waiting for a device's copies) as Append's.
    absl::StatusOr<int64_t> Commit();
    int64_t expected_bytes() const { return expected_bytes_; }

   private:
    friend class StagingArea;
    Upload(StagingArea* area, std::string ticket, std::string tenant, uint64_t id, int64_t expected_bytes,
           absl::Duration renew_for);
    // Frees the block and gives its reservation back (once).
    void Abandon();
    StagingArea* area_;
    std::string ticket_;
    std::string tenant_;  // whose reservation it holds
    uint64_t id_;
    int64_t expected_bytes_;
    absl::Duration renew_for_;  // StageTtl::kFromLastData: each Append's; zero: none
    std::unique_ptr<StagingMemory::Writer> writer_;
    int64_t received_ = 0;
    absl::Status failed_;  // the staging memory's error, once it failed
    bool committed_ = false;
    bool ended_ = false;  // abandoned: nothing held
  };
  // Ends a stream whose ticket expired while it was open (a client that
  // stalls would otherwise hold its bytes past the TTL); called by Sweep,
  // never after the stream's Upload or Download is destroyed.
  using CancelStream = std::function<void()>;

  // When a ticket being staged expires. kFromIssue: a TTL after the
  // coordinator issued it (Expect), however the stream goes; a client's
  // Staging.Stage, which could otherwise trickle bytes to hold its budget.
  // kFromLastData: the TTL, or `idle` if longer, after the stream began or
  // its last Append; the coordinator's own stream of an inline put
  // (Worker.StageShard), which forwards the client's chunks as they come
  // and may take any time in all (a large weight), but ends a put that
  // waited `idle` (its --step_timeout) for one.
  enum class StageTtl { kFromIssue, kFromLastData };

  // NOT_FOUND for an unknown or expired ticket, PERMISSION_DENIED for
  // another tenant's, FAILED_PRECONDITION for one staged, being staged or
  // used already, RESOURCE_EXHAUSTED (naming --staging_budget, or the
  // tenant and --staging_tenant_share) when its bytes do not fit; the
  // staging memory's error (RESOURCE_EXHAUSTED: no device memory for it)
  // naming this worker, the ticket given back.
  absl::StatusOr<std::unique_ptr<Upload>> BeginStage(const std::string& ticket, const std::string& tenant,
                                                     CancelStream cancel = nullptr,
                                                     StageTtl ttl = StageTtl::kFromIssue,
                                                     absl::Duration idle = absl::ZeroDuration());

  // A step's input: the staged block, taken out (its bytes leave the
  // budget; the step owns them). `field` names the operand in errors.
  // NOT_FOUND unknown or expired; FAILED_PRECONDITION not staged yet, or
  // used; INVALID_ARGUMENT when dtype or shape differ from the ticket's.
  absl::StatusOr<StagedBlock> ClaimBlock(const std::string& ticket, DType dtype, const std::vector<int64_t>& shape,
                                         absl::string_view field);
  // As ClaimBlock, for a block in host memory (every block of the host
  // staging memory); INTERNAL, the block kept, for one in device memory.
  absl::StatusOr<HostTensor> Claim(const std::string& ticket, DType dtype, const std::vector<int64_t>& shape,
                                   absl::string_view field);

  // A step that named `ticket` failed, or the request or put staging it was
  // abandoned: its block (staged, being staged or still to come, or an
  // output held for fetch) can serve no other step or fetch, so its bytes go
  // now and the ticket is used (a stream staging it then fails its Commit
  // with FAILED_PRECONDITION; one fetching it is cancelled by the sweep). A
  // ticket not known yet is remembered as used until the TTL: a step still
  // running when its request was given up cannot hold its output after.
  void Discard(const std::string& ticket);

  // Holds a step's output block for the client's fetch under `ticket`.
  // RESOURCE_EXHAUSTED (naming --staging_budget) when it does not fit;
  // ALREADY_EXISTS for a ticket known already.
  absl::Status Hold(const std::string& ticket, const std::string& tenant, HostTensor block);
  // As Hold, for a block that is made only once its `bytes` fit (a resident
  // shard's: its host bytes shared, or a download of a device-only one):
  // they are reserved before `make` runs, so concurrent holds cannot take
  // more than the budget; freed again if `make` fails. The block is only
  // read (a fetch streams it), so `make` may share bytes another owner keeps
  // unchanged (a resident shard's generation): they count against the
  // budget all the same, until fetched or expired.
  absl::Status HoldMade(const std::string& ticket, const std::string& tenant, int64_t bytes,
                        const std::function<absl::StatusOr<std::shared_ptr<const HostTensor>>()>& make);
  // As Hold, for a step's output still to be brought to the host: `fill`
  // writes its bytes into host memory of the staging memory's (pinned on a
  // CUDA worker while its pool has room), once they are reserved. Errors as
  // Hold's, and `fill`'s own (nothing held then).
  absl::Status HoldOutput(const std::string& ticket, const std::string& tenant, DType dtype,
                          const std::vector<int64_t>& shape, const std::function<absl::Status(char* dst)>& fill);

  // One Fetch stream: the block stays held until Done (fetched: the ticket
  // is used); destroyed without Done, it may be fetched again.
  class Download {
   public:
    ~Download();
    Download(const Download&) = delete;
    Download& operator=(const Download&) = delete;
    const HostTensor& block() const { return *block_; }
    // The block's bytes: contiguous host memory, valid until destroyed.
    absl::string_view bytes() const { return block_->bytes; }
    void Done();

   private:
    friend class StagingArea;
    Download(StagingArea* area, std::string ticket, uint64_t id, std::shared_ptr<const HostTensor> block);
    StagingArea* area_;
    std::string ticket_;
    uint64_t id_;
    std::shared_ptr<const HostTensor> block_;
    bool done_ = false;
  };
  // NOT_FOUND unknown or expired (or not an output); PERMISSION_DENIED
  // another tenant's; FAILED_PRECONDITION fetched already or being fetched.
  absl::StatusOr<std::unique_ptr<Download>> BeginFetch(const std::string& ticket, const std::string& tenant,
                                                       CancelStream cancel = nullptr);

  // Forgets every ticket past its expiry, freeing its bytes, and cancels
  // the streams still open on expired tickets; returns how many tickets.
  int Sweep();

  int64_t held_bytes() const;  // staged, being staged and held for fetch
  int64_t held_bytes_of(const std::string& tenant) const;
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t tenant_limit_bytes() const { return tenant_limit_bytes_; }  // negative: none
  absl::Duration ttl() const { return ttl_; }
  size_t tickets() const;  // known now (for tests and status)

 private:
  enum class State { kExpected, kStaging, kStaged, kHeld, kFetching, kUsed };
  struct Entry {
    ExpectedBlock block;
    int64_t bytes = 0;  // the block's
    State state = State::kExpected;
    absl::Time expires;
    uint64_t id = 0;  // the stream that owns it now (kStaging, kFetching)
    CancelStream cancel;  // that stream's
    std::shared_ptr<const HostTensor> data;  // kStaged (a header when `device` is set), kHeld, kFetching
    std::shared_ptr<const DeviceBuffer> device;  // kStaged: its bytes, where the staging memory kept them there
  };
  // BeginStage's part under the lock: the reservation and the stream's
  // entry; `block` and `worker` for the staging memory and its errors.
  absl::StatusOr<std::unique_ptr<Upload>> OpenUpload(const std::string& ticket, const std::string& tenant,
                                                     CancelStream cancel, StageTtl ttl, absl::Duration idle,
                                                     ExpectedBlock* block, std::string* worker);
  // The live entry of `ticket` (expired ones are dropped first), or null.
  Entry* Find(const std::string& ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(absl::flat_hash_map<std::string, Entry>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK for a ticket not known here; FAILED_PRECONDITION for one dropped
  // (Discard), ALREADY_EXISTS for any other (a new hold is refused).
  absl::Status Known(const std::string& ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `bytes` of `tenant` against the budget and the tenant's limit.
  absl::Status Reserve(int64_t bytes, const std::string& tenant, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unreserve(int64_t bytes, const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndUpload(const std::string& ticket, const std::string& tenant, uint64_t id, int64_t reserved);
  // An Upload of StageTtl::kFromLastData got bytes: its ticket's TTL restarts.
  absl::Status Renew(const std::string& ticket, uint64_t id, absl::Duration renew_for);
  void EndDownload(const std::string& ticket, uint64_t id, bool done);
  void ForgetStream(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HoldMadeAs(const std::string& ticket, const std::string& tenant, int64_t bytes, absl::string_view what,
                          const std::function<absl::StatusOr<std::shared_ptr<const HostTensor>>()>& make);
  absl::StatusOr<StagedBlock> Take(const std::string& ticket, DType dtype, const std::vector<int64_t>& shape,
                                   absl::string_view field, bool host_only);
  // Keeps `block` under `ticket` for fetch; its bytes are reserved already.
  void InsertHeld(const std::string& ticket, const std::string& tenant, std::shared_ptr<const HostTensor> block)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t budget_bytes_;
  const int64_t tenant_limit_bytes_;
  const absl::Duration ttl_;
  const Clock now_;
  const std::unique_ptr<StagingMemory> memory_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int64_t> held_by_tenant_ ABSL_GUARDED_BY(mu_);  // only nonzero ones
  std::string worker_name_ ABSL_GUARDED_BY(mu_) = "this worker";
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Streams whose ticket was dropped while they were open, by stream id:
  // Sweep cancels them (under mu_, so a stream cannot end meanwhile).
  absl::flat_hash_map<uint64_t, CancelStream> expired_streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STAGING_AREA_H_
