#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/cpu/quantize.h"
#include "worker/backend.h"

namespace shardgemm {
namespace {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : num_threads_(num_threads > 0 ? num_threads
                                     : static_cast<int>(std::thread::hardware_concurrency())) {}

  std::string Name() const override { return "cpu"; }
  std::string Device() const override { return absl::StrCat("cpu (", num_threads_, " threads)"); }

  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& g) override {
    const HostTensor& lhs = *g.lhs;
    const HostTensor& rhs = *g.rhs;
    cpu::GroupedGemmArgs a;
    a.lhs_dtype = lhs.dtype;
    a.rhs_dtype = rhs.dtype;
    a.out_dtype = g.out_dtype;
    a.lhs = lhs.bytes.data();
    a.rhs = rhs.bytes.data();
    a.m = lhs.shape.at(0);
    a.k = lhs.shape.at(1);
    a.num_groups = static_cast<int64_t>(g.group_sizes.size());
    a.group_sizes = g.group_sizes.data();
    a.rhs_transposed = g.rhs_transposed;
    std::vector<int64_t> out_shape;
    if (g.ragged_k) {
      a.n = rhs.shape.at(1);
      out_shape = {a.num_groups, a.k, a.n};
    } else {
      a.n = g.rhs_transposed ? rhs.shape.at(1) : rhs.shape.at(2);
      out_shape = {a.m, a.n};
      if (g.bias != nullptr) {
        a.bias_dtype = g.bias->dtype;
        a.bias = g.bias->bytes.data();
      }
    }
    auto out = ZerosTensor(g.out_dtype, out_shape);
    if (!out.ok()) return out.status();
    a.out = out->bytes.empty() ? nullptr : &out->bytes[0];
    absl::Status s = g.ragged_k ? cpu::GroupedGemmRaggedK(a, num_threads_)
                                : cpu::GroupedGemmRaggedM(a, num_threads_);
    if (!s.ok()) return s;
    return out;
  }

  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override {
    GroupedQuantizeArgs a;
    a.x = q.x->bytes.data();
    a.x_dtype = q.x->dtype;
    a.m = q.m;
    a.k = q.k;
    a.group_sizes = q.group_sizes.data();
    a.num_groups = static_cast<int64_t>(q.group_sizes.size());
    a.mode = q.scales != nullptr ? ScalingMode::kDelayed : ScalingMode::kCurrent;
    a.format = q.out_dtype == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
    a.rowwise = q.rowwise;
    a.colwise = q.colwise;
    a.scale = q.scales != nullptr ? q.scales->data() : nullptr;
    QuantizeOutputs out;
    const int64_t g = a.num_groups;
    if (q.rowwise) out.rowwise_data = *ZerosTensor(q.out_dtype, {q.m, q.k});
    if (q.colwise) out.colwise_data = *ZerosTensor(q.out_dtype, {q.m, q.k});
    out.scale_inv = *ZerosTensor(DType::kF32, {g});
    out.amax = *ZerosTensor(DType::kF32, {g});
    auto data = [](HostTensor& t) {
      return t.bytes.empty() ? nullptr : reinterpret_cast<uint8_t*>(&t.bytes[0]);
    };
    a.rowwise_data = data(out.rowwise_data);
    a.colwise_data = data(out.colwise_data);
    // Per-group scaling: one scale_inv per group serves both directions.
    a.rowwise_scale_inv = q.rowwise && g > 0 ? out.scale_inv.data<float>() : nullptr;
    std::vector<float> colwise_scale_inv(static_cast<size_t>(g));
    a.colwise_scale_inv = q.colwise && g > 0 ? colwise_scale_inv.data() : nullptr;
    if (!q.rowwise && g > 0) a.colwise_scale_inv = out.scale_inv.data<float>();
    a.amax = g > 0 ? out.amax.data<float>() : nullptr;
    if (auto s = cpu::GroupedQuantize(a); !s.ok()) return s;
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
