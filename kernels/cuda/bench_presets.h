// The preset shapes the GPU benchmarks run (../shared/anchors/presets.json:
// {"presets": [{"name", "groups", "rows_per_group", "k", "n"}, ...]}).
#ifndef SHARDGEMM_KERNELS_CUDA_BENCH_PRESETS_H_
#define SHARDGEMM_KERNELS_CUDA_BENCH_PRESETS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardgemm {
namespace cuda {

struct Preset {
  std::string name;
  int64_t g = 0, m = 0, k = 0, n = 0;  // groups, rows per group, contracting and output dims
};

// NOT_FOUND when `path` cannot be read; INVALID_ARGUMENT naming the preset
// and field when the JSON is not the format above or a size is not positive.
absl::StatusOr<std::vector<Preset>> LoadPresets(const std::string& path);

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_BENCH_PRESETS_H_
