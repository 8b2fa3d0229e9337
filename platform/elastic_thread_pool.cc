#include "platform/elastic_thread_pool.h"

#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardgemm::platform {

ElasticThreadPool::ElasticThreadPool(int max_threads) : max_threads_(max_threads < 1 ? 1 : max_threads) {}

ElasticThreadPool::~ElasticThreadPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

absl::Status ElasticThreadPool::Run(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::FailedPreconditionError("the thread pool is shutting down");
  // Each queued task has an idle thread of its own to take it.
  if (static_cast<int>(tasks_.size()) >= idle_) {
    if (static_cast<int>(threads_.size()) >= max_threads_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", max_threads_, " threads for waiting tasks are busy"));
    }
    try {
      threads_.emplace_back([this] { Loop(); });
    } catch (const std::system_error& e) {  // the process is out of threads (or memory for one)
      return absl::ResourceExhaustedError(absl::StrCat("cannot start a thread for a waiting task: ", e.what()));
    }
    ++idle_;  // counted now: the next Run must not hand this thread a second task
  }
  tasks_.push_back(std::move(task));
  return absl::OkStatus();
}

void ElasticThreadPool::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !tasks_.empty(); };
    mu_.Await(absl::Condition(&ready));
    if (tasks_.empty()) return;  // stopping, nothing left to run
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    --idle_;
    mu_.Unlock();
    task();
    task = nullptr;  // what it held goes before the thread counts as idle
    mu_.Lock();
    ++idle_;
  }
}

int ElasticThreadPool::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

int ElasticThreadPool::busy() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size()) - idle_ + static_cast<int>(tasks_.size());
}

}  // namespace shardgemm::platform
