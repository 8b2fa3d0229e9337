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

// A rendezvous the coordinator ended because its epoch was revoked (the
// store answered ABORTED): the member it waits for has given it up.
class RendezvousRevoked : public gloo::IoException {
 public:
  using gloo::IoException::IoException;
};

class CoordinatorStore : public gloo::rendezvous::Store {
 public:
  CoordinatorStore(std::shared_ptr<grpc::Channel> coordinator, std::string prefix,
                   std::chrono::milliseconds timeout)
      : prefix_(std::move(prefix)), stub_(v1::Coordination::NewStub(std::move(coordinator))), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override { Set(key, data, 0); }
  std::vector<char> get(const std::string& key) override { return Get(key, 0); }
  // Gloo's own waits (connectFullMesh's gets) use its 30 s default: ours is
  // the collective timeout, so a peer that never comes fails the step in time.
  void wait(const std::vector<std::string>& keys) override { Fetch(keys, timeout_, 0); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Fetch(keys, timeout, 0);
  }

  // As set, get and wait, for a communicator of mesh epoch `epoch`: the
  // coordinator ends them at once once that epoch is revoked.
  void Set(const std::string& key, const std::vector<char>& data, uint64_t epoch) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StoreSetRequest request;
    request.set_key(prefix_ + key);
    request.set_value(std::string(data.begin(), data.end()));
    request.set_epoch(epoch);
    v1::StoreSetResponse response;
    grpc::Status s = stub_->StoreSet(&ctx, request, &response);
    if (!s.ok()) Throw("rendezvous set failed: ", s);
    std::lock_guard<std::mutex> lock(mu_);
    own_keys_.push_back(request.key());
  }
  std::vector<char> Get(const std::string& key, uint64_t epoch) {
    auto values = Fetch({key}, timeout_, epoch);
    return std::vector<char>(values[0].begin(), values[0].end());
  }
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout, uint64_t epoch) {
    Fetch(keys, timeout, epoch);
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

 private:
  [[noreturn]] static void Throw(const std::string& what, const grpc::Status& s) {
    if (s.error_code() == grpc::StatusCode::ABORTED) throw RendezvousRevoked(what + s.error_message());
    throw gloo::IoException(what + s.error_message());
  }

  std::vector<std::string> Fetch(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                                 uint64_t epoch) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
    v1::StoreGetRequest request;
    for (const auto& k : keys) request.add_keys(prefix_ + k);
    request.set_timeout_ms(timeout.count());
    request.set_epoch(epoch);
    v1::StoreGetResponse response;
    grpc::Status s = stub_->StoreGet(&ctx, request, &response);
    if (!s.ok()) Throw("rendezvous get failed: ", s);
    return std::vector<std::string>(response.values().begin(), response.values().end());
  }

  std::string prefix_;
  std::unique_ptr<v1::Coordination::Stub> stub_;
  std::mutex mu_;
  std::vector<std::string> own_keys_;
  const std::chrono::milliseconds timeout_;
};

// The store as one epoch's rendezvous uses it: through the coordinator its
// requests carry the epoch; any other store (a test's, a bench's) as is.
class EpochStore : public gloo::rendezvous::Store {
 public:
  EpochStore(gloo::rendezvous::Store& store, uint64_t epoch)
      : store_(store), coordinator_(dynamic_cast<CoordinatorStore*>(&store)), epoch_(epoch) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    if (coordinator_ != nullptr) return coordinator_->Set(key, data, epoch_);
    store_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    return coordinator_ != nullptr ? coordinator_->Get(key, epoch_) : store_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    if (coordinator_ != nullptr) return coordinator_->Wait(keys, timeout, epoch_);
    store_.wait(keys, timeout);
  }

 private:
  gloo::rendezvous::Store& store_;
  CoordinatorStore* const coordinator_;
  const uint64_t epoch_;
};

