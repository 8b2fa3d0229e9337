// Prints a plan as text; used to produce the worked examples in
// docs/sharding.md. Usage:
//   plan_text_main MESH ROLES OP COMPAT OUT_SPEC|- name=SHAPE@SPEC ... [attr=value ...]
// e.g. (one command line) plan_text_main dp=2,fsdp=2,ep=2 '' ragged_m te -
//        'lhs=64x32@((fsdp,ep),None)' 'rhs=4x32x16@(None,fsdp,None)' 'group_sizes=8@((fsdp,ep),)'
// Attributes: transposed=1 bias=1 flatten_axis=N scaling=current|delayed|mxfp8|block
//             shared=1 rowwise=0|1 colwise=0|1 fp8=1 (f8e4m3 lhs/rhs; give
//             lhs_scale_inv=... rhs_scale_inv=... operands)
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "planner/operand_text.h"
#include "planner/planner.h"

int main(int argc, char** argv) {
  using namespace shardgemm::planner;
  using shardgemm::DType;
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s MESH ROLES OP COMPAT OUT_SPEC|- name=SHAPE@SPEC...\n", argv[0]);
    return 2;
  }
  PlanRequest req;
  absl::StatusOr<Mesh> mesh = ParseMesh(argv[1], argv[2]);
  if (!mesh.ok()) { std::fprintf(stderr, "%s\n", mesh.status().ToString().c_str()); return 1; }
  req.mesh = *mesh;
  absl::StatusOr<OpKind> op = ParseOpKind(argv[3]);
  if (!op.ok()) { std::fprintf(stderr, "%s\n", op.status().ToString().c_str()); return 1; }
  req.op = *op;
  req.compat = std::string(argv[4]) == "te" ? CompatMode::kTe : CompatMode::kDefault;
  if (std::string(argv[5]) != "-") {
    absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(argv[5]);
    if (!spec.ok()) { std::fprintf(stderr, "%s\n", spec.status().ToString().c_str()); return 1; }
    req.out_spec = *spec;
  }
  bool fp8 = false;
  for (int i = 6; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    if (eq == std::string::npos) { std::fprintf(stderr, "bad arg %s\n", argv[i]); return 2; }
    std::string key = arg.substr(0, eq), value = arg.substr(eq + 1);
    int v = std::atoi(value.c_str());
    if (key == "transposed") { req.attrs.rhs_transposed = v; continue; }
    if (key == "bias") { req.attrs.has_bias = v; continue; }
    if (key == "flatten_axis") { req.attrs.flatten_axis = v; continue; }
    if (key == "shared") { req.attrs.shared_scales = v; continue; }
    if (key == "rowwise") { req.attrs.rowwise = v; continue; }
    if (key == "colwise") { req.attrs.colwise = v; continue; }
    if (key == "scaling") {
      req.attrs.scaling_mode = value == "delayed" ? ScalingMode::kDelayed
                               : value == "mxfp8" ? ScalingMode::kMxfp8
                               : value == "block" ? ScalingMode::kBlock : ScalingMode::kCurrent;
      continue;
    }
    if (key == "fp8") { fp8 = v; continue; }
    DType dtype = key == "group_sizes" ? DType::kI32 : DType::kBF16;
    absl::StatusOr<OperandRequest> operand = ParseOperand(key, value, dtype);
    if (!operand.ok()) { std::fprintf(stderr, "%s\n", operand.status().ToString().c_str()); return 1; }
    req.operands.push_back(*operand);
  }
  // fp8=1: lhs/rhs are f8e4m3 and their scales e8m0 (mxfp8) or f32.
  for (OperandRequest& op : req.operands) {
    if (!fp8) break;
    if (op.name == "lhs" || op.name == "rhs") op.dtype = DType::kF8E4M3;
    if (op.name == "lhs_scale_inv" || op.name == "rhs_scale_inv") {
      op.dtype = req.attrs.scaling_mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
    }
  }
  absl::StatusOr<Plan> plan = MakePlan(req);
  if (!plan.ok()) { std::printf("error: %s\n", plan.status().ToString().c_str()); return 1; }
  std::printf("%s", FormatPlanText(*plan).c_str());
  return 0;
}
