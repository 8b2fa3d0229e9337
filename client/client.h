// C++ client library for the shardgemm service.
#ifndef SHARDGEMM_CLIENT_CLIENT_H_
#define SHARDGEMM_CLIENT_CLIENT_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "kernels/host_tensor.h"
#include "proto/frame_socket_client.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"

namespace shardgemm {

// The credentials of a client's two kinds of hop: to the coordinator, and
// to the workers' staging ports (the direct path). They differ when the
// coordinator is reached on its Unix socket (gRPC's local credentials) and
// the workers over TCP (TLS). `workers` null: this client has none for the
// workers (the direct path is FAILED_PRECONDITION).
struct ClientCredentials {
  ClientCredentials(std::shared_ptr<grpc::ChannelCredentials> both)  // NOLINT: one for every hop
      : coordinator(both), workers(std::move(both)) {}
  ClientCredentials(std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials,
                    std::shared_ptr<grpc::ChannelCredentials> worker_credentials)
      : coordinator(std::move(coordinator_credentials)), workers(std::move(worker_credentials)) {}
  std::shared_ptr<grpc::ChannelCredentials> coordinator;
  std::shared_ptr<grpc::ChannelCredentials> workers;
  // The bearer token the call credentials carry, for the call socket's
  // frames ("": none).
  std::string token;
};

class ShardGemmClient {
 public:
  // `address`: HOST:PORT, or unix:PATH for a coordinator's --client_socket.
  // `credentials`: MakeClientCredentials's (TLS or local, and a token), or
  // insecure ones.
  // `max_message_bytes`: the largest message sent or received (a larger
  // inline response fails RESOURCE_EXHAUSTED; puts and gets go in chunks).
  ShardGemmClient(const std::string& address, ClientCredentials credentials, int max_message_bytes = kMaxMessageBytes);

  // Waits up to `timeout` for the coordinator to answer and its mesh to be
  // complete.
  absl::StatusOr<v1::ClusterInfo> WaitUntilReady(absl::Duration timeout);
  absl::StatusOr<v1::ClusterInfo> ClusterInfo();
  absl::StatusOr<v1::Plan> Plan(const v1::PlanRequest& request);
  // Bounded by timeout(), on either transport.
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemm(const v1::GroupedGemmRequest& request);
  // Bounded by timeout(), on either transport.
  absl::StatusOr<v1::GroupedQuantizeResponse> GroupedQuantize(const v1::GroupedQuantizeRequest& request);
  // GroupedGemm and GroupedQuantize calls go as frames on the coordinator's
  // --call_socket at `path` (same host, same user) with this client's token,
  // bounded by timeout(); a request the socket cannot take now (no
  // connection, a connection the server refused, larger than the message
  // limit, a socket of another user) goes on gRPC. Every other call stays
  // on gRPC.
  void UseCallSocket(const std::string& path);
  // GroupedGemm on the direct path (docs/architecture.md, "The direct
  // path"): the request's inline operands (lhs, rhs, bias, the FP8 scales)
  // are staged on the workers, each distinct block once per rank that needs
  // it, in parallel; the output (unless keep_output_as) is fetched from the
  // workers in parallel and put in the response's `out` as inline bytes, so
  // the answer reads like GroupedGemm's. The coordinator touches none of
  // those bytes. A request with no inline operand (all resident or in
  // shared memory) stages nothing and only fetches its output directly;
  // one that also keeps its output is INVALID_ARGUMENT (nothing would take
  // the direct path). FAILED_PRECONDITION when a worker serves no staging.
  // Each call of it (plan, stage, submit, fetch) is bounded by timeout();
  // a plan not submitted (a stage or the submit failed) is released
  // (ReleaseStaging), so its staged blocks leave the workers at once.
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemmDirect(const v1::GroupedGemmRequest& request);
  // PutTensor on the direct path: the coordinator places the copies
  // (PlanStaging's put), this client streams each holder its block in
  // parallel, and PutStaged registers them. Bounded and released as
  // GroupedGemmDirect.
  absl::StatusOr<v1::PutTensorResponse> PutTensorDirect(const std::string& name, const HostTensor& tensor,
                                                        const std::string& spec, bool overwrite);
  // GetTensor on the direct path: PlanFetch, then each distinct block read
  // from a worker holding it, in parallel.
  absl::StatusOr<HostTensor> GetTensorDirect(const std::string& name);
  // The bound on a GroupedGemm, a GroupedQuantize and a direct operation,
  // all of its calls together, the socket attempt and gRPC's (default
  // 5 min).
  void set_timeout(absl::Duration timeout) { timeout_ = timeout; }
  absl::Duration timeout() const { return timeout_; }
  // Streams the tensor in chunks, so tensors past gRPC's message limit work.
  absl::StatusOr<v1::PutTensorResponse> PutTensor(const std::string& name, const HostTensor& tensor,
                                                  const std::string& spec, bool overwrite);
  absl::StatusOr<HostTensor> GetTensor(const std::string& name);
  absl::Status DeleteTensor(const std::string& name);
  absl::StatusOr<v1::ListTensorsResponse> ListTensors();
  // A POSIX shared-memory object of this host (`key`, its shm_open name)
  // under `name`, for requests' SharedMemoryRef (coordinator --shared_memory).
  absl::Status RegisterSharedMemory(const std::string& name, const std::string& key, uint64_t byte_size);
  // A CUDA allocation of this process (`ipc_handle`: cudaIpcGetMemHandle's
  // 64 bytes of its base) under `name`, the same way: CUDA workers on this
  // host read operands from it in place and write outputs into it.
  absl::Status RegisterCudaMemory(const std::string& name, const std::string& ipc_handle, uint64_t byte_size);
  absl::Status UnregisterSharedMemory(const std::string& name);

