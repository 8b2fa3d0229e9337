#include "planner/operand_text.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace shardgemm {
namespace planner {

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text) {
  std::vector<int64_t> shape;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return absl::InvalidArgumentError("shape: empty (expected e.g. 4096x7168)");
  for (absl::string_view d : absl::StrSplit(text, 'x')) {
    int64_t v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape '", absl::CEscape(text), "': '", absl::CEscape(d), "' is not a positive integer"));
    }
    shape.push_back(v);
    if (shape.size() > 8) return absl::InvalidArgumentError("shape: more than 8 dims");
  }
  return shape;
}

absl::StatusOr<OperandRequest> ParseOperand(absl::string_view name, absl::string_view text,
                                            DType dtype) {
  OperandRequest op;
  op.name = std::string(name);
  op.dtype = dtype;
  std::vector<absl::string_view> parts = absl::StrSplit(text, absl::MaxSplits('@', 1));
  absl::StatusOr<std::vector<int64_t>> shape = ParseShape(parts[0]);
  if (!shape.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", shape.status().message()));
  }
  op.shape = std::move(*shape);
  if (parts.size() == 2) {
    absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(parts[1]);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", spec.status().message()));
    }
    op.spec = std::move(*spec);
  }
  return op;
}

absl::StatusOr<OpKind> ParseOpKind(absl::string_view text) {
  if (text == "gemm_m" || text == "ragged_m" || text == "grouped_gemm_ragged_m") {
    return OpKind::kGroupedGemmRaggedM;
  }
  if (text == "gemm_k" || text == "ragged_k" || text == "wgrad" || text == "grouped_gemm_ragged_k") {
    return OpKind::kGroupedGemmRaggedK;
  }
  if (text == "quantize" || text == "grouped_quantize") return OpKind::kGroupedQuantize;
  return absl::InvalidArgumentError(absl::StrCat(
      "op '", absl::CEscape(text), "': expected ragged_m, ragged_k (wgrad) or quantize"));
}

}  // namespace planner
}  // namespace shardgemm
