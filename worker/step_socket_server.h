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
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "platform/elastic_thread_pool.h"
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
  ~StepSocketServer();
  StepSocketServer(const StepSocketServer&) = delete;
  StepSocketServer& operator=(const StepSocketServer&) = delete;

  const std::string& path() const { return path_; }
  int connections() const;

 private:
  struct Connection;
  StepSocketServer(std::string path, int listen_fd, Handler handler);
  void Accept();
  void Serve(std::shared_ptr<Connection> connection);

  const std::string path_;
  const int listen_fd_;
  const Handler handler_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<platform::ElasticThreadPool> threads_;  // reset first when stopping
  std::thread acceptor_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_STEP_SOCKET_SERVER_H_
