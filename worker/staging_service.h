// The worker's client-facing Staging service (its --staging_port): clients
// stream the blocks of a transfer plan here under the coordinator's tickets,
// and fetch output blocks held for them. Callers are clients, not mesh
// members: their bearer token names their tenant, as at the coordinator.
#ifndef SHARDGEMM_WORKER_STAGING_SERVICE_H_
#define SHARDGEMM_WORKER_STAGING_SERVICE_H_

#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "security/tokens.h"
#include "worker/staging_area.h"

namespace shardgemm {

// Both methods take raw messages (proto/chunk_wire.h) on callback reactors:
// a staged chunk's bytes go from gRPC's slices straight into the block, and
// a fetched block goes out as slices borrowing its bytes, with no protobuf
// copy either way.
class StagingServiceImpl final
    : public v1::Staging::WithRawCallbackMethod_Stage<v1::Staging::WithRawCallbackMethod_Fetch<v1::Staging::Service>> {
 public:
  // `tokens` null: no tokens checked (--insecure), every caller is the
  // tenant "" (as at an insecure coordinator).
  StagingServiceImpl(StagingArea* area, security::TokenFile* tokens) : area_(area), tokens_(tokens) {}

  // StageChunk messages in, a StageResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Stage(grpc::CallbackServerContext* context,
                                                   grpc::ByteBuffer* response) override;
  // A FetchRequest in, FetchChunk messages out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;

  // Data bytes of a Fetch stream's message (with its header within 1 MiB, as the service's streams).
  static constexpr size_t kChunkBytes = static_cast<size_t>(kTensorChunkBytes);
  // The largest message either way: one chunk and its header. gRPC receives
  // a whole message before the handler sees it, so a larger limit would let
  // any caller make the worker allocate that much per stream, before its
  // ticket or the budget is checked.
  static constexpr int kMaxStreamMessageBytes = 1 << 20;

  // The staging port's server settings: the tensor servers' window and
  // frames, with messages of at most kMaxStreamMessageBytes.
  static void ConfigureServer(grpc::ServerBuilder* builder);

 private:
  // The caller's tenant: UNAUTHENTICATED without a valid token,
  // PERMISSION_DENIED for a token not granted compute.
  absl::StatusOr<std::string> TenantOf(const grpc::ServerContextBase& context);

  StagingArea* area_;
  security::TokenFile* tokens_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STAGING_SERVICE_H_
