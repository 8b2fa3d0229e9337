#include <new>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/fp8_grouped_gemm.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/cpu/quantize.h"
#include "worker/backend.h"

namespace shardgemm {
namespace {

// The dims, groups, output dtype and bias of either kernel's arguments for
// `g` (lhs as the kernel reads it); returns the output's shape.
template <typename Args>
std::vector<int64_t> SetGemmShape(const LocalGemm& g, const HostTensor& lhs, Args* a) {
  const HostTensor& rhs = *g.rhs;
  a->m = lhs.shape.at(0);
  a->k = lhs.shape.at(1);
  a->num_groups = static_cast<int64_t>(g.group_sizes.size());
  a->group_sizes = g.group_sizes.data();
  a->rhs_transposed = g.rhs_transposed;
  a->out_dtype = g.out_dtype;
  if (g.ragged_k) {
    a->n = rhs.shape.at(1);
    return {a->num_groups, a->k, a->n};
  }
  a->n = g.rhs_transposed ? rhs.shape.at(1) : rhs.shape.at(2);
  if (g.bias != nullptr) {
    a->bias_dtype = g.bias->dtype;
    a->bias = g.bias->bytes.data();
  }
  return {a->m, a->n};
}

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : num_threads_(num_threads > 0 ? num_threads
                                     : static_cast<int>(std::thread::hardware_concurrency())) {}

  std::string Name() const override { return "cpu"; }
  std::string Device() const override { return absl::StrCat("cpu (", num_threads_, " threads)"); }

  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& g) override {
    // Never asked for (CanGatherOnDevice is false), but a gather handed over
    // still runs: on the host.
    if (g.rhs_gather.enabled) return GroupedGemmAfterHostGather(this, g);
    if (IsFloat8(g.rhs->dtype)) {
      try {
        return Fp8GroupedGemm(g);
      } catch (const std::bad_alloc&) {  // the FP32 copies of the operands
        return absl::ResourceExhaustedError("FP8 GEMM: no host memory for the dequantized operands");
      }
    }
    const HostTensor& lhs = *g.lhs;
    const HostTensor& rhs = *g.rhs;
    cpu::GroupedGemmArgs a;
    a.lhs_dtype = lhs.dtype;
    a.rhs_dtype = rhs.dtype;
    a.lhs = lhs.bytes.data();
    a.rhs = rhs.bytes.data();
    const std::vector<int64_t> out_shape = SetGemmShape(g, lhs, &a);
    auto out = ZerosTensor(g.out_dtype, out_shape);
    if (!out.ok()) return out.status();
    a.out = out->bytes.empty() ? nullptr : &out->bytes[0];
    a.stop = g.stop;
    absl::Status s = g.ragged_k ? cpu::GroupedGemmRaggedK(a, num_threads_)
                                : cpu::GroupedGemmRaggedM(a, num_threads_);
    if (!s.ok()) return s;
    return out;
  }

  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override {
    auto out = AllocateQuantizeOutputs(q);
    if (!out.ok()) return out.status();
    GroupedQuantizeArgs a = QuantizeArgs(q, q.x->bytes.data());
    a.scale = q.scales != nullptr ? q.scales->data() : nullptr;
    // std::string::data() is never null, so empty outputs still pass validation.
    auto at = [](HostTensor& t) -> void* { return t.bytes.data(); };
    PointQuantizeOutputs(q, {at(out->rowwise_data), at(out->colwise_data), at(out->scale_inv),
                             at(out->colwise_scale_inv), at(out->amax)}, &a);
    if (auto s = cpu::GroupedQuantize(a); !s.ok()) return s;
    return out;
  }

  // The reference FP8 GEMM: dequantize, FP32 accumulate.
  absl::StatusOr<HostTensor> Fp8GroupedGemm(const LocalGemm& g) {
    QuantizedLhs quantized;
    const HostTensor* lhs = g.lhs;
    const HostTensor* lhs_scale = g.lhs_scale_inv;
    if (g.quantize_lhs_to != DType::kInvalid) {
      auto q = QuantizeLhsForGemm(this, g);
      if (!q.ok()) return q.status();
      quantized = std::move(*q);
      lhs = &quantized.data;
      lhs_scale = &quantized.scale_inv;
    }
    if (lhs_scale == nullptr || g.rhs_scale_inv == nullptr) {
      return absl::InvalidArgumentError("scale_inv: an FP8 GEMM needs both operands' scales");
    }
    const HostTensor& rhs = *g.rhs;
    cpu::Fp8GroupedGemmArgs a;
    a.ragged_k = g.ragged_k;
    a.lhs_dtype = lhs->dtype;
    a.rhs_dtype = rhs.dtype;
    a.lhs = reinterpret_cast<const uint8_t*>(lhs->bytes.data());
    a.rhs = reinterpret_cast<const uint8_t*>(rhs.bytes.data());
    a.lhs_mode = g.lhs_mode;
    a.rhs_mode = g.rhs_mode;
    a.lhs_scale_inv = lhs_scale->bytes.data();
    a.rhs_scale_inv = g.rhs_scale_inv->bytes.data();
    const std::vector<int64_t> out_shape = SetGemmShape(g, *lhs, &a);
    // The scales' shapes are the GEMM's contract: a wrong one is named.
    for (const auto& [t, want, name] :
         {std::make_tuple(lhs_scale, cpu::Fp8LhsScaleShape(a), "lhs_scale_inv"),
          std::make_tuple(g.rhs_scale_inv, cpu::Fp8RhsScaleShape(a), "rhs_scale_inv")}) {
      if (t->shape != want) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": local shape ", ShapeToString(t->shape),
                                                       ", expected ", ShapeToString(want), " (",
                                                       ScalingModeName(name[0] == 'l' ? a.lhs_mode : a.rhs_mode),
                                                       " scaling)"));
      }
    }
    auto out = ZerosTensor(g.out_dtype, out_shape);
    if (!out.ok()) return out.status();
    a.out = out->bytes.empty() ? nullptr : &out->bytes[0];
    if (auto s = cpu::Fp8GroupedGemm(a, num_threads_); !s.ok()) return s;
    return out;
  }

 private:
  int num_threads_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace shardgemm
