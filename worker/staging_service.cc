#include "worker/staging_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace shardgemm {

void StagingServiceImpl::ConfigureServer(grpc::ServerBuilder* builder) {
  ConfigureTensorServer(builder, kMaxStreamMessageBytes);
}

absl::StatusOr<std::string> StagingServiceImpl::TenantOf(const grpc::ServerContext& context) {
  if (tokens_ == nullptr) return std::string();
  auto principal = tokens_->Authenticate(context);
  if (!principal.ok()) return principal.status();
  if (!principal->Has(security::Grant::kCompute)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token of tenant '", principal->tenant, "' is not granted compute (staging)"));
  }
  return principal->tenant;
}

grpc::Status StagingServiceImpl::Stage(grpc::ServerContext* context, grpc::ServerReader<v1::StageChunk>* reader,
                                       v1::StageResponse* response) {
  auto tenant = TenantOf(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  v1::StageChunk chunk;
  if (!reader->Read(&chunk)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ticket: the stream ended before its first message");
  }
  if (chunk.ticket().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ticket: the first message carries no ticket");
  }
  const std::string ticket = chunk.ticket();
  auto upload = area_->BeginStage(ticket, *tenant, [context] { context->TryCancel(); });
  if (!upload.ok()) return ToGrpcStatus(upload.status());
  // Destroyed on every early return: a stream that does not finish holds nothing.
  do {
    if (!chunk.ticket().empty() && chunk.ticket() != ticket) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ticket: a stream stages one ticket's block");
    }
    if (auto s = (*upload)->Append(chunk.data()); !s.ok()) return ToGrpcStatus(s);
    chunk.Clear();
  } while (reader->Read(&chunk));
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the stream was cancelled (by the client, or its ticket expired: --staged_block_ttl)");
  }
  auto staged = (*upload)->Commit();
  if (!staged.ok()) return ToGrpcStatus(staged.status());
  response->set_bytes(*staged);
  return grpc::Status::OK;
}

grpc::Status StagingServiceImpl::Fetch(grpc::ServerContext* context, const v1::FetchRequest* request,
                                       grpc::ServerWriter<v1::FetchChunk>* writer) {
  auto tenant = TenantOf(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  auto download = area_->BeginFetch(request->ticket(), *tenant, [context] { context->TryCancel(); });
  if (!download.ok()) return ToGrpcStatus(download.status());
  const std::string& bytes = (*download)->block().bytes;
  size_t offset = 0;
  v1::FetchChunk chunk;
  do {
    const size_t n = std::min(kChunkBytes, bytes.size() - offset);
    chunk.set_data(bytes.data() + offset, n);
    if (!writer->Write(chunk)) {  // the client went away (the block may be fetched again), or it expired
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the stream was cancelled (by the client, or its block expired: --staged_block_ttl)");
    }
    offset += n;
  } while (offset < bytes.size());
  (*download)->Done();
  return grpc::Status::OK;
}

}  // namespace shardgemm
