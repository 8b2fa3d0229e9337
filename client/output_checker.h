// Checks a service answer's output bytes against a local op's output (the
// service bench's check, client/service_bench.cc).
#ifndef SHARDGEMM_CLIENT_OUTPUT_CHECKER_H_
#define SHARDGEMM_CLIENT_OUTPUT_CHECKER_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

// Max |a - b| over max |b|, both as F32; infinite when the shapes differ,
// a value is not a float type, or either holds a NaN or an infinity where
// the other does not match it (a NaN is never within a tolerance).
double RelativeError(const HostTensor& a, const HostTensor& b);

// Checks answers against the local op's output `want` (one row shard's
// block; the service's output is that block once per row shard, `total_bytes`
// in all). The first answer is checked within tolerance (1e-4 for F32, 1e-2
// otherwise) and becomes the reference; later ones are compared byte for
// byte with it, and a block that differs is checked within tolerance again
// (sums need not be bit-reproducible to be right).
class OutputChecker {
 public:
  OutputChecker(HostTensor want, DType dtype, int64_t total_bytes);

  // Before the timed calls (not thread-safe): "ok 1.2e-03" or "FAIL ..." saying why not.
  std::string SetReference(absl::string_view bytes);

  // Thread-safe once the reference is set.
  bool Matches(absl::string_view bytes) const;

  double tolerance() const { return tolerance_; }

 private:
  double BlockError(absl::string_view block) const;
  HostTensor want_;
  double tolerance_;
  int64_t total_bytes_;
  std::string reference_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_OUTPUT_CHECKER_H_
