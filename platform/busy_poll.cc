#include "platform/busy_poll.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

#include "absl/time/clock.h"
#include "platform/cpu_affinity.h"

namespace shardgemm::platform {
namespace {

// No PAUSE: on a KVM guest a PAUSE loop is taken for a spinning lock and
// the hypervisor de-schedules the vCPU (pause-loop exiting), which is the
// halt this is meant to avoid.
inline void SpinAWhile() {
  for (int i = 0; i < 256; ++i) asm volatile("" ::: "memory");
}

}  // namespace

BusyPoller::Activity& BusyPoller::Activity::operator=(Activity&& other) noexcept {
  if (this != &other) {
    Release();
    poller_ = other.poller_;
    other.poller_ = nullptr;
  }
  return *this;
}

void BusyPoller::Activity::Release() {
  if (poller_ == nullptr) return;
  // The linger counts from here: stamp it before the count can reach zero.
  poller_->last_end_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  poller_->active_.fetch_sub(1, std::memory_order_release);
  poller_ = nullptr;
}

BusyPoller::BusyPoller(Options options) : linger_ns_(absl::ToInt64Nanoseconds(options.linger)) {
  if (linger_ns_ <= 0 || options.max_cpus <= 0) return;
  std::vector<int> cpus = AllowedCpus();
  if (cpus.size() > static_cast<size_t>(options.max_cpus)) cpus.resize(options.max_cpus);
  for (int cpu : cpus) spinners_.emplace_back([this, cpu] { Spin(cpu); });
}

BusyPoller::~BusyPoller() {
  {
    absl::MutexLock lock(&mu_);  // wakes sleeping spinners to see stop_
    stop_.store(true);
  }
  for (std::thread& t : spinners_) t.join();
}

BusyPoller::Activity BusyPoller::Busy() {
  if (!on()) return Activity();
  if (active_.fetch_add(1, std::memory_order_acquire) == 0) {
    absl::MutexLock lock(&mu_);  // releasing it re-checks the sleepers' condition
  }
  return Activity(this);
}

bool BusyPoller::Wanted() const {
  return active_.load(std::memory_order_acquire) > 0 ||
         absl::GetCurrentTimeNanos() - last_end_ns_.load(std::memory_order_relaxed) < linger_ns_;
}

void BusyPoller::Spin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  // SCHED_IDLE: runs only when nothing else on its core can.
  sched_param param{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
  while (!stop_.load(std::memory_order_relaxed)) {
    while (!stop_.load(std::memory_order_relaxed) && Wanted()) {
      SpinAWhile();
      spin_rounds_.fetch_add(1, std::memory_order_relaxed);
    }
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](BusyPoller* p) { return p->stop_.load() || p->active_.load(std::memory_order_acquire) > 0; }, this));
  }
}

}  // namespace shardgemm::platform