// Ends every collective blocked on `context` now, as its timeout would:
// a receive nobody sends, waited on for a millisecond, times out, and Gloo
// then fails every pair of the context (a waiting collective throws; the
// pairs' sockets close, so the peers' collectives on their side of the
// context fail too). Gloo has no public call that does this directly.
void Interrupt(gloo::Context& context) {
  // A slot no collective uses: Gloo's collectives' slots carry their kind
  // (1 to 8) in the top byte.
  constexpr uint64_t kInterruptSlot = uint64_t{0xFF} << 56;
  char byte = 0;
  try {
    auto buffer = context.createUnboundBuffer(&byte, 1);
    buffer->recv((context.rank + 1) % context.size, kInterruptSlot);
    buffer->waitRecv(std::chrono::milliseconds(1));
  } catch (const std::exception&) {
    // Expected: the timeout, or a context already broken.
  }
}

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

  void BeginStep(uint64_t sequence, uint64_t epoch) override {
    step_ = sequence;
    Revoke(epoch, "");
    std::lock_guard<std::mutex> lock(mu_);
    step_epoch_ = epoch;
  }

  void Revoke(uint64_t epoch, const std::string& why) override {
    std::vector<std::shared_ptr<gloo::Context>> revoked;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (epoch < epoch_) return;
      if (epoch == epoch_) {
        if (why_.empty()) why_ = why;
        return;
      }
      epoch_ = epoch;
      why_ = why;
      for (auto& [key, group] : groups_) {
        if (group.context != nullptr) revoked.push_back(std::move(group.context));
      }
      groups_.clear();
    }
    for (auto& context : revoked) Interrupt(*context);
  }

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
  // fault tests). Tagged with the step's sequence, such a pair never matches.
  // (The epoch already keeps it from happening: a missed step advances it.)
  uint32_t Tag() const { return static_cast<uint32_t>(step_); }

  // This worker's communicator of one group in the current epoch.
  struct Group {
    std::shared_ptr<gloo::Context> context;  // null once broken
    std::string broken;                      // why, once it broke: not built again this epoch
  };

  // ABORTED when the running step's epoch was revoked.
  absl::Status RevokedLocked() const {
    if (step_epoch_ < epoch_) return RevokedStatus(step_epoch_, epoch_, why_);
    return absl::OkStatus();
  }

  // The group over `key` broke in the running step's epoch (`why`): its
  // later collectives in this epoch fail at once.
  void MarkBroken(const std::string& key, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (step_epoch_ == epoch_) groups_[key] = Group{nullptr, why};
  }

  absl::Status Broken(const std::vector<std::string>& axes, const std::exception& e) {
    const std::string key = absl::StrJoin(axes, ",");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (absl::Status revoked = RevokedLocked(); !revoked.ok()) return revoked;  // interrupted by Revoke
    }
    // A context that timed out or lost a peer cannot be trusted again.
    const std::string why = absl::StrCat("collective over (", key, ") failed: ", e.what());
    MarkBroken(key, why);
    return absl::UnavailableError(why);
  }

  // The context of this worker's group over `axes` in the running step's
  // epoch; null for a group of one.
  absl::StatusOr<std::shared_ptr<gloo::Context>> Context(const std::vector<std::string>& axes) {
    auto size = position_.GroupSize(axes);
    auto index = position_.GroupIndex(axes);
    if (!size.ok()) return size.status();
    if (!index.ok()) return index.status();
    if (*size == 1) return std::shared_ptr<gloo::Context>();
    const std::string key = absl::StrJoin(axes, ",");
    uint64_t epoch = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (absl::Status revoked = RevokedLocked(); !revoked.ok()) return revoked;
      auto it = groups_.find(key);
      if (it != groups_.end()) {
        if (it->second.context != nullptr) return it->second.context;
        return absl::UnavailableError(absl::StrCat(it->second.broken, " earlier in mesh epoch ", epoch_,
                                                   "; the coordinator rebuilds the group's collectives in the next"));
      }
      epoch = step_epoch_;
    }
    // Named by the group and the epoch (built once per epoch, at the same
    // step on every member). The rendezvous waits out of the lock: a Revoke
    // meanwhile ends it through the coordinator's store.
    const std::string prefix = absl::StrCat("gloo/", position_.GroupName(axes), "/", epoch);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(*index), static_cast<int>(*size));
    ctx->setTimeout(timeout_);
    try {
      EpochStore scoped(*store_, epoch);
      gloo::rendezvous::PrefixStore prefixed(prefix, scoped);
      ctx->connectFullMesh(prefixed, device_);
    } catch (const RendezvousRevoked& e) {
      MarkBroken(key, e.what());
      return absl::AbortedError(absl::StrCat("cannot connect the (", key, ") group: ", e.what()));
    } catch (const std::exception& e) {
      const std::string why = absl::StrCat("cannot connect the (", key, ") group: ", e.what());
      MarkBroken(key, why);
      return absl::UnavailableError(why);
    }
    absl::Status revoked;
    {
      std::lock_guard<std::mutex> lock(mu_);
      revoked = RevokedLocked();
      if (revoked.ok()) groups_[key] = Group{ctx, ""};  // from here a Revoke interrupts it
    }
    if (!revoked.ok()) {
      Interrupt(*ctx);  // revoked while it connected: its peers give it up too
      return revoked;
    }
    if (auto* coordinator = dynamic_cast<CoordinatorStore*>(store_.get())) {
      try {
        gloo::BarrierOptions every_member_connected(ctx);
        every_member_connected.setTimeout(timeout_);
        every_member_connected.setTag(Tag());
        gloo::barrier(every_member_connected);
      } catch (const std::exception& e) {
        return Broken(axes, e);
      }
      coordinator->ForgetOwnKeys();
    }
    return std::shared_ptr<gloo::Context>(ctx);
  }

  MeshPosition position_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::mutex mu_;
  uint64_t epoch_ = 0;       // the newest epoch known: a step's, or Revoke's
  std::string why_;          // why epoch_ began (may be empty)
  uint64_t step_epoch_ = 0;  // the running step's
  std::map<std::string, Group> groups_;  // epoch_'s, by axes
  uint64_t step_ = 0;        // the running step's sequence (its thread only)
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
