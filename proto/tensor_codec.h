// Converts tensors between the wire (shardgemm.v1.Tensor / LocalTensor) and
// HostTensor, validating what a client sent.
#ifndef SHARDGEMM_PROTO_TENSOR_CODEC_H_
#define SHARDGEMM_PROTO_TENSOR_CODEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/host_tensor.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);

// Validates dtype, shape (no negative dims, no overflow) and that the data
// length equals prod(shape) * size(dtype). `field` names the tensor in errors,
// e.g. "lhs". The tensor must carry inline data.
absl::StatusOr<HostTensor> HostTensorFromProto(const v1::Tensor& t, absl::string_view field);
absl::StatusOr<HostTensor> HostTensorFromProto(const v1::LocalTensor& t, absl::string_view field);
absl::StatusOr<HostTensor> HostTensorFromProto(v1::LocalTensor&& t, absl::string_view field);

void HostTensorToProto(const HostTensor& t, v1::Tensor* out);
void HostTensorToProto(HostTensor&& t, v1::Tensor* out);  // moves the bytes
void HostTensorToProto(const HostTensor& t, v1::LocalTensor* out);
void HostTensorToProto(HostTensor&& t, v1::LocalTensor* out);

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_TENSOR_CODEC_H_
