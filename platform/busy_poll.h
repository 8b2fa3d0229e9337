// Keeping a process's cores out of idle while it has work in flight.
//
// On a VM guest an idle core halts, and waking it (a step's answer arriving
// on a socket) costs tens of microseconds, several times on a request's
// path (docs/performance/service.md). A BusyPoller runs one spinning thread
// per CPU of the process (up to a cap) while work is in flight and for a
// linger after it, at SCHED_IDLE priority: it takes no time from any thread
// that can run, but its core never halts, so a wake-up is a context switch.
// Off (no threads) when the linger is zero. Its cost is power, and CPU
// quota under a cgroup limit: it is for hosts whose cores are the
// service's.
#ifndef SHARDGEMM_PLATFORM_BUSY_POLL_H_
#define SHARDGEMM_PLATFORM_BUSY_POLL_H_

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardgemm::platform {

class BusyPoller {
 public:
  struct Options {
    // How long the spinners go on after the last work ends (a client's next
    // request usually comes within it). Zero: off.
    absl::Duration linger = absl::ZeroDuration();
    // Spinners: one per CPU the process may run on (pin it with --cpus),
    // at most this many.
    int max_cpus = 4;
  };

  // Held while work is in flight; movable, releases on destruction.
  class Activity {
   public:
    Activity() = default;
    Activity(Activity&& other) noexcept : poller_(other.poller_) { other.poller_ = nullptr; }
    Activity& operator=(Activity&& other) noexcept;
    Activity(const Activity&) = delete;
    Activity& operator=(const Activity&) = delete;
    ~Activity() { Release(); }

   private:
    friend class BusyPoller;
    explicit Activity(BusyPoller* poller) : poller_(poller) {}
    void Release();
    BusyPoller* poller_ = nullptr;
  };

  explicit BusyPoller(Options options);
  ~BusyPoller();  // stops and joins the spinners
  BusyPoller(const BusyPoller&) = delete;
  BusyPoller& operator=(const BusyPoller&) = delete;

  // Work begins; the spinners run until it and the linger after it end.
  // Null poller or off: a no-op Activity.
  static Activity BusyIfOn(BusyPoller* poller) { return poller == nullptr ? Activity() : poller->Busy(); }
  Activity Busy();

  bool on() const { return !spinners_.empty(); }
  int spinners() const { return static_cast<int>(spinners_.size()); }
  // Spin rounds so far, over every spinner (it grows only while spinning).
  int64_t spin_rounds() const { return spin_rounds_.load(std::memory_order_relaxed); }

 private:
  void Spin(int cpu);
  bool Wanted() const;

  const int64_t linger_ns_;
  std::atomic<int> active_{0};
  std::atomic<int64_t> last_end_ns_{0};
  std::atomic<bool> stop_{false};
  // Apart from the counters every request writes: the spinners bump it
  // continually, and sharing their cache line would slow each Busy().
  alignas(64) std::atomic<int64_t> spin_rounds_{0};
  absl::Mutex mu_;  // the spinners sleep on it between bursts of work
  std::vector<std::thread> spinners_;
};

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_BUSY_POLL_H_
