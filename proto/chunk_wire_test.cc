#include "proto/chunk_wire.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

// `bytes` as a received message would come: slices cut at `cuts`.
grpc::ByteBuffer Split(const std::string& bytes, std::vector<size_t> cuts = {}) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  cuts.push_back(bytes.size());
  for (size_t to : cuts) {
    slices.emplace_back(bytes.data() + from, to - from);  // copied: owned by the slice
    from = to;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flat(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string DataOf(const DecodedChunk& chunk) {
  std::string out(chunk.data_size(), '\0');
  chunk.CopyDataTo(out.data());
  return out;
}

std::string Bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 131 + 7);
  return s;
}

TEST(ChunkWireTest, EncodesAsProtobufSerializes) {
  for (const std::string& ticket : {std::string(), std::string("0123456789abcdef"), std::string(300, 't')}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{16384}, size_t{1} << 20}) {
      const std::string data = Bytes(n);
      v1::StageChunk stage;
      stage.set_ticket(ticket);
      stage.set_data(data);
      EXPECT_EQ(Flat(EncodeStageChunk(ticket, data)), stage.SerializeAsString()) << ticket.size() << " " << n;
      v1::FetchChunk fetch;
      fetch.set_data(data);
      EXPECT_EQ(Flat(EncodeFetchChunk(data)), fetch.SerializeAsString()) << n;
    }
  }
}

TEST(ChunkWireTest, TheDataSliceBorrowsTheCallersBytes) {
  const std::string data = Bytes(4096);
  grpc::ByteBuffer message = EncodeFetchChunk(data);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(message.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), data.data());  // not a copy
}

TEST(ChunkWireTest, AnOwnerIsHeldUntilGrpcDropsTheSlice) {
  auto owner = std::make_shared<std::string>(Bytes(1000));
  std::weak_ptr<std::string> watch = owner;
  {
    grpc::ByteBuffer message = EncodeStageChunk("t", *owner, owner);
    owner.reset();
    EXPECT_FALSE(watch.expired());  // the message's slice keeps it
    DecodedChunk decoded;
    ASSERT_TRUE(DecodeStageChunk(message, &decoded).ok());
    message.Clear();
    ASSERT_FALSE(watch.expired());  // and so does a decode of it (it references the slices)
    EXPECT_EQ(DataOf(decoded), *watch.lock());
  }
  EXPECT_TRUE(watch.expired());
}

TEST(ChunkWireTest, DecodesWhatProtobufSerializesAcrossAnySliceBoundaries) {
  v1::StageChunk chunk;
  chunk.set_ticket("0123456789abcdef0123456789abcdef");
  chunk.set_data(Bytes(300));
  const std::string wire = chunk.SerializeAsString();
  for (size_t a = 0; a <= wire.size(); a += 7) {
    for (size_t b = a; b <= wire.size(); b += 13) {
      DecodedChunk decoded;
      ASSERT_TRUE(DecodeStageChunk(Split(wire, {a, a, b}), &decoded).ok()) << a << " " << b;  // an empty slice too
      EXPECT_EQ(decoded.ticket(), chunk.ticket());
      EXPECT_EQ(DataOf(decoded), chunk.data());
      for (absl::string_view piece : decoded.data()) EXPECT_FALSE(piece.empty());
    }
  }
}

TEST(ChunkWireTest, EmptyMessagesAndEmptyData) {
  DecodedChunk decoded;
  ASSERT_TRUE(DecodeStageChunk(grpc::ByteBuffer(), &decoded).ok());
  EXPECT_TRUE(decoded.ticket().empty());
  EXPECT_EQ(decoded.data_size(), 0u);
  EXPECT_TRUE(decoded.data().empty());
  ASSERT_TRUE(DecodeFetchChunk(EncodeFetchChunk(""), &decoded).ok());
  EXPECT_EQ(decoded.data_size(), 0u);
  ASSERT_TRUE(DecodeStageChunk(Split(std::string("\x12\x00", 2)), &decoded).ok());  // data present but empty
  EXPECT_EQ(decoded.data_size(), 0u);
}

