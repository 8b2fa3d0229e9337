// The client side of a frame socket (proto/frame_socket_server.h): calls
// sent as frames on one Unix stream connection and answered, in any order,
// by call id. Request and Reply are the socket's messages: Request has
// set_call_id, Reply call_id(), code() (a google.rpc code) and message().
// A call is not sent when there is no connection (Send says so, and the
// caller takes another way); a connection that fails fails its calls in
// flight (UNAVAILABLE) and is tried again at most once a second; a call
// not answered by its deadline ends DEADLINE_EXCEEDED.
#ifndef SHARDGEMM_PROTO_FRAME_SOCKET_CLIENT_H_
#define SHARDGEMM_PROTO_FRAME_SOCKET_CLIENT_H_

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/step_frame.h"

namespace shardgemm {

// A call's status says none of it ran (the server refused the connection
// it went on, before reading it): the caller may send it another way.
inline constexpr char kFrameCallNotRunUrl[] = "type.shardgemm/frame_call_not_run";
// A call the server answered with an error carries the whole reply (its
// other fields: a request id) as this payload, serialized.
inline constexpr char kFrameReplyUrl[] = "type.shardgemm/frame_reply";
inline bool FrameCallNotRun(const absl::Status& status) {
  return status.GetPayload(kFrameCallNotRunUrl).has_value();
}

template <typename Request, typename Reply>
class FrameSocketClient {
 public:
  // The call's reply (code OK), or its status: the reply's code and
  // message, or why it got none. Runs once, on the reader's thread or on
  // the caller's; it may send again.
  using Done = std::function<void(absl::StatusOr<Reply>)>;

  // `peer` names the server in errors ("worker at HOST:PORT"); `socket`
  // names the socket ("step socket"). `name_peer_in_replies`: a reply's
  // message is prefixed with `peer` too (else passed on as the server
  // wrote it, as a gRPC status would be). Connects at the first Send.
  FrameSocketClient(std::string path, std::string peer, std::string socket, bool name_peer_in_replies = true)
      : state_(std::make_shared<State>(std::move(path), std::move(peer), std::move(socket), name_peer_in_replies)) {
    reader_ = std::thread([state = state_] { state->ReadConnections(); });
  }
  ~FrameSocketClient() {
    state_->Stop();
    // Dropped by a callback on the reader's own thread: it cannot be joined
    // there, and ends by itself (it holds the state).
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();
    } else {
      reader_.join();
    }
    State::Fail(state_->TakeAllPending(), absl::CancelledError(absl::StrCat(state_->peer, ": the channel was closed")));
  }
  FrameSocketClient(const FrameSocketClient&) = delete;
  FrameSocketClient& operator=(const FrameSocketClient&) = delete;

  // Sends `request` as a new call (its call_id set here) whose answer goes
  // to `*done`. False when it was not sent: `*done` is then back with the
  // caller, unless the connection's end already answered it (then null).
  bool Send(Request& request, absl::Time deadline, Done* done) { return state_->Send(request, deadline, done); }

 private:
  struct Pending {
    absl::Time deadline;
    Done done;
  };

  // What the client and its reader share: the reader holds it too, so a
  // client dropped by a callback on the reader's own thread leaves the
  // reader something to finish with.
  class State {
   public:
    State(std::string path, std::string peer, std::string socket, bool name_peer_in_replies)
        : path(std::move(path)),
          peer(std::move(peer)),
          socket(std::move(socket)),
          name_peer_in_replies(name_peer_in_replies) {}

    const std::string path, peer, socket;
    const bool name_peer_in_replies;

    bool Send(Request& request, absl::Time deadline, Done* done) {
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
      // Not all of the frame went, so the server runs nothing of it, and
      // the connection takes no call more. Its reader goes on: the server
      // (one that stopped reading for a shutdown) may still answer the
      // calls it read, and the reader ends the connection at its end.
      absl::MutexLock lock(&mu_);
      if (auto it = pending_.find(id); it != pending_.end()) {
        *done = std::move(it->second.done);
        pending_.erase(it);
      }
      if (fd_ == fd && !sends_ended_) {
        sends_ended_ = true;
        ::shutdown(fd, SHUT_WR);
      }
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
    // Out of every lock: a done may send again.
    static void Fail(std::map<uint64_t, Pending> calls, const absl::Status& why) {
      for (auto& [id, p] : calls) p.done(why);
    }

    // The client's one reader: a connection at a time, until the client goes.
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
          sends_ended_ = false;
          ::close(fd);
          failed.swap(pending_);
        }
        if (FrameCallNotRun(ended)) {
          Fail(std::move(failed), ended);
        } else {
          Fail(std::move(failed), absl::UnavailableError(absl::StrCat(peer, ": its ", socket,
                                                                      " closed with the call in flight (",
                                                                      ended.message(), ")")));
        }
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
    }

