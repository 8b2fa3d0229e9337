#include "proto/frame_socket_server.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "logging/log.h"
#include "proto/step_frame.h"

namespace shardgemm {

// One accepted connection. Replies are written in the order given: at once
// when the socket takes the whole frame without waiting, else queued for a
// drainer on the server's pool, which writes them without holding `mu`. The
// fd is closed only once no write can touch it, so a late reply never
// writes to a reused fd.
struct FrameSocketServer::Connection : std::enable_shared_from_this<FrameSocketServer::Connection> {
  Connection(int fd, platform::ElasticThreadPool* pool) : fd(fd), pool(pool) {}
  absl::Mutex mu;
  const int fd;
  platform::ElasticThreadPool* const pool;  // not touched once writes_ended
  bool writes_ended ABSL_GUARDED_BY(mu) = false;  // replies are dropped
  bool closed ABSL_GUARDED_BY(mu) = false;        // the connection is over
  bool fd_open ABSL_GUARDED_BY(mu) = true;
  bool draining ABSL_GUARDED_BY(mu) = false;      // a drainer owns the queue's writes
  std::deque<std::string> queued ABSL_GUARDED_BY(mu);
  size_t queued_front_sent ABSL_GUARDED_BY(mu) = 0;
  // A peer that ended its writes still reads the answers to the calls it
  // sent: the connection closes once they are written.
  int calls_open ABSL_GUARDED_BY(mu) = 0;  // read, their replies not yet given or dropped
  bool peer_done ABSL_GUARDED_BY(mu) = false;

  void Write(const google::protobuf::MessageLite& reply) {
    const size_t payload = reply.ByteSizeLong();
    if (payload > kMaxStepFramePayloadBytes) {
      EndWrites();  // the peer would wait for an answer that cannot be sent
      return;
    }
    std::string frame = StepFrameHeader(payload);
    frame.resize(kStepFrameHeaderBytes + payload);
    if (!reply.SerializeToArray(frame.data() + kStepFrameHeaderBytes, static_cast<int>(payload))) {
      EndWrites();
      return;
    }
    absl::MutexLock lock(&mu);
    if (writes_ended) return;
    size_t sent = 0;
    if (!draining && queued.empty()) {
      while (sent < frame.size()) {
        const ssize_t w = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
          sent += static_cast<size_t>(w);
          continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        EndWritesLocked();  // the peer went
        return;
      }
      if (sent == frame.size()) return;
    }
    queued.push_back(std::move(frame));
    if (queued.size() == 1) queued_front_sent = sent;
    if (draining) return;
    draining = true;
    if (!pool->Run([self = shared_from_this()] { self->Drain(); }).ok()) {
      draining = false;
      EndWritesLocked();  // no thread to write with: the peer hears the connection end
    }
  }

  void Drain();
  void EndWrites() {
    absl::MutexLock lock(&mu);
    EndWritesLocked();
  }
  void EndWritesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    writes_ended = true;
    queued.clear();
    if (fd_open) ::shutdown(fd, SHUT_RDWR);
  }
  // Waits (up to `until`) for the replies given so far to be written.
  bool Flush(absl::Time until) {
    absl::MutexLock lock(&mu);
    auto written = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return writes_ended || (!draining && queued.empty()); };
    return mu.AwaitWithDeadline(absl::Condition(&written), until);
  }
  void CallStarted() {
    absl::MutexLock lock(&mu);
    ++calls_open;
  }
  void CallEnded() {
    absl::MutexLock lock(&mu);
    --calls_open;
    CloseIfDoneLocked();
  }
  // The peer ended its writes (or went): closed once its calls are answered.
  void PeerDone() {
    absl::MutexLock lock(&mu);
    peer_done = true;
    CloseIfDoneLocked();
  }
  void CloseIfDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (peer_done && calls_open == 0 && !draining && queued.empty()) CloseLocked();
  }
  // Reads no more; replies still go out.
  void StopReading() {
    absl::MutexLock lock(&mu);
    if (fd_open) ::shutdown(fd, SHUT_RD);
  }
  void Close() {
    absl::MutexLock lock(&mu);
    CloseLocked();
  }
  // A drainer still writing closes the fd when it stops.
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    EndWritesLocked();
    closed = true;
    if (fd_open && !draining) {
      ::close(fd);
      fd_open = false;
    }
  }
};

