#include "client/client.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/field_mask.pb.h"
#include "google/protobuf/util/field_mask_util.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "platform/huge_pages.h"
#include "proto/chunk_wire.h"
#include "proto/tensor_codec.h"
#include "proto/transport.h"
#include "proto/grpc_status.h"

namespace shardgemm {
namespace {
constexpr size_t kChunkBytes = kTensorChunkBytes;
constexpr char kStageMethod[] = "/shardgemm.v1.Staging/Stage";
constexpr char kFetchMethod[] = "/shardgemm.v1.Staging/Fetch";
// How long a staged block's bytes may stay lent to gRPC after its call
// ended: only a connection whose writes are stuck holds them that long.
constexpr absl::Duration kLentBytesTimeout = absl::Seconds(30);

// One raw call on a generic stub, client-streaming or server-streaming
// alike: writes each message `next` gives until it returns false, then
// half-closes; hands each message the server answers to `on_message`
// (false: the call is cancelled). The context's deadline bounds the wait.
class RawCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Next = std::function<bool(grpc::ByteBuffer*)>;
  using OnMessage = std::function<bool(const grpc::ByteBuffer&)>;

  static grpc::Status Run(grpc::GenericStub* stub, grpc::ClientContext* ctx, const char* method, Next next,
                          OnMessage on_message) {
    RawCall call(ctx, std::move(next), std::move(on_message));
    stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), &call);
    call.StartRead(&call.in_);
    call.WriteNext();
    call.StartCall();
    call.done_.WaitForNotification();
    return call.status_;
  }

  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();  // else the server ended the call: OnDone says why
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (!on_message_(in_)) {
      ctx_->TryCancel();
      return;
    }
    in_.Clear();
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    out_.Clear();
    done_.Notify();
  }

 private:
  RawCall(grpc::ClientContext* ctx, Next next, OnMessage on_message)
      : ctx_(ctx), next_(std::move(next)), on_message_(std::move(on_message)) {}
  void WriteNext() {
    if (next_(&out_)) {
      StartWrite(&out_);
    } else {
      out_.Clear();
      StartWritesDone();
    }
  }
  grpc::ClientContext* const ctx_;
  Next next_;
  OnMessage on_message_;
  grpc::ByteBuffer out_, in_;
  grpc::Status status_;
  absl::Notification done_;
};
}  // namespace

ShardGemmClient::ShardGemmClient(const std::string& address, ClientCredentials credentials, int max_message_bytes)
    : worker_credentials_(std::move(credentials.workers)),
      token_(std::move(credentials.token)),
      max_message_bytes_(max_message_bytes) {
  grpc::ChannelArguments args = TensorChannelArguments(max_message_bytes);
  stub_ = v1::ShardGemm::NewStub(grpc::CreateCustomChannel(address, std::move(credentials.coordinator), args));
}

namespace {
absl::Status NoWorkerCredentials(const std::string& address) {
  return absl::FailedPreconditionError(
      absl::StrCat("the direct path: no credentials for the workers' staging ports (", address,
                   "): a client of the coordinator's Unix socket needs --tls_dir for them, or --insecure"));
}
}  // namespace

grpc::GenericStub* ShardGemmClient::StagingStub(const std::string& address) {
  if (worker_credentials_ == nullptr) return nullptr;
  absl::MutexLock lock(&staging_mu_);
  std::unique_ptr<grpc::GenericStub>& stub = staging_[address];
  if (stub == nullptr) {
    grpc::ChannelArguments args = TensorChannelArguments(max_message_bytes_);
    stub = std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(address, worker_credentials_, args));
  }
  return stub.get();
}

namespace {

// The block a plan names lies inside its tensor (the plan is the coordinator's; checked all the same).
absl::Status CheckBlock(const std::vector<int64_t>& shape, const google::protobuf::RepeatedField<int64_t>& offsets,
                        const google::protobuf::RepeatedField<int64_t>& block, absl::string_view what) {
  bool inside = offsets.size() == static_cast<int>(shape.size()) && block.size() == offsets.size();
  for (int d = 0; inside && d < offsets.size(); ++d) {
    inside = offsets[d] >= 0 && block[d] >= 0 && offsets[d] + block[d] <= shape[d];
  }
  if (inside) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the coordinator named a ", what, " block outside its tensor of shape ",
                                          ShapeToString(shape)));
}

