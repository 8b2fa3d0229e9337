#include "server/step_socket_channel.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/step_frame.h"

namespace shardgemm {
namespace {

struct Pending {
  absl::Time deadline;
  WorkerChannel::ExecuteDone done;
};

// What the channel and its reader share: the reader holds it too, so a
// channel dropped by a callback on the reader's own thread (the last
// reference to it going there) leaves the reader something to finish with.
class StepSocket {
 public:
  StepSocket(std::string path, std::string name) : path_(std::move(path)), name_(std::move(name)) {}

  // Sends `request` as call `id` (set here) whose answer goes to `*done`;
  // false when it was not sent, and `*done` is then back with the caller
  // unless the connection's end already failed it (then null).
  bool Send(v1::StepSocketRequest& request, absl::Time deadline, WorkerChannel::ExecuteDone* done) {
    absl::MutexLock write_lock(&write_mu_);
    int fd = -1;
    uint64_t id = 0;
    {
      absl::MutexLock lock(&mu_);
      fd = ConnectedLocked();
      if (fd < 0) return false;
      id = next_id_++;
      pending_.emplace(id, Pending{deadline, std::move(*done)});
      *done = nullptr;
    }
    request.set_call_id(id);
    if (WriteStepFrame(fd, request).ok()) return true;
    // Not all of the frame went, so the worker runs nothing of it, and the
    // connection is given up.
    absl::MutexLock lock(&mu_);
    if (auto it = pending_.find(id); it != pending_.end()) {
      *done = std::move(it->second.done);
      pending_.erase(it);
    }
    ::shutdown(fd, SHUT_RDWR);
    return false;
  }

  void Stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

  std::map<uint64_t, Pending> TakeAllPending() {
    absl::MutexLock lock(&mu_);
    std::map<uint64_t, Pending> all;
    all.swap(pending_);
    return all;
  }
  // Out of every lock: a done may dispatch again.
  static void Fail(std::map<uint64_t, Pending> calls, const absl::Status& why) {
    for (auto& [id, p] : calls) p.done(why);
  }

  // The channel's one reader: a connection at a time, until the channel goes.
  void ReadConnections() {
    while (true) {
      int fd;
      {
        absl::MutexLock lock(&mu_);
        auto connected_or_stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return fd_ >= 0 || stopping_; };
        mu_.Await(absl::Condition(&connected_or_stopping));
        if (stopping_ && fd_ < 0) return;
        fd = fd_;
      }
      const absl::Status ended = ReadConnection(fd);
      std::map<uint64_t, Pending> failed;
      {
        // The writer may be inside a write on this fd: it is closed only
        // once no write can touch it.
        ::shutdown(fd, SHUT_RDWR);
        absl::MutexLock write_lock(&write_mu_);
        absl::MutexLock lock(&mu_);
        fd_ = -1;
        ::close(fd);
        failed.swap(pending_);
      }
      Fail(std::move(failed), absl::UnavailableError(absl::StrCat(
                                  "worker at ", name_, ": its step socket closed with the step in flight (",
                                  ended.message(), ")")));
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
  }

 private:
  static constexpr absl::Duration kRetryAfter = absl::Seconds(1);

  // The connection's fd, connecting first if there is none (at most once per
  // kRetryAfter after a failure); -1 when there is none to use. The connect
  // never waits: a worker whose backlog is full gets this step on gRPC.
  int ConnectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_) return -1;
    if (fd_ >= 0) return fd_;
    if (absl::Now() < retry_at_) return -1;
    retry_at_ = absl::Now() + kRetryAfter;
    sockaddr_un address{};
    if (path_.size() >= sizeof(address.sun_path)) return -1;
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path_.c_str(), path_.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    const int flags = ::fcntl(fd, F_GETFL);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 || flags < 0 ||
        ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      ::close(fd);
      return -1;
    }
    // A step's write is bounded: a worker that stops reading loses the connection, not this thread.
    timeval send_timeout{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    fd_ = fd;  // the reader takes it from here
    return fd_;
  }