   private:
    static constexpr absl::Duration kRetryAfter = absl::Seconds(1);

    // The connection's fd, connecting first if there is none (at most once
    // per kRetryAfter after a failure); -1 when there is none to use. The
    // connect never waits: a server whose backlog is full gets the call by
    // the caller's other way.
    int ConnectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (stopping_) return -1;
      if (fd_ >= 0) return sends_ended_ ? -1 : fd_;
      if (absl::Now() < retry_at_) return -1;
      retry_at_ = absl::Now() + kRetryAfter;
      sockaddr_un address{};
      if (path.size() >= sizeof(address.sun_path)) return -1;
      address.sun_family = AF_UNIX;
      std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
      const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) return -1;
      const int flags = ::fcntl(fd, F_GETFL);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 || flags < 0 ||
          ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        ::close(fd);
        return -1;
      }
      // Only a server of this user gets the calls (and the token in them):
      // a socket another user bound at the path is not ours.
      ucred server{};
      socklen_t length = sizeof(server);
      if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &server, &length) != 0 || server.uid != ::geteuid()) {
        ::close(fd);
        return -1;
      }
      // A call's write is bounded: a server that stops reading loses the
      // connection, not this thread.
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
        std::vector<Done> expired;
        {
          absl::MutexLock lock(&mu_);
          if (stopping_) return absl::CancelledError("the channel was closed");
          if (sends_ended_ && pending_.empty()) return absl::UnavailableError("a send on it failed");
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
        for (Done& done : expired) {
          done(absl::DeadlineExceededError(absl::StrCat(peer, ": no answer on its ", socket, " by the call's deadline")));
        }
        // Woken by the next frame, or for the earliest deadline (at least
        // every 100 ms: a call sent meanwhile may have an earlier one).
        const absl::Duration wait =
            std::clamp(earliest - absl::Now(), absl::ZeroDuration(), absl::Milliseconds(100));
        pollfd p{fd, POLLIN, 0};
        const int ready = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait)) + 1);
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0) continue;
        if (ready < 0) return absl::UnavailableError(std::strerror(errno));
        Reply reply;
        if (absl::Status s = ReadStepFrame(fd, &reply); !s.ok()) return s;
        if (reply.call_id() == 0 && reply.code() != 0) {
          // The connection's refusal: the server read none of its calls.
          absl::Status refused = absl::UnavailableError(
              absl::StrCat(peer, ": its ", socket, " refused the connection: ", reply.message()));
          refused.SetPayload(kFrameCallNotRunUrl, absl::Cord());
          return refused;
        }
        Done done;
        {
          absl::MutexLock lock(&mu_);
          auto it = pending_.find(reply.call_id());
          if (it == pending_.end()) continue;  // answered after its deadline
          done = std::move(it->second.done);
          pending_.erase(it);
        }
        if (reply.code() == 0) {
          done(std::move(reply));
        } else if (reply.code() < 0 || reply.code() > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
          done(absl::UnknownError(
              absl::StrCat(peer, ": answered status code ", reply.code(), ", which is none: ", reply.message())));
        } else {
          absl::Status status(static_cast<absl::StatusCode>(reply.code()),
                              name_peer_in_replies ? absl::StrCat(peer, ": ", reply.message()) : reply.message());
          status.SetPayload(kFrameReplyUrl, absl::Cord(reply.SerializeAsString()));
          done(std::move(status));
        }
      }
    }

    absl::Mutex write_mu_;  // one frame at a time on the socket; taken before mu_
    absl::Mutex mu_;
    int fd_ ABSL_GUARDED_BY(mu_) = -1;
    bool stopping_ ABSL_GUARDED_BY(mu_) = false;
    bool sends_ended_ ABSL_GUARDED_BY(mu_) = false;  // a send failed on fd_: its reader ends it
    absl::Time retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
    uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
    std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  };

  const std::shared_ptr<State> state_;
  std::thread reader_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_FRAME_SOCKET_CLIENT_H_
