// The coordinator's plans by request: MakePlan is a pure function of its
// request (planner::PlanRequestKey names everything it reads), and a
// service sees the same few shapes and specs over and over, so a plan made
// once serves every later request with the same key. Bounded by its plans'
// size (a plan holds a part per worker): the least recently used plans go
// when a new one does not fit. Refusals are not kept (a bad request costs
// its own planning).
#ifndef SHARDGEMM_SERVER_PLAN_CACHE_H_
#define SHARDGEMM_SERVER_PLAN_CACHE_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "planner/planner.h"

namespace shardgemm {

class PlanCache {
 public:
  // Plans kept while their worker parts (Plan::workers, one more per plan)
  // number `capacity` at most: 65536 is a few MiB, and 8192 plans of an
  // 8-worker mesh. 0: none kept (every call plans); a plan larger than
  // `capacity` is not kept.
  explicit PlanCache(size_t capacity = 65536) : capacity_(capacity) {}

  // The plan of `request`: the kept one, or MakePlan's (kept when it is one).
  absl::StatusOr<std::shared_ptr<const planner::Plan>> Get(const planner::PlanRequest& request);

  struct Stats {
    int64_t hits = 0;
    int64_t misses = 0;
    size_t size = 0;   // plans kept
    size_t parts = 0;  // their worker parts, against the capacity
  };
  Stats stats() const;

 private:
  using Lru = std::list<std::string>;  // keys, most recent first
  struct Entry {
    std::shared_ptr<const planner::Plan> plan;
    Lru::iterator at;
    size_t parts = 0;
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> plans_ ABSL_GUARDED_BY(mu_);
  Lru lru_ ABSL_GUARDED_BY(mu_);
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
  size_t parts_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_PLAN_CACHE_H_
