// Pinning a server process to CPUs (--cpus). On a VM guest a wake-up that
// crosses cores costs several times one that stays on a core (see
// docs/performance/service.md), and a request's path hands off between
// threads several times; keeping a process's threads on a few cores makes
// those hand-offs cheap.
#ifndef SHARDGEMM_PLATFORM_CPU_AFFINITY_H_
#define SHARDGEMM_PLATFORM_CPU_AFFINITY_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardgemm::platform {

// "2", "2-3", "0,4-7": the CPUs listed, ascending, each once. Empty text: an
// empty list. INVALID_ARGUMENT naming `field` for anything else (a negative
// or reversed range, a CPU number of 1024 or more, stray characters).
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, absl::string_view field);

// Pins the calling thread, and so every thread it starts afterwards, to
// `cpus` (call it first thing in main). INVALID_ARGUMENT naming `field` when
// none of them is a CPU this process may run on.
absl::Status PinToCpus(const std::vector<int>& cpus, absl::string_view field);

// The CPUs the calling thread may run on.
std::vector<int> AllowedCpus();

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_CPU_AFFINITY_H_
