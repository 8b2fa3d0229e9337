#include "platform/busy_poll_flags.h"

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

ABSL_FLAG(absl::Duration, busy_poll, absl::ZeroDuration(),
          "keep this process's cores from idling while a request or step is in flight and for this long after "
          "(e.g. 2ms; 0: off): a spinning thread per CPU at SCHED_IDLE priority, which yields to any work, so a "
          "wake-up is not a halted core's (on a VM guest, tens of microseconds each). For hosts whose cores are "
          "the service's: it costs power, and CPU quota under a cgroup limit. Pin the process (--cpus) so the "
          "spinners share its cores");
ABSL_FLAG(int, busy_poll_cpus, 4, "--busy_poll spins at most this many of the process's CPUs");

namespace shardgemm::platform {

absl::StatusOr<BusyPoller::Options> BusyPollOptionsFromFlags() {
  BusyPoller::Options options;
  options.linger = absl::GetFlag(FLAGS_busy_poll);
  options.max_cpus = absl::GetFlag(FLAGS_busy_poll_cpus);
  if (options.linger < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--busy_poll=", absl::FormatDuration(options.linger), ": must not be negative"));
  }
  if (options.max_cpus < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--busy_poll_cpus=", options.max_cpus, ": must be at least 1"));
  }
  return options;
}

}  // namespace shardgemm::platform
