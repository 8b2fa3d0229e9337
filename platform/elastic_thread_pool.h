// A pool for tasks that may block for long (a step waiting for its turn):
// each task runs on an idle thread, or on a new one when none is idle, so a
// blocked task never holds up another. Threads are kept for later tasks; at
// most `max_threads` exist, and a task past that is refused, not queued (a
// queued task could wait behind the very tasks that wait for it).
#ifndef SHARDGEMM_PLATFORM_ELASTIC_THREAD_POOL_H_
#define SHARDGEMM_PLATFORM_ELASTIC_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace shardgemm::platform {

class ElasticThreadPool {
 public:
  explicit ElasticThreadPool(int max_threads);
  // Waits for the tasks given to finish, then joins every thread.
  ~ElasticThreadPool();
  ElasticThreadPool(const ElasticThreadPool&) = delete;
  ElasticThreadPool& operator=(const ElasticThreadPool&) = delete;

  // Starts `task` on a thread of its own now; RESOURCE_EXHAUSTED (the task
  // not run) when `max_threads` are all busy.
  absl::Status Run(std::function<void()> task);

  int threads() const;
  int busy() const;

 private:
  void Loop();

  const int max_threads_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_ELASTIC_THREAD_POOL_H_
