#include "worker/worker_service.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "logging/log.h"
#include "logging/trace_marks.h"
#include "proto/tensor_codec.h"
#include "proto/transport.h"
#include "proto/grpc_status.h"

namespace shardgemm {
namespace {

// How long a coordinator's call waits for this worker to finish joining
// the mesh it was registered into: the call's deadline, 10 s at most.
absl::Time JoinWaitDeadline(const grpc::ServerContext* context) {
  return std::min(DeadlineOf(context), absl::Now() + absl::Seconds(10));
}

}  // namespace


grpc::Status WorkerServiceImpl::CheckCaller(const grpc::ServerContextBase& context) const {
  if (transport_ == nullptr || transport_->CallerIs(context, security::kCoordinatorName) ||
      security::CallerIsLocalSocketPeer(context)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      "the Worker service answers only its coordinator (a shardgemm-coordinator certificate, "
                      "or its own Unix socket)");
}

grpc::Status WorkerServiceImpl::CheckDevice() {
  const absl::Status health = backend_->DeviceHealth();
  if (health.ok()) return grpc::Status::OK;
  if (on_device_lost_ != nullptr) std::call_once(device_lost_once_, [&] { on_device_lost_(health); });
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      absl::StrCat(health.message(), "; this worker is exiting for its supervisor to restart it"));
}

grpc::ServerUnaryReactor* WorkerServiceImpl::Execute(grpc::CallbackServerContext* context, const v1::Step* step,
                                                     v1::StepResult* result) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto call = std::make_unique<StepCall>();
  if (trace_steps_) call->marks.emplace();  // from the handler's start
  const logging::ScopedTraceMarks marking(call->marks ? &*call->marks : nullptr);
  if (grpc::Status s = CheckCaller(*context); !s.ok()) {
    reactor->Finish(s);
    return reactor;
  }
  // gRPC made the request non-const in the call's arena and destroys it
  // after the call is finished: the executor moves inline operands' bytes
  // out of it (a copy would copy every byte the request carries).
  call->step = const_cast<v1::Step*>(step);
  call->result = result;
  call->deadline = DeadlineOf(context);
  call->finish = [reactor](StepCall&, const grpc::Status& status) { reactor->Finish(status); };
  Run(std::move(call));
  return reactor;
}

void WorkerServiceImpl::ExecuteFromStepSocket(std::unique_ptr<v1::StepSocketRequest> request,
                                              std::function<void(v1::StepSocketReply)> reply) {
  auto call = std::make_unique<StepCall>();
  if (trace_steps_) call->marks.emplace();
  const logging::ScopedTraceMarks marking(call->marks ? &*call->marks : nullptr);
  call->deadline = request->deadline_unix_us() > 0 ? absl::FromUnixMicros(request->deadline_unix_us())
                                                   : absl::InfiniteFuture();
  call->socket_request = std::move(request);
  call->step = call->socket_request->mutable_step();
  call->socket_reply.set_call_id(call->socket_request->call_id());
  call->result = call->socket_reply.mutable_result();
  call->finish = [reply = std::move(reply)](StepCall& c, const grpc::Status& status) {
    c.socket_reply.set_code(static_cast<int32_t>(status.error_code()));
    c.socket_reply.set_message(status.error_message());
    if (!status.ok()) c.socket_reply.clear_result();
    reply(std::move(c.socket_reply));
  };
  Run(std::move(call));
}

void WorkerServiceImpl::Run(std::unique_ptr<StepCall> call) {
  call->busy = platform::BusyPoller::BusyIfOn(busy_poller_);
  if (grpc::Status s = CheckDevice(); !s.ok()) {
    call->finish(*call, s);
    return;
  }
  call->start = absl::Now();
  call->identity = StepObserver::StepIdentity::Of(*call->step);
  call->bytes_in = observer_ != nullptr ? static_cast<int64_t>(call->step->ByteSizeLong()) : 0;
  if (auto now = executor_->ExecuteIfItsTurn(*call->step, call->deadline); now.has_value()) {
    Answer(*call, *std::move(now));
    return;
  }
  // Early: it waits for the steps before it on a thread of its own.
  StepCall* refused = call.get();
  auto shared = std::shared_ptr<StepCall>(std::move(call));
  absl::Status parked = waiting_.Run([this, shared] {
    const logging::ScopedTraceMarks marking(shared->marks ? &*shared->marks : nullptr);
    Answer(*shared, executor_->Execute(std::move(*shared->step), shared->deadline));
  });
  if (!parked.ok()) {  // not run: `shared` still holds the call
    refused->finish(*refused, ToGrpcStatus(absl::ResourceExhaustedError(
                                  absl::StrCat("this worker has too many steps waiting for their turn: ",
                                               parked.message()))));
  }
}

