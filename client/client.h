// C++ client library for the shardgemm service.
#ifndef SHARDGEMM_CLIENT_CLIENT_H_
#define SHARDGEMM_CLIENT_CLIENT_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/host_tensor.h"
#include "grpcpp/security/credentials.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"

namespace shardgemm {

class ShardGemmClient {
 public:
  // `credentials`: MakeClientCredentials's (TLS and a token), or insecure ones.
  // `max_message_bytes`: the largest message sent or received (a larger
  // inline response fails RESOURCE_EXHAUSTED; puts and gets go in chunks).
  ShardGemmClient(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                  int max_message_bytes = kMaxMessageBytes);

  // Waits up to `timeout` for the coordinator to answer and its mesh to be
  // complete.
  absl::StatusOr<v1::ClusterInfo> WaitUntilReady(absl::Duration timeout);
  absl::StatusOr<v1::ClusterInfo> ClusterInfo();
  absl::StatusOr<v1::Plan> Plan(const v1::PlanRequest& request);
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemm(const v1::GroupedGemmRequest& request);
  // GroupedGemm on the direct path (docs/architecture.md, "The direct
  // path"): the request's inline operands (lhs, rhs, bias, the FP8 scales)
  // are staged on the workers, each distinct block once per rank that needs
  // it, in parallel; the output (unless keep_output_as) is fetched from the
  // workers in parallel and put in the response's `out` as inline bytes, so
  // the answer reads like GroupedGemm's. The coordinator touches none of
  // those bytes. FAILED_PRECONDITION when a worker serves no staging.
  absl::StatusOr<v1::GroupedGemmResponse> GroupedGemmDirect(const v1::GroupedGemmRequest& request);
  absl::StatusOr<v1::GroupedQuantizeResponse> GroupedQuantize(
      const v1::GroupedQuantizeRequest& request);
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

 private:
  void Prepare(grpc::ClientContext* ctx) const;
  void NoteRequestId(const grpc::ClientContext& ctx);

  v1::Staging::Stub* StagingStub(const std::string& address);

  std::unique_ptr<v1::ShardGemm::Stub> stub_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  int max_message_bytes_;
  absl::Mutex staging_mu_;
  std::map<std::string, std::unique_ptr<v1::Staging::Stub>> staging_ ABSL_GUARDED_BY(staging_mu_);
  std::string request_id_, last_request_id_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_CLIENT_H_
