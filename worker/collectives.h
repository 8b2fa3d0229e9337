// Collectives over groups of workers spanned by mesh axes. The CPU backend
// implements them with Gloo, the CUDA backend with NCCL; a mesh of one worker
// needs none (every group is the worker alone).
#ifndef SHARDGEMM_WORKER_COLLECTIVES_H_
#define SHARDGEMM_WORKER_COLLECTIVES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

// Where this worker sits on the mesh.
struct MeshPosition {
  std::vector<std::string> axis_names;
  std::vector<int64_t> axis_sizes;
  std::vector<int64_t> coords;
  int rank = 0;

  int64_t NumWorkers() const;
  // Size of the group spanned by `axes`, and this worker's index in it (the
  // first axis major, as a nested spec entry splits a dimension).
  absl::StatusOr<int64_t> GroupSize(const std::vector<std::string>& axes) const;
  absl::StatusOr<int64_t> GroupIndex(const std::vector<std::string>& axes) const;
  // Global ranks of the group spanned by `axes` that contains this worker, in
  // group-index order.
  absl::StatusOr<std::vector<int>> GroupRanks(const std::vector<std::string>& axes) const;
  // Names this worker's group over `axes` (the same on every member): the
  // axes and this worker's coordinates on the other axes.
  std::string GroupName(const std::vector<std::string>& axes) const;
};

MeshPosition SingleWorkerPosition();

enum class ReduceOp { kSum, kMax };

class Collectives {
 public:
  virtual ~Collectives() = default;
  // Concatenates the group's pieces along `dim` in group-index order.
  virtual absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                               const std::vector<std::string>& axes) = 0;
  // In place, elementwise over the group (F32 / BF16 / F16 reduce in FP32).
  virtual absl::Status AllReduce(HostTensor* t, ReduceOp op,
                                 const std::vector<std::string>& axes) = 0;
  // Sum over the group, then this worker keeps its piece along `dim`.
  virtual absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                                   const std::vector<std::string>& axes) = 0;
  // Device all-gather (the FSDP weight gather feeding a device GEMM): true
  // where AllGatherDevice works on device memory of the backend's device.
  virtual bool SupportsDeviceAllGather() const { return false; }
  // AllGather's output layout (the members' pieces concatenated along `dim`
  // in group-index order), on device memory: `send` holds this worker's
  // piece of shape `local_shape` and `dtype`, `recv` has room for the piece's
  // bytes times the group size. Runs on `stream` (a cudaStream_t of the
  // backend's device, kept opaque here) and returns once `recv` is written,
  // failing the same way as AllGather on an asynchronous error or timeout.
  virtual absl::Status AllGatherDevice(const void* send, void* recv,
                                       const std::vector<int64_t>& local_shape, DType dtype, int dim,
                                       const std::vector<std::string>& axes, void* stream) {
    (void)send, (void)recv, (void)local_shape, (void)dtype, (void)dim, (void)axes, (void)stream;
    return absl::UnimplementedError("these collectives have no device all-gather");
  }
  // Every worker of this worker's group over `axes` passes its own status;
  // all get OK only if all are OK. A worker that failed gets its own error
  // back, the others ABORTED. Steps call this before their collectives, over
  // the union of those collectives' axes (every worker that a failure could
  // leave waiting, directly or through another), so one worker's failure (a
  // bad shard, its memory budget) fails the step there instead of leaving
  // the others waiting in a collective.
  virtual absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) = 0;
  // The step about to run (on the step's thread), and the mesh epoch the
  // coordinator numbered it in (Step.epoch). Communicators are named by
  // (epoch, group) and built the first time a step of the epoch needs them:
  // every member of a group runs the same steps in the same order within an
  // epoch, so all build it at the same step. At the first step of a newer
  // epoch those of older epochs are dropped (Revoke). Within an epoch a
  // group's communicator is built once: after it broke (a timeout, a peer
  // gone), the epoch's later collectives over the group fail at once; the
  // coordinator advances the epoch on such a failure, and the next epoch
  // builds it afresh. A step of an epoch older than the newest this worker
  // knows fails its collectives at once (ABORTED): its communicators are
  // revoked, and a new one for it could pair with peers of another epoch.
  virtual void BeginStep(uint64_t sequence, uint64_t epoch) { (void)sequence, (void)epoch; }
  // The mesh moved on to `epoch` (`why`, for the errors of older steps;
  // may be empty, and is then taken from a later call for the same epoch).
  // From any thread, returning at once: every communicator of an older
  // epoch is revoked, and a collective blocked on one ends now (ABORTED),
  // not at its timeout. An epoch no newer than the newest known changes
  // nothing.
  virtual void Revoke(uint64_t epoch, const std::string& why) { (void)epoch, (void)why; }
};

// The error of a collective of a step whose epoch was revoked.
absl::Status RevokedStatus(uint64_t step_epoch, uint64_t epoch, absl::string_view why);

// For a mesh of one worker, or any group of size one: identity operations.
// Groups with more than one worker get FAILED_PRECONDITION.
std::unique_ptr<Collectives> MakeLocalCollectives(const MeshPosition& position);

// The local piece of `t` along `dim` for group index `index` of `count`.
absl::StatusOr<HostTensor> TakePiece(const HostTensor& t, int dim, int64_t index, int64_t count,
                                     absl::string_view what);

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_COLLECTIVES_H_