  // Sent with every later call as x-request-id metadata: the coordinator's
  // and every worker's log lines for the request carry it. Empty: the
  // coordinator makes one. Either way the id of the last call is
  // last_request_id().
  void set_request_id(std::string id) { request_id_ = std::move(id); }
  const std::string& last_request_id() const { return last_request_id_; }

  // An operand's bytes as the direct path stages them: the caller's, not copied.
  struct ArrayView {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> shape;
    absl::string_view bytes;
  };

 private:
  static ArrayView ArrayViewOf(const HostTensor& t);
  // INVALID_ARGUMENT naming `field` unless the data is the dtype and shape's bytes.
  static absl::StatusOr<ArrayView> ArrayViewOf(const v1::Tensor& t, absl::string_view field);
  void Prepare(grpc::ClientContext* ctx) const;
  void NoteRequestId(const grpc::ClientContext& ctx);

  // The raw Staging calls' stub for a worker's staging address (proto/chunk_wire.h encodes their chunks).
  grpc::GenericStub* StagingStub(const std::string& address);
  // The direct path's parts: the transfer plan (and the request id its
  // later calls carry); every block of it streamed to its destinations in
  // parallel; the blocks read from their holders into one tensor; a plan
  // given up (best effort, bounded by kReleaseTimeout).
  absl::StatusOr<v1::StagingPlan> PlanTransfer(const v1::StagingPlanRequest& request, absl::Time deadline,
                                               std::string* request_id);
  absl::Status StageAll(const v1::StagingPlan& plan, const std::map<v1::TensorRole, ArrayView>& arrays,
                        const std::string& request_id, absl::Time deadline);
  absl::StatusOr<HostTensor> FetchAll(v1::DType dtype, const std::vector<int64_t>& shape,
                                      const google::protobuf::RepeatedPtrField<v1::StagedBlock>& blocks,
                                      const std::string& request_id, absl::Time deadline);
  void Release(const std::string& staging_id, const std::string& request_id);
  static constexpr absl::Duration kReleaseTimeout = absl::Seconds(5);

  std::unique_ptr<v1::ShardGemm::Stub> stub_;
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials_;
  std::string token_;
  using CallSocket = FrameSocketClient<v1::CallSocketRequest, v1::CallSocketReply>;
  // `call` (borrowed into `frame`) sent on the call socket, bounded by
  // `deadline`: its reply or failure, or nullopt when it was not run there
  // (no socket, too large, not sent, refused) and goes on gRPC.
  std::optional<absl::StatusOr<v1::CallSocketReply>> CallOnSocket(const google::protobuf::Message& call,
                                                                  v1::CallSocketRequest* frame, absl::Time deadline);
  std::unique_ptr<CallSocket> call_socket_;
  int max_message_bytes_;
  absl::Mutex staging_mu_;
  std::map<std::string, std::unique_ptr<grpc::GenericStub>> staging_ ABSL_GUARDED_BY(staging_mu_);
  std::string request_id_, last_request_id_;
  absl::Duration timeout_ = absl::Minutes(5);
};

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_CLIENT_H_
