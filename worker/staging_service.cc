#include "worker/staging_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/chunk_wire.h"
#include "proto/grpc_status.h"

namespace shardgemm {

void StagingServiceImpl::ConfigureServer(grpc::ServerBuilder* builder) {
  ConfigureTensorServer(builder, kMaxStreamMessageBytes);
}

absl::StatusOr<std::string> StagingServiceImpl::TenantOf(const grpc::ServerContextBase& context) {
  if (tokens_ == nullptr) return std::string();
  auto principal = tokens_->Authenticate(context);
  if (!principal.ok()) return principal.status();
  if (!principal->Has(security::Grant::kCompute)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token of tenant '", principal->tenant, "' is not granted compute (staging)"));
  }
  return principal->tenant;
}

namespace {

grpc::Status Cancelled(absl::string_view what) {
  return grpc::Status(grpc::StatusCode::CANCELLED,
                      absl::StrCat("the stream was cancelled (by the client, or its ", what,
                                   " expired: --staged_block_ttl)"));
}

// One Stage stream: each message decoded over the received slices, its data
// appended to the block from there.
class StageReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  StageReactor(grpc::CallbackServerContext* context, StagingArea* area, absl::StatusOr<std::string> tenant,
               grpc::ByteBuffer* response)
      : context_(context), area_(area), response_(response) {
    if (!tenant.ok()) {
      Finish(ToGrpcStatus(tenant.status()));
      return;
    }
    tenant_ = *std::move(tenant);
    StartRead(&message_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) return End();
    absl::Status taken = Take();
    message_.Clear();
    if (!taken.ok()) return FinishNow(ToGrpcStatus(taken));
    StartRead(&message_);
  }
  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    if (auto s = DecodeStageChunk(message_, &chunk_); !s.ok()) return s;
    if (upload_ == nullptr) {
      if (chunk_.ticket().empty()) return absl::InvalidArgumentError("ticket: the first message carries no ticket");
      ticket_ = chunk_.ticket();
      // The context lives until OnDone, after the Upload (and with it the area's hold on this callback) is gone.
      auto upload = area_->BeginStage(ticket_, tenant_, [context = context_] { context->TryCancel(); });
      if (!upload.ok()) return upload.status();
      upload_ = *std::move(upload);
    } else if (!chunk_.ticket().empty() && chunk_.ticket() != ticket_) {
      return absl::InvalidArgumentError("ticket: a stream stages one ticket's block");
    }
    absl::Status appended = chunk_.data().empty() ? upload_->Append({}) : absl::OkStatus();
    for (absl::string_view piece : chunk_.data()) {
      if (!appended.ok()) break;
      appended = upload_->Append(piece);
    }
    chunk_.Clear();
    return appended;
  }
  // The client half-closed, or the stream was cancelled.
  void End() {
    if (upload_ == nullptr) {
      return FinishNow(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    "ticket: the stream ended before its first message"));
    }
    if (context_->IsCancelled()) return FinishNow(Cancelled("ticket"));
    auto staged = upload_->Commit();
    if (!staged.ok()) return FinishNow(ToGrpcStatus(staged.status()));
    v1::StageResponse response;
    response.set_bytes(*staged);
    grpc::Slice slice(response.SerializeAsString());
    *response_ = grpc::ByteBuffer(&slice, 1);
    FinishNow(grpc::Status::OK);
  }
  // The Upload goes before the client hears the status: a stream that did
  // not commit holds nothing by then, and its ticket may be staged again.
  void FinishNow(const grpc::Status& status) {
    upload_.reset();
    Finish(status);
  }

  grpc::CallbackServerContext* const context_;
  StagingArea* const area_;
  grpc::ByteBuffer* const response_;
  std::string tenant_, ticket_;
  std::unique_ptr<StagingArea::Upload> upload_;
  grpc::ByteBuffer message_;
  DecodedChunk chunk_;
};

// The Fetch stream's context for the area's CancelStream, which may outlive
// the call: the Download stays alive while gRPC holds slices of its bytes.
class CancelHandle {
 public:
  explicit CancelHandle(grpc::CallbackServerContext* context) : context_(context) {}
  void Cancel() {
    absl::MutexLock lock(&mu_);
    if (context_ != nullptr) context_->TryCancel();
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  grpc::CallbackServerContext* context_ ABSL_GUARDED_BY(mu_);
};

// One Fetch stream: each message a header slice and a slice borrowing the
// held block's bytes, which keeps the Download alive until gRPC drops it.
class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(grpc::CallbackServerContext* context, StagingArea* area, absl::StatusOr<std::string> tenant,
               const grpc::ByteBuffer& request)
      : handle_(std::make_shared<CancelHandle>(context)) {
    if (!tenant.ok()) {
      FinishNow(ToGrpcStatus(tenant.status()));
      return;
    }
    v1::FetchRequest fetch;
    grpc::Slice flat;
    if (request.Valid() && (!request.DumpToSingleSlice(&flat).ok() ||
                            !fetch.ParseFromArray(flat.begin(), static_cast<int>(flat.size())))) {
      FinishNow(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "FetchRequest: not a valid message"));
      return;
    }
    auto download = area->BeginFetch(fetch.ticket(), *tenant, [handle = handle_] { handle->Cancel(); });
    if (!download.ok()) {
      FinishNow(ToGrpcStatus(download.status()));
      return;
    }
    download_ = std::shared_ptr<StagingArea::Download>(std::move(*download));
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    // Not ok: the client went away (the block may be fetched again), or it expired.
    if (!ok) return FinishNow(Cancelled("block"));
    WriteNext();
  }
  void OnDone() override {
    handle_->Detach();  // the context goes with the call
    delete this;
  }

 private:
  void WriteNext() {
    const std::string& bytes = download_->block().bytes;
    if (offset_ >= bytes.size() && wrote_) return Fetched();
    const size_t n = std::min(StagingServiceImpl::kChunkBytes, bytes.size() - offset_);
    message_ = EncodeFetchChunk(absl::string_view(bytes).substr(offset_, n), download_);
    offset_ += n;
    wrote_ = true;
    StartWrite(&message_);
  }
  // Every message was written. Done drops the Download's hold on the bytes,
  // so it waits for gRPC to drop the slices (at once after a write that
  // completed; bounded all the same), else the block stays for a fetch again.
  void Fetched() {
    message_.Clear();
    const absl::Time give_up = absl::Now() + absl::Seconds(1);
    while (download_.use_count() > 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    if (download_.use_count() == 1) download_->Done();
    FinishNow(grpc::Status::OK);
  }
  // The handle is detached before the reactor's hold on the Download goes: a
  // sweep cancelling it then cannot be the one that drops the last slice
  // (whose Download would end under the sweep's lock).
  void FinishNow(const grpc::Status& status) {
    handle_->Detach();
    message_.Clear();
    download_.reset();
    Finish(status);
  }

  std::shared_ptr<CancelHandle> handle_;
  std::shared_ptr<StagingArea::Download> download_;
  grpc::ByteBuffer message_;
  size_t offset_ = 0;
  bool wrote_ = false;  // an empty block is one empty message
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StagingServiceImpl::Stage(grpc::CallbackServerContext* context,
                                                                     grpc::ByteBuffer* response) {
  return new StageReactor(context, area_, TenantOf(*context), response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StagingServiceImpl::Fetch(grpc::CallbackServerContext* context,
                                                                      const grpc::ByteBuffer* request) {
  return new FetchReactor(context, area_, TenantOf(*context), *request);
}

}  // namespace shardgemm
