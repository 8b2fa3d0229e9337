#include "client/output_checker.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"

namespace shardgemm {

double RelativeError(const HostTensor& a, const HostTensor& b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (a.shape != b.shape || a.NumBytes() != a.NumElements() * DTypeSize(a.dtype) ||
      b.NumBytes() != b.NumElements() * DTypeSize(b.dtype)) {
    return kInf;
  }
  auto fa = ConvertFloatTensor(a, DType::kF32);
  auto fb = ConvertFloatTensor(b, DType::kF32);
  if (!fa.ok() || !fb.ok()) return kInf;
  double err = 0, scale = 0;
  for (int64_t i = 0; i < fa->NumElements(); ++i) {
    const double x = fa->data<float>()[i], y = fb->data<float>()[i];
    const double d = std::abs(x - y);
    // std::max would pass over a NaN (every comparison with it is false).
    if (std::isnan(d)) return kInf;
    err = std::max(err, d);
    scale = std::max(scale, std::abs(y));
  }
  return scale > 0 ? err / scale : err;
}

OutputChecker::OutputChecker(HostTensor want, DType dtype, int64_t total_bytes)
    : want_(std::move(want)), tolerance_(dtype == DType::kF32 ? 1e-4 : 1e-2), total_bytes_(total_bytes) {}

std::string OutputChecker::SetReference(absl::string_view bytes) {
  if (static_cast<int64_t>(bytes.size()) != total_bytes_) {
    return absl::StrFormat("FAIL %d bytes, want %d", bytes.size(), total_bytes_);
  }
  if (want_.NumBytes() <= 0 || total_bytes_ % want_.NumBytes() != 0) {
    return absl::StrFormat("FAIL the output's %d bytes are not whole blocks of %d", total_bytes_, want_.NumBytes());
  }
  double worst = 0;
  for (int64_t at = 0; at < total_bytes_; at += want_.NumBytes()) {
    worst = std::max(worst, BlockError(bytes.substr(at, want_.NumBytes())));
  }
  if (!(worst <= tolerance_)) return absl::StrFormat("FAIL %.1e", worst);
  reference_ = std::string(bytes);
  return absl::StrFormat("ok %.1e", worst);
}

bool OutputChecker::Matches(absl::string_view bytes) const {
  if (static_cast<int64_t>(bytes.size()) != total_bytes_) return false;
  if (want_.NumBytes() <= 0 || total_bytes_ % want_.NumBytes() != 0) return false;
  if (!reference_.empty() && bytes == reference_) return true;
  for (int64_t at = 0; at < total_bytes_; at += want_.NumBytes()) {
    const absl::string_view block = bytes.substr(at, want_.NumBytes());
    if (!reference_.empty() && block == absl::string_view(reference_).substr(at, want_.NumBytes())) continue;
    if (!(BlockError(block) <= tolerance_)) return false;
  }
  return true;
}

double OutputChecker::BlockError(absl::string_view block) const {
  HostTensor got;
  got.dtype = want_.dtype;
  got.shape = want_.shape;
  got.bytes = std::string(block);
  return RelativeError(got, want_);
}

}  // namespace shardgemm
