// Text forms used by the CLI, tests and docs: shapes "4096x7168" and
// operands "SHAPE@SPEC", e.g. "8x7168x2048@(ep, fsdp, None)".
#ifndef SHARDGEMM_PLANNER_OPERAND_TEXT_H_
#define SHARDGEMM_PLANNER_OPERAND_TEXT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {

// "4096x7168" -> {4096, 7168}; dims must be positive integers.
absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text);

// "SHAPE@SPEC" or "SHAPE" (replicated).
absl::StatusOr<OperandRequest> ParseOperand(absl::string_view name, absl::string_view text,
                                            DType dtype);

// "gemm_m" / "ragged_m", "gemm_k" / "ragged_k" / "wgrad", "quantize".
absl::StatusOr<OpKind> ParseOpKind(absl::string_view text);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_OPERAND_TEXT_H_
