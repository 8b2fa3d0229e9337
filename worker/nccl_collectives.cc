#include "worker/nccl_collectives.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cuda/cuda_status.h"
#include "proto/shardgemm.grpc.pb.h"
#include "worker/nccl_status.h"

namespace shardgemm {
namespace {

// A collective enqueued on a nonblocking communicator returns ncclInProgress
// while NCCL enqueues it in the background (Wait then polls until it is).
absl::Status Enqueued(ncclResult_t r, absl::string_view what) {
  return r == ncclInProgress ? absl::OkStatus() : NcclStatus(r, what);
}

// Rows before `dim` (the product of the leading dimensions).
int64_t Outer(const std::vector<int64_t>& shape, int dim) {
  int64_t outer = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[d];
  return outer;
}

class NcclCollectives : public Collectives {
 public:
  NcclCollectives(MeshPosition position, int device, IdExchange exchange,
                  std::chrono::milliseconds timeout)
      : position_(std::move(position)), device_(device), exchange_(std::move(exchange)),
        timeout_(timeout) {
    cudaSetDevice(device_);
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    int pitch = 0;
    if (cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device_) == cudaSuccess && pitch > 0) {
      max_pitch_ = pitch;
    }
  }
  ~NcclCollectives() override {
    // Aborted, not destroyed: destroying a nonblocking communicator waits
    // for its peers, who may be gone.
    for (auto& [key, group] : groups_) {
      if (group.comm != nullptr) ncclCommAbort(group.comm);
    }
    for (ncclComm_t comm : retired_) ncclCommAbort(comm);
    for (auto& [slot, buffer] : buffers_) cudaFree(buffer.second);
    cudaStreamDestroy(stream_);
  }

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override {
    cudaSetDevice(device_);  // the current device is per thread; gRPC threads vary
    if (dim < 0 || dim >= static_cast<int>(local.shape.size())) {
      return absl::InvalidArgumentError(absl::StrCat("all_gather: dimension ", dim, " out of range"));
    }
    auto comm = Comm(axes);
    if (!comm.ok()) return comm.status();
    if (*comm == nullptr) return local;
    auto size = position_.GroupSize(axes);
    const int64_t n = local.NumBytes();
    auto send = Buffer(0, n), recv = Buffer(1, n * *size);
    if (!send.ok()) return send.status();
    if (!recv.ok()) return recv.status();
    HostTensor out;
    out.dtype = local.dtype;
    out.shape = local.shape;
    out.shape[dim] *= *size;
    out.bytes.resize(n * *size);
    absl::Status s =
        CudaStatus(cudaMemcpyAsync(*send, local.bytes.data(), n, cudaMemcpyHostToDevice, stream_), "upload");
    if (s.ok()) s = Enqueued(ncclAllGather(*send, *recv, n, ncclUint8, *comm, stream_), "ncclAllGather");
    // Wait (watching for errors) before copying back: a copy into pageable
    // memory would block until the collective finished, past any timeout.
    if (s.ok()) s = Wait(axes, *comm, stream_);
    // The members' pieces arrive one after another; along `dim` they
    // interleave every `outer` rows: place them with strided copies straight
    // into the output instead of through host-side slices.
    const int64_t outer = Outer(local.shape, dim), row = outer > 0 ? n / outer : 0;
    for (int64_t i = 0; s.ok() && n > 0 && i < *size; ++i) {
      char* dst = &out.bytes[0] + i * row;
      const char* src = static_cast<const char*>(*recv) + i * n;
      s = outer == 1 ? CudaStatus(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_), "download")
                     : CopyRows(dst, row * *size, src, row, row, outer, cudaMemcpyDeviceToHost, stream_, "download");
    }
    if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream_), "download");
    if (!s.ok()) return s;
    return out;
  }

  bool SupportsDeviceAllGather() const override { return true; }

  // The FSDP weight gather that stays on the device: ncclAllGather on the
  // caller's stream, into `recv` directly when the pieces are contiguous
  // along `dim` (every dimension before it is 1), otherwise into a scratch
  // buffer and then placed along `dim` with strided device-to-device copies.
  absl::Status AllGatherDevice(const void* send, void* recv, const std::vector<int64_t>& local_shape,
                               DType dtype, int dim, const std::vector<std::string>& axes,
                               void* stream_ptr) override {
    cudaSetDevice(device_);
    if (dim < 0 || dim >= static_cast<int>(local_shape.size())) {
      return absl::InvalidArgumentError(absl::StrCat("all_gather: dimension ", dim, " out of range"));
    }
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    auto size = position_.GroupSize(axes);
    if (!size.ok()) return size.status();
    int64_t elements = 1;
    for (int64_t d : local_shape) elements *= d;
    const int64_t n = elements * DTypeSize(dtype);
    auto comm = Comm(axes);
    if (!comm.ok()) return comm.status();
    if (*comm == nullptr) {  // a group of one: the piece is the whole
      absl::Status s;
      if (n > 0 && send != recv)
        s = CudaStatus(cudaMemcpyAsync(recv, send, n, cudaMemcpyDeviceToDevice, stream), "copy");
      if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream), "copy");
      return s;
    }
    if (n == 0) return absl::OkStatus();  // every member has the same (empty) piece
    const int64_t outer = Outer(local_shape, dim), row = n / outer;
    void* gathered = recv;
    if (outer > 1) {
      auto buf = Buffer(1, n * *size);
      if (!buf.ok()) return buf.status();
      gathered = *buf;
    }
    absl::Status s = Enqueued(ncclAllGather(send, gathered, n, ncclUint8, *comm, stream), "ncclAllGather");
    // Enqueued before the placement copies go on the stream behind it.
    if (s.ok()) s = WaitEnqueued(axes, *comm);
    // Member i's piece is `outer` rows of `row` bytes; along `dim` they
    // interleave: row j of piece i goes to row j * size + i of the output.
    const int64_t dpitch = row * *size;
    for (int64_t i = 0; s.ok() && outer > 1 && i < *size; ++i) {
      char* dst = static_cast<char*>(recv) + i * row;
      const char* src = static_cast<const char*>(gathered) + i * n;
      s = CopyRows(dst, dpitch, src, row, row, outer, cudaMemcpyDeviceToDevice, stream, "all_gather placement");
    }
    if (s.ok()) s = Wait(axes, *comm, stream);
    return s;
  }

  absl::Status AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) override {
    cudaSetDevice(device_);
    auto comm = Comm(axes);
    if (!comm.ok()) return comm.status();
    if (*comm == nullptr || t->NumElements() == 0) return absl::OkStatus();
    ncclDataType_t type;
    switch (t->dtype) {
      case DType::kF32: type = ncclFloat32; break;
      case DType::kBF16: type = ncclBfloat16; break;
      case DType::kF16: type = ncclFloat16; break;
      case DType::kI32: type = ncclInt32; break;
      case DType::kI64: type = ncclInt64; break;
      default: return absl::InvalidArgumentError(absl::StrCat("cannot all-reduce ", DTypeName(t->dtype)));
    }
    auto buf = Buffer(0, t->NumBytes());
    if (!buf.ok()) return buf.status();
    absl::Status s =
        CudaStatus(cudaMemcpyAsync(*buf, t->bytes.data(), t->NumBytes(), cudaMemcpyHostToDevice, stream_), "upload");
    if (s.ok()) {
      s = Enqueued(
          ncclAllReduce(*buf, *buf, t->NumElements(), type, op == ReduceOp::kSum ? ncclSum : ncclMax, *comm, stream_),
          "ncclAllReduce");
    }
    if (s.ok()) s = Wait(axes, *comm, stream_);
    if (s.ok()) s = CudaStatus(cudaMemcpy(&t->bytes[0], *buf, t->NumBytes(), cudaMemcpyDeviceToHost), "download");
    return s;
  }

  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                           const std::vector<std::string>& axes) override {
    cudaSetDevice(device_);
    auto size = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!size.ok()) return size.status();
    if (!index.ok()) return index.status();
    if (*size == 1) return t;
    if (dim < 0 || dim >= static_cast<int>(t.shape.size())) {
      return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: dimension ", dim, " out of range"));
    }
    if (t.shape[dim] % *size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: dimension ", dim, " of size ", t.shape[dim],
                                                     " does not split into ", *size));
    }
    if (t.dtype != DType::kF32) return absl::InvalidArgumentError("reduce-scatter runs on FP32 partial sums");
    auto comm = Comm(axes);
    if (!comm.ok()) return comm.status();
    HostTensor mine;
    mine.dtype = t.dtype;
    mine.shape = t.shape;
    mine.shape[dim] /= *size;
    const int64_t total = t.NumBytes(), piece = total / *size;
    mine.bytes.resize(piece);
    if (total == 0) return mine;
    // ncclReduceScatter splits the flat buffer: bring `dim` to the front on
    // the device (strided copies) so each member's piece is contiguous.
    const int64_t outer = Outer(t.shape, dim), row = piece / outer;
    auto in = Buffer(2, total), buf = Buffer(0, total), out = Buffer(1, piece);
    if (!in.ok()) return in.status();
    if (!buf.ok()) return buf.status();
    if (!out.ok()) return out.status();
    absl::Status s = CudaStatus(
        cudaMemcpyAsync(outer == 1 ? *buf : *in, t.bytes.data(), total, cudaMemcpyHostToDevice, stream_), "upload");
    for (int64_t i = 0; s.ok() && outer > 1 && i < *size; ++i) {
      s = CopyRows(static_cast<char*>(*buf) + i * piece, row, static_cast<const char*>(*in) + i * row, row * *size, row,
                   outer, cudaMemcpyDeviceToDevice, stream_, "reduce_scatter layout");
    }
    if (s.ok())
      s = Enqueued(ncclReduceScatter(*buf, *out, piece / 4, ncclFloat32, ncclSum, *comm, stream_),
                   "ncclReduceScatter");
    if (s.ok()) s = Wait(axes, *comm, stream_);
    if (s.ok()) s = CudaStatus(cudaMemcpy(&mine.bytes[0], *out, piece, cudaMemcpyDeviceToHost), "download");
    if (!s.ok()) return s;
    return mine;
  }

  void BeginStep(uint64_t sequence, uint64_t epoch) override {
    Revoke(epoch, "");
    std::vector<ncclComm_t> retired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      step_epoch_ = epoch;
      retired.swap(retired_);
    }
    // No step uses them now (this is the step thread, between steps).
    for (ncclComm_t comm : retired) ncclCommAbort(comm);
  }

  // From any thread: the communicators of older epochs retire, and the step
  // thread, polling its collective (Wait), sees the epoch and aborts the
  // one it waits on. NCCL calls on a communicator stay on the step thread.
  void Revoke(uint64_t epoch, const std::string& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch < epoch_) return;
    if (epoch == epoch_) {
      if (why_.empty()) why_ = why;
      return;
    }
    epoch_ = epoch;
    why_ = why;
    newest_epoch_.store(epoch);
    for (auto& [key, group] : groups_) {
      if (group.comm != nullptr) retired_.push_back(group.comm);
    }
    groups_.clear();
  }

  absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) override {
    HostTensor flag = *ZerosTensor(DType::kI32, {1});
    flag.data<int32_t>()[0] = local.ok() ? 0 : 1;
    if (auto s = AllReduce(&flag, ReduceOp::kMax, axes); !s.ok()) return s;
    if (!local.ok()) return local;
    if (flag.data<int32_t>()[0] != 0) return absl::AbortedError("another worker failed this step");
    return absl::OkStatus();
  }

 private:
  bool Revoked() const { return step_epoch_ < newest_epoch_.load(); }
  absl::Status RevokedNow() {
    std::lock_guard<std::mutex> lock(mu_);
    return RevokedStatus(step_epoch_, epoch_, why_);
  }

  // Polls the communicator's asynchronous state and then `stream`, so a
  // peer that never arrives, or a revoke, fails the step instead of hanging
  // it. The stream counts only once the collective is enqueued (the state
  // is ncclSuccess, not ncclInProgress): a nonblocking communicator enqueues
  // in the background.
  absl::Status Wait(const std::vector<std::string>& axes, ncclComm_t comm, cudaStream_t stream) {
    return Poll(axes, comm, stream);
  }
  // Only until the collective is enqueued.
  absl::Status WaitEnqueued(const std::vector<std::string>& axes, ncclComm_t comm) {
    return Poll(axes, comm, nullptr);
  }
  absl::Status Poll(const std::vector<std::string>& axes, ncclComm_t comm, cudaStream_t stream) {
    const absl::Time deadline = absl::Now() + absl::FromChrono(timeout_);
    while (true) {
      // First: a revoked communicator's kernels stop, and its stream then
      // looks done.
      if (Revoked()) {
        Abort(axes, comm, "");
        return RevokedNow();
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        absl::Status failed = NcclStatus(async, absl::StrCat("collective over (", absl::StrJoin(axes, ","),
                                                            ") failed asynchronously"));
        Abort(axes, comm, std::string(failed.message()));
        return failed;
      }
      if (async == ncclSuccess) {
        if (stream == nullptr) return absl::OkStatus();
        cudaError_t e = cudaStreamQuery(stream);
        if (e == cudaSuccess) return absl::OkStatus();
        if (e != cudaErrorNotReady) return CudaStatus(e, "collective");
      }
      if (absl::Now() > deadline) {
        const std::string why = absl::StrCat("collective over (", absl::StrJoin(axes, ","), ") did not finish within ",
                                             absl::FormatDuration(absl::FromChrono(timeout_)),
                                             "; communicator aborted");
        Abort(axes, comm, why);
        return absl::UnavailableError(why);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Aborts `comm` (the step thread's), whichever epoch it belongs to; a
  // group of the current epoch is then broken (`why`) until the next.
  void Abort(const std::vector<std::string>& axes, ncclComm_t comm, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(absl::StrJoin(axes, ","));
      if (it != groups_.end() && it->second.comm == comm) {
        it->second = Group{nullptr, why};
      } else {
        auto r = std::find(retired_.begin(), retired_.end(), comm);
        if (r == retired_.end()) return;  // not ours (aborted already)
        retired_.erase(r);
      }
    }
    ncclCommAbort(comm);
  }

  // A device buffer of at least `bytes`, kept between calls (slot 0 or 1).
  absl::StatusOr<void*> Buffer(int slot, int64_t bytes) {
    auto& [size, ptr] = buffers_[slot];
    if (size < bytes) {
      if (ptr != nullptr) cudaFree(ptr);
      ptr = nullptr;
      if (auto s = CudaStatus(cudaMalloc(&ptr, std::max<int64_t>(bytes, 256)), "collective buffer"); !s.ok()) {
        size = 0;
        return s;
      }
      size = bytes;
    }
    return ptr;
  }

  // The communicator of this worker's group over `axes` in the running
  // step's epoch (null for a group of one), built the first time the epoch
  // needs it: the group's first member makes the id and hands it out
  // through the exchange (keyed by group and epoch); the members join it
  // nonblocking, polled like a collective (a member that never comes, or a
  // revoke, ends the wait instead of hanging it).
  absl::StatusOr<ncclComm_t> Comm(const std::vector<std::string>& axes) {
    auto size = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!size.ok()) return size.status();
    if (!index.ok()) return index.status();
    if (*size == 1) return static_cast<ncclComm_t>(nullptr);
    const std::string key = absl::StrJoin(axes, ",");
    uint64_t epoch = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (step_epoch_ < epoch_) return RevokedStatus(step_epoch_, epoch_, why_);
      auto it = groups_.find(key);
      if (it != groups_.end()) {
        if (it->second.comm != nullptr) return it->second.comm;
        return absl::UnavailableError(absl::StrCat(it->second.broken, " earlier in mesh epoch ", epoch_,
                                                   "; the coordinator rebuilds the group's collectives in the next"));
      }
      epoch = step_epoch_;
    }
    auto broken = [&](absl::Status s) {
      std::lock_guard<std::mutex> lock(mu_);
      if (step_epoch_ == epoch_) groups_[key] = Group{nullptr, std::string(s.message())};
      return s;
    };
    const std::string id_key = absl::StrCat("nccl/", position_.GroupName(axes), "/", epoch);
    ncclUniqueId id;
    if (*index == 0) {
      if (auto s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return broken(s);
      if (auto s = exchange_.set(id_key, std::string(id.internal, sizeof(id.internal)), epoch); !s.ok()) {
        return broken(s);
      }
    } else {
      auto v = exchange_.get(id_key, epoch);
      if (!v.ok()) return broken(v.status());
      if (v->size() != sizeof(id.internal)) return broken(absl::InternalError("malformed ncclUniqueId"));
      std::copy(v->begin(), v->end(), id.internal);
    }
    cudaSetDevice(device_);
    ncclComm_t comm = nullptr;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (auto s = Enqueued(ncclCommInitRankConfig(&comm, static_cast<int>(*size), id, static_cast<int>(*index), &config),
                          absl::StrCat("ncclCommInitRank (", key, ")"));
        !s.ok()) {
      if (comm != nullptr) ncclCommAbort(comm);
      return broken(s);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      retired_.push_back(comm);  // Poll aborts it from there if the join fails
    }
    if (auto s = WaitEnqueued(axes, comm); !s.ok()) return Revoked() ? s : broken(s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto r = std::find(retired_.begin(), retired_.end(), comm);
      if (r != retired_.end()) retired_.erase(r);
      if (step_epoch_ < epoch_) {
        retired_.push_back(comm);  // revoked just now: the next step aborts it
        return RevokedStatus(step_epoch_, epoch_, why_);
      }
      groups_[key] = Group{comm, ""};
    }
    // Every member is in the communicator: all have read the id.
    if (*index == 0 && exchange_.forget) exchange_.forget(id_key);
    return comm;
  }

  MeshPosition position_;
  int device_;
  IdExchange exchange_;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  int64_t max_pitch_ = (int64_t{1} << 31) - 1;  // cudaDevAttrMaxPitch: the widest 2D copy

  // `rows` rows of `width` bytes from src (rows `spitch` apart) to dst (rows
  // `dpitch` apart): one 2D copy, or a copy per row where a pitch is wider
  // than a 2D copy allows.
  absl::Status CopyRows(void* dst, int64_t dpitch, const void* src, int64_t spitch, int64_t width, int64_t rows,
                        cudaMemcpyKind kind, cudaStream_t stream, const char* what) {
    if (dpitch <= max_pitch_ && spitch <= max_pitch_) {
      return CudaStatus(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind, stream), what);
    }
    for (int64_t j = 0; j < rows; ++j) {
      if (auto st = CudaStatus(cudaMemcpyAsync(static_cast<char*>(dst) + j * dpitch,
                                               static_cast<const char*>(src) + j * spitch, width, kind, stream),
                               what);
          !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }
  // This worker's communicator of one group in the current epoch.
  struct Group {
    ncclComm_t comm = nullptr;  // null once broken
    std::string broken;         // why, once it broke: not built again this epoch
  };
  std::mutex mu_;
  uint64_t epoch_ = 0;       // the newest epoch known: a step's, or Revoke's
  std::string why_;          // why epoch_ began (may be empty)
  uint64_t step_epoch_ = 0;  // the running step's
  std::atomic<uint64_t> newest_epoch_{0};  // epoch_, for Poll's loop
  std::map<std::string, Group> groups_;    // epoch_'s, by axes
  // Communicators of older epochs (or one still joining): aborted on the
  // step thread, by Poll or at the next BeginStep.
  std::vector<ncclComm_t> retired_;
  std::map<int, std::pair<int64_t, void*>> buffers_;
};

}  // namespace

namespace {

// ABORTED (the store ended a wait of a revoked epoch) stays ABORTED; any
// other failure to reach the store is UNAVAILABLE.
absl::Status RendezvousStatus(absl::string_view what, const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::ABORTED) return absl::AbortedError(absl::StrCat(what, s.error_message()));
  return absl::UnavailableError(absl::StrCat(what, s.error_message()));
}

}  // namespace

