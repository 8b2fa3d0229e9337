// A Unix stream socket server of framed protobuf calls (proto/step_frame.h):
// the worker's step socket and the coordinator's call socket. Only processes
// of this server's user may connect (each connection's peer credentials are
// checked). Each frame is handed to the handler on a thread of its own while
// another reads the connection's next frames, so a long call never stops the
// ones behind it; replies go back as the handler gives them, in any order.
#ifndef SHARDGEMM_PROTO_FRAME_SOCKET_SERVER_H_
#define SHARDGEMM_PROTO_FRAME_SOCKET_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message_lite.h"
#include "platform/elastic_thread_pool.h"

namespace shardgemm {

class FrameSocketServer {
 public:
  // Answers one frame; callable from any thread. A reply to a connection
  // that has closed is dropped.
  using Reply = std::function<void(const google::protobuf::MessageLite&)>;
  // Takes one frame's payload. A status other than OK (the payload is not a
  // request) ends the connection: the peer speaks something else.
  using Handler = std::function<absl::Status(std::string payload, Reply reply)>;

  struct Options {
    // For log lines and errors: "step socket", "call socket".
    std::string name = "frame socket";
    // The largest frame read; a larger one ends its connection.
    uint64_t max_payload_bytes = uint64_t{16} << 20;
    int max_connections = 64;
    // Threads reading connections and running the calls they read.
    int max_threads = 1024;
  };

  // Listens on `path` (which must not exist), bound under the caller's
  // umask: a caller that needs the socket owner-only sets it around Start.
  static absl::StatusOr<std::unique_ptr<FrameSocketServer>> Start(const std::string& path, Options options,
                                                                  Handler handler);
  // Stops accepting, ends every connection and waits for the calls running
  // on its threads (a handler that handed its reply on answers into nothing).
  ~FrameSocketServer();
  FrameSocketServer(const FrameSocketServer&) = delete;
  FrameSocketServer& operator=(const FrameSocketServer&) = delete;

  const std::string& path() const { return path_; }
  int connections() const;

 private:
  struct Connection;
  FrameSocketServer(std::string path, Options options, int listen_fd, Handler handler);
  void Accept();
  void Serve(std::shared_ptr<Connection> connection);
  std::string EventName(const char* what) const;

  const std::string path_;
  const Options options_;
  const int listen_fd_;
  const Handler handler_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<platform::ElasticThreadPool> threads_;  // reset first when stopping
  std::thread acceptor_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_FRAME_SOCKET_SERVER_H_
