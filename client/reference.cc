#include "client/reference.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/grouped_gemm.h"

namespace shardgemm {

absl::StatusOr<HostTensor> ReferenceGroupedGemm(const GemmOperands& in, const v1::Plan& plan) {
  const int64_t m = in.lhs.shape.at(0), k = in.lhs.shape.at(1);
  const int64_t n = in.ragged_k ? in.rhs.shape.at(1)
                                : (in.rhs_transposed ? in.rhs.shape.at(1) : in.rhs.shape.at(2));
  // Row shards: distinct group ranges in the plan, in order.
  struct Shard { int64_t begin, end, first_group; };
  std::vector<Shard> shards;
  for (const auto& w : plan.workers()) {
    bool seen = false;
    for (const Shard& s : shards) seen |= s.begin == w.group_sizes_begin();
    if (!seen) shards.push_back({w.group_sizes_begin(), w.group_sizes_end(), w.first_group()});
  }
  if (shards.empty()) {
    shards.push_back({0, static_cast<int64_t>(in.group_sizes.size()), 0});
  }
  for (const Shard& s : shards) {
    if (s.begin < 0 || s.end < s.begin || s.end > static_cast<int64_t>(in.group_sizes.size())) {
      return absl::InvalidArgumentError("the plan's group ranges do not fit group_sizes");
    }
  }
  std::sort(shards.begin(), shards.end(), [](const Shard& a, const Shard& b) { return a.begin < b.begin; });
  const int64_t num_shards = static_cast<int64_t>(shards.size());
  if (m % num_shards != 0) return absl::InvalidArgumentError("rows do not split into the plan's shards");
  const int64_t rows = m / num_shards;
  const int64_t total_groups =
      in.ragged_k ? [&] { int64_t g = 0; for (auto& s : shards) g = std::max(g, s.first_group + s.end - s.begin); return g; }()
                  : in.rhs.shape.at(0);
  auto out = ZerosTensor(DType::kF32, in.ragged_k ? std::vector<int64_t>{total_groups, k, n}
                                                  : std::vector<int64_t>{m, n});
  if (!out.ok()) return out.status();
  const int esize_lhs = DTypeSize(in.lhs.dtype), esize_rhs = DTypeSize(in.rhs.dtype);
  for (int64_t s = 0; s < num_shards; ++s) {
    const Shard& sh = shards[s];
    const int64_t g = sh.end - sh.begin;
    std::vector<int64_t> sizes(in.group_sizes.begin() + sh.begin, in.group_sizes.begin() + sh.end);
    cpu::GroupedGemmArgs a;
    a.lhs_dtype = in.lhs.dtype;
    a.rhs_dtype = in.rhs.dtype;
    a.out_dtype = DType::kF32;
    a.lhs = in.lhs.bytes.data() + s * rows * k * esize_lhs;
    a.m = rows;
    a.k = k;
    a.n = n;
    a.num_groups = g;
    a.group_sizes = sizes.data();
    a.rhs_transposed = in.rhs_transposed;
    if (in.ragged_k) {
      a.rhs = in.rhs.bytes.data() + s * rows * n * esize_rhs;
      std::vector<float> part(static_cast<size_t>(g * k * n));
      a.out = part.data();
      if (auto st = cpu::GroupedGemmRaggedK(a); !st.ok()) return st;
      float* o = out->data<float>() + sh.first_group * k * n;
      for (size_t i = 0; i < part.size(); ++i) o[i] += part[i];
    } else {
      a.rhs = in.rhs.bytes.data() + sh.first_group * k * n * esize_rhs;
      if (in.bias.dtype != DType::kInvalid) {
        a.bias_dtype = in.bias.dtype;
        a.bias = in.bias.bytes.data() + sh.first_group * n * DTypeSize(in.bias.dtype);
      }
      a.out = out->data<float>() + s * rows * n;
      if (auto st = cpu::GroupedGemmRaggedM(a); !st.ok()) return st;
    }
  }
  return out;
}

Comparison CompareToReference(const HostTensor& got, const HostTensor& reference,
                              int64_t contracting) {
  Comparison c;
  const double eps_out = got.dtype == DType::kBF16 ? std::ldexp(1.0, -8)
                         : got.dtype == DType::kF16 ? std::ldexp(1.0, -11)
                                                    : std::ldexp(1.0, -24);
  const int64_t n = reference.NumElements();
  for (int64_t i = 0; i < n; ++i) {
    c.max_abs_reference = std::max(c.max_abs_reference, std::fabs(double(LoadAsFloat(reference, i))));
  }
  c.tolerance = (eps_out + 2.0 * static_cast<double>(contracting) * std::ldexp(1.0, -24)) *
                std::max(1.0, c.max_abs_reference);
  if (got.NumElements() != n) {
    c.mismatches = std::max<int64_t>(n, 1);
    return c;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::fabs(double(LoadAsFloat(got, i)) - double(LoadAsFloat(reference, i)));
    if (!(err <= c.tolerance)) ++c.mismatches;  // NaN counts as a mismatch
    c.max_abs_error = std::max(c.max_abs_error, std::isnan(err) ? INFINITY : err);
  }
  return c;
}

}  // namespace shardgemm