TEST(ChunkWireTest, UnknownFieldsAreSkippedAndTheLastOfAFieldWins) {
  v1::StageChunk first;
  first.set_ticket("first");
  first.set_data("aaaa");
  auto* unknown = first.GetReflection()->MutableUnknownFields(&first);
  unknown->AddVarint(7, uint64_t{1} << 63);
  unknown->AddFixed32(8, 5);
  unknown->AddFixed64(9, 6);
  unknown->AddLengthDelimited(10, "skipped");
  v1::StageChunk second;
  second.set_data("bb");
  const std::string wire = first.SerializeAsString() + second.SerializeAsString();
  v1::StageChunk parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  DecodedChunk decoded;
  ASSERT_TRUE(DecodeStageChunk(Split(wire, {3, 9}), &decoded).ok());
  EXPECT_EQ(decoded.ticket(), parsed.ticket());
  EXPECT_EQ(DataOf(decoded), parsed.data());
  EXPECT_EQ(DataOf(decoded), "bb");
  // A FetchChunk's field 2 (StageChunk's data) is unknown to it, and its field 1 is the data.
  ASSERT_TRUE(DecodeFetchChunk(Split(std::string("\x12\x02xy\x0a\x01z", 7)), &decoded).ok());
  EXPECT_EQ(DataOf(decoded), "z");
}

struct Malformed {
  std::string wire;
  std::string message;  // a part of the error
};

TEST(ChunkWireTest, MalformedChunksAreInvalidArgumentNamingTheField) {
  const std::vector<Malformed> cases = {
      {std::string("\x12\xd2\x09", 3) + std::string(1000 - 3, 'x'),
       "StageChunk.data: length 1234 at byte 0 runs past the message's 1000 bytes"},
      {std::string("\x0a\x05" "abc", 5), "StageChunk.ticket: length 5 at byte 0 runs past the message's 5 bytes"},
      {std::string("\x12\x80\x80", 3), "StageChunk.data: the length of the field at byte 0 is cut off"},
      {std::string("\x12\xff\xff\xff\xff\x7f", 6), "StageChunk.data: length 34359738367 at byte 0 overflows"},
      {std::string("\x12\xff\xff\xff\xff\xff\x01", 7), "StageChunk.data: the length of the field at byte 0 overflows 32 bits"},
      {std::string("\x10\x05", 2), "StageChunk.data: wire type 0 at byte 0, not length-delimited"},
      {std::string("\x0d\x01\x02\x03\x04", 5), "StageChunk.ticket: wire type 5"},
      {std::string("\x0a\x02\xc3\x28", 4), "StageChunk.ticket: the string at byte 0 is not UTF-8"},
      {std::string("\x80", 1), "StageChunk: the tag at byte 0 is cut off"},
      {std::string("\x12\x00\xff\xff\xff\xff\xff\x01", 8), "StageChunk: the tag at byte 2 runs over 5 bytes"},
      {std::string("\x02\x00", 2), "StageChunk: field number 0 at byte 0"},
      {std::string("\x38\xff\xff", 3), "StageChunk: field 7's varint at byte 0 is cut off"},
      {std::string("\x38") + std::string(10, '\xff') + "\x01", "StageChunk: field 7's varint at byte 0 runs over 10"},
      {std::string("\x41\x01\x02", 3), "StageChunk: field 8's 8 bytes at byte 0 run past the message's 3 bytes"},
      {std::string("\x4a\x09", 2), "StageChunk: field 9: length 9 at byte 0 runs past"},
      {std::string("\x5b\x5c", 2), "StageChunk: field 11 at byte 0 is a group"},
      {std::string("\x5c", 1), "StageChunk: field 11 at byte 0: invalid wire type 4"},
      {std::string("\x5e", 1), "StageChunk: field 11 at byte 0: invalid wire type 6"},
  };
  for (const Malformed& c : cases) {
    for (size_t cut = 0; cut <= c.wire.size(); ++cut) {
      DecodedChunk decoded;
      absl::Status s = DecodeStageChunk(Split(c.wire, {cut}), &decoded);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
      EXPECT_THAT(s.message(), HasSubstr(c.message));
    }
  }
  DecodedChunk decoded;
  absl::Status s = DecodeFetchChunk(Split(std::string("\x0a\x09", 2)), &decoded);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("FetchChunk.data: length 9"));
}

}  // namespace
}  // namespace shardgemm
