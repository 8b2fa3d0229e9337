#include "server/plan_cache.h"

#include <utility>

namespace shardgemm {

absl::StatusOr<std::shared_ptr<const planner::Plan>> PlanCache::Get(const planner::PlanRequest& request) {
  std::string key = planner::PlanRequestKey(request);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = plans_.find(key); it != plans_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.at);
      ++hits_;
      return it->second.plan;
    }
    ++misses_;
  }
  // Planned outside the lock: concurrent requests of new shapes do not wait
  // on each other (two of the same key may both plan; either result is it).
  auto made = planner::MakePlan(request);
  if (!made.ok()) return made.status();
  auto plan = std::make_shared<const planner::Plan>(*std::move(made));
  const size_t parts = plan->workers.size() + 1;
  if (parts > capacity_) return plan;
  absl::MutexLock lock(&mu_);
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.plan;
  while (parts_ + parts > capacity_ && !lru_.empty()) {
    auto oldest = plans_.find(lru_.back());
    parts_ -= oldest->second.parts;
    plans_.erase(oldest);
    lru_.pop_back();
  }
  lru_.push_front(key);
  plans_.emplace(std::move(key), Entry{plan, lru_.begin(), parts});
  parts_ += parts;
  return plan;
}

PlanCache::Stats PlanCache::stats() const {
  absl::MutexLock lock(&mu_);
  return {hits_, misses_, plans_.size(), parts_};
}

}  // namespace shardgemm
