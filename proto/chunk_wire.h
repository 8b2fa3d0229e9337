// StageChunk and FetchChunk (proto/shardgemm.proto) in protobuf's wire
// format, straight over gRPC slices, for the direct path's raw streams
// (docs/architecture.md "Data paths"): decoding leaves the data where gRPC
// received it, encoding borrows the caller's bytes, so a chunk's tensor bytes
// are copied once per side (into the staging block, or into the fetched
// output) instead of by protobuf's parse and serialization too. The bytes
// are exactly protobuf's: the Python client and the coordinator keep the
// generated classes on the other end of the same methods.
#ifndef SHARDGEMM_PROTO_CHUNK_WIRE_H_
#define SHARDGEMM_PROTO_CHUNK_WIRE_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace shardgemm {

// A decoded chunk. Its data lies inside the received message's slices, which
// it keeps referenced (no copy) until it is cleared or destroyed.
class DecodedChunk {
 public:
  DecodedChunk() = default;
  // Not copyable: the pieces may point into the slices' own storage (small
  // slices keep their bytes inline). A move keeps them where they are.
  DecodedChunk(const DecodedChunk&) = delete;
  DecodedChunk& operator=(const DecodedChunk&) = delete;
  DecodedChunk(DecodedChunk&&) = default;
  DecodedChunk& operator=(DecodedChunk&&) = default;

  const std::string& ticket() const { return ticket_; }  // StageChunk's; empty for a FetchChunk
  // The data field's bytes, in order, as pieces of the message's slices (no
  // piece is empty; none at all for empty data).
  const std::vector<absl::string_view>& data() const { return data_; }
  size_t data_size() const { return data_size_; }
  // Copies the data to `dest` (data_size() bytes).
  void CopyDataTo(char* dest) const;
  void Clear();

 private:
  friend class ChunkDecoder;  // chunk_wire.cc
  std::vector<grpc::Slice> slices_;
  std::string ticket_;
  std::vector<absl::string_view> data_;
  size_t data_size_ = 0;
};

// Decode as protobuf parses: fields in any order, the last of a repeated
// singular field wins, unknown fields skipped by wire type. INVALID_ARGUMENT
// naming the message or field for what protobuf would refuse (a truncated
// varint, a length past the message's end or over 2 GiB, field number 0, an
// invalid wire type, a ticket that is not UTF-8) and, stricter than protobuf,
// for a known field of the wrong wire type and for groups (neither is ever
// sent by a protobuf encoder of these messages).
absl::Status DecodeStageChunk(const grpc::ByteBuffer& message, DecodedChunk* out);
absl::Status DecodeFetchChunk(const grpc::ByteBuffer& message, DecodedChunk* out);

// Encode as protobuf serializes (empty fields left out): one small slice for
// the ticket and the field headers, then one slice borrowing `data` (none
// when empty). With `owner`, the data slice holds a reference to it until gRPC
// drops the slice, which may be after the call ended; without one, the caller
// keeps `data` alive and unchanged until gRPC has released the message.
grpc::ByteBuffer EncodeStageChunk(absl::string_view ticket, absl::string_view data,
                                  std::shared_ptr<const void> owner = nullptr);
grpc::ByteBuffer EncodeFetchChunk(absl::string_view data, std::shared_ptr<const void> owner = nullptr);

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_CHUNK_WIRE_H_
