// An in-process executor for plans: every worker is a set of FP32 host
// buffers, collectives are simulated, and the local ops are simple
// deterministic reference kernels (fixed summation order). Used by the
// property test to check that running a plan gives the per-shard semantics.
#ifndef SHARDGEMM_PLANNER_SIMULATOR_H_
#define SHARDGEMM_PLANNER_SIMULATOR_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {

struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major; group_sizes hold small integers
};
using TensorMap = std::map<std::string, HostTensor>;

// Runs `plan` (made from `request`) on the global `inputs` (keyed by operand
// name): shards them per input spec, applies the collectives, runs the local
// kernels and assembles every output per its final spec. Fails if a
// worker's buffers disagree with the plan's specs/shapes, or if two
// replicas of an output block differ.
absl::StatusOr<TensorMap> SimulatePlan(const PlanRequest& request, const Plan& plan,
                                       const TensorMap& inputs);

// The per-shard semantics of DESIGN.md computed straight from the global
// tensors: every row shard (rows split over lhs/x dim 0's axes) is its own
// ragged array with its own group_sizes entries and, when the ep axis splits
// the rows, its own experts. Independent of any plan.
absl::StatusOr<TensorMap> ReferenceOutputs(const PlanRequest& request, const TensorMap& inputs);

// Elementwise comparison (value equality: -0 == +0); "" when equal.
std::string CompareTensors(const std::string& name, const HostTensor& got, const HostTensor& want);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_SIMULATOR_H_
