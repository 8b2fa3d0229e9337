// CPU grouped GEMM kernels (MoE expert layers): ragged-M (forward / dgrad) and
// ragged-K (wgrad). See /DESIGN.md, "The operations".
//
// Numerics: inputs are converted to FP32, products are accumulated in FP32 and
// the result is rounded once (round-to-nearest-even) to the output dtype. The
// bias (ragged-M only) is added in FP32 after accumulation.
//
// Determinism: every output element is accumulated by one FP32 accumulator,
// in increasing order of the contracting index (k = 0, 1, ..., K-1 for ragged-M;
// the group's rows in order for ragged-K), starting from +0.0f. The order
// depends only on the contracting length, never on M, N, the thread count, the
// neighbouring rows/columns or the group's position, so computing any subset
// of rows or columns (a shard) gives bit-identical values to the full GEMM.
// On CPUs with FMA (x86-64-v3 and up) each step is one fused multiply-add
// (AVX2 and AVX-512 kernels give identical bits); on CPUs without FMA the
// portable kernel does a separate multiply and add, so bits can differ between
// a machine with FMA and one without.
#ifndef SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_H_
#define SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "kernels/dtype.h"

namespace shardgemm {
namespace cpu {

struct GroupedGemmArgs {
  DType lhs_dtype = DType::kInvalid;  // kF32 | kBF16 | kF16
  DType rhs_dtype = DType::kInvalid;  // kF32 | kBF16 | kF16
  DType out_dtype = DType::kInvalid;  // kF32 | kBF16 | kF16
  DType bias_dtype = DType::kInvalid;  // kInvalid when no bias
  const void* lhs = nullptr;  // ragged-M: [M, K]; ragged-K: [M, K]
  // ragged-M: [G, K, N] or [G, N, K] if rhs_transposed; ragged-K: [M, N].
  const void* rhs = nullptr;
  const void* bias = nullptr;  // ragged-M only: [G, N]
  void* out = nullptr;         // ragged-M: [M, N]; ragged-K: [G, K, N]
  int64_t m = 0, k = 0, n = 0, num_groups = 0;
  const int64_t* group_sizes = nullptr;  // num_groups entries, host memory
  bool rhs_transposed = false;           // ragged-M only
  // Asked between tiles and between a tile's packed blocks (96 rows by 256
  // deep; empty: never): once it answers true no more work starts and the
  // call returns CANCELLED, `out` partly written. A GEMM whose
  // request was cancelled or expired does not hold the worker for its
  // remaining seconds.
  std::function<bool()> stop;
};

// Returns InvalidArgument naming the offending field for: negative dims or
// group sizes, sum(group_sizes) > m, unsupported dtypes, null pointers with
// nonzero sizes, byte sizes that overflow int64, bias/rhs_transposed given to
// ragged-K.
absl::Status ValidateGroupedGemmArgs(const GroupedGemmArgs& args, bool ragged_k);

// out[rows of g] = lhs[rows of g] @ rhs[g] (+ bias[g]); rows past
// sum(group_sizes) are set to zero. num_threads <= 0: hardware concurrency.
// CANCELLED when `args.stop` said so.
absl::Status GroupedGemmRaggedM(const GroupedGemmArgs& args, int num_threads = 0);

// out[g] = lhs[rows of g]^T @ rhs[rows of g]; rows past sum(group_sizes) are
// ignored; an empty group gives zeros. num_threads <= 0: hardware concurrency.
absl::Status GroupedGemmRaggedK(const GroupedGemmArgs& args, int num_threads = 0);

}  // namespace cpu
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CPU_GROUPED_GEMM_H_
