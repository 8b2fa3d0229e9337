#include "worker/gloo_collectives.h"

#include <exception>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "grpcpp/grpcpp.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"

namespace shardgemm {
namespace {

class CoordinatorStore : public gloo::rendezvous::Store {
 public:
  CoordinatorStore(std::shared_ptr<grpc::Channel> coordinator, std::string prefix,
                   std::chrono::milliseconds timeout)
      : prefix_(std::move(prefix)), stub_(v1::Coordination::NewStub(std::move(coordinator))), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StoreSetRequest request;
    request.set_key(prefix_ + key);
    request.set_value(std::string(data.begin(), data.end()));
    v1::StoreSetResponse response;
    grpc::Status s = stub_->StoreSet(&ctx, request, &response);
    if (!s.ok()) throw gloo::IoException("rendezvous set failed: " + s.error_message());
    std::lock_guard<std::mutex> lock(mu_);
    own_keys_.push_back(request.key());
  }

  // The keys this member set. Once every member's full mesh is connected
  // (a barrier on the new context after connectFullMesh: a member that is
  // connected may still have a peer that has not read its key) the store
  // may forget them. Best effort: a failure leaves them until the session ends.
  void ForgetOwnKeys() {
    v1::StoreDeleteRequest request;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (std::string& k : own_keys_) request.add_keys(std::move(k));
      own_keys_.clear();
    }
    if (request.keys_size() == 0) return;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StoreDeleteResponse response;
    (void)stub_->StoreDelete(&ctx, request, &response);
  }

  std::vector<char> get(const std::string& key) override {
    auto values = Fetch({key}, timeout_);
    return std::vector<char>(values[0].begin(), values[0].end());
  }

  // Gloo's own waits (connectFullMesh's gets) use its 30 s default: ours is
  // the collective timeout, so a peer that never comes fails the step in time.
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    Fetch(keys, timeout);
  }

 private:
  std::vector<std::string> Fetch(const std::vector<std::string>& keys,
                                 std::chrono::milliseconds timeout) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
    v1::StoreGetRequest request;
    for (const auto& k : keys) request.add_keys(prefix_ + k);
    request.set_timeout_ms(timeout.count());
    v1::StoreGetResponse response;
    grpc::Status s = stub_->StoreGet(&ctx, request, &response);
    if (!s.ok()) throw gloo::IoException("rendezvous get failed: " + s.error_message());
    return std::vector<std::string>(response.values().begin(), response.values().end());
  }

  std::string prefix_;
  std::unique_ptr<v1::Coordination::Stub> stub_;
  std::mutex mu_;
  std::vector<std::string> own_keys_;
  const std::chrono::milliseconds timeout_;
};

// FP32 view of a float tensor for reductions (BF16/F16 reduce in FP32).
std::vector<float> ToFloat(const HostTensor& t) {
  std::vector<float> v(static_cast<size_t>(t.NumElements()));
  for (int64_t i = 0; i < t.NumElements(); ++i) v[i] = LoadAsFloat(t, i);
  return v;
}

class GlooCollectives : public Collectives {
 public:
  GlooCollectives(MeshPosition position, std::shared_ptr<gloo::rendezvous::Store> store,
                  const std::string& hostname, std::chrono::milliseconds timeout)
      : position_(std::move(position)), store_(std::move(store)), timeout_(timeout) {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    device_ = gloo::transport::tcp::CreateDevice(attr);
  }

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override {
    auto ctx = Context(axes);
    if (!ctx.ok()) return ctx.status();
    if (*ctx == nullptr) return local;
    const int size = (*ctx)->size;
    std::string gathered(local.bytes.size() * size, '\0');
    try {
      gloo::AllgatherOptions opts(*ctx);
      opts.setInput(const_cast<char*>(local.bytes.data()), local.bytes.size());
      opts.setOutput(&gathered[0], gathered.size());
      opts.setTimeout(timeout_);
      opts.setTag(Tag());
      gloo::allgather(opts);
    } catch (const std::exception& e) {
      return Broken(axes, e);
    }
    // Pieces arrive in group-index order; place each along `dim`.
    HostTensor out;
    out.dtype = local.dtype;
    out.shape = local.shape;
    out.shape[dim] *= size;
    out.bytes.assign(gathered.size(), '\0');
    for (int i = 0; i < size; ++i) {
      HostTensor piece;
      piece.dtype = local.dtype;
      piece.shape = local.shape;
      piece.bytes = gathered.substr(i * local.bytes.size(), local.bytes.size());
      std::vector<int64_t> offsets(local.shape.size(), 0);
      offsets[dim] = i * local.shape[dim];
      InsertBlock(piece, offsets, &out);
    }
    return out;
  }

