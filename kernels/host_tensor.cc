#include "kernels/host_tensor.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm {

int64_t HostTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape, int element_size,
                                           absl::string_view field) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "] is negative (", shape[i], ")"));
    }
    if (shape[i] != 0 &&
        n > std::numeric_limits<int64_t>::max() / shape[i] / std::max(element_size, 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape ", ShapeToString(shape), " overflows: too many elements"));
    }
    n *= shape[i];
  }
  return n;
}

absl::StatusOr<HostTensor> ZerosTensor(DType dtype, std::vector<int64_t> shape) {
  if (DTypeSize(dtype) == 0) return absl::InvalidArgumentError("invalid dtype");
  auto n = CheckedNumElements(shape, DTypeSize(dtype), "tensor");
  if (!n.ok()) return n.status();
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(static_cast<size_t>(*n) * DTypeSize(dtype), '\0');
  return t;
}

float LoadAsFloat(const HostTensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kBF16: return BF16ToFloat(t.data<uint16_t>()[i]);
    case DType::kF16: return F16ToFloat(t.data<uint16_t>()[i]);
    case DType::kI32: return static_cast<float>(t.data<int32_t>()[i]);
    case DType::kI64: return static_cast<float>(t.data<int64_t>()[i]);
    default: return 0.0f;
  }
}

void StoreFromFloat(HostTensor* t, int64_t i, float value) {
  switch (t->dtype) {
    case DType::kF32: t->data<float>()[i] = value; break;
    case DType::kBF16: t->data<uint16_t>()[i] = FloatToBF16(value); break;
    case DType::kF16: t->data<uint16_t>()[i] = FloatToF16(value); break;
    default: break;
  }
}

absl::StatusOr<HostTensor> ConvertFloatTensor(const HostTensor& t, DType to) {
  if (!IsGemmFloat(t.dtype) || !IsGemmFloat(to)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot convert ", DTypeName(t.dtype), " to ",
                                                   DTypeName(to)));
  }
  if (t.dtype == to) return t;
  auto out = ZerosTensor(to, t.shape);
  if (!out.ok()) return out.status();
  const int64_t n = t.NumElements();
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(&*out, i, LoadAsFloat(t, i));
  return out;
}

absl::StatusOr<std::vector<int64_t>> ToInt64Vector(const HostTensor& t, absl::string_view field) {
  const int64_t n = t.NumElements();
  std::vector<int64_t> v(static_cast<size_t>(n));
  if (t.dtype == DType::kI32) {
    for (int64_t i = 0; i < n; ++i) v[i] = t.data<int32_t>()[i];
  } else if (t.dtype == DType::kI64) {
    for (int64_t i = 0; i < n; ++i) v[i] = t.data<int64_t>()[i];
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype must be i32 or i64, got ", DTypeName(t.dtype)));
  }
  return v;
}

namespace {

// Copies between a block and a full tensor, one contiguous innermost run at a
// time. `to_block` picks the direction.
void CopyBlock(const std::vector<int64_t>& full_shape, absl::Span<const int64_t> offsets,
               absl::Span<const int64_t> sizes, int esize, const char* src, char* dst,
               bool to_block) {
  const int rank = static_cast<int>(full_shape.size());
  if (rank == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  for (int64_t s : sizes) if (s == 0) return;
  std::vector<int64_t> full_stride(rank), block_stride(rank);
  full_stride[rank - 1] = block_stride[rank - 1] = 1;
  for (int d = rank - 2; d >= 0; --d) {
    full_stride[d] = full_stride[d + 1] * full_shape[d + 1];
    block_stride[d] = block_stride[d + 1] * sizes[d + 1];
  }
  const int64_t run = sizes[rank - 1] * esize;
  std::vector<int64_t> idx(rank, 0);
  while (true) {
    int64_t full_off = 0, block_off = 0;
    for (int d = 0; d < rank; ++d) {
      full_off += (offsets[d] + idx[d]) * full_stride[d];
      block_off += idx[d] * block_stride[d];
    }
    if (to_block) {
      std::memcpy(dst + block_off * esize, src + full_off * esize, run);
    } else {
      std::memcpy(dst + full_off * esize, src + block_off * esize, run);
    }
    int d = rank - 2;
    while (d >= 0 && ++idx[d] == sizes[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

}  // namespace

HostTensor SliceBlock(const HostTensor& t, absl::Span<const int64_t> offsets,
                      absl::Span<const int64_t> sizes) {
  HostTensor out;
  out.dtype = t.dtype;
  out.shape.assign(sizes.begin(), sizes.end());
  out.bytes.assign(static_cast<size_t>(out.NumElements()) * DTypeSize(t.dtype), '\0');
  CopyBlock(t.shape, offsets, sizes, DTypeSize(t.dtype), t.bytes.data(), &out.bytes[0], true);
  return out;
}

void InsertBlock(const HostTensor& block, absl::Span<const int64_t> offsets, HostTensor* dst) {
  if (block.bytes.empty()) return;
  CopyBlock(dst->shape, offsets, block.shape, DTypeSize(dst->dtype), block.bytes.data(),
            &dst->bytes[0], false);
}

std::string ShapeToString(absl::Span<const int64_t> shape) {
  if (shape.empty()) return "scalar";
  return absl::StrJoin(shape, "x");
}

}  // namespace shardgemm
