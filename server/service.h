// The gRPC face of the coordinator: thin classes that translate RPCs into
// Coordinator calls.
#ifndef SHARDGEMM_SERVER_SERVICE_H_
#define SHARDGEMM_SERVER_SERVICE_H_

#include <cstdint>
#include <functional>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "proto/shardgemm.grpc.pb.h"
#include "platform/busy_poll.h"
#include "server/coordinator.h"
#include "server/rendezvous_store.h"
#include "security/tls.h"
#include "security/tokens.h"
#include "server/request_observer.h"

namespace shardgemm {

// Plan and GroupedGemm are served on the callback API: the reactor path
// skips the synchronous server's thread hand-offs, a GEMM's workers answer
// it with no thread waiting, and a client's cancellation reaches it at once.
class ShardGemmService final
    : public v1::ShardGemm::WithCallbackMethod_GroupedGemm<v1::ShardGemm::WithCallbackMethod_Plan<v1::ShardGemm::Service>> {
 public:
  // `observer` (may be null) sees every request. `tokens` (null: every
  // caller is let in, as with --insecure) authenticates clients.
  // `max_requests_per_tenant` (0: no limit) bounds one tenant's GEMM,
  // quantize, put and get requests running at once.
  explicit ShardGemmService(Coordinator* coordinator, RequestObserver* observer = nullptr,
                            security::TokenFile* tokens = nullptr, int max_requests_per_tenant = 0)
      : coordinator_(coordinator),
        observer_(observer),
        tokens_(tokens),
        max_requests_per_tenant_(max_requests_per_tenant) {}

  // Called as each request ends, to hand the allocator's free pages back to
  // the system when there are many (the main's choice): without it a 1 GiB
  // put leaves the process several GiB larger for good. Null: never.
  void SetFreeMemoryReleaser(std::function<void()> release) { release_free_memory_ = std::move(release); }

  // Keeps the process's cores busy while a GEMM or quantize request is in
  // flight (--busy_poll). Null: never. Set before the server starts.
  void SetBusyPoller(platform::BusyPoller* poller) { busy_poller_ = poller; }
  // --trace_requests: one "request_marks" log line per GroupedGemm
  // (logging/trace_marks.h). Set before the server starts.
  void SetTraceRequests(bool on) { trace_requests_ = on; }

  grpc::Status GetClusterInfo(grpc::ServerContext*, const v1::ClusterInfoRequest*,
                              v1::ClusterInfo*) override;
  grpc::ServerUnaryReactor* Plan(grpc::CallbackServerContext* context, const v1::PlanRequest* request,
                                 v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* GroupedGemm(grpc::CallbackServerContext* context, const v1::GroupedGemmRequest* request,
                                        v1::GroupedGemmResponse* response) override;
  grpc::Status GroupedQuantize(grpc::ServerContext*, const v1::GroupedQuantizeRequest*,
                               v1::GroupedQuantizeResponse*) override;

  // A GroupedGemm that came on the call socket (server/call_socket.h):
  // authenticated by its token, admitted, recorded and traced as a gRPC
  // call is. `finish` runs once, with the status a gRPC call would end with
  // (`response` filled when OK) and the request's id; `request` and
  // `response` live until then.
  struct SocketCall {
    std::string token;       // "": none sent
    std::string request_id;  // the client's, or "" for one made here
    absl::Time deadline = absl::InfiniteFuture();
    // The call's deadline bounds it: a client whose connection ends does
    // not cancel its calls in flight.
    std::shared_ptr<Cancellation> cancellation = std::make_shared<Cancellation>();
  };
  void GroupedGemmFromSocket(const v1::GroupedGemmRequest& request, const SocketCall& origin,
                             v1::GroupedGemmResponse* response,
                             std::function<void(grpc::Status, const std::string& request_id)> finish);
  // A GroupedQuantize that came on the call socket, served on the caller's
  // thread as the gRPC call is; `request_id` gets the request's id.
  grpc::Status GroupedQuantizeFromSocket(const v1::GroupedQuantizeRequest& request, const SocketCall& origin,
                                         v1::GroupedQuantizeResponse* response, std::string* request_id);
  // Waits (up to `bound`) until every socket call has finished (a GEMM's
  // `finish` returned, a quantize returned):
  // what the server's Wait is for gRPC calls, before the service goes.
  // False, with the number still in flight logged, at the bound.
  bool WaitForSocketCalls(absl::Duration bound);
  grpc::Status PutTensor(grpc::ServerContext*, grpc::ServerReader<v1::TensorChunk>*,
                         v1::PutTensorResponse*) override;
  grpc::Status GetTensor(grpc::ServerContext*, const v1::GetTensorRequest*,
                         grpc::ServerWriter<v1::TensorChunk>*) override;
  grpc::Status DeleteTensor(grpc::ServerContext*, const v1::DeleteTensorRequest*,
                            v1::DeleteTensorResponse*) override;
  grpc::Status ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*,
                           v1::ListTensorsResponse*) override;
  grpc::Status RegisterSharedMemory(grpc::ServerContext*, const v1::RegisterSharedMemoryRequest*,
                                    v1::RegisterSharedMemoryResponse*) override;
  grpc::Status RenewSharedMemory(grpc::ServerContext*, const v1::RenewSharedMemoryRequest*,
                                 v1::RenewSharedMemoryResponse*) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext*, const v1::UnregisterSharedMemoryRequest*,
                                      v1::UnregisterSharedMemoryResponse*) override;
  grpc::Status PlanStaging(grpc::ServerContext* context, const v1::StagingPlanRequest* request,
                           v1::StagingPlan* plan) override;
  grpc::Status PutStaged(grpc::ServerContext* context, const v1::PutStagedRequest* request,
                         v1::PutTensorResponse* response) override;
  grpc::Status PlanFetch(grpc::ServerContext* context, const v1::GetTensorRequest* request,
                         v1::TensorBlocks* blocks) override;
  grpc::Status ReleaseStaging(grpc::ServerContext* context, const v1::ReleaseStagingRequest* request,
                              v1::ReleaseStagingResponse* response) override;

