#include "worker/fake_collectives.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"

namespace shardgemm {

absl::StatusOr<HostTensor> MirrorCollectives::AllGather(const HostTensor& local, int dim,
                                                        const std::vector<std::string>& axes) {
  calls.push_back("all_gather");
  auto n = position_.GroupSize(axes);
  if (!n.ok()) return n.status();
  if (dim < 0 || dim >= static_cast<int>(local.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather: dim ", dim, " out of range"));
  }
  std::vector<int64_t> shape = local.shape;
  shape[dim] *= *n;
  auto out = ZerosTensor(local.dtype, shape);
  if (!out.ok()) return out.status();
  int64_t outer = 1, inner = DTypeSize(local.dtype);
  for (int d = 0; d < dim; ++d) outer *= local.shape[d];
  for (size_t d = dim; d < local.shape.size(); ++d) inner *= local.shape[d];
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t p = 0; p < *n; ++p) {
      std::memcpy(&out->bytes[(o * *n + p) * inner], &local.bytes[o * inner], inner);
    }
  }
  return out;
}

absl::Status MirrorCollectives::AllReduce(HostTensor* t, ReduceOp op, const std::vector<std::string>& axes) {
  calls.push_back("all_reduce");
  auto n = position_.GroupSize(axes);
  if (!n.ok()) return n.status();
  if (op == ReduceOp::kMax) return absl::OkStatus();
  if (t->dtype != DType::kF32) return absl::UnimplementedError("the mirror sums F32 only");
  float* v = t->data<float>();
  for (int64_t i = 0; i < t->NumElements(); ++i) v[i] *= static_cast<float>(*n);
  return absl::OkStatus();
}

absl::StatusOr<HostTensor> MirrorCollectives::ReduceScatter(const HostTensor& t, int dim,
                                                            const std::vector<std::string>& axes) {
  calls.push_back("reduce_scatter");
  HostTensor summed = t;
  auto n = position_.GroupSize(axes);
  if (!n.ok()) return n.status();
  if (summed.dtype != DType::kF32) return absl::UnimplementedError("the mirror sums F32 only");
  float* v = summed.data<float>();
  for (int64_t i = 0; i < summed.NumElements(); ++i) v[i] *= static_cast<float>(*n);
  auto index = position_.GroupIndex(axes);
  if (!index.ok()) return index.status();
  return TakePiece(summed, dim, *index, *n, "reduce_scatter");
}

}  // namespace shardgemm
