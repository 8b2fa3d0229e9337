// Local reference for a grouped GEMM under the per-shard semantics
// (docs/sharding.md): every row shard is its own ragged array, using the
// rhs groups its plan entry names; partial sums of row shards are added.
#ifndef SHARDGEMM_CLIENT_REFERENCE_H_
#define SHARDGEMM_CLIENT_REFERENCE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

struct GemmOperands {
  HostTensor lhs, rhs;
  HostTensor bias;  // dtype kInvalid when absent
  std::vector<int64_t> group_sizes;
  bool rhs_transposed = false;
  bool ragged_k = false;
};

// Output in FP32. `plan` supplies the row shards (workers' group ranges); an
// empty plan means one shard.
absl::StatusOr<HostTensor> ReferenceGroupedGemm(const GemmOperands& in, const v1::Plan& plan);

struct Comparison {
  double max_abs_error = 0;
  double max_abs_reference = 0;
  double tolerance = 0;
  int64_t mismatches = 0;
  bool ok() const { return mismatches == 0; }
};

// Tolerance: one rounding of the output dtype plus FP32 accumulation over
// the contracting length, relative to the largest reference magnitude:
// tol = (eps(out) + 2 * contracting * eps(f32)) * max(1, max|ref|).
Comparison CompareToReference(const HostTensor& got, const HostTensor& reference,
                              int64_t contracting);

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_REFERENCE_H_
