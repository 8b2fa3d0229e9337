// The client side of a frame socket (proto/frame_socket_server.h): calls
// sent as frames on one Unix stream connection and answered, in any order,
// by call id. Request and Reply are the socket's messages: Request has
// set_call_id, Reply call_id(), code() (a google.rpc code) and message().
// A call is not sent when there is no connection (Send says so, and the
// caller takes another way); a connection that fails fails its calls in
// flight (UNAVAILABLE) and is tried again at most once a second; a call
// not answered by its deadline ends DEADLINE_EXCEEDED.
//
// Who reads the replies (FrameReader): a thread of the client's own, which
// answers each call's Done (for callers that go on while the call runs), or
// the callers of Call themselves (for callers that wait for their answer):
// then the reply wakes the waiting caller itself and no thread passes it on.
// When several wait, one reads and hands each the reply that is its own.
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
#include <optional>
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

enum class FrameReader {
  kThread,   // the client's reader thread: Send (with a Done) and Call
  kCallers,  // the caller of Call waits by reading: Call only
};

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
  // wrote it, as a gRPC status would be). Connects at the first call.
  FrameSocketClient(std::string path, std::string peer, std::string socket, bool name_peer_in_replies = true,
                    FrameReader reader = FrameReader::kThread)
      : state_(std::make_shared<State>(std::move(path), std::move(peer), std::move(socket), name_peer_in_replies,
                                       reader)) {
    if (reader == FrameReader::kThread) reader_ = std::thread([state = state_] { state->ReadConnections(); });
  }
  ~FrameSocketClient() {
    state_->Stop();
    if (!reader_.joinable()) {
      state_->EndIdleConnection();
    } else if (reader_.get_id() == std::this_thread::get_id()) {
      // Dropped by a callback on the reader's own thread: it cannot be
      // joined there, and ends by itself (it holds the state).
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
  // FrameReader::kThread only (with kCallers nothing would read the
  // answer): there it is never sent.
  bool Send(Request& request, absl::Time deadline, Done* done) {
    if (state_->reader != FrameReader::kThread) return false;
    return state_->Send(request, deadline, done);
  }

  // Sends `request` as a new call and waits for its answer, at most until
  // `deadline`: the reply, or the status Done would have had; nullopt when
  // it was not sent (no connection, or a send that failed: none of it
  // ran), and the caller may take another way.
  std::optional<absl::StatusOr<Reply>> Call(Request& request, absl::Time deadline) {
    return state_->Call(request, deadline);
  }

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
    State(std::string path, std::string peer, std::string socket, bool name_peer_in_replies, FrameReader reader)
        : path(std::move(path)),
          peer(std::move(peer)),
          socket(std::move(socket)),
          name_peer_in_replies(name_peer_in_replies),
          reader(reader) {}

    const std::string path, peer, socket;
    const bool name_peer_in_replies;
    const FrameReader reader;

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

    std::optional<absl::StatusOr<Reply>> Call(Request& request, absl::Time deadline) {
      auto answer = std::make_shared<Answer>();
      Done done = [this, answer](absl::StatusOr<Reply> reply) {
        absl::MutexLock lock(&mu_);
        answer->reply = std::move(reply);
        answer->ready = true;
      };
      if (!Send(request, deadline, &done) && done != nullptr) {
        if (reader == FrameReader::kCallers) EndIfUnusable();
        return std::nullopt;
      }
      const uint64_t id = request.call_id();
      absl::MutexLock lock(&mu_);
      auto ready = [&answer]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return answer->ready; };
      if (reader == FrameReader::kThread) {
        // The reader answers every call by its deadline; the margin covers its poll.
        if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline + kReaderMargin)) Forget(id, answer.get());
        return std::move(answer->reply);
      }
      // Woken by its answer, or when no one reads or ends the connection
      // (then this caller reads it, or its call ended with it).
      auto ready_or_free = [this, &answer]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return answer->ready || (!reading_ && !ending_) || stopping_;
      };
      while (!answer->ready) {
        if (stopping_ || fd_ < 0) {  // a connection that ended failed its calls: not reached
          Forget(id, answer.get());
          break;
        }
        if (reading_ || ending_) {
          if (!mu_.AwaitWithDeadline(absl::Condition(&ready_or_free), deadline)) {
            Forget(id, answer.get());
            break;
          }
          continue;
        }
        // This caller reads, for every waiting caller, until its own answer comes.
        reading_ = true;
        const int fd = fd_;
        const uint64_t connection = connection_;
        mu_.Unlock();
        const absl::Status ended = ReadUntil(fd, *answer, deadline);
        mu_.Lock();
        reading_ = false;
        // Claimed in the same hold of mu_ as reading_ goes: no other caller
        // starts reading a connection that is ending.
        if ((!ended.ok() || (sends_ended_ && pending_.empty())) && ClaimEndLocked(fd, connection)) {
          mu_.Unlock();
          FailEnded(FinishEnd(fd), ended.ok() ? absl::UnavailableError("a send on it failed") : ended);
          mu_.Lock();
        } else if (!answer->ready && absl::Now() >= deadline) {
          Forget(id, answer.get());
        }
      }
      if (sends_ended_) {  // else nothing to end
        mu_.Unlock();
        EndIfUnusable();
        mu_.Lock();
      }
      return std::move(answer->reply);
    }

    void Stop() {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
    }

    // FrameReader::kCallers: the connection closed once no caller reads or
    // ends it (after Stop, a reader sees stopping_ within its 100 ms poll).
    void EndIdleConnection() {
      int fd = -1;
      {
        absl::MutexLock lock(&mu_);
        auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !reading_ && !ending_; };
        mu_.AwaitWithTimeout(absl::Condition(&idle), kReaderMargin);
        if (!reading_ && ClaimEndLocked(fd_, connection_)) fd = fd_;
      }
      if (fd >= 0) FailEnded(FinishEnd(fd), absl::CancelledError("the channel was closed"));
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
        bool mine;
        {
          absl::MutexLock lock(&mu_);
          mine = ClaimEndLocked(fd, connection_);  // always: the reader is the connection's one ender
        }
        if (mine) FailEnded(FinishEnd(fd), ended);
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
    }

   private:
    static constexpr absl::Duration kRetryAfter = absl::Seconds(1);
    static constexpr absl::Duration kReaderMargin = absl::Seconds(5);

    // A Call's answer, guarded by mu_.
    struct Answer {
      bool ready = false;
      absl::StatusOr<Reply> reply = absl::UnknownError("not answered");
    };

    // The call `id` unanswered by its deadline (or its client closing):
    // taken from the pending calls, so a late reply is dropped. A call
    // already taken is being answered by whoever took it, at once.
    void Forget(uint64_t id, Answer* answer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (auto it = pending_.find(id); it != pending_.end()) {
        pending_.erase(it);
        answer->reply = stopping_ ? absl::CancelledError(absl::StrCat(peer, ": the channel was closed"))
                                  : DeadlineExceeded();
        answer->ready = true;
        return;
      }
      auto ready = [answer]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return answer->ready; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&ready), kReaderMargin)) {
        answer->reply = DeadlineExceeded();
        answer->ready = true;
      }
    }

    absl::Status DeadlineExceeded() const {
      return absl::DeadlineExceededError(absl::StrCat(peer, ": no answer on its ", socket, " by the call's deadline"));
    }

    // The connection's fd, connecting first if there is none (at most once
    // per kRetryAfter after a failure); -1 when there is none to use. The
    // connect never waits: a server whose backlog is full gets the call by
    // the caller's other way.
    int ConnectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, write_mu_) {
      if (stopping_) return -1;
      if (fd_ >= 0 && reader == FrameReader::kCallers && !reading_ && !ending_ && pending_.empty()) {
        // No call is in flight, so nothing should wait to be read: the
        // server closed the connection (or refused it), or answered a call
        // after its deadline. It goes, and a fresh one takes the call.
        // (No one else reads or ends it, and writes hold write_mu_.)
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) {
          ::shutdown(fd_, SHUT_RDWR);
          CloseLocked();
          retry_at_ = absl::InfinitePast();
        }
      }
      if (fd_ >= 0) return sends_ended_ || ending_ ? -1 : fd_;
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
      // So is a read inside a frame: a server that stops mid-frame loses the
      // connection, and its reader (a caller, or the reader thread that
      // expires every call's deadline) is not held.
      timeval receive_timeout{10, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &receive_timeout, sizeof(receive_timeout));
      fd_ = fd;  // its reader takes it from here
      ++connection_;
      return fd_;
    }

    // Whoever ends a connection claims it first, under mu_: only the
    // current connection, and only once, so a descriptor number the kernel
    // has given to a newer connection (or anything else) is never shut or
    // closed. Once claimed, no call is sent on it and no caller reads it.
    bool ClaimEndLocked(int fd, uint64_t connection) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (fd < 0 || fd_ != fd || connection_ != connection || ending_) return false;
      ending_ = true;
      return true;
    }
    // Closes the claimed connection once no write can touch it (the
    // shutdown ends a write in progress); the calls it leaves unanswered.
    std::map<uint64_t, Pending> FinishEnd(int fd) ABSL_LOCKS_EXCLUDED(mu_, write_mu_) {
      ::shutdown(fd, SHUT_RDWR);
      absl::MutexLock write_lock(&write_mu_);
      absl::MutexLock lock(&mu_);
      CloseLocked();
      std::map<uint64_t, Pending> failed;
      failed.swap(pending_);
      return failed;
    }
    // Closes fd_, which no one reads, writes or ends any more.
    void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, write_mu_) {
      ::close(fd_);
      fd_ = -1;
      ending_ = false;
      sends_ended_ = false;
    }
    // FrameReader::kCallers: a connection no call can use (a send on it
    // failed) and no call waits on ends here, as there is no reader to end it.
    void EndIfUnusable() ABSL_LOCKS_EXCLUDED(mu_, write_mu_) {
      int fd = -1;
      {
        absl::MutexLock lock(&mu_);
        if (!reading_ && sends_ended_ && pending_.empty() && ClaimEndLocked(fd_, connection_)) fd = fd_;
      }
      if (fd >= 0) FailEnded(FinishEnd(fd), absl::UnavailableError("a send on it failed"));
    }

    // Fails the calls a connection left unanswered, with why it ended.
    void FailEnded(std::map<uint64_t, Pending> failed, const absl::Status& ended) const {
      if (FrameCallNotRun(ended)) {
        Fail(std::move(failed), ended);
      } else {
        Fail(std::move(failed), absl::UnavailableError(absl::StrCat(peer, ": its ", socket,
                                                                    " closed with the call in flight (",
                                                                    ended.message(), ")")));
      }
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
        for (Done& done : expired) done(DeadlineExceeded());
        // Woken by the next frame, or for the earliest deadline (at least
        // every 100 ms: a call sent meanwhile may have an earlier one).
        if (absl::Status s = AnswerNextFrame(fd, earliest); !s.ok()) return s;
      }
    }

    // FrameReader::kCallers: answers the connection's calls until `answer`
    // is ready or `deadline` passes (OK), or the connection ends (why).
    absl::Status ReadUntil(int fd, const Answer& answer, absl::Time deadline) {
      while (true) {
        {
          absl::MutexLock lock(&mu_);
          if (answer.ready) return absl::OkStatus();
          if (stopping_) return absl::CancelledError("the channel was closed");
        }
        if (absl::Now() >= deadline) return absl::OkStatus();
        if (absl::Status s = AnswerNextFrame(fd, deadline); !s.ok()) return s;
      }
    }

    // Waits for the next frame at most until `until` (and 100 ms), and
    // answers the call it is the reply to; an error ends the connection.
    absl::Status AnswerNextFrame(int fd, absl::Time until) {
      const absl::Duration wait = std::clamp(until - absl::Now(), absl::ZeroDuration(), absl::Milliseconds(100));
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait)) + 1);
      if (ready < 0 && errno == EINTR) return absl::OkStatus();
      if (ready == 0) return absl::OkStatus();
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
        if (it == pending_.end()) return absl::OkStatus();  // answered after its deadline
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
      return absl::OkStatus();
    }

    absl::Mutex write_mu_;  // one frame at a time on the socket; taken before mu_
    absl::Mutex mu_;
    int fd_ ABSL_GUARDED_BY(mu_) = -1;
    bool stopping_ ABSL_GUARDED_BY(mu_) = false;
    bool sends_ended_ ABSL_GUARDED_BY(mu_) = false;  // a send failed on fd_: its reader ends it
    bool reading_ ABSL_GUARDED_BY(mu_) = false;      // FrameReader::kCallers: a caller reads fd_
    bool ending_ ABSL_GUARDED_BY(mu_) = false;       // fd_ is claimed by the one who ends it
    uint64_t connection_ ABSL_GUARDED_BY(mu_) = 0;   // counts connections made: which one fd_ is
    absl::Time retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
    uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
    std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  };

  const std::shared_ptr<State> state_;
  std::thread reader_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_FRAME_SOCKET_CLIENT_H_
