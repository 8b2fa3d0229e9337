#include "server/service.h"

#include <new>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "logging/log.h"
#include "logging/trace_marks.h"
#include "proto/tensor_codec.h"
#include "proto/transport.h"
#include "proto/grpc_status.h"

namespace shardgemm {

namespace {
CallContext CallOf(const RequestRecord& record, grpc::ServerContextBase* context = nullptr) {
  CallContext call{record.tenant, record.request_id, nullptr};
  if (context != nullptr) call.cancelled = [context] { return context->IsCancelled(); };
  return call;
}

// The first name a quantize keeps its outputs under ("" : none kept): its
// record's tensor, and what makes it need write.
std::string KeptByQuantize(const v1::GroupedQuantizeRequest& request) {
  return !request.keep().rowwise_data().empty() ? request.keep().rowwise_data() : request.keep().scale_inv();
}
}  // namespace

RequestRecord ShardGemmService::Begin(RequestOp op, grpc::ServerContextBase* context) {
  if (observer_ != nullptr) return observer_->Begin(op, context);
  RequestRecord record;
  record.op = op;
  return record;
}

class ShardGemmService::Slot {
 public:
  Slot(ShardGemmService* service, std::string tenant) : service_(service), tenant_(std::move(tenant)) {}
  ~Slot() {
    absl::MutexLock lock(&service_->slots_mu_);
    if (--service_->running_[tenant_] <= 0) service_->running_.erase(tenant_);
  }

 private:
  ShardGemmService* service_;
  std::string tenant_;
};

absl::StatusOr<std::unique_ptr<ShardGemmService::Slot>> ShardGemmService::TakeSlot(const std::string& tenant) {
  absl::MutexLock lock(&slots_mu_);
  int& running = running_[tenant];
  if (max_requests_per_tenant_ > 0 && running >= max_requests_per_tenant_) {
    if (running == 0) running_.erase(tenant);
    return absl::ResourceExhaustedError(absl::StrCat(
        tenant.empty() ? "this tenant" : absl::StrCat("tenant '", tenant, "'"), " has ", max_requests_per_tenant_,
        " requests running, its limit (--max_requests_per_tenant); retry when one is done"));
  }
  ++running;
  return std::make_unique<Slot>(this, tenant);
}

grpc::Status ShardGemmService::Authenticate(const grpc::ServerContextBase& context, RequestRecord* record,
                                            security::Grant needed) {
  if (tokens_ == nullptr) return grpc::Status::OK;
  return Authorize(tokens_->Authenticate(context), record, needed);
}

grpc::Status ShardGemmService::Authorize(const absl::StatusOr<security::Principal>& principal, RequestRecord* record,
                                         security::Grant needed) {
  if (!principal.ok()) return ToGrpcStatus(principal.status());
  record->tenant = principal->tenant;
  if (!principal->Has(needed)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("the token of tenant '", principal->tenant, "' is not granted ",
                                     security::GrantName(needed), " (", RequestOpName(record->op), ")"));
  }
  // A compute call that keeps what it makes writes a resident tensor.
  const bool keeps = (record->op == RequestOp::kGroupedGemm || record->op == RequestOp::kGroupedQuantize) &&
                     !record->tensor.empty();
  if (keeps && !principal->Has(security::Grant::kWrite)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(record->op == RequestOp::kGroupedGemm ? "keep_output_as" : "keep",
                                     ": the token of tenant '", principal->tenant, "' is not granted write"));
  }
  return grpc::Status::OK;
}

grpc::Status ShardGemmService::Finish(const RequestRecord& record, grpc::Status status) {
  if (observer_ != nullptr) observer_->End(record, status);
  if (release_free_memory_) release_free_memory_();
  return status;
}

void ShardGemmService::FinishReactor(grpc::ServerUnaryReactor* reactor, const RequestRecord& record,
                                     grpc::Status status) {
  // The record first: a client that has its answer finds it in the metrics,
  // and the service's objects outlive it (the server's Wait returns once
  // every call is finished). Its log line is queued, not written, here.
  reactor->Finish(Finish(record, std::move(status)));
}