// Where a block lies in its row-major tensor's bytes when it is one range of
// them (it splits at most one dimension, and every dimension before that one
// is 1 in the block): its first byte; -1 when the block is strided.
int64_t ContiguousStart(const std::vector<int64_t>& shape, const google::protobuf::RepeatedField<int64_t>& offsets,
                        const google::protobuf::RepeatedField<int64_t>& block, int64_t element_bytes) {
  const int rank = static_cast<int>(shape.size());
  int split = -1;  // the last dimension the block does not cover whole
  for (int d = 0; d < rank; ++d) {
    if (block[d] != shape[d]) split = d;
  }
  for (int d = 0; d < split; ++d) {
    if (block[d] != 1) return -1;
  }
  int64_t start = 0;
  for (int d = 0; d < rank; ++d) start = start * shape[d] + offsets[d];
  return start * element_bytes;
}

// The bytes of block [offsets, offsets + sizes) of `array` (the plan's block, checked inside it),
// one innermost run at a time.
std::string SliceOf(const ShardGemmClient::ArrayView& array, const google::protobuf::RepeatedField<int64_t>& offsets,
                    const google::protobuf::RepeatedField<int64_t>& sizes) {
  const int rank = static_cast<int>(array.shape.size());
  const int64_t element_bytes = DTypeSize(array.dtype);
  int64_t bytes = element_bytes;
  for (int64_t d : sizes) bytes *= d;
  std::string out;
  out.reserve(static_cast<size_t>(bytes));
  if (bytes == 0) return out;
  if (rank == 0) return std::string(array.bytes.substr(0, static_cast<size_t>(element_bytes)));
  std::vector<int64_t> stride(rank, 1);
  for (int d = rank - 2; d >= 0; --d) stride[d] = stride[d + 1] * array.shape[d + 1];
  const size_t run = static_cast<size_t>(sizes[rank - 1] * element_bytes);
  std::vector<int64_t> idx(rank, 0);  // over every dimension but the innermost
  while (true) {
    int64_t at = offsets[rank - 1];
    for (int d = 0; d < rank - 1; ++d) at += (offsets[d] + idx[d]) * stride[d];
    out.append(array.bytes.data() + at * element_bytes, run);
    int d = rank - 2;
    for (; d >= 0; --d) {
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return out;
  }
}

// Runs f(i) for i in [0, n) on threads of their own; the first error.
absl::Status InParallel(int n, const std::function<absl::Status(int)>& f) {
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { status[i] = f(i); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

ShardGemmClient::ArrayView ShardGemmClient::ArrayViewOf(const HostTensor& t) { return {t.dtype, t.shape, t.bytes}; }

absl::StatusOr<ShardGemmClient::ArrayView> ShardGemmClient::ArrayViewOf(const v1::Tensor& t, absl::string_view field) {
  auto dtype = DTypeFromProto(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  ArrayView view{*dtype, std::vector<int64_t>(t.shape().begin(), t.shape().end()), t.data()};
  auto n = CheckedNumElements(view.shape, DTypeSize(view.dtype), field);
  if (!n.ok()) return n.status();
  if (static_cast<int64_t>(view.bytes.size()) != *n * DTypeSize(view.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data has ", view.bytes.size(), " bytes but shape ",
                                                   ShapeToString(view.shape), " of ", DTypeName(view.dtype),
                                                   " needs ", *n * DTypeSize(view.dtype)));
  }
  return view;
}

namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Time deadline) { ctx->set_deadline(absl::ToChronoTime(deadline)); }

}  // namespace

absl::StatusOr<v1::StagingPlan> ShardGemmClient::PlanTransfer(const v1::StagingPlanRequest& request,
                                                              absl::Time deadline, std::string* request_id) {
  v1::StagingPlan plan;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  SetDeadline(&ctx, deadline);
  grpc::Status s = stub_->PlanStaging(&ctx, request, &plan);
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  // The request's later calls share the plan's id.
  *request_id = request_id_.empty() ? last_request_id_ : request_id_;
  return plan;
}

absl::Status ShardGemmClient::StageAll(const v1::StagingPlan& plan, const std::map<v1::TensorRole, ArrayView>& arrays,
                                       const std::string& request_id, absl::Time deadline) {
  // Each distinct block's bytes: a range of its tensor when it is one (sent from there), else sliced once.
  std::vector<absl::string_view> blocks;
  std::vector<std::unique_ptr<std::string>> sliced;
  std::vector<std::pair<size_t, const v1::StagingDestination*>> sends;  // (block index, destination)
  for (const v1::StagedOperand& op : plan.operands()) {
    auto it = arrays.find(op.role());
    if (it == arrays.end()) return absl::InternalError("the transfer plan names an operand this client did not stage");
    const ArrayView& array = it->second;
    for (const v1::StagedBlock& b : op.blocks()) {
      if (auto s = CheckBlock(array.shape, b.offsets(), b.shape(), v1::TensorRole_Name(op.role())); !s.ok()) {
        return s;
      }
      int64_t bytes = DTypeSize(array.dtype);
      for (int64_t d : b.shape()) bytes *= d;
      const int64_t start = ContiguousStart(array.shape, b.offsets(), b.shape(), DTypeSize(array.dtype));
      if (start >= 0) {
        blocks.push_back(array.bytes.substr(static_cast<size_t>(start), static_cast<size_t>(bytes)));
      } else {
        sliced.push_back(std::make_unique<std::string>(SliceOf(array, b.offsets(), b.shape())));
        blocks.push_back(*sliced.back());
      }
      for (const v1::StagingDestination& d : b.destinations()) sends.emplace_back(blocks.size() - 1, &d);
    }
  }
  return InParallel(static_cast<int>(sends.size()), [&](int i) -> absl::Status {
    const absl::string_view block = blocks[sends[i].first];
    const v1::StagingDestination& d = *sends[i].second;
    grpc::GenericStub* stub = StagingStub(d.address());
    if (stub == nullptr) return NoWorkerCredentials(d.address());
    grpc::ClientContext ctx;
    if (!request_id.empty()) ctx.AddMetadata("x-request-id", request_id);
    SetDeadline(&ctx, deadline);
    // Each message's data borrows the block's bytes; gRPC may hold them a
    // moment past the call's end (a write still on the socket), so the
    // caller's bytes are handed back only once it has let go of them all.
    auto released = std::make_shared<absl::Notification>();
    grpc::Status s;
    {
      std::shared_ptr<const void> lent(block.data(), [released](const void*) { released->Notify(); });
      size_t offset = 0;
      bool first = true;
      s = RawCall::Run(
          stub, &ctx, kStageMethod,
          [&](grpc::ByteBuffer* message) {
            if (!first && offset >= block.size()) return false;
            const size_t n = std::min(kChunkBytes, block.size() - offset);
            *message = EncodeStageChunk(first ? absl::string_view(d.ticket()) : absl::string_view(),
                                        block.substr(offset, n), lent);
            offset += n;
            first = false;
            return true;
          },
          [](const grpc::ByteBuffer&) { return true; });  // the StageResponse: its byte count is the block's
    }
    if (!released->WaitForNotificationWithTimeout(kLentBytesTimeout)) {
      return absl::UnavailableError(absl::StrCat("staging at worker rank ", d.rank(), " (", d.address(),
                                                 "): the connection still held the block's bytes ",
                                                 absl::FormatDuration(kLentBytesTimeout), " after the call"));
    }
    if (!s.ok()) {
      return absl::Status(FromGrpcStatus(s).code(),
                          absl::StrCat("staging at worker rank ", d.rank(), " (", d.address(), "): ", s.error_message()));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<HostTensor> ShardGemmClient::FetchAll(v1::DType dtype_proto, const std::vector<int64_t>& shape,
                                                     const google::protobuf::RepeatedPtrField<v1::StagedBlock>& blocks,
                                                     const std::string& request_id, absl::Time deadline) {
  auto dtype = DTypeFromProto(dtype_proto, "dtype");
  if (!dtype.ok()) return dtype.status();
  const int64_t element_bytes = DTypeSize(*dtype);
  for (const v1::StagedBlock& b : blocks) {
    if (auto s = CheckBlock(shape, b.offsets(), b.shape(), "fetched"); !s.ok()) return s;
  }
  // One block that is the whole tensor (a get from one holder) is received as the output itself;
  // otherwise each block that is one range of the output's bytes is written there as it arrives, and a
  // strided one is received whole and then inserted.
  bool whole = blocks.size() == 1;
  for (int d = 0; whole && d < blocks[0].shape_size(); ++d) whole = blocks[0].shape(d) == shape[d];
  absl::StatusOr<HostTensor> out;
  if (whole) {
    auto n = CheckedNumElements(shape, element_bytes, "fetched");
    if (!n.ok()) return n.status();
    out = HostTensor();
    out->dtype = *dtype;
    out->shape = shape;
    out->bytes.reserve(static_cast<size_t>(*n * element_bytes));
    platform::AdviseHugePages(out->bytes.data(), out->bytes.capacity());
  } else {
    auto n = CheckedNumElements(shape, element_bytes, "fetched");
    if (!n.ok()) return n.status();
    out = HostTensor();
    out->dtype = *dtype;
    out->shape = shape;
    // Advised before resize() zero-fills it (the blocks then cover every byte).
    out->bytes.reserve(static_cast<size_t>(*n * element_bytes));
    platform::AdviseHugePages(out->bytes.data(), out->bytes.capacity());
    out->bytes.resize(static_cast<size_t>(*n * element_bytes));
  }
  char* const out_bytes = out->bytes.data();  // not reallocated while the blocks arrive
  absl::Mutex out_mu;
  absl::Status fetched = InParallel(blocks.size(), [&](int i) -> absl::Status {
    const v1::StagedBlock& b = blocks[i];
    if (b.destinations_size() == 0) return absl::InternalError("a block with no worker holding it");
    const v1::StagingDestination& d = b.destinations(0);
    int64_t block_bytes = element_bytes;
    for (int64_t n : b.shape()) block_bytes *= n;
    const int64_t start = whole ? -1 : ContiguousStart(shape, b.offsets(), b.shape(), element_bytes);
    HostTensor block;  // a strided block's bytes, or (whole) the output's
    if (start < 0 && !whole) {
      block.dtype = *dtype;
      block.shape.assign(b.shape().begin(), b.shape().end());
      block.bytes.reserve(static_cast<size_t>(block_bytes));
      platform::AdviseHugePages(block.bytes.data(), block.bytes.capacity());
    }
    std::string& received = whole ? out->bytes : block.bytes;
    grpc::GenericStub* stub = StagingStub(d.address());
    if (stub == nullptr) return NoWorkerCredentials(d.address());
    grpc::ClientContext ctx;
    if (!request_id.empty()) ctx.AddMetadata("x-request-id", request_id);
    SetDeadline(&ctx, deadline);
    v1::FetchRequest fetch;
    fetch.set_ticket(d.ticket());
    int64_t got = 0;
    bool overflow = false;
    absl::Status malformed;
    bool asked = false;
    DecodedChunk chunk;
    // Each chunk's bytes are copied once, from gRPC's slices to where they go.
    grpc::Status s = RawCall::Run(
        stub, &ctx, kFetchMethod,
        [&](grpc::ByteBuffer* message) {
          if (asked) return false;
          asked = true;
          grpc::Slice slice(fetch.SerializeAsString());
          *message = grpc::ByteBuffer(&slice, 1);
          return true;
        },
        [&](const grpc::ByteBuffer& message) {
          if (malformed = DecodeFetchChunk(message, &chunk); !malformed.ok()) return false;
          const int64_t n = static_cast<int64_t>(chunk.data_size());
          if (got + n > block_bytes) {
            overflow = true;
            return false;  // the call is cancelled: it ends at once
          }
          if (start >= 0) {
            chunk.CopyDataTo(out_bytes + start + got);
          } else {
            for (absl::string_view piece : chunk.data()) received.append(piece.data(), piece.size());
          }
          got += n;
          chunk.Clear();
          return true;
        });
    if (overflow) return absl::DataLossError(absl::StrCat("block ", i, " came with more than its ", block_bytes, " bytes"));
    if (!malformed.ok()) {
      return absl::DataLossError(absl::StrCat("fetching from worker rank ", d.rank(), " (", d.address(),
                                              "): ", malformed.message()));
    }
    if (!s.ok()) {
      return absl::Status(FromGrpcStatus(s).code(),
                          absl::StrCat("fetching from worker rank ", d.rank(), " (", d.address(), "): ",
                                       s.error_message()));
    }
    if (got != block_bytes) {
      return absl::DataLossError(absl::StrCat("block ", i, " came with ", got, " bytes"));
    }
    if (start < 0 && !whole) {
      absl::MutexLock lock(&out_mu);
      InsertBlock(block, std::vector<int64_t>(b.offsets().begin(), b.offsets().end()), &*out);
    }
    return absl::OkStatus();
  });
  if (!fetched.ok()) return fetched;
  return out;
}

void ShardGemmClient::Release(const std::string& staging_id, const std::string& request_id) {
  grpc::ClientContext ctx;
  if (!request_id.empty()) ctx.AddMetadata("x-request-id", request_id);
  SetDeadline(&ctx, absl::Now() + kReleaseTimeout);
  v1::ReleaseStagingRequest request;
  request.set_staging_id(staging_id);
  v1::ReleaseStagingResponse response;
  (void)stub_->ReleaseStaging(&ctx, request, &response);  // the caller reports the error that ended the call
}

absl::StatusOr<v1::GroupedGemmResponse> ShardGemmClient::GroupedGemmDirect(const v1::GroupedGemmRequest& request) {
  const absl::Time deadline = absl::Now() + timeout_;
  const bool keep = !request.keep_output_as().empty();
  // The operands whose bytes this client holds are staged from the request's bytes (not copied); the
  // request sent on carries everything else, their headers included.
  const std::pair<v1::TensorRole, const char*> fields[] = {{v1::TENSOR_LHS, "lhs"},
                                                           {v1::TENSOR_RHS, "rhs"},
                                                           {v1::TENSOR_BIAS, "bias"},
                                                           {v1::TENSOR_LHS_SCALE_INV, "lhs_scale_inv"},
                                                           {v1::TENSOR_RHS_SCALE_INV, "rhs_scale_inv"}};
  const google::protobuf::Descriptor* descriptor = v1::GroupedGemmRequest::descriptor();
  const google::protobuf::Reflection* reflection = request.GetReflection();
  std::map<v1::TensorRole, ArrayView> arrays;
  std::set<std::string> staged_fields;
  for (const auto& [role, name] : fields) {
    const google::protobuf::FieldDescriptor* f = descriptor->FindFieldByName(name);
    if (f == nullptr || !reflection->HasField(request, f)) continue;
    const auto& t = static_cast<const v1::Tensor&>(reflection->GetMessage(request, f));
    if (t.source_case() != v1::Tensor::kData) continue;
    auto view = ArrayViewOf(t, v1::TensorRole_Name(role));
    if (!view.ok()) return view.status();
    arrays[role] = *std::move(view);
    staged_fields.insert(name);
  }
  google::protobuf::FieldMask mask;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = descriptor->field(i);
    if (staged_fields.count(f->name()) == 0) {
      mask.add_paths(f->name());
      continue;
    }
    const google::protobuf::Descriptor* tensor = v1::Tensor::descriptor();
    for (int j = 0; j < tensor->field_count(); ++j) {
      if (tensor->field(j)->name() != "data") mask.add_paths(absl::StrCat(f->name(), ".", tensor->field(j)->name()));
    }
  }
  v1::GroupedGemmRequest planned;
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(request, mask,
                                                        google::protobuf::util::FieldMaskUtil::MergeOptions(), &planned);
  if (arrays.empty() && keep) {
    return absl::InvalidArgumentError(
        "direct path: the request has no inline operand to stage and keeps its output (keep_output_as): "
        "nothing would go direct");
  }
  // With nothing to stage there is no transfer plan: only the output is
  // held on the workers for the fetch below.
  std::string request_id = request_id_;
  v1::StagingPlan plan;
  if (!arrays.empty()) {
    v1::StagingPlanRequest plan_request;
    *plan_request.mutable_grouped_gemm() = planned;
    auto planned_transfer = PlanTransfer(plan_request, deadline, &request_id);
    if (!planned_transfer.ok()) return planned_transfer.status();
    plan = *std::move(planned_transfer);
    if (absl::Status s = StageAll(plan, arrays, request_id, deadline); !s.ok()) {
      Release(plan.staging_id(), request_id);
      return s;
    }
  }

  v1::GroupedGemmRequest submitted = std::move(planned);
  for (const auto& [role, name] : fields) {
    if (arrays.count(role) == 0) continue;
    auto* t = static_cast<v1::Tensor*>(
        submitted.GetReflection()->MutableMessage(&submitted, descriptor->FindFieldByName(name)));
    t->set_staged(plan.staging_id());
  }
  submitted.set_direct_output(!keep);
  v1::GroupedGemmResponse response;
  {
    grpc::ClientContext ctx;
    if (!request_id.empty()) ctx.AddMetadata("x-request-id", request_id);
    SetDeadline(&ctx, deadline);
    grpc::Status s = stub_->GroupedGemm(&ctx, submitted, &response);
    NoteRequestId(ctx);
    if (!s.ok()) {
      // Refused before its steps, the plan would wait for its TTL.
      if (!plan.staging_id().empty()) Release(plan.staging_id(), request_id);
      return FromGrpcStatus(s);
    }
  }
  if (keep) return response;
  if (request_id.empty()) request_id = last_request_id_;  // nothing staged: the submit named the request
  const std::vector<int64_t> shape(response.out().shape().begin(), response.out().shape().end());
  auto out = FetchAll(response.out().dtype(), shape, response.out_blocks(), request_id, deadline);
  if (!out.ok()) return out.status();
  const std::string spec = response.out().spec();
  HostTensorToProto(std::move(*out), response.mutable_out());
  response.mutable_out()->set_spec(spec);
  response.clear_out_blocks();
  return response;
}

absl::StatusOr<v1::PutTensorResponse> ShardGemmClient::PutTensorDirect(const std::string& name,
                                                                       const HostTensor& tensor,
                                                                       const std::string& spec, bool overwrite) {
  const absl::Time deadline = absl::Now() + timeout_;
  v1::StagingPlanRequest plan_request;
  v1::PutStagingRequest* put = plan_request.mutable_put();
  put->set_name(name);
  put->set_dtype(DTypeToProto(tensor.dtype));
  put->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  put->set_spec(spec);
  put->set_overwrite(overwrite);
  std::string request_id;
  auto plan = PlanTransfer(plan_request, deadline, &request_id);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = StageAll(*plan, {{v1::TENSOR_ROLE_UNSPECIFIED, ArrayViewOf(tensor)}}, request_id, deadline); !s.ok()) {
    Release(plan->staging_id(), request_id);
    return s;
  }
  grpc::ClientContext ctx;
  if (!request_id.empty()) ctx.AddMetadata("x-request-id", request_id);
  SetDeadline(&ctx, deadline);
  v1::PutStagedRequest request;
  request.set_staging_id(plan->staging_id());
  v1::PutTensorResponse response;
  grpc::Status s = stub_->PutStaged(&ctx, request, &response);
  NoteRequestId(ctx);
  if (!s.ok()) {
    Release(plan->staging_id(), request_id);  // a put refused for its name leaves its plan for a retry this client won't make
    return FromGrpcStatus(s);
  }
  return response;
}

absl::StatusOr<HostTensor> ShardGemmClient::GetTensorDirect(const std::string& name) {
  const absl::Time deadline = absl::Now() + timeout_;
  v1::TensorBlocks blocks;
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    SetDeadline(&ctx, deadline);
    v1::GetTensorRequest request;
    request.set_name(name);
    grpc::Status s = stub_->PlanFetch(&ctx, request, &blocks);
    NoteRequestId(ctx);
    if (!s.ok()) return FromGrpcStatus(s);
  }
  const std::string request_id = request_id_.empty() ? last_request_id_ : request_id_;
  const std::vector<int64_t> shape(blocks.shape().begin(), blocks.shape().end());
  return FetchAll(blocks.dtype(), shape, blocks.blocks(), request_id, deadline);
}

void ShardGemmClient::Prepare(grpc::ClientContext* ctx) const {
  if (!request_id_.empty()) ctx->AddMetadata("x-request-id", request_id_);
}

void ShardGemmClient::NoteRequestId(const grpc::ClientContext& ctx) {
  const auto& metadata = ctx.GetServerInitialMetadata();
  auto it = metadata.find("x-request-id");
  if (it != metadata.end()) last_request_id_.assign(it->second.data(), it->second.size());
}

absl::StatusOr<v1::ClusterInfo> ShardGemmClient::WaitUntilReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("coordinator did not answer");
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ctx.set_wait_for_ready(true);
    v1::ClusterInfo info;
    grpc::Status s = stub_->GetClusterInfo(&ctx, v1::ClusterInfoRequest(), &info);
    if (s.ok() && info.ready()) return info;
    last = s.ok() ? absl::UnavailableError(absl::StrCat(info.workers_size(), " of ",
                                                        info.workers_expected(),
                                                        " workers registered"))
                  : FromGrpcStatus(s);
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::Status(last.code(), absl::StrCat("cluster not ready: ", last.message()));
}

absl::StatusOr<v1::ClusterInfo> ShardGemmClient::ClusterInfo() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ClusterInfo info;
  grpc::Status s = stub_->GetClusterInfo(&ctx, v1::ClusterInfoRequest(), &info);
  if (!s.ok()) return FromGrpcStatus(s);
  return info;
}