void FrameSocketServer::Connection::Drain() {
  while (true) {
    std::string frame;
    size_t sent = 0;
    {
      absl::MutexLock lock(&mu);
      if (writes_ended || queued.empty()) {
        draining = false;
        if (closed && fd_open) {
          ::close(fd);
          fd_open = false;
        }
        CloseIfDoneLocked();
        return;
      }
      frame = std::move(queued.front());
      queued.pop_front();
      sent = queued_front_sent;
      queued_front_sent = 0;
    }
    // Blocking, bounded by the socket's SO_SNDTIMEO; EndWrites' shutdown ends it.
    while (sent < frame.size()) {
      const ssize_t w = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (w > 0) {
        sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      EndWrites();  // the peer went, or read nothing for the send timeout
      break;
    }
  }
}

absl::StatusOr<std::unique_ptr<FrameSocketServer>> FrameSocketServer::Start(const std::string& path,
                                                                            Options options, Handler handler) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, " path '", path, "' is longer than a Unix socket's ", sizeof(address.sun_path) - 1));
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat(options.name, ": socket(): ", std::strerror(errno)));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat(options.name, ": cannot listen on ", path, ": ", why));
  }
  auto server = std::unique_ptr<FrameSocketServer>(new FrameSocketServer(path, std::move(options), fd, std::move(handler)));
  server->acceptor_ = std::thread([s = server.get()] { s->Accept(); });
  return server;
}

FrameSocketServer::FrameSocketServer(std::string path, Options options, int listen_fd, Handler handler)
    : path_(std::move(path)),
      options_(std::move(options)),
      listen_fd_(listen_fd),
      handler_(std::move(handler)),
      threads_(std::make_unique<platform::ElasticThreadPool>(options_.max_threads)) {}

// "step_socket_dropped" for the step socket.
std::string FrameSocketServer::EventName(const char* what) const {
  std::string name = options_.name;
  for (char& c : name) {
    if (c == ' ') c = '_';
  }
  return absl::StrCat(name, "_", what);
}

bool FrameSocketServer::StopReading(absl::Duration bound) {
  std::vector<std::shared_ptr<Connection>> connections;
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    first = !reading_stopped_;
    reading_stopped_ = true;
    connections = connections_;
  }
  if (first) {
    ::shutdown(listen_fd_, SHUT_RDWR);  // ends the acceptor's accept()
    if (acceptor_.joinable()) acceptor_.join();
    for (const auto& c : connections) c->StopReading();  // ends each reader's recv()
  }
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return serving_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), bound);
}

bool FrameSocketServer::FlushReplies(absl::Duration bound) {
  const absl::Time until = absl::Now() + bound;
  std::vector<std::shared_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    connections = connections_;
  }
  bool flushed = true;
  for (const auto& c : connections) flushed = c->Flush(until) && flushed;
  return flushed;
}

FrameSocketServer::~FrameSocketServer() {
  StopReading(absl::ZeroDuration());
  std::vector<std::shared_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    connections = connections_;
  }
  for (const auto& c : connections) c->EndWrites();  // ends each drainer's send()
  threads_.reset();  // waits for the readers, the calls running on their threads and the drainers
  for (const auto& c : connections) c->Close();
  ::close(listen_fd_);
  ::unlink(path_.c_str());
}

int FrameSocketServer::connections() const {
  absl::MutexLock lock(&mu_);
  int open = 0;
  for (const auto& c : connections_) {
    absl::MutexLock connection_lock(&c->mu);
    open += c->closed ? 0 : 1;
  }
  return open;
}

bool FrameSocketServer::ServeOnPool(const std::shared_ptr<Connection>& connection) {
  {
    absl::MutexLock lock(&mu_);
    ++serving_;
  }
  if (threads_->Run([this, connection] { Serve(connection); }).ok()) return true;
  absl::MutexLock lock(&mu_);
  --serving_;
  return false;
}

