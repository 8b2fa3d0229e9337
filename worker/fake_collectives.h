// Test-only collectives for one worker of a larger mesh whose peers all hold
// what this worker holds: an all-gather repeats the local piece, a sum
// multiplies by the group size, a max is the identity. Lets the executor's
// multi-rank logic (collective order, agreements, shapes) run in one process.
#ifndef SHARDGEMM_WORKER_FAKE_COLLECTIVES_H_
#define SHARDGEMM_WORKER_FAKE_COLLECTIVES_H_

#include <string>
#include <vector>

#include "worker/collectives.h"

namespace shardgemm {

class MirrorCollectives : public Collectives {
 public:
  explicit MirrorCollectives(MeshPosition position) : position_(std::move(position)) {}

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int dim,
                                       const std::vector<std::string>& axes) override;
  absl::Status AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) override;
  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int dim,
                                           const std::vector<std::string>& axes) override;
  // Counts the calls; every peer is taken to pass OK.
  absl::Status Agree(const absl::Status& local, const std::vector<std::string>& axes) override {
    ++agreements;
    agreement_axes = axes;
    return local;
  }

  int agreements = 0;
  std::vector<std::string> agreement_axes;  // of the last agreement
  std::vector<std::string> calls;  // "all_gather", "all_reduce", "reduce_scatter", in order

 private:
  MeshPosition position_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_FAKE_COLLECTIVES_H_