  // Answers the connection's calls and fails those past their deadline;
  // returns why the connection ended.
  absl::Status ReadConnection(int fd) {
    while (true) {
      absl::Time earliest = absl::InfiniteFuture();
      std::vector<WorkerChannel::ExecuteDone> expired;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return absl::CancelledError("the channel was closed");
        const absl::Time now = absl::Now();
        for (auto it = pending_.begin(); it != pending_.end();) {
          if (it->second.deadline <= now) {
            expired.push_back(std::move(it->second.done));
            it = pending_.erase(it);
          } else {
            earliest = std::min(earliest, it->second.deadline);
            ++it;
          }
        }
      }
      for (WorkerChannel::ExecuteDone& done : expired) {
        done(absl::DeadlineExceededError(
            absl::StrCat("worker at ", name_, ": no answer on its step socket by the step's deadline")));
      }
      // Woken by the next frame, or for the earliest deadline (at least every
      // 100 ms: a call sent meanwhile may have an earlier one).
      const absl::Duration wait = std::clamp(earliest - absl::Now(), absl::ZeroDuration(), absl::Milliseconds(100));
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait)) + 1);
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) continue;
      if (ready < 0) return absl::UnavailableError(std::strerror(errno));
      v1::StepSocketReply reply;
      if (absl::Status s = ReadStepFrame(fd, &reply); !s.ok()) return s;
      WorkerChannel::ExecuteDone done;
      {
        absl::MutexLock lock(&mu_);
        auto it = pending_.find(reply.call_id());
        if (it == pending_.end()) continue;  // answered after its deadline
        done = std::move(it->second.done);
        pending_.erase(it);
      }
      if (reply.code() == 0) {
        done(std::move(*reply.mutable_result()));
      } else if (reply.code() < 0 || reply.code() > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
        done(absl::UnknownError(absl::StrCat("worker at ", name_, ": answered status code ", reply.code(),
                                             ", which is none: ", reply.message())));
      } else {
        done(absl::Status(static_cast<absl::StatusCode>(reply.code()),
                          absl::StrCat("worker at ", name_, ": ", reply.message())));
      }
    }
  }

  const std::string path_;
  const std::string name_;
  absl::Mutex write_mu_;  // one frame at a time on the socket; taken before mu_
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

class StepSocketChannel final : public WorkerChannel {
 public:
  StepSocketChannel(std::unique_ptr<WorkerChannel> grpc, std::string path, std::string name, uint64_t max_step_bytes)
      : grpc_(std::move(grpc)),
        socket_(std::make_shared<StepSocket>(std::move(path), name)),
        name_(std::move(name)),
        max_step_bytes_(max_step_bytes) {
    reader_ = std::thread([socket = socket_] { socket->ReadConnections(); });
  }

  ~StepSocketChannel() override {
    socket_->Stop();
    // Dropped by a callback on the reader's own thread: it cannot be joined
    // there, and ends by itself (it holds the socket's state).
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();
    } else {
      reader_.join();
    }
    StepSocket::Fail(socket_->TakeAllPending(),
                     absl::CancelledError(absl::StrCat("worker at ", name_, ": the channel was closed")));
  }

  void ExecuteAsync(v1::Step step, absl::Time deadline, ExecuteDone done) override {
    if (step.ByteSizeLong() > max_step_bytes_) return grpc_->ExecuteAsync(std::move(step), deadline, std::move(done));
    v1::StepSocketRequest request;
    request.mutable_step()->Swap(&step);  // a put's step holds its block: not copied
    request.set_deadline_unix_us(deadline == absl::InfiniteFuture() ? 0 : absl::ToUnixMicros(deadline));
    if (socket_->Send(request, deadline, &done) || done == nullptr) return;
    step.Swap(request.mutable_step());
    grpc_->ExecuteAsync(std::move(step), deadline, std::move(done));
  }

  absl::StatusOr<v1::LocalTensor> GetShard(const std::string& name, absl::Time deadline) override {
    return grpc_->GetShard(name, deadline);
  }
  absl::Status PutShard(const std::string& name, const v1::LocalTensor& shard, absl::Time deadline) override {
    return grpc_->PutShard(name, shard, deadline);
  }
  void CancelSteps(const v1::CancelStepsRequest& request, absl::Time deadline) override {
    grpc_->CancelSteps(request, deadline);
  }
  void AdvanceEpoch(const v1::AdvanceEpochRequest& request, absl::Time deadline) override {
    grpc_->AdvanceEpoch(request, deadline);
  }
  absl::Status ExpectStaged(const v1::ExpectStagedRequest& request, absl::Time deadline) override {
    return grpc_->ExpectStaged(request, deadline);
  }
  absl::Status HoldShard(const v1::HoldShardRequest& request, absl::Time deadline) override {
    return grpc_->HoldShard(request, deadline);
  }
  absl::StatusOr<std::unique_ptr<StageStream>> OpenStage(const v1::StageShardChunk& header,
                                                         absl::Time deadline) override {
    return grpc_->OpenStage(header, deadline);
  }
  absl::Status DropStaged(const v1::DropStagedRequest& request, absl::Time deadline) override {
    return grpc_->DropStaged(request, deadline);
  }
  absl::Status ForgetClientMemory(const v1::ForgetClientMemoryRequest& request, absl::Time deadline) override {
    return grpc_->ForgetClientMemory(request, deadline);
  }
  absl::Status Ping(absl::Time deadline) override { return grpc_->Ping(deadline); }

 private:
  const std::unique_ptr<WorkerChannel> grpc_;
  const std::shared_ptr<StepSocket> socket_;
  const std::string name_;
  const uint64_t max_step_bytes_;
  std::thread reader_;
};

}  // namespace

std::unique_ptr<WorkerChannel> MakeStepSocketChannel(std::unique_ptr<WorkerChannel> grpc,
                                                     const std::string& socket_path, const std::string& name,
                                                     uint64_t max_step_bytes) {
  return std::make_unique<StepSocketChannel>(std::move(grpc), socket_path, name, max_step_bytes);
}

}  // namespace shardgemm
