#include "proto/tensor_codec.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(TensorCodecTest, RoundTrip) {
  auto t = *ZerosTensor(DType::kBF16, {2, 3});
  StoreFromFloat(&t, 4, 2.5f);
  v1::Tensor proto;
  HostTensorToProto(t, &proto);
  auto back = HostTensorFromProto(proto, "lhs");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape, t.shape);
  EXPECT_EQ(back->bytes, t.bytes);
}

TEST(TensorCodecTest, RejectsLengthMismatchNamingTheField) {
  v1::Tensor proto;
  proto.set_dtype(v1::F32);
  proto.add_shape(4);
  proto.set_data(std::string(15, '\0'));
  auto s = HostTensorFromProto(proto, "rhs").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rhs.data has 15 bytes"), std::string::npos) << s;
}

TEST(TensorCodecTest, RejectsUnknownDTypeAndNegativeDims) {
  v1::Tensor proto;
  proto.set_dtype(static_cast<v1::DType>(42));
  EXPECT_NE(HostTensorFromProto(proto, "bias").status().message().find("bias.dtype is unknown"),
            std::string::npos);
  proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(HostTensorFromProto(proto, "bias").status().code(),
            absl::StatusCode::kInvalidArgument);
  proto.set_dtype(v1::F16);
  proto.add_shape(-3);
  auto s = HostTensorFromProto(proto, "lhs").status();
  EXPECT_NE(s.message().find("lhs.shape[0] is negative"), std::string::npos) << s;
}

TEST(TensorCodecTest, ResidentReferenceIsNotData) {
  v1::Tensor proto;
  proto.set_dtype(v1::F32);
  proto.set_resident("w");
  EXPECT_EQ(HostTensorFromProto(proto, "rhs").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardgemm
