// The coordinator's logic, free of gRPC: the mesh and its workers, the
// resident-tensor registry, planning, and dispatch of every request's steps
// in one global order.
#ifndef SHARDGEMM_SERVER_COORDINATOR_H_
#define SHARDGEMM_SERVER_COORDINATOR_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <set>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/host_tensor.h"
#include "proto/plan_codec.h"
#include "proto/shardgemm.pb.h"
#include "logging/trace_marks.h"
#include "planner/mesh.h"
#include "planner/spec.h"
#include "server/dispatcher.h"
#include "server/plan_cache.h"
#include "server/resident_registry.h"
#include "server/shared_memory_registry.h"
#include "server/worker_channel.h"

namespace shardgemm {

struct CoordinatorOptions {
  // The longest a step may take on the workers when the client sets no
  // earlier deadline (queueing behind other steps included).
  absl::Duration step_timeout = absl::Seconds(120);
  // How long past a step's deadline Dispatch waits for a channel that has
  // not reported back (gRPC channels report by the deadline themselves).
  absl::Duration dispatch_grace = absl::Seconds(5);
  // Resident tensors one tenant may hold (0: no limit).
  int64_t max_tensors_per_tenant = 0;
  // How often every worker is pinged (zero: no heartbeat), and after how
  // many missed answers in a row it is marked down.
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  int heartbeat_misses = 3;
  // Same-host clients may name shared-memory regions as sources and
  // destinations (the workers map them; FAILED_PRECONDITION when off).
  bool allow_shared_memory = false;
  // Workers on this host are called on their Unix socket (Dispatcher).
  bool prefer_local_socket = false;
  // With it: such a worker's steps go on its step socket when it serves one.
  bool prefer_step_socket = false;
  // Workers holding each block of a resident tensor (1 to the mesh's size):
  // with 2 or more, a worker that takes a replaced worker's rank gets its
  // copies back from the others (docs/reliability.md).
  int replicas = 1;
  // How long a transfer plan (PlanStaging) waits for the request that
  // names it; the workers expire its tickets by their own --staged_block_ttl.
  absl::Duration staging_ttl = absl::Seconds(60);
  // Transfer plans not yet used or expired, at most (RESOURCE_EXHAUSTED past it).
  int max_staging_plans = 4096;
};

// Who asks: the caller's tenant (its token's; "" with --insecure), whose
// namespace of resident tensors the request sees, and the request's id (the
// client's x-request-id, or one the service made), which goes with every
// step the request sends, for the workers' logs.
struct CallContext {
  std::string tenant;
  std::string request_id;
  // Whether the client has gone (the RPC was cancelled); null: never.
  std::function<bool()> cancelled;
  // The same, pushed (the callback API's OnCancel): a dispatch in flight
  // ends at once. Null: `cancelled` is polled, or there is none.
  std::shared_ptr<Cancellation> cancellation;
  // --trace_requests: the request's instants (null: not traced).
  std::shared_ptr<logging::TraceMarks> marks;
};

class Coordinator {
 public:
  using Connector = std::function<std::unique_ptr<WorkerChannel>(const std::string& address)>;

  Coordinator(planner::Mesh mesh, Connector connect, CoordinatorOptions options = {});
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // One heartbeat round: pings every registered worker, marks down one that
  // missed heartbeat_misses in a row and up one that answers. The heartbeat
  // thread runs it every heartbeat_interval; tests call it directly.
  void Heartbeat();

  // Keeps the registry of resident tensors in `state_dir` (registry.pb),
  // loading what is there: after a restart the workers register again with
  // their shards and the registry is reconciled with them once every rank
  // is back (tensors a rank lacks are lost, shards no tensor owns dropped).
  absl::Status MakeDurable(const std::string& state_dir);

  // Hears every advance of the mesh epoch (Dispatcher::SetEpochListener):
  // the rendezvous store ends the waits of older epochs. Set before serving.
  void SetEpochListener(Dispatcher::EpochListener listener) { dispatcher_.SetEpochListener(std::move(listener)); }

  // Answers every request still waiting on its workers with UNAVAILABLE
  // (the coordinator is shutting down); call before the server shuts down.
  void AbandonRequests();

  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  v1::ClusterInfo ClusterInfo() const;
  // What the metrics read at each scrape.
  struct Stats {
    int workers_expected = 0;
    int workers_registered = 0;
    bool ready = false;
    int64_t resident_tensors = 0;
    int64_t resident_bytes = 0;  // logical bytes of the resident tensors
    std::vector<bool> up;        // by rank: registered and answering its heartbeat
    std::vector<int64_t> standby_bytes;  // by rank: bytes of the standby copies placed there
    int64_t restoring_tensors = 0;
    int64_t restored = 0;        // tensors whose copies on a rank were restored
    int64_t restore_failures = 0;  // restores that ended with the tensor lost
    int64_t restored_bytes = 0;
    // Operand and output bytes of GEMM and quantize requests the
    // coordinator decoded or encoded itself, by the request's path.
    int64_t inline_activation_bytes = 0;
    int64_t direct_activation_bytes = 0;
    Dispatcher::Stats dispatch;
  };
  Stats GetStats() const;

  absl::StatusOr<v1::Plan> Plan(const v1::PlanRequest& request, const CallContext& call = {}) const;
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemm(const v1::GroupedGemmRequest& request,
                                                      absl::Time deadline = absl::InfiniteFuture(),
                                                      const CallContext& call = {});
  // GroupedGemm without a thread waiting on the workers: `done` runs once,
  // on the thread of the last worker's answer (or inline when the request
  // fails before dispatch). `request` must outlive the call.
  using GemmDone = std::function<void(absl::StatusOr<v1::GroupedGemmResponse>)>;
  void GroupedGemmAsync(const v1::GroupedGemmRequest& request, absl::Time deadline, CallContext call,
                        GemmDone done);
  absl::StatusOr<v1::GroupedQuantizeResponse> GroupedQuantize(
      const v1::GroupedQuantizeRequest& request, absl::Time deadline = absl::InfiniteFuture(),
      const CallContext& call = {});

  // Resident tensors: the workers keep only their shards.
  absl::StatusOr<v1::PutTensorResponse> PutTensor(const std::string& name, HostTensor tensor,
                                                  const std::string& spec, bool overwrite,
                                                  absl::Time deadline = absl::InfiniteFuture(),
                                                  const CallContext& call = {});
  // An inline PutTensor whose bytes go on to the workers as they arrive
  // (BeginStreamedPut). Destroyed unfinished (or after a failed Finish):
  // the streams are cancelled, the staged blocks dropped, nothing is
  // registered and the name's claim is released.
  class StreamedPut {
   public:
    virtual ~StreamedPut() = default;
    // The tensor's next row-major bytes, forwarded to the streams of the
    // ranks whose blocks contain them. INVALID_ARGUMENT ("data: ...") past
    // the tensor's bytes; a worker's stream that broke: its error, naming
    // the rank.
    virtual absl::Status Append(absl::string_view data) = 0;
    virtual int64_t received_bytes() const = 0;
    // The put is bounded by progress, not by its length: once it has waited
    // --step_timeout for one thing (the client's next chunk, a worker's
    // reservation, write or answer) it is ended: every stream is cancelled
    // and `stalled` runs (once, on another thread; at once if that happened
    // already), to end the client's call. The call's own deadline still
    // bounds it all.
    virtual void OnStall(std::function<void()> stalled) = 0;
    // DEADLINE_EXCEEDED naming what it waited for and the bytes that came
    // once the put was ended so; else OK.
    virtual absl::Status Stalled() const = 0;
    // After the last chunk: INVALID_ARGUMENT unless every byte arrived;
    // then each worker's answer, and the store steps naming the staged
    // blocks (as PutStaged).
    virtual absl::StatusOr<v1::PutTensorResponse> Finish() = 0;
  };
  // For a put on a mesh whose workers all stage and whose staging budgets
  // fit the blocks (a block split on a later dimension is taken from each
  // chunk run by run: BlockRuns): opens
  // a stage stream to each holder, all bounded by `deadline` and by
  // progress (StreamedPut::OnStall). Null (OK) when
  // the put does not qualify, or when a holder's staging budget is taken now
  // (it refused its stream before any byte went): it takes PutTensor. Errors
  // as PutTensor's (name, spec, an existing name without overwrite) before
  // anything is sent.
  absl::StatusOr<std::unique_ptr<StreamedPut>> BeginStreamedPut(const std::string& name, DType dtype,
                                                                const std::vector<int64_t>& shape,
                                                                const std::string& spec, bool overwrite,
                                                                absl::Time deadline = absl::InfiniteFuture(),
                                                                const CallContext& call = {});
  struct Fetched {
    v1::ResidentTensorInfo info;
    HostTensor tensor;
  };
  // RESOURCE_EXHAUSTED when a tensor of `bytes` could not be held by the
  // mesh even fully sharded (the workers' budgets together), or unless the
  // mesh is complete (UNAVAILABLE): checked before a put's data is received.
  absl::Status CheckTensorFits(const std::string& name, int64_t bytes) const;

  absl::StatusOr<Fetched> GetTensor(const std::string& name, absl::Time deadline = absl::InfiniteFuture(),
                                    const CallContext& call = {});
  absl::Status DeleteTensor(const std::string& name, absl::Time deadline = absl::InfiniteFuture(),
                            const CallContext& call = {});
  v1::ListTensorsResponse ListTensors(const CallContext& call = {}) const;

  // A transfer plan for a GroupedGemm request's operands that carry no
  // source (dtype, shape, spec only): per operand, per distinct block, each
  // rank's staging address and ticket; the workers are told the tickets
  // before it is answered. Tensor.staged then names its staging_id.
  absl::StatusOr<v1::StagingPlan> PlanStaging(const v1::StagingPlanRequest& request,
                                              absl::Time deadline = absl::InfiniteFuture(),
                                              const CallContext& call = {});
  // The resident tensor `name` for a direct read: each distinct block held
  // for one fetch on the lowest rank that has it (Worker.HoldShard).
  absl::StatusOr<v1::TensorBlocks> PlanFetch(const std::string& name, absl::Time deadline = absl::InfiniteFuture(),
                                             const CallContext& call = {});
  // A put whose blocks and standby copies were staged under a put's plan:
  // stores them on the workers and registers the tensor (as PutTensor).
  absl::StatusOr<v1::PutTensorResponse> PutStaged(const v1::PutStagedRequest& request,
                                                  absl::Time deadline = absl::InfiniteFuture(),
                                                  const CallContext& call = {});
  // Whether the transfer plan `staging_id` of this tenant is a put's (the
  // grant releasing it needs): NOT_FOUND unknown or expired, PERMISSION_DENIED another tenant's.
  absl::StatusOr<bool> StagingPlanIsPut(const std::string& staging_id, const CallContext& call = {});
  // A plan its client will not submit: every holder drops its tickets now
  // (bounded by `deadline` and a few seconds), and the plan is marked used.
  // A plan submitted already is left to its request (RELEASE_PLAN_SUBMITTED).
  absl::StatusOr<v1::ReleaseStagingResponse> ReleaseStaging(const std::string& staging_id,
                                                            absl::Time deadline = absl::InfiniteFuture(),
                                                            const CallContext& call = {});

  // A same-host client's shared-memory region, by the name requests use.
  absl::StatusOr<v1::RegisterSharedMemoryResponse> RegisterSharedMemory(const v1::RegisterSharedMemoryRequest& request,
                                                                        const CallContext& call = {});
  absl::StatusOr<v1::RenewSharedMemoryResponse> RenewSharedMemory(const v1::RenewSharedMemoryRequest& request,
                                                                  const CallContext& call = {});
  absl::Status UnregisterSharedMemory(const std::string& name, const CallContext& call = {});

  const planner::Mesh& mesh() const { return mesh_; }
  const std::string& session() const { return session_; }

 private:

  // An operand the caller has decoded already (GLOBAL_SORTED's routed rows
  // and per-shard group sizes): it stands for the request's field of that
  // name, whose proto is then not read at all.
  struct DecodedOperand {
    HostTensor tensor;
    std::string spec;
  };
  // The PER_SHARD layout. With `decoded`, those operands replace the
  // request's; with `out_tensor`, the output (when not kept resident) is
  // moved there instead of encoded into the response's `out`.
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemmPerShard(
      const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call,
      absl::flat_hash_map<std::string, DecodedOperand> decoded = {}, HostTensor* out_tensor = nullptr);
  // The PER_SHARD layout in two halves around its dispatch: what the steps
  // need (plan, pins, claimed name, the steps), and the response from the
  // workers' answers.
  struct GemmCall;
  absl::StatusOr<std::shared_ptr<GemmCall>> PrepareGroupedGemm(
      const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call,
      absl::flat_hash_map<std::string, DecodedOperand> decoded, HostTensor* out_tensor);
  absl::StatusOr<v1::GroupedGemmResponse> CompleteGroupedGemm(GemmCall& c,
                                                              absl::StatusOr<std::vector<v1::StepResult>> results);
  void StartGroupedGemmPerShard(const v1::GroupedGemmRequest& request, absl::Time deadline, const CallContext& call,
                                absl::flat_hash_map<std::string, DecodedOperand> decoded, HostTensor* out_tensor,
                                GemmDone done);
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemmGlobalSorted(const v1::GroupedGemmRequest& request,
                                                                  absl::Time deadline,
                                                                  const CallContext& call);
  // UNAVAILABLE until every worker of the mesh has registered.
  absl::Status CheckReady() const;
  // The deadline of a request's steps: the client's, or the server's default.
  absl::Time StepDeadline(absl::Time client_deadline) const;
  // Dispatcher::Dispatch.
  absl::StatusOr<std::vector<v1::StepResult>> Dispatch(std::vector<v1::Step> steps, absl::Time deadline,
                                                       const CallContext& call);
  // Dispatch without a thread waiting; the call's cancellation ends it at once.
  void DispatchThen(std::vector<v1::Step> steps, absl::Time deadline, const CallContext& call,
                    Dispatcher::DispatchDone done);
  static struct TensorMeta MetaOf(const Resident& resident);
  // Resident shards that a running request has resolved are pinned: a
  // replacement or delete retires them, and they leave the workers when the
  // last request using them is done (not from under it).
  void Unpin(const std::vector<std::string>& pins);
  // Deletes every copy now (the delete step's status), or when their last
  // pin goes (OK now).
  absl::Status Retire(const ShardCopies& copies, absl::Time deadline = absl::InfiniteFuture(),
                      const CallContext& call = {});
  struct PinGuard {
    Coordinator* coordinator;
    std::vector<std::string> pins;
    std::vector<std::string> names;  // the resident tensors pinned, by the caller's names
    ~PinGuard() { coordinator->Unpin(pins); }
  };
  // Shape, dtype and spec of a request tensor, resident (pinned) or inline (validated).
  absl::StatusOr<struct TensorMeta> ResolveMeta(const v1::Tensor& t, const std::string& field, const std::string& tenant,
                                                PinGuard* guard);
  // A worker's NOT_FOUND for a request that read resident tensors: when one
  // of them is being restored (UNAVAILABLE) or lost (DATA_LOSS) that is the
  // answer, not NOT_FOUND; otherwise `status` as it is.
  absl::Status ExplainMissingShard(absl::Status status, const std::string& tenant,
                                   const std::vector<std::string>& names) const;

  // --replicas: where the copies of a new tensor's blocks go.
  struct Placement {
    std::vector<int> block_of_rank;
    std::vector<StandbyCopy> standby;
  };
  absl::StatusOr<Placement> Place(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                                  const planner::PartitionSpec& spec) const;
  // A kept output (made on the workers) gets its standby copies: each block
  // read from its rank and stored on its holders in one step. On failure the
  // caller drops `placement`'s copies (some may have been stored).
  absl::Status StoreStandbyOfKept(const std::string& shard_name, const Placement& placement, absl::Time deadline,
                                  const CallContext& call);
  // Fills a new Resident's copies and replicas.
  void SetPlacement(const Placement& placement, Resident* resident) const;
  // Restores the tasks' copies, one tensor after another, on a thread of
  // its own (joined when the coordinator goes).
  void StartRestores(std::vector<RestoreTask> tasks);
  void RunRestores(const std::vector<RestoreTask>& tasks);
  // One tensor's copies on its rank: each read from a rank holding a copy
  // and stored on the task's rank (PutShard). Retries while the failure may
  // pass, until `deadline`. True when restored; false when the task was
  // overtaken (a delete, a replacement, the rank registered again) or the
  // coordinator is stopping. `bytes` gets what was copied.
  absl::StatusOr<bool> RestoreOne(const RestoreTask& task, absl::Time deadline, int64_t* bytes);
  // Reads back a sharded tensor (or a request output) from the workers.
  absl::StatusOr<HostTensor> Assemble(DType dtype, const std::vector<int64_t>& shape,
                                      const planner::PartitionSpec& spec,
                                      const std::function<absl::StatusOr<HostTensor>(int)>& shard);
  absl::Status DeleteShards(const ShardCopies& copies, absl::Time deadline = absl::InfiniteFuture(),
                            const CallContext& call = {});
  void DeleteShardsBestEffort(const ShardCopies& copies);
  // Retire, without waiting for the workers.
  void RetireBestEffort(const ShardCopies& copies);

  const CoordinatorOptions options_;
  const planner::Mesh mesh_;
  const int num_workers_;
  const std::string session_;  // names this run in rendezvous keys

  // planner::MakePlan through plan_cache_.
  absl::StatusOr<planner::Plan> MakePlan(const planner::PlanRequest& request) const;
  Dispatcher dispatcher_;

  ResidentRegistry registry_;
  // Plans by request (MakePlan is pure): a repeated shape is planned once.
  mutable PlanCache plan_cache_;
  SharedMemoryRegistry shared_memory_;

