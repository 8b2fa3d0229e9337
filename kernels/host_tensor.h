// A dense row-major tensor in host memory: the unit that moves between the
// wire, the shard store and the kernels.
#ifndef SHARDGEMM_KERNELS_HOST_TENSOR_H_
#define SHARDGEMM_KERNELS_HOST_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"

namespace shardgemm {

struct HostTensor {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::string bytes;  // NumElements() * DTypeSize(dtype)

  int64_t NumElements() const;
  int64_t NumBytes() const { return static_cast<int64_t>(bytes.size()); }
  template <typename T>
  T* data() { return reinterpret_cast<T*>(&bytes[0]); }
  template <typename T>
  const T* data() const { return reinterpret_cast<const T*>(bytes.data()); }
};

// Element count of `shape`; InvalidArgument naming `field` when a dimension is
// negative or the count (times `element_size`) overflows int64.
absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape, int element_size,
                                           absl::string_view field);

// A zero-filled tensor.
absl::StatusOr<HostTensor> ZerosTensor(DType dtype, std::vector<int64_t> shape);

// Element i as float (F32, BF16, F16, I32, I64) and back (F32, BF16, F16; RNE).
float LoadAsFloat(const HostTensor& t, int64_t i);
void StoreFromFloat(HostTensor* t, int64_t i, float value);

// Converts among F32 / BF16 / F16 (RNE).
absl::StatusOr<HostTensor> ConvertFloatTensor(const HostTensor& t, DType to);

// Integer tensor (I32 / I64) as int64 values.
absl::StatusOr<std::vector<int64_t>> ToInt64Vector(const HostTensor& t, absl::string_view field);

// The block [offsets, offsets + sizes) of `t`, and its inverse: writes `block`
// into `dst` at `offsets`. Callers guarantee the block is inside the tensor.
HostTensor SliceBlock(const HostTensor& t, absl::Span<const int64_t> offsets,
                      absl::Span<const int64_t> sizes);
void InsertBlock(const HostTensor& block, absl::Span<const int64_t> offsets, HostTensor* dst);

std::string ShapeToString(absl::Span<const int64_t> shape);  // "4x128x64"

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_HOST_TENSOR_H_
