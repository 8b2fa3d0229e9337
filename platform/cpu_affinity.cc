#include "platform/cpu_affinity.h"

#include <sched.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardgemm::platform {

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, absl::string_view field) {
  std::set<int> cpus;
  if (absl::StripAsciiWhitespace(text).empty()) return std::vector<int>();
  auto bad = [&](absl::string_view part, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", part, "' ", why, " (a CPU list such as 2, 2-3 or 0,4-7)"));
  };
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    std::vector<absl::string_view> ends = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int first = 0, last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || (ends.size() == 2 && !absl::SimpleAtoi(ends[1], &last))) {
      return bad(part, "is not a CPU number or range");
    }
    if (ends.size() == 1) last = first;
    if (first < 0 || last < 0) return bad(part, "is negative");
    if (last < first) return bad(part, "is a reversed range");
    if (last >= CPU_SETSIZE) return bad(part, absl::StrCat("names a CPU beyond ", CPU_SETSIZE - 1));
    for (int c = first; c <= last; ++c) cpus.insert(c);
  }
  return std::vector<int>(cpus.begin(), cpus.end());
}

absl::Status PinToCpus(const std::vector<int>& cpus, absl::string_view field) {
  if (cpus.empty()) return absl::OkStatus();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) return absl::InvalidArgumentError(absl::StrCat(field, ": CPU ", c, " out of range"));
    CPU_SET(c, &set);
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    const int err = errno;
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot run on CPUs ", absl::StrJoin(cpus, ","), " (",
                                                   std::strerror(err), "); this process may run on ",
                                                   absl::StrJoin(AllowedCpus(), ",")));
  }
  return absl::OkStatus();
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

}  // namespace shardgemm::platform
