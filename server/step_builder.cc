#include "server/step_builder.h"

#include "absl/strings/str_cat.h"
#include "proto/tensor_codec.h"

namespace shardgemm {

absl::StatusOr<std::vector<v1::Step>> BuildGemmSteps(const GemmStepsRequest& request) {
  const planner::Plan& plan = *request.plan;
  const planner::Mesh& mesh = *request.mesh;
  const int num_workers = static_cast<int>(plan.workers.size());
  bool any_collective = false;
  for (const planner::Collective& c : plan.collectives) {
    any_collective |= c.phase != planner::Phase::kWithin &&
                      !(request.quantize_lhs_to != DType::kInvalid && c.tensor == "lhs_scale_inv");
  }
  std::vector<v1::Step> steps(num_workers);
  for (int r = 0; r < num_workers; ++r) {
    const planner::WorkerPlan& wp = plan.workers[r];
    v1::GemmStep* gemm = steps[r].mutable_gemm();
    gemm->set_ragged(request.ragged);
    gemm->set_rhs_transposed(request.rhs_transposed);
    gemm->set_out_dtype(DTypeToProto(plan.out_dtype));
    if (wp.group_sizes_end > static_cast<int64_t>(request.group_sizes.size())) {
      return absl::InternalError(absl::StrCat("rank ", r, " reads group_sizes[", wp.group_sizes_begin, ":",
                                              wp.group_sizes_end, "] of ", request.group_sizes.size()));
    }
    for (int64_t i = wp.group_sizes_begin; i < wp.group_sizes_end; ++i) gemm->add_group_sizes(request.group_sizes[i]);
    gemm->set_apply_bias(request.operands.contains("bias") && wp.apply_bias);
    gemm->set_scaling(request.scaling);
    if (request.quantize_lhs_to != DType::kInvalid) gemm->set_quantize_lhs_to(DTypeToProto(request.quantize_lhs_to));
    using Field = v1::LocalTensor* (v1::GemmStep::*)();
    const std::pair<const char*, Field> fields[] = {
        {"lhs", &v1::GemmStep::mutable_lhs},
        {"rhs", &v1::GemmStep::mutable_rhs},
        {"bias", &v1::GemmStep::mutable_bias},
        {"lhs_scale_inv", &v1::GemmStep::mutable_lhs_scale_inv},
        {"rhs_scale_inv", &v1::GemmStep::mutable_rhs_scale_inv}};
    for (const auto& [name, field] : fields) {
      auto it = request.operands.find(name);
      if (it == request.operands.end()) continue;
      v1::LocalTensor* local = (gemm->*field)();
      const planner::PlanOperand* op = planner::FindPlanOperand(plan, name);
      if (op == nullptr) return absl::InternalError(absl::StrCat("the plan has no operand ", name));
      const GemmOperand& operand = it->second;
      if (!operand.meta.resident_shard.empty()) {
        local->set_dtype(DTypeToProto(operand.meta.dtype));
        local->mutable_shape()->Assign(op->input_local_shape.begin(), op->input_local_shape.end());
        local->set_resident(operand.meta.resident_shard);
        continue;
      }
      if (!operand.meta.staged_tickets.empty()) {  // the client streamed each worker its block
        if (operand.meta.staged_tickets.size() != static_cast<size_t>(num_workers)) {
          return absl::InternalError(absl::StrCat(name, " has ", operand.meta.staged_tickets.size(),
                                                  " staged tickets for ", num_workers, " ranks"));
        }
        local->set_dtype(DTypeToProto(operand.meta.dtype));
        local->mutable_shape()->Assign(op->input_local_shape.begin(), op->input_local_shape.end());
        local->set_staged(operand.meta.staged_tickets[r]);
        continue;
      }
      if (operand.meta.shared_memory.has_value()) {  // the worker reads its block itself
        local->set_dtype(DTypeToProto(operand.meta.dtype));
        local->mutable_shape()->Assign(op->input_local_shape.begin(), op->input_local_shape.end());
        v1::SharedMemoryBlock* block = local->mutable_shared_memory();
        *block = *operand.meta.shared_memory;
        block->mutable_global_shape()->Assign(op->global_shape.begin(), op->global_shape.end());
        auto offsets = planner::BlockOffsets(name, op->global_shape, op->input_spec, mesh, r);
        if (!offsets.ok()) return offsets.status();
        block->mutable_block_offsets()->Assign(offsets->begin(), offsets->end());
        continue;
      }
      if (operand.tensor == nullptr) return absl::InternalError(absl::StrCat(name, " has neither data nor a shard"));
      if (op->input_local_shape == op->global_shape) {  // replicated: no slicing copy
        HostTensorToProto(*operand.tensor, local);
        continue;
      }
      auto offsets = planner::BlockOffsets(name, op->global_shape, op->input_spec, mesh, r);
      if (!offsets.ok()) return offsets.status();
      HostTensorToProto(SliceBlock(*operand.tensor, *offsets, op->input_local_shape), local);
    }
    for (const planner::Collective& c : plan.collectives) {
      if (c.phase == planner::Phase::kWithin) continue;
      // The step's own quantize makes lhs's scales in its compute layout.
      if (request.quantize_lhs_to != DType::kInvalid && c.tensor == "lhs_scale_inv") continue;
      CollectiveToProto(c, gemm->add_collectives());
    }
    // Every worker takes the same decision, so the agreement itself matches.
    gemm->set_agree(any_collective && num_workers > 1);
  }
  return steps;
}

absl::StatusOr<std::vector<v1::Step>> BuildQuantizeSteps(const QuantizeStepsRequest& request) {
  const planner::Plan& plan = *request.plan;
  const int num_workers = static_cast<int>(plan.workers.size());
  const planner::PlanOperand* x_op = planner::FindPlanOperand(plan, "x");
  if (x_op == nullptr) return absl::InternalError("the plan has no operand x");
  if (!request.scales.empty() && request.scales.size() != request.group_sizes.size()) {
    return absl::InternalError("delayed scales and group sizes differ in length");
  }
  std::vector<v1::Step> steps(num_workers);
  for (int r = 0; r < num_workers; ++r) {
    const planner::WorkerPlan& wp = plan.workers[r];
    v1::QuantizeStep* q = steps[r].mutable_quantize();
    if (!request.x.meta.resident_shard.empty()) {
      q->mutable_x()->set_dtype(DTypeToProto(request.x.meta.dtype));
      q->mutable_x()->mutable_shape()->Assign(x_op->input_local_shape.begin(), x_op->input_local_shape.end());
      q->mutable_x()->set_resident(request.x.meta.resident_shard);
    } else if (!request.x.meta.staged_tickets.empty()) {  // the client streamed each worker its block
      if (request.x.meta.staged_tickets.size() != static_cast<size_t>(num_workers)) {
        return absl::InternalError(absl::StrCat("x has ", request.x.meta.staged_tickets.size(),
                                                " staged tickets for ", num_workers, " ranks"));
      }
      q->mutable_x()->set_dtype(DTypeToProto(request.x.meta.dtype));
      q->mutable_x()->mutable_shape()->Assign(x_op->input_local_shape.begin(), x_op->input_local_shape.end());
      q->mutable_x()->set_staged(request.x.meta.staged_tickets[r]);
    } else {
      if (request.x.tensor == nullptr) return absl::InternalError("x has neither data nor a shard");
      auto offsets = planner::BlockOffsets("x", x_op->global_shape, x_op->input_spec, *request.mesh, r);
      if (!offsets.ok()) return offsets.status();
      HostTensorToProto(SliceBlock(*request.x.tensor, *offsets, x_op->input_local_shape), q->mutable_x());
    }
    if (wp.group_sizes_end > static_cast<int64_t>(request.group_sizes.size())) {
      return absl::InternalError(absl::StrCat("rank ", r, " reads group_sizes[", wp.group_sizes_begin, ":",
                                              wp.group_sizes_end, "] of ", request.group_sizes.size()));
    }
    for (int64_t i = wp.group_sizes_begin; i < wp.group_sizes_end; ++i) {
      q->add_group_sizes(request.group_sizes[i]);
      if (!request.scales.empty()) q->add_scales(request.scales[i]);
    }
    q->set_out_dtype(DTypeToProto(request.out_dtype));
    q->set_scaling(request.scaling);
    q->set_rowwise(request.rowwise);
    q->set_colwise(request.colwise);
    q->set_flatten_axis(request.flatten_axis);
    q->set_block_2d(request.block_2d);
    for (const planner::Collective& c : plan.collectives) CollectiveToProto(c, q->add_collectives());
    q->set_agree(!plan.collectives.empty() && num_workers > 1);
  }
  return steps;
}

}  // namespace shardgemm
