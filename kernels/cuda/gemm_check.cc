#include "kernels/cuda/gemm_check.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/gemm_testing.h"

namespace shardgemm {
namespace cuda {
namespace testing {
namespace {

struct DevBuf {
  void* p = nullptr;
  cudaError_t Alloc(int64_t bytes) { return cudaMalloc(&p, bytes > 0 ? bytes : 1); }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
};

#define CK(expr)                                                               \
  do {                                                                         \
    cudaError_t _e = (expr);                                                   \
    if (_e != cudaSuccess) {                                                   \
      r.error = absl::StrCat(#expr, ": ", cudaGetErrorString(_e));             \
      return r;                                                                \
    }                                                                          \
  } while (0)

void Compare(const std::vector<float>& out, const std::vector<float>& ref, CheckResult* r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++r->nonfinite;
      continue;
    }
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    r->max_abs = std::max(r->max_abs, std::fabs(d));
    r->max_ref = std::max(r->max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  r->checked += static_cast<int64_t>(out.size());
  r->rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

bool CheckResult::Ok(double tol) const {
  return error.empty() && nonfinite == 0 && bad_padding == 0 && rel_l2 <= tol &&
         max_abs <= 8 * tol * std::max(max_ref, 1e-6);
}

std::string CheckResult::ToString() const {
  return absl::StrCat("rel_l2=", rel_l2, " max_abs=", max_abs, " max_ref=", max_ref, " checked=", checked,
                      " nonfinite=", nonfinite, " bad_padding=", bad_padding, error.empty() ? "" : " error=", error);
}

double Tolerance(DType out) {
  switch (out) {
    case DType::kF32: return 1e-3;
    case DType::kF16: return 3e-3;
    default: return 1e-2;
  }
}

CheckResult CheckRaggedM(const DeviceGroupedGemmArgs& a, const std::vector<int64_t>& sizes, int max_rows,
                         uint64_t seed, cudaStream_t s) {
  CheckResult r;
  std::mt19937_64 rng(seed);
  std::vector<int64_t> rows, groups, pad_rows;
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) starts[g + 1] = starts[g] + sizes[g];
  std::vector<int64_t> order(sizes.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = g;
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t g : order) {
    if (sizes[g] == 0) continue;
    if (static_cast<int>(rows.size()) >= max_rows) break;
    std::vector<int64_t> pick = {starts[g], starts[g + 1] - 1,
                                 starts[g] + static_cast<int64_t>(rng() % sizes[g])};
    std::sort(pick.begin(), pick.end());
    pick.erase(std::unique(pick.begin(), pick.end()), pick.end());
    for (int64_t row : pick) {
      rows.push_back(row);
      groups.push_back(g);
    }
  }
  const int64_t total = starts.back();
  if (total < a.m) {
    pad_rows = {total, a.m - 1, total + static_cast<int64_t>(rng() % (a.m - total))};
  }
  const int64_t nr = rows.size(), np = pad_rows.size(), n = a.n;
  DevBuf d_rows, d_groups, d_ref, d_idx, d_out;
  CK(d_rows.Alloc(nr * 8));
  CK(d_groups.Alloc(nr * 8));
  CK(d_ref.Alloc(nr * n * 4));
  CK(d_idx.Alloc((nr + np) * n * 8));
  CK(d_out.Alloc((nr + np) * n * 4));
  std::vector<int64_t> idx;
  idx.reserve((nr + np) * n);
  for (int64_t row : rows)
    for (int64_t c = 0; c < n; ++c) idx.push_back(row * n + c);
  for (int64_t row : pad_rows)
    for (int64_t c = 0; c < n; ++c) idx.push_back(row * n + c);
  CK(cudaMemcpyAsync(d_rows.p, rows.data(), nr * 8, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(d_groups.p, groups.data(), nr * 8, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(d_idx.p, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice, s));
  CK(ReferenceRowsRaggedM(a.lhs, a.rhs, a.rhs_transposed, a.bias, ToCu(a.bias_dtype), ToCu(a.in_dtype), a.k, n,
                          static_cast<int64_t*>(d_rows.p), static_cast<int64_t*>(d_groups.p), nr,
                          static_cast<float*>(d_ref.p), s));
  CK(GatherAsFloat(a.out, ToCu(a.out_dtype), static_cast<int64_t*>(d_idx.p), idx.size(), static_cast<float*>(d_out.p),
                   s));
  std::vector<float> out(idx.size()), ref(nr * n);
  CK(cudaMemcpyAsync(out.data(), d_out.p, out.size() * 4, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(ref.data(), d_ref.p, ref.size() * 4, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  for (int64_t i = nr * n; i < static_cast<int64_t>(out.size()); ++i)
    if (out[i] != 0.f) ++r.bad_padding;
  out.resize(nr * n);
  Compare(out, ref, &r);
  return r;
}

CheckResult CheckRaggedK(const DeviceGroupedGemmArgs& a, const std::vector<int64_t>& sizes, int max_entries,
                         uint64_t seed, cudaStream_t s) {
  CheckResult r;
  std::mt19937_64 rng(seed);
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) starts[g + 1] = starts[g] + sizes[g];
  std::vector<int64_t> entries, idx;
  const int64_t per_group = std::max<int64_t>(1, max_entries / static_cast<int64_t>(sizes.size()));
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t e = 0; e < per_group; ++e) {
      int64_t kk = e == 0 ? 0 : (e == 1 ? a.k - 1 : static_cast<int64_t>(rng() % a.k));
      int64_t nn = e == 0 ? 0 : (e == 1 ? a.n - 1 : static_cast<int64_t>(rng() % a.n));
      entries.insert(entries.end(), {starts[g], sizes[g], kk, nn});
      idx.push_back((static_cast<int64_t>(g) * a.k + kk) * a.n + nn);
    }
  }
  const int64_t num = idx.size();
  DevBuf d_e, d_idx, d_ref, d_out;
  CK(d_e.Alloc(num * 32));
  CK(d_idx.Alloc(num * 8));
  CK(d_ref.Alloc(num * 4));
  CK(d_out.Alloc(num * 4));
  CK(cudaMemcpyAsync(d_e.p, entries.data(), num * 32, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(d_idx.p, idx.data(), num * 8, cudaMemcpyHostToDevice, s));
  CK(ReferenceEntriesRaggedK(a.lhs, a.rhs, ToCu(a.in_dtype), a.k, a.n, static_cast<int64_t*>(d_e.p), num,
                             static_cast<float*>(d_ref.p), s));
  CK(GatherAsFloat(a.out, ToCu(a.out_dtype), static_cast<int64_t*>(d_idx.p), num, static_cast<float*>(d_out.p), s));
  std::vector<float> out(num), ref(num);
  CK(cudaMemcpyAsync(out.data(), d_out.p, num * 4, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(ref.data(), d_ref.p, num * 4, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  Compare(out, ref, &r);
  return r;
}

}  // namespace testing
}  // namespace cuda
}  // namespace shardgemm
