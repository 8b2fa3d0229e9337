// The worker's step socket: a Unix stream socket (in the worker's private
// socket directory, beside its gRPC one) on which a coordinator of the same
// host sends steps as frames (proto/step_frame.h) instead of one gRPC call
// each. Only processes of this worker's user may connect (the directory is
// theirs alone, and each connection's peer credentials are checked).
#ifndef SHARDGEMM_WORKER_STEP_SOCKET_SERVER_H_
#define SHARDGEMM_WORKER_STEP_SOCKET_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "proto/frame_socket_server.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

class StepSocketServer {
 public:
  // Answers one request; callable from any thread, once. A reply to a
  // connection that has closed is dropped.
  using Reply = std::function<void(v1::StepSocketReply)>;
  // Runs on the thread that read the request (another reads the
  // connection's next frames meanwhile); it may answer there or hand the
  // reply on.
  using Handler = std::function<void(std::unique_ptr<v1::StepSocketRequest>, Reply)>;

  static constexpr int kMaxConnections = 64;
  // Threads reading connections and running the steps they read.
  static constexpr int kMaxThreads = 1024;

  // Listens on `path` (which must not exist). Its inode is the socket's, for the registration.
  static absl::StatusOr<std::unique_ptr<StepSocketServer>> Start(const std::string& path, Handler handler);
  // Stops accepting, ends every connection and waits for the steps running
  // on its threads (a handler that handed its reply on answers into nothing).
  ~StepSocketServer() = default;
  StepSocketServer(const StepSocketServer&) = delete;
  StepSocketServer& operator=(const StepSocketServer&) = delete;

  const std::string& path() const { return frames_->path(); }
  int connections() const { return frames_->connections(); }

 private:
  explicit StepSocketServer(std::unique_ptr<FrameSocketServer> frames) : frames_(std::move(frames)) {}
  const std::unique_ptr<FrameSocketServer> frames_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STEP_SOCKET_SERVER_H_
