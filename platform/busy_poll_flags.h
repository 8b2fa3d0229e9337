// --busy_poll and --busy_poll_cpus, for the coordinator's and the worker's
// mains (one definition of each flag).
#ifndef SHARDGEMM_PLATFORM_BUSY_POLL_FLAGS_H_
#define SHARDGEMM_PLATFORM_BUSY_POLL_FLAGS_H_

#include "absl/status/statusor.h"
#include "platform/busy_poll.h"

namespace shardgemm::platform {

// The options the flags ask for; INVALID_ARGUMENT naming the flag for a
// negative linger or CPU count.
absl::StatusOr<BusyPoller::Options> BusyPollOptionsFromFlags();

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_BUSY_POLL_FLAGS_H_