  // Transfer plans by staging id, until used or expired.
  struct StagedOperandRecord {
    struct TensorMeta meta;                  // as planned: dtype, shape, spec
    std::vector<std::string> ticket_of_rank;
    std::vector<std::vector<int64_t>> offsets_of_rank;  // each rank's block in the tensor
  };
  // A put's plan: the tensor, and each copy's ticket where it will be stored.
  struct StagedPut {
    std::string name;
    bool overwrite = false;
    DType dtype = DType::kInvalid;
    std::vector<int64_t> shape, local_shape;
    planner::PartitionSpec spec;
    std::vector<int> block_of_rank;
    std::vector<std::string> ticket_of_rank;                  // each rank's own block
    std::vector<std::pair<StandbyCopy, std::string>> standby;  // --replicas' copies and their tickets
  };
  struct StagingRecord {
    std::string tenant;
    absl::Time expires;
    bool used = false;
    bool released = false;  // by ReleaseStaging (used too)
    bool is_put = false;
    std::map<std::string, StagedOperandRecord> operands;  // "lhs", "rhs", ...
    std::unique_ptr<StagedPut> put;                        // a put's plan instead
  };
  // Stores a put's staged blocks (each rank's store step naming its
  // tickets) as shard generation `shard_name`, then registers it with
  // `register_resident` (a claim's Register): the response, or why not (its
  // new shards dropped).
  absl::StatusOr<v1::PutTensorResponse> StoreStagedPut(
      const StagedPut& put, const std::string& shard_name,
      const std::function<absl::StatusOr<ShardCopies>(Resident)>& register_resident, absl::Time deadline,
      const CallContext& call);
  class StreamedPutImpl;
  // Tickets by holder rank, of blocks no step will claim nor client fetch.
  using TicketsByRank = std::map<int, std::vector<std::string>>;
  static TicketsByRank TicketsOf(const StagingRecord& record);
  static TicketsByRank TicketsOf(const std::vector<v1::ExpectStagedRequest>& expect);
  // Has each holder drop its tickets now (Worker.DropStaged, in parallel,
  // each call bounded by `until`); a worker that misses it expires them.
  void DropStaged(const TicketsByRank& tickets, absl::Time until);
  // As DropStaged, on a thread of its own (bounded by kDropStagedTimeout):
  // a failed request's answer does not wait for it.
  void DropStagedBestEffort(TicketsByRank tickets);
  // Tells every worker which clients' memory no region names any more
  // (unregistered or lapsed): waiting for their answers (bounded) with
  // `wait`, so an unregister returns once the workers let go of it; else
  // from a thread of its own (the heartbeat's lapses).
  void ForgetGoneClientMemory(bool wait);
  // Tells each worker its tickets (Worker.ExpectStaged, in parallel).
  absl::Status TellStagingTickets(std::vector<v1::ExpectStagedRequest> expect, absl::Time deadline);
  // Tells each worker its tickets, then keeps the record under a new staging id.
  absl::StatusOr<v1::StagingPlan> IssueStaging(StagingRecord record, v1::StagingPlan response,
                                               std::vector<v1::ExpectStagedRequest> expect, absl::Time deadline);
  absl::StatusOr<v1::StagingPlan> PlanPutStaging(const v1::PutStagingRequest& put, absl::Time deadline,
                                                 const CallContext& call);
  absl::Mutex staging_mu_;
  std::map<std::string, StagingRecord> staging_ ABSL_GUARDED_BY(staging_mu_);
  // Forgets the expired plans; RESOURCE_EXHAUSTED when --max_staging_plans wait still.
  absl::Status RoomForStagingPlan() ABSL_EXCLUSIVE_LOCKS_REQUIRED(staging_mu_);
  // The staged operand `field` of `staging_id`, checked against the request's
  // tensor `t` (tenant, expiry, dtype, shape, spec); not yet marked used.
  absl::StatusOr<struct TensorMeta> ResolveStaged(const v1::Tensor& t, const std::string& field,
                                                  const std::string& tenant);
  // Marks `staging_id` used (FAILED_PRECONDITION if it was) and checks that
  // `plan` places each staged operand's blocks where they were staged.
  // `tickets` gets the plan's (each holder's), to drop if the request fails.
  absl::Status TakeStaged(const std::string& staging_id, const planner::Plan& plan, TicketsByRank* tickets);
  // The workers' staging addresses by rank (FAILED_PRECONDITION naming a rank without one).
  absl::StatusOr<std::vector<std::string>> StagingAddresses() const;

  std::atomic<int64_t> inline_activation_bytes_{0};
  std::atomic<int64_t> direct_activation_bytes_{0};

  absl::Mutex reconcile_mu_;
  std::vector<std::set<std::string>> reported_ ABSL_GUARDED_BY(reconcile_mu_);  // shards by rank, at registration
  // Which ranks' registrations have reported (a rank joined in the
  // dispatcher may not have reported yet: two registering at once).
  std::vector<bool> has_reported_ ABSL_GUARDED_BY(reconcile_mu_);
  bool reconciled_ ABSL_GUARDED_BY(reconcile_mu_) = false;

  // Each registration's number (RestoreTask::epoch), and the latest by rank.
  std::atomic<uint64_t> next_epoch_{1};
  mutable absl::Mutex restore_mu_;  // taken last: nothing is called with it held
  std::vector<uint64_t> rank_epoch_ ABSL_GUARDED_BY(restore_mu_);
  struct Restorer {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Restorer> restorers_ ABSL_GUARDED_BY(restore_mu_);
  bool restore_stopping_ ABSL_GUARDED_BY(restore_mu_) = false;
  int64_t restored_ ABSL_GUARDED_BY(restore_mu_) = 0;
  int64_t restore_failures_ ABSL_GUARDED_BY(restore_mu_) = 0;
  int64_t restored_bytes_ ABSL_GUARDED_BY(restore_mu_) = 0;

  absl::Mutex heartbeat_mu_;
  std::vector<int> missed_ ABSL_GUARDED_BY(heartbeat_mu_);
  bool stopping_ ABSL_GUARDED_BY(heartbeat_mu_) = false;
  std::thread heartbeat_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_COORDINATOR_H_
