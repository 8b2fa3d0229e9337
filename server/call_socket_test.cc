#include "server/call_socket.h"

#include <string>

#include "gtest/gtest.h"
#include "proto/frame_socket_server.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

std::string Head(const std::string& payload) {
  return payload.substr(0, FrameSocketServer::kOversizedHeadBytes);
}

// A request large enough to be refused unread: a big inline lhs.
v1::CallSocketRequest BigRequest(uint64_t call_id) {
  v1::CallSocketRequest request;
  request.set_call_id(call_id);
  request.set_token(std::string(200, 't'));
  request.set_request_id("req-7");
  request.mutable_grouped_gemm()->mutable_lhs()->set_data(std::string(1 << 16, 'x'));
  return request;
}

TEST(CallIdOfRequestHead, ReadsTheIdProtobufWritesFirst) {
  EXPECT_EQ(CallIdOfRequestHead(Head(BigRequest(41).SerializeAsString())), 41u);
  EXPECT_EQ(CallIdOfRequestHead(Head(BigRequest(uint64_t{1} << 62).SerializeAsString())), uint64_t{1} << 62);
}

TEST(CallIdOfRequestHead, SkipsTheFieldsAWriterPutBeforeIt) {
  // Another writer's order: the token and request id first, the call id
  // after them, the call last.
  v1::CallSocketRequest request = BigRequest(9);
  v1::CallSocketRequest fields;
  fields.set_token(request.token());
  fields.set_request_id(request.request_id());
  v1::CallSocketRequest id_only;
  id_only.set_call_id(9);
  v1::CallSocketRequest call_only;
  *call_only.mutable_grouped_gemm() = request.grouped_gemm();
  const std::string reordered =
      fields.SerializeAsString() + id_only.SerializeAsString() + call_only.SerializeAsString();
  v1::CallSocketRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(reordered));  // still one valid request
  ASSERT_EQ(parsed.call_id(), 9u);
  EXPECT_EQ(CallIdOfRequestHead(Head(reordered)), 9u);
}

TEST(CallIdOfRequestHead, IsZeroWhenTheHeadHoldsNoId) {
  EXPECT_EQ(CallIdOfRequestHead(""), 0u);
  EXPECT_EQ(CallIdOfRequestHead(std::string(64, '\xff')), 0u);  // not a message
  // The call before the id: the id lies past the head.
  v1::CallSocketRequest call_only;
  call_only.mutable_grouped_gemm()->mutable_lhs()->set_data(std::string(1 << 16, 'x'));
  v1::CallSocketRequest id_only;
  id_only.set_call_id(5);
  EXPECT_EQ(CallIdOfRequestHead(Head(call_only.SerializeAsString() + id_only.SerializeAsString())), 0u);
  // Cut inside the id's varint.
  const std::string payload = BigRequest(uint64_t{1} << 40).SerializeAsString();
  EXPECT_EQ(CallIdOfRequestHead(payload.substr(0, 3)), 0u);
}

}  // namespace
}  // namespace shardgemm