  absl::Status AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) override {
    auto ctx = Context(axes);
    if (!ctx.ok()) return ctx.status();
    if (*ctx == nullptr || t->NumElements() == 0) return absl::OkStatus();
    try {
      if (t->dtype == DType::kI64) {
        Reduce<int64_t>(*ctx, t->data<int64_t>(), t->NumElements(), op);
      } else if (t->dtype == DType::kI32) {
        Reduce<int32_t>(*ctx, t->data<int32_t>(), t->NumElements(), op);
      } else if (t->dtype == DType::kF32) {
        Reduce<float>(*ctx, t->data<float>(), t->NumElements(), op);
      } else {
        std::vector<float> v = ToFloat(*t);
        Reduce<float>(*ctx, v.data(), v.size(), op);
        for (int64_t i = 0; i < t->NumElements(); ++i) StoreFromFloat(t, i, v[i]);
      }
    } catch (const std::exception& e) {
      return Broken(axes, e);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                           const std::vector<std::string>& axes) override {
    // Gloo's reduce-scatter is an old-style algorithm class; allreduce then
    // keep our piece gives the same result with Gloo's tuned allreduce.
    HostTensor full = t;
    if (auto s = AllReduce(&full, ReduceOp::kSum, axes); !s.ok()) return s;
    auto count = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!count.ok()) return count.status();
    if (!index.ok()) return index.status();
    return TakePiece(full, dim, *index, *count, "reduce_scatter");
  }

  void BeginStep(uint64_t sequence) override { step_ = sequence; }

  absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) override {
    HostTensor flag = *ZerosTensor(DType::kI32, {1});
    flag.data<int32_t>()[0] = local.ok() ? 0 : 1;
    if (auto s = AllReduce(&flag, ReduceOp::kMax, axes); !s.ok()) return s;
    if (!local.ok()) return local;
    if (flag.data<int32_t>()[0] != 0) {
      return absl::AbortedError("another worker failed this step; see the request's status");
    }
    return absl::OkStatus();
  }

 private:
  template <typename T>
  void Reduce(const std::shared_ptr<gloo::Context>& ctx, T* data, size_t n, ReduceOp op) {
    gloo::AllreduceOptions opts(ctx);
    opts.setOutput(data, n);
    using Fn = void (*)(void*, const void*, const void*, size_t);
    Fn fn = op == ReduceOp::kSum ? static_cast<Fn>(&gloo::sum<T>) : static_cast<Fn>(&gloo::max<T>);
    opts.setReduceFunction(fn);
    opts.setTimeout(timeout_);
    opts.setTag(Tag());
    gloo::allreduce(opts);
  }

  // Gloo pairs a collective's messages by (kind, tag) only, not by our
  // step: with one tag for every step, a member that missed a step its peers
  // ran (its call lost on the way, or given up on while it was frozen) paired
  // its next step's pieces with their previous step's, and both steps
  // "succeeded" with each other's data (wrong answers served, found by the
  // fault tests). Tagged with the step's sequence, such a pair never matches:
  // the collective times out and the context is dropped.
  uint32_t Tag() const { return static_cast<uint32_t>(step_); }

  absl::Status Broken(const std::vector<std::string>& axes, const std::exception& e) {
    // A context that timed out or lost a peer cannot be trusted again.
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.erase(absl::StrJoin(axes, ","));
    return absl::UnavailableError(
        absl::StrCat("collective over (", absl::StrJoin(axes, ","), ") failed: ", e.what()));
  }

  // The context of this worker's group over `axes`; null for a group of one.
  absl::StatusOr<std::shared_ptr<gloo::Context>> Context(const std::vector<std::string>& axes) {
    auto size = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!size.ok()) return size.status();
    if (!index.ok()) return index.status();
    if (*size == 1) return std::shared_ptr<gloo::Context>();
    const std::string key = absl::StrJoin(axes, ",");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(key);
    if (it != contexts_.end()) return it->second;
    // Named by the group and the step that creates the context (the same
    // step on every member).
    const std::string prefix = absl::StrCat("gloo/", position_.GroupName(axes), "/", step_);
    try {
      auto ctx = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(*index),
                                                             static_cast<int>(*size));
      ctx->setTimeout(timeout_);
      gloo::rendezvous::PrefixStore prefixed(prefix, *store_);
      ctx->connectFullMesh(prefixed, device_);
      if (auto* coordinator = dynamic_cast<CoordinatorStore*>(store_.get())) {
        gloo::BarrierOptions every_member_connected(ctx);
        every_member_connected.setTimeout(timeout_);
        gloo::barrier(every_member_connected);
        coordinator->ForgetOwnKeys();
      }
      contexts_[key] = ctx;
      return std::shared_ptr<gloo::Context>(ctx);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot connect the (", key, ") group: ", e.what()));
    }
  }

  MeshPosition position_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<gloo::Context>> contexts_;
  uint64_t step_ = 0;
};

}  // namespace

std::shared_ptr<gloo::rendezvous::Store> MakeCoordinatorStore(std::shared_ptr<grpc::Channel> coordinator,
                                                              const std::string& namespace_prefix,
                                                              std::chrono::milliseconds timeout) {
  return std::make_shared<CoordinatorStore>(std::move(coordinator), namespace_prefix, timeout);
}

std::unique_ptr<Collectives> MakeGlooCollectives(const MeshPosition& position,
                                                 std::shared_ptr<gloo::rendezvous::Store> store,
                                                 const std::string& hostname,
                                                 std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCollectives>(position, std::move(store), hostname, timeout);
}

}  // namespace shardgemm