void WorkerServiceImpl::Answer(StepCall& call, absl::StatusOr<v1::StepResult> r) {
  if (!r.ok()) (void)CheckDevice();  // a failure may have lost the device
  if (r.ok()) *call.result = *std::move(r);
  logging::TraceMark("executed");
  if (observer_ != nullptr) {
    observer_->Record(call.identity, absl::Now() - call.start, r.status(), r.ok() ? call.result : nullptr,
                      call.bytes_in, r.ok() ? static_cast<int64_t>(call.result->ByteSizeLong()) : 0);
  }
  if (call.marks) {
    logging::TraceMark("recorded");
    std::vector<logging::Field> fields = {{"request_id", call.identity.request_id},
                                          {"sequence", call.identity.sequence},
                                          {"ok", r.ok()}};
    for (logging::Field& f : call.marks->Fields()) fields.push_back(std::move(f));
    logging::ProcessLogger().Log(logging::Level::kInfo, "step_marks", fields);
  }
  call.finish(call, r.ok() ? grpc::Status::OK : ToGrpcStatus(r.status()));
}

grpc::Status WorkerServiceImpl::CancelSteps(grpc::ServerContext* context, const v1::CancelStepsRequest* request,
                                            v1::CancelStepsResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  return ToGrpcStatus(executor_->Cancel(
      request->session(), std::vector<uint64_t>(request->sequences().begin(), request->sequences().end())));
}

grpc::Status WorkerServiceImpl::AdvanceEpoch(grpc::ServerContext* context, const v1::AdvanceEpochRequest* request,
                                             v1::AdvanceEpochResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  absl::Status s = executor_->AdvanceEpoch(*request);
  if (s.ok()) {
    logging::ProcessLogger().Log(logging::Level::kInfo, "epoch_advanced",
                                 {{"epoch", static_cast<int64_t>(request->epoch())},
                                  {"reason", v1::EpochReason_Name(request->reason())},
                                  {"rank", request->rank()},
                                  {"sequence", static_cast<int64_t>(request->sequence())}});
  }
  return ToGrpcStatus(s);
}

