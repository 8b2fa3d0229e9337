#include "planner/plan_fuzz_entry.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "planner/operand_text.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "plan fuzz invariant violated: %s\n", what.c_str());
  std::abort();
}

void CheckError(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kInvalidArgument) Fail("non-InvalidArgument error: " + s.ToString());
  if (s.message().empty()) Fail("empty error message");
}

void CheckPlan(const PlanRequest& req, const Plan& plan) {
  const Mesh& mesh = req.mesh;
  if (static_cast<int64_t>(plan.workers.size()) != NumWorkers(mesh)) Fail("worker count");
  if (plan.outputs.empty()) Fail("no outputs");
  for (const PlanOperand& op : plan.operands) {
    if (!ValidatePartitionSpec(op.name, op.global_shape, op.compute_spec, mesh).ok()) {
      Fail("compute spec invalid for " + op.name);
    }
    for (size_t d = 0; d < op.global_shape.size(); ++d) {
      if (op.local_shape[d] * AxesProduct(mesh, op.compute_spec.dims[d]) != op.global_shape[d]) {
        Fail("local shape of " + op.name);
      }
    }
  }
  for (const PlanOutput& o : plan.outputs) {
    if (!ValidatePartitionSpec(o.name, o.global_shape, o.spec, mesh).ok()) Fail("output spec " + o.name);
  }
  for (const Collective& c : plan.collectives) {
    if (c.axes.empty()) Fail("collective without axes");
    for (const std::string& a : c.axes) {
      if (AxisIndex(mesh, a) < 0) Fail("collective over unknown axis " + a);
    }
    if (c.bytes_per_worker < 0) Fail("negative bytes");
  }
  if (plan.flops_per_worker < 0) Fail("negative flops");
  absl::StatusOr<PartitionSpec> again = ParsePartitionSpec(FormatPartitionSpec(plan.out_spec));
  if (!again.ok() || *again != plan.out_spec) Fail("out spec does not round-trip");
  for (const WorkerPlan& w : plan.workers) {
    if (w.group_sizes_begin < 0 || w.group_sizes_end > plan.local_group_count * NumWorkers(mesh) ||
        w.first_group < 0 || w.first_group + w.local_group_count > plan.num_groups) {
      Fail("worker group range");
    }
  }
  if (FormatPlanText(plan).empty()) Fail("empty plan text");
}

}  // namespace

void FuzzSpecOnce(const std::string& text) {
  absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(text);
  if (!spec.ok()) {
    CheckError(spec.status());
    return;
  }
  absl::StatusOr<PartitionSpec> again = ParsePartitionSpec(FormatPartitionSpec(*spec));
  if (!again.ok() || *again != *spec) Fail("spec round trip: " + text);
}

int FuzzPlanOnce(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> lines = absl::StrSplit(input, '\n');
  while (lines.size() < 5) lines.emplace_back();
  for (size_t i = 5; i < lines.size(); ++i) {
    size_t eq = lines[i].find('=');
    if (eq != std::string::npos) FuzzSpecOnce(lines[i].substr(eq + 1));
  }
  absl::StatusOr<Mesh> mesh = ParseMesh(lines[0], lines[1]);
  if (!mesh.ok()) {
    CheckError(mesh.status());
    return 0;
  }
  PlanRequest req;
  req.mesh = *mesh;
  const char op = lines[2].empty() ? 'm' : lines[2][0];
  req.op = op == 'k' ? OpKind::kGroupedGemmRaggedK
           : op == 'q' ? OpKind::kGroupedQuantize : OpKind::kGroupedGemmRaggedM;
  req.compat = !lines[3].empty() && lines[3][0] == 't' ? CompatMode::kTe : CompatMode::kDefault;
  const std::string& attrs = lines[4];
  for (size_t i = 0; i < attrs.size(); ++i) {
    switch (attrs[i]) {
      case 'T': req.attrs.rhs_transposed = true; break;
      case 'B': req.attrs.has_bias = true; break;
      case 'S': req.attrs.shared_scales = true; break;
      case 'C': req.attrs.colwise = true; break;
      case 'R': req.attrs.rowwise = false; break;
      case 'c': req.attrs.scaling_mode = ScalingMode::kCurrent; break;
      case 'd': req.attrs.scaling_mode = ScalingMode::kDelayed; break;
      case 'x': req.attrs.scaling_mode = ScalingMode::kMxfp8; break;
      case 'b': req.attrs.scaling_mode = ScalingMode::kBlock; break;
      case 'f': req.attrs.out_dtype = DType::kF32; break;
      case '8': req.attrs.out_dtype = DType::kF8E5M2; break;
      case '-':
        if (i + 1 < attrs.size() && absl::ascii_isdigit(attrs[i + 1])) {
          req.attrs.flatten_axis = -(attrs[++i] - '0');
        }
        break;
      default:
        if (absl::ascii_isdigit(attrs[i])) req.attrs.flatten_axis = attrs[i] - '0';
    }
  }
  for (size_t i = 5; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = line.substr(0, eq), value = line.substr(eq + 1);
    if (name == "out") {
      absl::StatusOr<PartitionSpec> spec = ParsePartitionSpec(value);
      if (!spec.ok()) {
        CheckError(spec.status());
        return 0;
      }
      req.out_spec = *spec;
      continue;
    }
    const bool fp8 = attrs.find('F') != std::string::npos;
    const bool scale = name == "lhs_scale_inv" || name == "rhs_scale_inv";
    DType dtype = name == "group_sizes" ? DType::kI32
                  : name == "bias"      ? DType::kF32
                  : scale ? (req.attrs.scaling_mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32)
                  : fp8 && (name == "lhs" || name == "rhs") ? DType::kF8E4M3
                                                           : DType::kBF16;
    absl::StatusOr<OperandRequest> operand = ParseOperand(name, value, dtype);
    if (!operand.ok()) {
      CheckError(operand.status());
      return 0;
    }
    req.operands.push_back(*operand);
  }
  absl::StatusOr<Plan> plan = MakePlan(req);
  if (!plan.ok()) {
    CheckError(plan.status());
    return 0;
  }
  CheckPlan(req, *plan);
  return 1;
}

}  // namespace planner
}  // namespace shardgemm