absl::StatusOr<v1::Plan> ShardGemmClient::Plan(const v1::PlanRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::PlanResponse response;
  grpc::Status s = stub_->Plan(&ctx, request, &response);
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.plan();
}

void ShardGemmClient::UseCallSocket(const std::string& path) {
  call_socket_ = std::make_unique<CallSocket>(path, absl::StrCat("the coordinator's call socket at ", path),
                                              "call socket", /*name_peer_in_replies=*/false, FrameReader::kCallers);
}

std::optional<absl::StatusOr<v1::CallSocketReply>> ShardGemmClient::CallOnSocket(
    const google::protobuf::Message& call, v1::CallSocketRequest* frame, absl::Time deadline) {
  // The frame's own fields and protobuf's tags fit in this much.
  constexpr size_t kFrameFieldsBytes = 4096;
  if (call_socket_ == nullptr || call.ByteSizeLong() + kFrameFieldsBytes > static_cast<size_t>(max_message_bytes_)) {
    return std::nullopt;
  }
  frame->set_token(token_);
  frame->set_request_id(request_id_);
  frame->set_deadline_unix_us(absl::ToUnixMicros(deadline));
  // The caller reads its own answer (FrameReader::kCallers): the reply
  // wakes this thread, not a reader that would then wake it.
  std::optional<absl::StatusOr<v1::CallSocketReply>> answer = call_socket_->Call(*frame, deadline);
  if (!answer.has_value()) return std::nullopt;  // not sent: gRPC
  if (answer->ok()) {
    last_request_id_ = (*answer)->request_id();
    return std::move(answer);
  }
  const absl::Status& failed = answer->status();
  if (FrameCallNotRun(failed)) return std::nullopt;  // refused before it was read: gRPC
  if (auto sent_back = failed.GetPayload(kFrameReplyUrl); sent_back.has_value()) {
    v1::CallSocketReply reply;
    if (reply.ParseFromString(std::string(*sent_back))) last_request_id_ = reply.request_id();
  }
  return absl::StatusOr<v1::CallSocketReply>(absl::Status(failed.code(), failed.message()));  // without the payloads
}

