// Host side of the grouped-GEMM checks (tests and bench): samples rows or
// entries of an output already computed on the device and compares them with
// the naive device reference (gemm_testing.h). Padding rows must be exactly 0.
#ifndef SHARDGEMM_KERNELS_CUDA_GEMM_CHECK_H_
#define SHARDGEMM_KERNELS_CUDA_GEMM_CHECK_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/grouped_gemm.h"

namespace shardgemm {
namespace cuda {
namespace testing {

struct CheckResult {
  double rel_l2 = 0;     // ||out - ref|| / ||ref|| over the sampled elements
  double max_abs = 0;    // max |out - ref|
  double max_ref = 0;    // max |ref|
  int64_t checked = 0;   // elements compared
  int64_t nonfinite = 0; // NaN/Inf in the output (e.g. never written)
  int64_t bad_padding = 0;
  std::string error;     // CUDA error while checking
  // Passes when finite, padding zero, rel_l2 <= tol and max_abs <= 8 tol max_ref.
  bool Ok(double tol) const;
  std::string ToString() const;
};

// Tolerance for an output dtype (bf16 inputs rounded at the output).
double Tolerance(DType out);

CheckResult CheckRaggedM(const DeviceGroupedGemmArgs& a, const std::vector<int64_t>& sizes, int max_rows,
                         uint64_t seed, cudaStream_t s);
CheckResult CheckRaggedK(const DeviceGroupedGemmArgs& a, const std::vector<int64_t>& sizes, int max_entries,
                         uint64_t seed, cudaStream_t s);

}  // namespace testing
}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_GEMM_CHECK_H_