grpc::Status WorkerServiceImpl::GetShard(grpc::ServerContext* context, const v1::GetShardRequest* request,
                                         v1::LocalTensor* shard) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  auto t = store_->Get(request->name());
  if (!t.ok()) return ToGrpcStatus(t.status());
  if ((*t)->host != nullptr) {
    HostTensorToProto(*(*t)->host, shard);
    return grpc::Status::OK;
  }
  auto host = backend_->Download(**t);  // a shard kept in device memory
  if (!host.ok()) return ToGrpcStatus(host.status());
  HostTensorToProto(std::move(*host), shard);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::PutShard(grpc::ServerContext* context, const v1::PutShardRequest* request,
                                         v1::PutShardResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (grpc::Status s = CheckDevice(); !s.ok()) return s;  // a copy restored here would be lost with it
  if (request->name().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name is empty");
  auto t = HostTensorFromProto(request->shard(), "shard");
  if (!t.ok()) return ToGrpcStatus(t.status());
  absl::Status stored = store_->Put(request->name(), std::move(*t));
  if (!stored.ok()) {
    return ToGrpcStatus(absl::Status(stored.code(), absl::StrCat(stored.message(), " (--memory_budget_mb)")));
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::Status(grpc::ServerContext* context, const v1::WorkerStatusRequest*,
                                       v1::WorkerStatus* status) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (grpc::Status s = CheckDevice(); !s.ok()) return s;
  status->set_rank(executor_->position().rank);
  status->set_backend(backend_->Name());
  status->set_memory_used_bytes(store_->used_bytes());
  status->set_memory_budget_bytes(store_->budget_bytes());
  status->set_device_memory_used_bytes(store_->device_used_bytes());
  status->set_device_memory_budget_bytes(store_->device_budget_bytes());
  if (staging_ != nullptr) {
    status->set_staged_bytes(staging_->held_bytes());
    status->set_staging_budget_bytes(staging_->budget_bytes());
    status->set_staging_tenant_limit_bytes(staging_->tenant_limit_bytes());
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::HoldShard(grpc::ServerContext* context, const v1::HoldShardRequest* request,
                                          v1::HoldShardResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (staging_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this worker serves no staging (--staging_port)");
  }
  if (!executor_->IsSession(request->session(), JoinWaitDeadline(context))) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "a hold of another coordinator session");
  }
  auto t = store_->Get(request->name());
  if (!t.ok()) return ToGrpcStatus(t.status());
  const std::shared_ptr<const Shard>& shard = *t;
  // Held once its bytes are reserved: holds past the budget download nothing. A host shard's
  // bytes are shared, not copied: a generation's bytes are never changed (a put replaces the shard).
  return ToGrpcStatus(staging_->HoldMade(
      request->ticket().ticket(), request->ticket().tenant(), shard->NumBytes(),
      [&]() -> absl::StatusOr<std::shared_ptr<const HostTensor>> {
        if (shard->host != nullptr) return shard->host;
        auto downloaded = backend_->Download(*shard);  // a shard kept on the device
        if (!downloaded.ok()) return downloaded.status();
        return std::make_shared<const HostTensor>(*std::move(downloaded));
      }));
}

grpc::Status WorkerServiceImpl::ExpectStaged(grpc::ServerContext* context, const v1::ExpectStagedRequest* request,
                                             v1::ExpectStagedResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (staging_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this worker serves no staging (--staging_port)");
  }
  if (!executor_->IsSession(request->session(), JoinWaitDeadline(context))) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "tickets of another coordinator session");
  }
  for (const v1::StagingTicket& t : request->tickets()) {
    ExpectedBlock block;
    block.tenant = t.tenant();
    // Puts have no role: their blocks are named by tensor and rank.
    block.operand = t.put_tensor().empty()
                        ? absl::StrCat("the ", v1::TensorRole_Name(t.role()), " block")
                        : absl::StrCat("the block of tensor '", t.put_tensor(), "' for rank ", t.put_block_rank());
    auto dtype = DTypeFromProto(t.dtype(), "dtype");
    if (!dtype.ok()) return ToGrpcStatus(dtype.status());
    block.dtype = *dtype;
    block.shape.assign(t.shape().begin(), t.shape().end());
    // A GEMM's operand may wait where the GEMM reads it (device memory on a CUDA worker).
    block.gemm_operand = t.put_tensor().empty() && (t.role() == v1::TENSOR_LHS || t.role() == v1::TENSOR_RHS);
    if (auto s = staging_->Expect(t.ticket(), std::move(block)); !s.ok()) return ToGrpcStatus(s);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::StageShard(grpc::ServerContext* context,
                                           grpc::ServerReader<v1::StageShardChunk>* reader,
                                           v1::StageResponse* response) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (staging_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this worker serves no staging (--staging_port)");
  }
  v1::StageShardChunk chunk;
  if (!reader->Read(&chunk)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ticket: the stream ended before its first message");
  }
  if (!executor_->IsSession(chunk.session(), JoinWaitDeadline(context))) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "a stage of another coordinator session");
  }
  if (chunk.ticket().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ticket: the first message carries no ticket");
  }
  // The coordinator forwards a put's chunks as its client sends them (and an empty message now and then
  // while they go to other blocks): the block's TTL restarts with each message and is at least the
  // coordinator's own bound on a wait (a large put takes as long as it takes, a lost coordinator's stream
  // holds nothing past it); the sweep ends this stream once it expires.
  auto upload = staging_->BeginStage(chunk.ticket(), chunk.tenant(), [context] { context->TryCancel(); },
                                     StagingArea::StageTtl::kFromLastData,
                                     absl::Milliseconds(std::max<int64_t>(0, chunk.idle_timeout_ms())));
  if (!upload.ok()) return ToGrpcStatus(upload.status());
  // The coordinator waits for this before it forwards bytes (GrpcStageStream::Open).
  context->AddInitialMetadata(kStageReservedMetadataKey, "1");
  reader->SendInitialMetadata();
  // Destroyed on every early return: a stream that does not finish holds nothing.
  do {
    if (auto s = (*upload)->Append(chunk.data()); !s.ok()) return ToGrpcStatus(s);
    chunk.Clear();
  } while (reader->Read(&chunk));
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the coordinator ended the stream");
  auto staged = (*upload)->Commit();
  if (!staged.ok()) return ToGrpcStatus(staged.status());
  response->set_bytes(*staged);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::DropStaged(grpc::ServerContext* context, const v1::DropStagedRequest* request,
                                           v1::DropStagedResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  if (staging_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this worker serves no staging (--staging_port)");
  }
  if (!executor_->IsSession(request->session(), JoinWaitDeadline(context))) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "a drop of another coordinator session");
  }
  for (const std::string& ticket : request->tickets()) staging_->Discard(ticket);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::ForgetClientMemory(grpc::ServerContext* context,
                                                   const v1::ForgetClientMemoryRequest* request,
                                                   v1::ForgetClientMemoryResponse* response) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  response->set_closed(executor_->ForgetClientMemory(*request));
  return grpc::Status::OK;
}

}  // namespace shardgemm