absl::StatusOr<v1::GroupedGemmResponse> ShardGemmClient::GroupedGemm(
    const v1::GroupedGemmRequest& request) {
  const absl::Time deadline = absl::Now() + timeout_;
  {
    v1::CallSocketRequest frame;
    // Borrowed for the write, not copied: Send serializes it before returning.
    frame.unsafe_arena_set_allocated_grouped_gemm(const_cast<v1::GroupedGemmRequest*>(&request));
    auto answered = CallOnSocket(request, &frame, deadline);
    frame.unsafe_arena_release_grouped_gemm();
    if (answered.has_value()) {
      if (!answered->ok()) return answered->status();
      return std::move(*(*answered)->mutable_grouped_gemm());
    }
  }
  grpc::ClientContext ctx;
  Prepare(&ctx);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::GroupedGemmResponse response;
  grpc::Status s = stub_->GroupedGemm(&ctx, request, &response);
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::GroupedQuantizeResponse> ShardGemmClient::GroupedQuantize(
    const v1::GroupedQuantizeRequest& request) {
  const absl::Time deadline = absl::Now() + timeout_;
  {
    v1::CallSocketRequest frame;
    frame.unsafe_arena_set_allocated_grouped_quantize(const_cast<v1::GroupedQuantizeRequest*>(&request));
    auto answered = CallOnSocket(request, &frame, deadline);
    frame.unsafe_arena_release_grouped_quantize();
    if (answered.has_value()) {
      if (!answered->ok()) return answered->status();
      return std::move(*(*answered)->mutable_grouped_quantize());
    }
  }
  grpc::ClientContext ctx;
  Prepare(&ctx);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::GroupedQuantizeResponse response;
  grpc::Status s = stub_->GroupedQuantize(&ctx, request, &response);
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::PutTensorResponse> ShardGemmClient::PutTensor(const std::string& name,
                                                                 const HostTensor& tensor,
                                                                 const std::string& spec,
                                                                 bool overwrite) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::PutTensorResponse response;
  auto writer = stub_->PutTensor(&ctx, &response);
  size_t offset = 0;
  do {
    v1::TensorChunk chunk;
    if (offset == 0) {
      chunk.set_name(name);
      chunk.set_dtype(DTypeToProto(tensor.dtype));
      chunk.mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
      chunk.set_spec(spec);
      chunk.set_overwrite(overwrite);
    }
    const size_t len = std::min(kChunkBytes, tensor.bytes.size() - offset);
    chunk.set_data(tensor.bytes.substr(offset, len));
    offset += len;
    if (!writer->Write(chunk)) break;
  } while (offset < tensor.bytes.size());
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<HostTensor> ShardGemmClient::GetTensor(const std::string& name) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::GetTensorRequest request;
  request.set_name(name);
  auto reader = stub_->GetTensor(&ctx, request);
  HostTensor t;
  v1::TensorChunk chunk;
  bool first = true;
  while (reader->Read(&chunk)) {
    if (first) {
      t.dtype = static_cast<DType>(static_cast<int>(chunk.dtype()));
      t.shape.assign(chunk.shape().begin(), chunk.shape().end());
      auto n = CheckedNumElements(t.shape, DTypeSize(t.dtype), name);
      if (n.ok()) t.bytes.reserve(*n * DTypeSize(t.dtype));
      first = false;
    }
    t.bytes += chunk.data();
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  if (t.NumBytes() != t.NumElements() * DTypeSize(t.dtype)) {
    return absl::DataLossError(absl::StrCat("tensor '", name, "' arrived incomplete"));
  }
  return t;
}

absl::Status ShardGemmClient::DeleteTensor(const std::string& name) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::DeleteTensorRequest request;
  request.set_name(name);
  v1::DeleteTensorResponse response;
  grpc::Status s = stub_->DeleteTensor(&ctx, request, &response);
  NoteRequestId(ctx);
  return FromGrpcStatus(s);
}

absl::Status ShardGemmClient::RegisterSharedMemory(const std::string& name, const std::string& key,
                                                   uint64_t byte_size) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  grpc::Status s = stub_->RegisterSharedMemory(&ctx, request, &response);
  NoteRequestId(ctx);
  return FromGrpcStatus(s);
}

absl::Status ShardGemmClient::RegisterCudaMemory(const std::string& name, const std::string& ipc_handle,
                                                 uint64_t byte_size) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.mutable_cuda()->set_ipc_handle(ipc_handle);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  grpc::Status s = stub_->RegisterSharedMemory(&ctx, request, &response);
  NoteRequestId(ctx);
  return FromGrpcStatus(s);
}

absl::Status ShardGemmClient::UnregisterSharedMemory(const std::string& name) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSharedMemoryResponse response;
  grpc::Status s = stub_->UnregisterSharedMemory(&ctx, request, &response);
  NoteRequestId(ctx);
  return FromGrpcStatus(s);
}

absl::StatusOr<v1::ListTensorsResponse> ShardGemmClient::ListTensors() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ListTensorsResponse response;
  grpc::Status s = stub_->ListTensors(&ctx, v1::ListTensorsRequest(), &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

}  // namespace shardgemm