IdExchange CoordinatorIdExchange(std::shared_ptr<grpc::Channel> coordinator, const std::string& prefix,
                                 std::chrono::milliseconds timeout) {
  auto stub = std::shared_ptr<v1::Coordination::Stub>(v1::Coordination::NewStub(std::move(coordinator)));
  IdExchange x;
  x.set = [stub, prefix](const std::string& key, const std::string& value, uint64_t epoch) -> absl::Status {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StoreSetRequest request;
    request.set_key(prefix + key);
    request.set_value(value);
    request.set_epoch(epoch);
    v1::StoreSetResponse response;
    grpc::Status s = stub->StoreSet(&ctx, request, &response);
    return s.ok() ? absl::OkStatus() : RendezvousStatus("rendezvous set failed: ", s);
  };
  x.get = [stub, prefix, timeout](const std::string& key, uint64_t epoch) -> absl::StatusOr<std::string> {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
    v1::StoreGetRequest request;
    request.add_keys(prefix + key);
    request.set_timeout_ms(timeout.count());
    request.set_epoch(epoch);
    v1::StoreGetResponse response;
    grpc::Status s = stub->StoreGet(&ctx, request, &response);
    if (!s.ok()) return RendezvousStatus("rendezvous get failed: ", s);
    return response.values(0);
  };
  x.forget = [stub, prefix](const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StoreDeleteRequest request;
    request.add_keys(prefix + key);
    v1::StoreDeleteResponse response;
    (void)stub->StoreDelete(&ctx, request, &response);
  };
  return x;
}

std::unique_ptr<Collectives> MakeNcclCollectives(const MeshPosition& position, int device,
                                                 IdExchange exchange,
                                                 std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCollectives>(position, device, std::move(exchange), timeout);
}

}  // namespace shardgemm