 private:
  // Records `record` with `status` (when observed) and returns `status`.
  // A callback call's record (Finish's), then its answer.
  void FinishReactor(grpc::ServerUnaryReactor* reactor, const RequestRecord& record, grpc::Status status);
  grpc::Status Finish(const RequestRecord& record, grpc::Status status);
  grpc::Status ReceiveTensor(grpc::ServerContext* context, grpc::ServerReader<v1::TensorChunk>* reader,
                             v1::PutTensorResponse* response, RequestRecord* record);
  RequestRecord Begin(RequestOp op, grpc::ServerContextBase* context);
  // The caller's tenant (UNAUTHENTICATED without a valid token), into `record`.
  // PERMISSION_DENIED when the token lacks `needed` (or write, for a GEMM
  // or quantize that keeps its output: record->tensor set first).
  grpc::Status Authenticate(const grpc::ServerContextBase& context, RequestRecord* record, security::Grant needed);
  // The same checks for a principal found another way.
  grpc::Status Authorize(const absl::StatusOr<security::Principal>& principal, RequestRecord* record,
                         security::Grant needed);
  // +1 as a socket call starts, -1 once it has answered (WaitForSocketCalls).
  void CountSocketCall(int change);
  // A socket call's record, its caller checked by the token it sent
  // (`authenticated`), as Begin and Authenticate do for a gRPC call.
  RequestRecord BeginSocketCall(RequestOp op, const SocketCall& origin, const std::string& tensor,
                                grpc::Status* authenticated);
  // GroupedQuantize on either transport, on the caller's thread.
  grpc::Status ServeGroupedQuantize(const v1::GroupedQuantizeRequest& request, absl::Time deadline,
                                    RequestRecord record, grpc::Status authenticated, CallContext call,
                                    v1::GroupedQuantizeResponse* response);
  // GroupedGemm on either transport: `authenticated` is the caller's check;
  // `answer` gets the call's status once its record is finished.
  void ServeGroupedGemm(const v1::GroupedGemmRequest& request, absl::Time deadline, RequestRecord record,
                        grpc::Status authenticated, std::shared_ptr<Cancellation> cancellation,
                        v1::GroupedGemmResponse* response, std::function<void(grpc::Status)> answer);

  // Takes one of the tenant's request slots (RESOURCE_EXHAUSTED when none
  // is free); the slot is given back when the returned guard goes.
  class Slot;
  absl::StatusOr<std::unique_ptr<Slot>> TakeSlot(const std::string& tenant);

  Coordinator* coordinator_;
  RequestObserver* observer_;
  security::TokenFile* tokens_;
  const int max_requests_per_tenant_;
  std::function<void()> release_free_memory_;
  platform::BusyPoller* busy_poller_ = nullptr;
  bool trace_requests_ = false;
  absl::Mutex socket_calls_mu_;
  int socket_calls_in_flight_ ABSL_GUARDED_BY(socket_calls_mu_) = 0;
  absl::Mutex slots_mu_;
  absl::flat_hash_map<std::string, int> running_ ABSL_GUARDED_BY(slots_mu_);
};

class CoordinationService final : public v1::Coordination::Service {
 public:
  // `transport` (null: accept every caller) lets in only workers' certificates.
  CoordinationService(Coordinator* coordinator, RendezvousStore* store,
                      const security::Transport* transport = nullptr)
      : coordinator_(coordinator), store_(store), transport_(transport) {}
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*,
                        v1::RegisterResponse*) override;
  grpc::Status StoreSet(grpc::ServerContext*, const v1::StoreSetRequest*,
                        v1::StoreSetResponse*) override;
  grpc::Status StoreGet(grpc::ServerContext*, const v1::StoreGetRequest*,
                        v1::StoreGetResponse*) override;
  grpc::Status StoreDelete(grpc::ServerContext*, const v1::StoreDeleteRequest*,
                           v1::StoreDeleteResponse*) override;
  grpc::Status Session(grpc::ServerContext*, const v1::SessionRequest*, v1::SessionResponse*) override;

 private:
  grpc::Status CheckCaller(const grpc::ServerContext& context) const;

  Coordinator* coordinator_;
  RendezvousStore* store_;
  const security::Transport* transport_;
};


}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_SERVICE_H_
