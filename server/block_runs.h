// Where one block of a row-major tensor lies in the tensor's bytes: a run
// of contiguous bytes per index of the dimensions before the innermost split
// one (one run when only dim 0 is split, or none). A put's bytes arrive in
// order; BlockRuns hands out, chunk by chunk, the pieces of them that are
// the block's, in the block's own row-major order, without holding any.
#ifndef SHARDGEMM_SERVER_BLOCK_RUNS_H_
#define SHARDGEMM_SERVER_BLOCK_RUNS_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardgemm {

class BlockRuns {
 public:
  // `shape`: the tensor's (its bytes fit an int64: callers check it);
  // `offsets` and `extent`: the block's start and size per dimension (in
  // bounds); `element_bytes` > 0.
  BlockRuns() = default;  // an empty block
  static absl::StatusOr<BlockRuns> Make(const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets,
                                        const std::vector<int64_t>& extent, int64_t element_bytes);

  // `data` is the tensor's bytes from `from` on; chunks come in order with
  // no gap. Calls `piece` with each part of `data` that is the block's, in
  // order (views into `data`; none kept).
  void Take(int64_t from, absl::string_view data, absl::FunctionRef<void(absl::string_view)> piece);

  int64_t block_bytes() const { return run_bytes_ * num_runs_; }
  int64_t run_bytes() const { return run_bytes_; }
  int64_t num_runs() const { return num_runs_; }
  bool done() const { return run_ >= num_runs_; }

 private:
  void StartRun();  // run_start_ of run_ (when not done)

  std::vector<int64_t> offsets_, extent_, stride_;  // the dimensions before the run's, and their byte strides
  int64_t base_ = 0;                                // the run dimension's offset, in bytes
  int64_t run_bytes_ = 0, num_runs_ = 0;
  int64_t run_ = 0;                 // the run being taken
  std::vector<int64_t> index_;      // its index over the outer dimensions
  int64_t run_start_ = 0;           // its first byte in the tensor
};

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_BLOCK_RUNS_H_