grpc::Status ShardGemmService::GetClusterInfo(grpc::ServerContext* context, const v1::ClusterInfoRequest*,
                                              v1::ClusterInfo* info) {
  RequestRecord record = Begin(RequestOp::kGetClusterInfo, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kRead); !a.ok()) {
    return Finish(record, std::move(a));
  }
  *info = coordinator_->ClusterInfo();
  return Finish(record, grpc::Status::OK);
}

grpc::ServerUnaryReactor* ShardGemmService::Plan(grpc::CallbackServerContext* context,
                                                 const v1::PlanRequest* request,
                                                 v1::PlanResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestRecord record = Begin(RequestOp::kPlan, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kCompute); !a.ok()) {
    FinishReactor(reactor, record, std::move(a));
    return reactor;
  }
  record.bytes_in = static_cast<int64_t>(request->ByteSizeLong());
  auto plan = coordinator_->Plan(*request, CallOf(record));
  if (!plan.ok()) {
    FinishReactor(reactor, record, ToGrpcStatus(plan.status()));
  } else {
    *response->mutable_plan() = std::move(*plan);
    record.bytes_out = static_cast<int64_t>(response->ByteSizeLong());
    FinishReactor(reactor, record, grpc::Status::OK);
  }
  return reactor;
}

namespace {

// A unary call on the callback API that hears of its client's cancellation
// at once (OnCancel), whatever is waiting on its behalf.
class CancellableReactor : public grpc::ServerUnaryReactor {
 public:
  const std::shared_ptr<Cancellation>& cancellation() const { return cancellation_; }
  void OnCancel() override { cancellation_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<Cancellation> cancellation_ = std::make_shared<Cancellation>();
};

}  // namespace

grpc::ServerUnaryReactor* ShardGemmService::GroupedGemm(grpc::CallbackServerContext* context,
                                                        const v1::GroupedGemmRequest* request,
                                                        v1::GroupedGemmResponse* response) {
  auto* reactor = new CancellableReactor;
  RequestRecord record = Begin(RequestOp::kGroupedGemm, context);
  record.tensor = request->keep_output_as();
  grpc::Status authenticated = Authenticate(*context, &record, security::Grant::kCompute);
  ServeGroupedGemm(*request, DeadlineOf(context), std::move(record), std::move(authenticated),
                   reactor->cancellation(), response, [reactor](grpc::Status status) { reactor->Finish(status); });
  return reactor;
}

RequestRecord ShardGemmService::BeginSocketCall(RequestOp op, const SocketCall& origin, const std::string& tensor,
                                               grpc::Status* authenticated) {
  RequestRecord record;
  record.op = op;
  if (observer_ != nullptr) record = observer_->Begin(op, origin.request_id);
  record.transport = RequestTransport::kCallSocket;
  record.tensor = tensor;
  *authenticated = grpc::Status::OK;
  if (tokens_ != nullptr) {
    *authenticated =
        origin.token.empty()
            ? grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no bearer token: set the call's token")
            : Authorize(tokens_->TenantOf(origin.token), &record, security::Grant::kCompute);
  }
  return record;
}

void ShardGemmService::GroupedGemmFromSocket(const v1::GroupedGemmRequest& request, const SocketCall& origin,
                                             v1::GroupedGemmResponse* response,
                                             std::function<void(grpc::Status, const std::string&)> finish) {
  grpc::Status authenticated;
  RequestRecord record =
      BeginSocketCall(RequestOp::kGroupedGemm, origin, request.keep_output_as(), &authenticated);
  const std::string request_id = record.request_id;
  CountSocketCall(+1);
  ServeGroupedGemm(request, origin.deadline, std::move(record), std::move(authenticated), origin.cancellation,
                   response, [this, finish = std::move(finish), request_id](grpc::Status status) {
                     finish(std::move(status), request_id);
                     CountSocketCall(-1);
                   });
}

void ShardGemmService::CountSocketCall(int change) {
  absl::MutexLock lock(&socket_calls_mu_);
  socket_calls_in_flight_ += change;
}

bool ShardGemmService::WaitForSocketCalls(absl::Duration bound) {
  absl::MutexLock lock(&socket_calls_mu_);
  auto none = [this]() ABSL_SHARED_LOCKS_REQUIRED(socket_calls_mu_) { return socket_calls_in_flight_ == 0; };
  if (socket_calls_mu_.AwaitWithTimeout(absl::Condition(&none), bound)) return true;
  logging::ProcessLogger().Log(logging::Level::kError, "socket_calls_unfinished",
                               {{"in_flight", socket_calls_in_flight_},
                                {"message", "call socket calls still in flight at the shutdown's bound"}});
  return false;
}

void ShardGemmService::ServeGroupedGemm(const v1::GroupedGemmRequest& request, absl::Time deadline,
                                        RequestRecord record, grpc::Status authenticated,
                                        std::shared_ptr<Cancellation> cancellation, v1::GroupedGemmResponse* response,
                                        std::function<void(grpc::Status)> answer) {
  auto marks = trace_requests_ ? std::make_shared<logging::TraceMarks>() : nullptr;
  // The handler's thread marks the request's preparation (the coordinator's
  // TraceMark calls); the answers arrive on other threads (marks itself).
  const logging::ScopedTraceMarks marking(marks.get());
  // The record first: a client that has its answer finds it in the metrics,
  // and the service's objects outlive it (the server's Wait returns once
  // every call is finished). Its log line is queued, not written, here.
  auto finish = [this, answer = std::move(answer)](const RequestRecord& r, grpc::Status status) {
    answer(Finish(r, std::move(status)));
  };
  // Shared so the completion callback (copyable) can hold it; none when off.
  auto busy = busy_poller_ != nullptr && busy_poller_->on()
                  ? std::make_shared<platform::BusyPoller::Activity>(busy_poller_->Busy())
                  : nullptr;
  if (!authenticated.ok()) return finish(record, std::move(authenticated));
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return finish(record, ToGrpcStatus(slot.status()));
  record.bytes_in = static_cast<int64_t>(request.ByteSizeLong());
  CallContext call = CallOf(record);
  call.cancellation = std::move(cancellation);
  call.cancelled = [c = call.cancellation] { return c->cancelled(); };
  call.marks = marks;
  std::shared_ptr<Slot> held(std::move(*slot));
  logging::TraceMark("admitted");
  coordinator_->GroupedGemmAsync(
      request, deadline, std::move(call),
      [finish = std::move(finish), response, record, held, busy,
       marks](absl::StatusOr<v1::GroupedGemmResponse> r) mutable {
        held.reset();  // the tenant's slot is free before the client hears back
        // The line goes out once the call's answer is handed on.
        auto log_marks = [&] {
          if (marks == nullptr) return;
          marks->Mark("finished");
          std::vector<logging::Field> fields = {{"request_id", record.request_id}, {"ok", r.ok()}};
          for (logging::Field& f : marks->Fields()) fields.push_back(std::move(f));
          logging::ProcessLogger().Log(logging::Level::kInfo, "request_marks", fields);
        };
        if (!r.ok()) {
          finish(record, ToGrpcStatus(r.status()));
          log_marks();
          return;
        }
        *response = std::move(*r);
        record.plan_summary = response->plan_summary();
        record.server_seconds = response->server_seconds();
        record.worker_seconds = response->worker_seconds();
        record.host_to_device_bytes = response->host_to_device_bytes();
        record.device_to_host_bytes = response->device_to_host_bytes();
        record.bytes_out = static_cast<int64_t>(response->ByteSizeLong());
        if (marks != nullptr) marks->Mark("response_made");
        finish(record, grpc::Status::OK);
        log_marks();
      });
}

grpc::Status ShardGemmService::GroupedQuantize(grpc::ServerContext* context,
                                               const v1::GroupedQuantizeRequest* request,
                                               v1::GroupedQuantizeResponse* response) {
  RequestRecord record = Begin(RequestOp::kGroupedQuantize, context);
  record.tensor = KeptByQuantize(*request);
  grpc::Status authenticated = Authenticate(*context, &record, security::Grant::kCompute);
  CallContext call = CallOf(record, context);
  return ServeGroupedQuantize(*request, DeadlineOf(context), std::move(record), std::move(authenticated),
                              std::move(call), response);
}

grpc::Status ShardGemmService::GroupedQuantizeFromSocket(const v1::GroupedQuantizeRequest& request,
                                                         const SocketCall& origin,
                                                         v1::GroupedQuantizeResponse* response,
                                                         std::string* request_id) {
  grpc::Status authenticated;
  RequestRecord record =
      BeginSocketCall(RequestOp::kGroupedQuantize, origin, KeptByQuantize(request), &authenticated);
  *request_id = record.request_id;
  CountSocketCall(+1);
  CallContext call = CallOf(record);
  call.cancellation = origin.cancellation;
  call.cancelled = [c = origin.cancellation] { return c->cancelled(); };
  grpc::Status status = ServeGroupedQuantize(request, origin.deadline, std::move(record), std::move(authenticated),
                                             std::move(call), response);
  CountSocketCall(-1);
  return status;
}

grpc::Status ShardGemmService::ServeGroupedQuantize(const v1::GroupedQuantizeRequest& request, absl::Time deadline,
                                                    RequestRecord record, grpc::Status authenticated,
                                                    CallContext call, v1::GroupedQuantizeResponse* response) {
  platform::BusyPoller::Activity busy = platform::BusyPoller::BusyIfOn(busy_poller_);
  if (!authenticated.ok()) return Finish(record, std::move(authenticated));
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return Finish(record, ToGrpcStatus(slot.status()));
  record.bytes_in = static_cast<int64_t>(request.ByteSizeLong());
  auto r = coordinator_->GroupedQuantize(request, deadline, call);
  if (!r.ok()) return Finish(record, ToGrpcStatus(r.status()));
  *response = std::move(*r);
  record.plan_summary = response->plan_summary();
  record.server_seconds = response->server_seconds();
  record.worker_seconds = response->worker_seconds();
  record.bytes_out = static_cast<int64_t>(response->ByteSizeLong());
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::PutTensor(grpc::ServerContext* context,
                                         grpc::ServerReader<v1::TensorChunk>* reader,
                                         v1::PutTensorResponse* response) {
  RequestRecord record = Begin(RequestOp::kPutTensor, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return Finish(record, ToGrpcStatus(slot.status()));
  record.path = BytePath::kStream;
  grpc::Status status = ReceiveTensor(context, reader, response, &record);
  return Finish(record, std::move(status));
}

grpc::Status ShardGemmService::ReceiveTensor(grpc::ServerContext* context,
                                             grpc::ServerReader<v1::TensorChunk>* reader,
                                             v1::PutTensorResponse* response, RequestRecord* record) {
  v1::TensorChunk first;
  if (!reader->Read(&first)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "PutTensor got no chunks");
  }
  record->tensor = first.name();
  auto dtype = DTypeFromProto(first.dtype(), "dtype");
  if (!dtype.ok()) return ToGrpcStatus(dtype.status());
  std::vector<int64_t> shape(first.shape().begin(), first.shape().end());
  auto n = CheckedNumElements(shape, DTypeSize(*dtype), first.name());
  if (!n.ok()) return ToGrpcStatus(n.status());
  const int64_t expected = *n * DTypeSize(*dtype);
  // A shape no worker budget could hold is refused before anything is
  // allocated for it (a claimed size is not to be trusted).
  if (auto s = coordinator_->CheckTensorFits(first.name(), expected); !s.ok()) return ToGrpcStatus(s);
  auto too_few = [&](int64_t carried, bool or_more) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("data: tensor '", first.name(), "' of shape ", ShapeToString(shape), " ",
                                     DTypeName(*dtype), " needs ", expected, " bytes, the chunks carry ", carried,
                                     or_more ? " or more" : ""));
  };
  // Blocks that are ranges of the bytes go on to the workers as the chunks arrive.
  auto streamed = coordinator_->BeginStreamedPut(first.name(), *dtype, shape, first.spec(), first.overwrite(),
                                                 DeadlineOf(context), CallOf(*record, context));
  if (!streamed.ok()) return ToGrpcStatus(streamed.status());
  if (*streamed != nullptr) {
    Coordinator::StreamedPut& put = **streamed;
    auto forward = [&](const std::string& data) {
      const int64_t carried = put.received_bytes() + static_cast<int64_t>(data.size());
      if (carried > expected) return too_few(carried, true);
      grpc::Status appended = ToGrpcStatus(put.Append(data));
      record->bytes_in = put.received_bytes();
      return appended;
    };
    // A put that waited --step_timeout for the client's next chunk (or for a worker) cannot go on, and its
    // call would hold the name's claim and a slot for as long as its client stayed connected: ended then.
    put.OnStall([context] { context->TryCancel(); });
    if (grpc::Status s = forward(first.data()); !s.ok()) return s;
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) {
      if (grpc::Status s = forward(chunk.data()); !s.ok()) return s;
    }
    if (absl::Status stalled = put.Stalled(); !stalled.ok()) return ToGrpcStatus(stalled);
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat("the client ended the stream; tensor '",
                                                                    first.name(), "' was not kept"));
    }
    if (put.received_bytes() != expected) return too_few(put.received_bytes(), false);
    auto r = put.Finish();
    if (!r.ok()) return ToGrpcStatus(r.status());
    *response = *r;
    return grpc::Status::OK;
  }
  HostTensor tensor;
  tensor.dtype = *dtype;
  tensor.shape = shape;
  std::string* data = first.mutable_data();
  tensor.bytes.swap(*data);
  // One allocation for the whole tensor (not a doubling string growing chunk by chunk).
  try {
    if (expected > static_cast<int64_t>(tensor.bytes.size())) tensor.bytes.reserve(expected);
  } catch (const std::bad_alloc&) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("shape: tensor '", first.name(), "' needs ", expected,
                                     " bytes, more than the coordinator can hold now"));
  }
  v1::TensorChunk chunk;
  bool too_long = static_cast<int64_t>(tensor.bytes.size()) > expected;
  while (!too_long && reader->Read(&chunk)) {
    too_long = static_cast<int64_t>(tensor.bytes.size() + chunk.data().size()) > expected;
    if (!too_long) tensor.bytes += chunk.data();
  }
  record->bytes_in = static_cast<int64_t>(tensor.bytes.size());
  if (too_long || static_cast<int64_t>(tensor.bytes.size()) != expected) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("data: tensor '", first.name(), "' of shape ", ShapeToString(shape), " ",
                     DTypeName(*dtype), " needs ", expected, " bytes, the chunks carry ",
                     tensor.bytes.size(), " or more"));
  }
  auto r = coordinator_->PutTensor(first.name(), std::move(tensor), first.spec(), first.overwrite(),
                                   DeadlineOf(context), CallOf(*record, context));
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *r;
  return grpc::Status::OK;
}

grpc::Status ShardGemmService::GetTensor(grpc::ServerContext* context, const v1::GetTensorRequest* request,
                                         grpc::ServerWriter<v1::TensorChunk>* writer) {
  RequestRecord record = Begin(RequestOp::kGetTensor, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kRead); !a.ok()) {
    return Finish(record, std::move(a));
  }
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return Finish(record, ToGrpcStatus(slot.status()));
  record.path = BytePath::kStream;
  record.tensor = request->name();
  auto fetched = coordinator_->GetTensor(request->name(), DeadlineOf(context), CallOf(record));
  if (!fetched.ok()) return Finish(record, ToGrpcStatus(fetched.status()));
  const std::string& bytes = fetched->tensor.bytes;
  size_t offset = 0;
  do {
    v1::TensorChunk chunk;
    if (offset == 0) {
      chunk.set_name(fetched->info.name());
      chunk.set_dtype(fetched->info.dtype());
      *chunk.mutable_shape() = fetched->info.shape();
      chunk.set_spec(fetched->info.spec());
    }
    const size_t len = std::min<size_t>(kTensorChunkBytes, bytes.size() - offset);
    chunk.set_data(bytes.substr(offset, len));
    offset += len;
    if (!writer->Write(chunk)) {
      return Finish(record, grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
    }
    record.bytes_out += static_cast<int64_t>(len);
  } while (offset < bytes.size());
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::DeleteTensor(grpc::ServerContext* context,
                                            const v1::DeleteTensorRequest* request,
                                            v1::DeleteTensorResponse*) {
  RequestRecord record = Begin(RequestOp::kDeleteTensor, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  record.tensor = request->name();
  return Finish(record,
                ToGrpcStatus(coordinator_->DeleteTensor(request->name(), DeadlineOf(context), CallOf(record))));
}

grpc::Status ShardGemmService::ListTensors(grpc::ServerContext* context, const v1::ListTensorsRequest*,
                                           v1::ListTensorsResponse* response) {
  RequestRecord record = Begin(RequestOp::kListTensors, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kRead); !a.ok()) {
    return Finish(record, std::move(a));
  }
  *response = coordinator_->ListTensors(CallOf(record));
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::RegisterSharedMemory(grpc::ServerContext* context,
                                                    const v1::RegisterSharedMemoryRequest* request,
                                                    v1::RegisterSharedMemoryResponse* response) {
  RequestRecord record = Begin(RequestOp::kRegisterSharedMemory, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  record.tensor = request->name();
  auto registered = coordinator_->RegisterSharedMemory(*request, CallOf(record));
  if (!registered.ok()) return Finish(record, ToGrpcStatus(registered.status()));
  *response = *std::move(registered);
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::RenewSharedMemory(grpc::ServerContext* context,
                                                 const v1::RenewSharedMemoryRequest* request,
                                                 v1::RenewSharedMemoryResponse* response) {
  RequestRecord record = Begin(RequestOp::kRenewSharedMemory, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  auto renewed = coordinator_->RenewSharedMemory(*request, CallOf(record));
  if (!renewed.ok()) return Finish(record, ToGrpcStatus(renewed.status()));
  *response = *std::move(renewed);
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::UnregisterSharedMemory(grpc::ServerContext* context,
                                                      const v1::UnregisterSharedMemoryRequest* request,
                                                      v1::UnregisterSharedMemoryResponse*) {
  RequestRecord record = Begin(RequestOp::kUnregisterSharedMemory, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  record.tensor = request->name();
  return Finish(record, ToGrpcStatus(coordinator_->UnregisterSharedMemory(request->name(), CallOf(record))));
}

grpc::Status ShardGemmService::PlanStaging(grpc::ServerContext* context, const v1::StagingPlanRequest* request,
                                           v1::StagingPlan* plan) {
  RequestRecord record = Begin(RequestOp::kPlanStaging, context);
  // A put's plan is a put's first half: it needs write.
  const security::Grant needed = request->has_put() ? security::Grant::kWrite : security::Grant::kCompute;
  if (grpc::Status a = Authenticate(*context, &record, needed); !a.ok()) {
    return Finish(record, std::move(a));
  }
  record.bytes_in = static_cast<int64_t>(request->ByteSizeLong());
  auto r = coordinator_->PlanStaging(*request, DeadlineOf(context), CallOf(record, context));
  if (!r.ok()) return Finish(record, ToGrpcStatus(r.status()));
  *plan = std::move(*r);
  record.bytes_out = static_cast<int64_t>(plan->ByteSizeLong());
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::PutStaged(grpc::ServerContext* context, const v1::PutStagedRequest* request,
                                         v1::PutTensorResponse* response) {
  RequestRecord record = Begin(RequestOp::kPutStaged, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kWrite); !a.ok()) {
    return Finish(record, std::move(a));
  }
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return Finish(record, ToGrpcStatus(slot.status()));
  auto r = coordinator_->PutStaged(*request, DeadlineOf(context), CallOf(record, context));
  if (!r.ok()) return Finish(record, ToGrpcStatus(r.status()));
  *response = std::move(*r);
  record.tensor = response->name();
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::PlanFetch(grpc::ServerContext* context, const v1::GetTensorRequest* request,
                                         v1::TensorBlocks* blocks) {
  RequestRecord record = Begin(RequestOp::kPlanFetch, context);
  if (grpc::Status a = Authenticate(*context, &record, security::Grant::kRead); !a.ok()) {
    return Finish(record, std::move(a));
  }
  record.tensor = request->name();
  auto slot = TakeSlot(record.tenant);
  if (!slot.ok()) return Finish(record, ToGrpcStatus(slot.status()));
  auto r = coordinator_->PlanFetch(request->name(), DeadlineOf(context), CallOf(record, context));
  if (!r.ok()) return Finish(record, ToGrpcStatus(r.status()));
  *blocks = std::move(*r);
  return Finish(record, grpc::Status::OK);
}

grpc::Status ShardGemmService::ReleaseStaging(grpc::ServerContext* context, const v1::ReleaseStagingRequest* request,
                                              v1::ReleaseStagingResponse* response) {
  RequestRecord record = Begin(RequestOp::kReleaseStaging, context);
  // Releasing a plan needs the grant making it did: write for a put's, compute otherwise.
  std::optional<security::Principal> principal;
  if (tokens_ != nullptr) {
    auto p = tokens_->Authenticate(*context);
    if (!p.ok()) return Finish(record, ToGrpcStatus(p.status()));
    record.tenant = p->tenant;
    principal = *std::move(p);
  }
  auto is_put = coordinator_->StagingPlanIsPut(request->staging_id(), CallOf(record));
  if (!is_put.ok()) return Finish(record, ToGrpcStatus(is_put.status()));
  const security::Grant needed = *is_put ? security::Grant::kWrite : security::Grant::kCompute;
  if (principal.has_value() && !principal->Has(needed)) {
    return Finish(record, grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                       absl::StrCat("the token of tenant '", principal->tenant, "' is not granted ",
                                                    security::GrantName(needed), " (release_staging of a ",
                                                    *is_put ? "put's" : "request's", " transfer plan)")));
  }
  auto r = coordinator_->ReleaseStaging(request->staging_id(), DeadlineOf(context), CallOf(record, context));
  if (!r.ok()) return Finish(record, ToGrpcStatus(r.status()));
  *response = std::move(*r);
  return Finish(record, grpc::Status::OK);
}

grpc::Status CoordinationService::CheckCaller(const grpc::ServerContext& context) const {
  if (transport_ == nullptr || transport_->CallerIs(context, security::kWorkerName)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      "the Coordination service answers only mesh workers (a shardgemm-worker certificate)");
}

grpc::Status CoordinationService::Register(grpc::ServerContext* context,
                                           const v1::RegisterRequest* request,
                                           v1::RegisterResponse* response) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  auto r = coordinator_->Register(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status CoordinationService::StoreSet(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                                           v1::StoreSetResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  return ToGrpcStatus(store_->Set(request->key(), request->value(), request->epoch()));
}

grpc::Status CoordinationService::StoreGet(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                                           v1::StoreGetResponse* response) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  const int64_t ms = request->timeout_ms() > 0 ? std::min<int64_t>(request->timeout_ms(), 600000) : 30000;
  auto values = store_->Get(std::vector<std::string>(request->keys().begin(), request->keys().end()),
                            absl::Milliseconds(ms), request->epoch());
  if (!values.ok()) return ToGrpcStatus(values.status());
  for (auto& v : *values) response->add_values(std::move(v));
  return grpc::Status::OK;
}

grpc::Status CoordinationService::StoreDelete(grpc::ServerContext* context, const v1::StoreDeleteRequest* request,
                                              v1::StoreDeleteResponse*) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  store_->Erase(std::vector<std::string>(request->keys().begin(), request->keys().end()));
  return grpc::Status::OK;
}

grpc::Status CoordinationService::Session(grpc::ServerContext* context, const v1::SessionRequest*,
                                          v1::SessionResponse* response) {
  if (grpc::Status s = CheckCaller(*context); !s.ok()) return s;
  response->set_session(coordinator_->session());
  return grpc::Status::OK;
}

}  // namespace shardgemm
