// A Unix stream socket server of framed protobuf calls (proto/step_frame.h):
// the worker's step socket and the coordinator's call socket. Only processes
// of this server's user may connect (each connection's peer credentials are
// checked). Each frame is handed to the handler on a thread of its own while
// another reads the connection's next frames, so a long call never stops the
// ones behind it; replies go back as the handler gives them, in any order,
// and a reply the socket cannot take at once is written by a thread of the
// server's, so the thread that answers (a completion) never waits on a
// client that reads slowly.
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
#include "absl/time/time.h"
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

  // Answers a frame larger than Options::max_payload_bytes, read and
  // dropped: `head` is its payload's first kOversizedHeadBytes (room for
  // the call id a reply names, and for small fields a writer may put before
  // it: a token, a request id).
  // A status other than OK (no call to answer under) ends the connection,
  // as the handler's does.
  using Oversized = std::function<absl::Status(std::string head, uint64_t payload_bytes, Reply reply)>;
  static constexpr size_t kOversizedHeadBytes = 4096;

  struct Options {
    // For log lines and errors: "step socket", "call socket".
    std::string name = "frame socket";
    // The largest frame taken. A larger one ends its connection, unless
    // `oversized` is set: then it is read, dropped and answered by it.
    uint64_t max_payload_bytes = uint64_t{16} << 20;
    Oversized oversized;
    // Connections past this are refused: sent `refusal` (a serialized
    // reply, when not empty) as one frame, then closed, none of their
    // frames read.
    int max_connections = 64;
    std::string refusal;
    // Threads reading connections, running the calls they read and
    // writing the replies the socket could not take at once.
    int max_threads = 1024;
  };

  // Listens on `path` (which must not exist), bound under the caller's
  // umask: a caller that needs the socket owner-only sets it around Start.
  static absl::StatusOr<std::unique_ptr<FrameSocketServer>> Start(const std::string& path, Options options,
                                                                  Handler handler);
  // Stops taking calls: refuses new connections, runs no frame more, and
  // waits (up to `bound`) for the handlers running; replies still go out,
  // so the calls in flight can be answered before the server goes. False
  // when a handler was still running at the bound. A later call only waits
  // (a shutdown stops the reading at once, ends what the handlers wait on,
  // then waits for them).
  bool StopReading(absl::Duration bound);
  // Waits (up to `bound`) for the replies given so far to be written, as a
  // shutdown does before it ends the connections: a reply larger than the
  // socket's buffer may still be going out. False at the bound.
  bool FlushReplies(absl::Duration bound);
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
  // Runs Serve on a pool thread, counted in serving_; false when none is free.
  bool ServeOnPool(const std::shared_ptr<Connection>& connection);
  void Serve(std::shared_ptr<Connection> connection);
  std::string EventName(const char* what) const;

  const std::string path_;
  const Options options_;
  const int listen_fd_;
  const Handler handler_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_stopped_ ABSL_GUARDED_BY(mu_) = false;
  int serving_ ABSL_GUARDED_BY(mu_) = 0;  // threads in Serve: readers and handlers
  std::vector<std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<platform::ElasticThreadPool> threads_;  // reset first when stopping
  std::thread acceptor_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_FRAME_SOCKET_SERVER_H_
