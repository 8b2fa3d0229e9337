#include "proto/frame_socket_server.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "logging/log.h"
#include "proto/step_frame.h"

namespace shardgemm {

// One accepted connection: its replies are written under `mu`, and the fd
// is closed only under it, so a late reply never writes to a reused fd.
struct FrameSocketServer::Connection {
  explicit Connection(int fd) : fd(fd) {}
  absl::Mutex mu;
  int fd ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;

  void Write(const google::protobuf::MessageLite& reply) {
    absl::MutexLock lock(&mu);
    if (closed) return;
    if (absl::Status s = WriteStepFrame(fd, reply); !s.ok()) {
      // The peer stopped reading (or went): this connection is done.
      ::shutdown(fd, SHUT_RDWR);
    }
  }
  void Close() {
    absl::MutexLock lock(&mu);
    if (closed) return;
    closed = true;
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }
  void Shutdown() {
    absl::MutexLock lock(&mu);
    if (!closed) ::shutdown(fd, SHUT_RDWR);
  }
};

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

FrameSocketServer::~FrameSocketServer() {
  std::vector<std::shared_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    connections = connections_;
  }
  ::shutdown(listen_fd_, SHUT_RDWR);  // ends the acceptor's accept()
  if (acceptor_.joinable()) acceptor_.join();
  for (const auto& c : connections) c->Shutdown();  // ends each reader's recv()
  threads_.reset();  // waits for the readers and the steps running on their threads
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

void FrameSocketServer::Accept() {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
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
    absl::MutexLock lock(&mu_);
    // Connections that ended go from the list.
    std::vector<std::shared_ptr<Connection>> open;
    for (auto& c : connections_) {
      absl::MutexLock connection_lock(&c->mu);
      if (!c->closed) open.push_back(c);
    }
    connections_.swap(open);
    if (stopping_ || static_cast<int>(connections_.size()) >= options_.max_connections) {
      ::close(fd);
      if (stopping_) return;
      continue;
    }
    auto connection = std::make_shared<Connection>(fd);
    if (!threads_->Run([this, connection] { Serve(connection); }).ok()) {
      connection->Close();
      continue;
    }
    connections_.push_back(connection);
  }
}

void FrameSocketServer::Serve(std::shared_ptr<Connection> connection) {
  int fd;
  {
    absl::MutexLock lock(&connection->mu);
    fd = connection->fd;
  }
  while (true) {
    std::string payload;
    // One thread at a time reads a connection, and its fd stays open until
    // the reader that sees it end closes it.
    if (absl::Status s = ReadStepFramePayload(fd, &payload, options_.max_payload_bytes); !s.ok()) {
      if (s.code() != absl::StatusCode::kUnavailable) {
        logging::ProcessLogger().Log(logging::Level::kWarning, EventName("dropped"),
                                     {{"message", std::string(s.message())}});
      }
      break;
    }
    // Another thread reads on while this one runs the call: a long call
    // leaves the next frames read, not stuck in the client's write.
    // With no thread to spare, this one reads again after the call.
    const bool handed_on = threads_->Run([this, connection] { Serve(connection); }).ok();
    std::weak_ptr<Connection> weak = connection;
    const absl::Status taken = handler_(
        std::move(payload),
        [weak](const google::protobuf::MessageLite& reply) {
          if (auto c = weak.lock()) c->Write(reply);
        });
    if (!taken.ok()) {
      logging::ProcessLogger().Log(logging::Level::kWarning, EventName("dropped"),
                                   {{"message", std::string(taken.message())}});
      connection->Shutdown();  // the reader handed on sees the end and closes it
      if (handed_on) return;
      break;
    }
    if (handed_on) return;
  }
  connection->Close();
}

}  // namespace shardgemm
