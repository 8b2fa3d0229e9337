#include "client/client.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/tensor_codec.h"
#include "proto/transport.h"
#include "proto/grpc_status.h"

namespace shardgemm {
namespace {
constexpr size_t kChunkBytes = kTensorChunkBytes;
}  // namespace

ShardGemmClient::ShardGemmClient(const std::string& address,
                                 std::shared_ptr<grpc::ChannelCredentials> credentials, int max_message_bytes) {
  grpc::ChannelArguments args = TensorChannelArguments(max_message_bytes);
  stub_ = v1::ShardGemm::NewStub(grpc::CreateCustomChannel(address, std::move(credentials), args));
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

absl::StatusOr<v1::GroupedGemmResponse> ShardGemmClient::GroupedGemm(
    const v1::GroupedGemmRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::GroupedGemmResponse response;
  grpc::Status s = stub_->GroupedGemm(&ctx, request, &response);
  NoteRequestId(ctx);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::GroupedQuantizeResponse> ShardGemmClient::GroupedQuantize(
    const v1::GroupedQuantizeRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
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