void FrameSocketServer::Accept() {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      {
        absl::MutexLock lock(&mu_);
        if (reading_stopped_) return;
      }
      if (error == EBADF || error == EINVAL || error == ENOTSOCK) return;  // the socket itself is gone
      // Out of descriptors or memory for now: the clients' calls go on gRPC meanwhile.
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("accept_failed"),
                                   {{"message", std::strerror(error)}});
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    ucred peer{};
    socklen_t length = sizeof(peer);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0 || peer.uid != ::geteuid()) {
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("refused"),
                                   {{"message", absl::StrCat("a process of another user connected to the ", options_.name)}});
      ::close(fd);
      continue;
    }
    // A reply's write is bounded: a client that stops reading loses the connection, not a thread.
    timeval send_timeout{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    auto refuse = [&](const char* why) {
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("refused"),
                                   {{"message", absl::StrCat("a connection to the ", options_.name, ": ", why)}});
      if (!options_.refusal.empty()) {
        const std::string frame = absl::StrCat(StepFrameHeader(options_.refusal.size()), options_.refusal);
        // The socket's buffer takes a frame this small at once; a client that
        // already wrote its call reads the refusal before the end.
        (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::shutdown(fd, SHUT_WR);
      }
      ::close(fd);
    };
    absl::MutexLock lock(&mu_);
    if (reading_stopped_) {
      ::close(fd);
      return;
    }
    // Connections that ended go from the list.
    std::vector<std::shared_ptr<Connection>> open;
    for (auto& c : connections_) {
      absl::MutexLock connection_lock(&c->mu);
      if (!c->closed) open.push_back(c);
    }
    connections_.swap(open);
    if (static_cast<int>(connections_.size()) >= options_.max_connections) {
      refuse(absl::StrCat("more than the ", options_.max_connections, " allowed at once").c_str());
      continue;
    }
    ++serving_;
    auto connection = std::make_shared<Connection>(fd, threads_.get());
    if (!threads_->Run([this, connection] { Serve(connection); }).ok()) {
      --serving_;
      refuse("no thread free to serve it");  // closes the fd; the connection was never listed
      continue;
    }
    connections_.push_back(connection);
  }
}

void FrameSocketServer::Serve(std::shared_ptr<Connection> connection) {
  const int fd = connection->fd;
  // Once this thread is done with the connection.
  auto leave = [this] {
    absl::MutexLock lock(&mu_);
    --serving_;
  };
  // Each call's reply holds the call open until it is given or dropped.
  struct CallHold {
    explicit CallHold(std::shared_ptr<Connection> c) : connection(std::move(c)) { connection->CallStarted(); }
    ~CallHold() { connection->CallEnded(); }
    const std::shared_ptr<Connection> connection;
  };
  auto reply_for_a_call = [&connection]() -> Reply {
    auto hold = std::make_shared<CallHold>(connection);
    return [hold](const google::protobuf::MessageLite& message) { hold->connection->Write(message); };
  };
  bool peer_done = false;
  while (true) {
    // One thread at a time reads a connection, and its fd stays open until
    // the reader that sees it end closes it.
    std::string payload;
    absl::StatusOr<uint64_t> bytes = ReadStepFrameHeader(fd);
    absl::Status read = bytes.status();
    bool oversized = false;
    if (bytes.ok() && *bytes > options_.max_payload_bytes) {
      if (options_.oversized == nullptr) {
        read = absl::DataLossError(absl::StrCat("a frame of ", *bytes, " bytes, more than the ",
                                                options_.max_payload_bytes, " allowed"));
      } else {
        read = SkipStepFrameBody(fd, *bytes, kOversizedHeadBytes, &payload);
        oversized = true;
      }
    } else if (bytes.ok()) {
      read = ReadStepFrameBody(fd, *bytes, &payload);
    }
    if (!read.ok()) {
      if (read.code() != absl::StatusCode::kUnavailable) {
        logging::ProcessLogger().Log(logging::Level::kWarning, EventName("dropped"),
                                     {{"message", std::string(read.message())}});
      } else {
        peer_done = true;  // at a frame's boundary: its calls are still answered
      }
      break;
    }
    {
      // A frame already in the socket's buffer when reading stopped is
      // still read: it is not run (the pool may be going).
      absl::MutexLock lock(&mu_);
      if (reading_stopped_) break;
    }
    if (oversized) {
      const absl::Status answered = options_.oversized(std::move(payload), *bytes, reply_for_a_call());
      if (answered.ok()) continue;
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("dropped"),
                                   {{"message", std::string(answered.message())}});
      connection->EndWrites();
      break;
    }
    // Another thread reads on while this one runs the call: a long call
    // leaves the next frames read, not stuck in the client's write.
    // With no thread to spare, this one reads again after the call.
    Reply reply = reply_for_a_call();  // before the next reader can see the peer done
    const bool handed_on = ServeOnPool(connection);
    const absl::Status taken = handler_(std::move(payload), std::move(reply));
    if (!taken.ok()) {
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("dropped"),
                                   {{"message", std::string(taken.message())}});
      connection->EndWrites();  // the reader handed on sees the end and closes it
      if (handed_on) return leave();
      break;
    }
    if (handed_on) return leave();
  }
  bool close = true;
  {
    // Reading stopped for a shutdown: the replies of the calls in flight
    // still go out, and the destructor closes the connection.
    absl::MutexLock lock(&mu_);
    close = !reading_stopped_ || stopping_;
  }
  if (close && peer_done) {
    connection->PeerDone();
  } else if (close) {
    connection->Close();
  }
  leave();
}

}  // namespace shardgemm
