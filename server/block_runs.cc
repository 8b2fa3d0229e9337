#include "server/block_runs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::StatusOr<BlockRuns> BlockRuns::Make(const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets,
                                          const std::vector<int64_t>& extent, int64_t element_bytes) {
  if (offsets.size() != shape.size() || extent.size() != shape.size() || element_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("a block of a rank-", shape.size(), " tensor needs ",
                                                   shape.size(), " offsets and extents"));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (offsets[d] < 0 || extent[d] < 0 || offsets[d] > shape[d] - extent[d]) {
      return absl::InvalidArgumentError(absl::StrCat("block dim ", d, " [", offsets[d], ", +", extent[d],
                                                     ") is outside the tensor's ", shape[d]));
    }
  }
  BlockRuns runs;
  // The run's dimension: the innermost one that the block does not cover whole (dims after it are whole).
  size_t run_dim = 0;
  for (size_t d = shape.size(); d-- > 0;) {
    if (extent[d] != shape[d]) {
      run_dim = d;
      break;
    }
  }
  std::vector<int64_t> stride(shape.size(), element_bytes);
  for (size_t d = shape.size(); d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  runs.run_bytes_ = shape.empty() ? element_bytes : extent[run_dim] * stride[run_dim];
  runs.base_ = shape.empty() ? 0 : offsets[run_dim] * stride[run_dim];
  runs.num_runs_ = 1;
  for (size_t d = 0; d < run_dim; ++d) {
    runs.offsets_.push_back(offsets[d]);
    runs.extent_.push_back(extent[d]);
    runs.stride_.push_back(stride[d]);
    runs.num_runs_ *= extent[d];
  }
  if (runs.run_bytes_ == 0) runs.num_runs_ = 0;
  runs.index_.assign(run_dim, 0);
  runs.StartRun();
  return runs;
}

void BlockRuns::StartRun() {
  run_start_ = base_;
  for (size_t d = 0; d < index_.size(); ++d) run_start_ += (offsets_[d] + index_[d]) * stride_[d];
}

void BlockRuns::Take(int64_t from, absl::string_view data, absl::FunctionRef<void(absl::string_view)> piece) {
  const int64_t to = from + static_cast<int64_t>(data.size());
  while (run_ < num_runs_ && run_start_ < to) {
    const int64_t run_end = run_start_ + run_bytes_;
    const int64_t begin = std::max(from, run_start_), end = std::min(to, run_end);
    if (begin < end) piece(data.substr(static_cast<size_t>(begin - from), static_cast<size_t>(end - begin)));
    if (run_end > to) return;  // the rest of this run comes with the next chunk
    if (++run_ == num_runs_) return;
    // The next outer index, last dimension fastest; the start moves by its stride but at a carry.
    size_t d = index_.size();
    while (d-- > 0 && ++index_[d] == extent_[d]) index_[d] = 0;
    if (d == index_.size() - 1) {
      run_start_ += stride_[d];
    } else {
      StartRun();
    }
  }
}

}  // namespace shardgemm
