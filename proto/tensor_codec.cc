#include "proto/tensor_codec.h"

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  if (dtype <= v1::DTYPE_UNSPECIFIED || dtype > v1::I64) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype is ", dtype == v1::DTYPE_UNSPECIFIED ? "unset" : "unknown",
                     " (", static_cast<int>(dtype), ")"));
  }
  return static_cast<DType>(static_cast<int>(dtype));
}

v1::DType DTypeToProto(DType dtype) { return static_cast<v1::DType>(static_cast<int>(dtype)); }

namespace {

template <typename ProtoT>
absl::StatusOr<HostTensor> Decode(const ProtoT& t, std::string&& data, absl::string_view field) {
  auto dtype = DTypeFromProto(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  HostTensor out;
  out.dtype = *dtype;
  out.shape.assign(t.shape().begin(), t.shape().end());
  auto n = CheckedNumElements(out.shape, DTypeSize(out.dtype), field);
  if (!n.ok()) return n.status();
  const int64_t expected = *n * DTypeSize(out.dtype);
  if (static_cast<int64_t>(data.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", data.size(), " bytes but shape ", ShapeToString(out.shape), " of ",
        DTypeName(out.dtype), " needs ", expected));
  }
  out.bytes = std::move(data);
  return out;
}

}  // namespace

absl::StatusOr<HostTensor> HostTensorFromProto(const v1::Tensor& t, absl::string_view field) {
  if (t.source_case() == v1::Tensor::kResident) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " refers to resident tensor '", t.resident(), "' where data is needed"));
  }
  return Decode(t, std::string(t.data()), field);
}

absl::StatusOr<HostTensor> HostTensorFromProto(const v1::LocalTensor& t, absl::string_view field) {
  return Decode(t, std::string(t.data()), field);
}

absl::StatusOr<HostTensor> HostTensorFromProto(v1::LocalTensor&& t, absl::string_view field) {
  std::string data = std::move(*t.mutable_data());
  return Decode(t, std::move(data), field);
}

void HostTensorToProto(const HostTensor& t, v1::Tensor* out) {
  out->set_dtype(DTypeToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->set_data(t.bytes);
}

void HostTensorToProto(HostTensor&& t, v1::Tensor* out) {
  out->set_dtype(DTypeToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->set_data(std::move(t.bytes));
}

void HostTensorToProto(const HostTensor& t, v1::LocalTensor* out) {
  out->set_dtype(DTypeToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->set_data(t.bytes);
}

void HostTensorToProto(HostTensor&& t, v1::LocalTensor* out) {
  out->set_dtype(DTypeToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->set_data(std::move(t.bytes));
}

}  // namespace shardgemm
