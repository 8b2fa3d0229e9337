#include "proto/chunk_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {

// Wire types (protobuf's encoding guide).
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kStartGroup = 3, kFixed32 = 5;

// A message laid over slices, read front to back.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices) size_ += s.size();
  }
  size_t size() const { return size_; }
  size_t position() const { return position_; }
  size_t remaining() const { return size_ - position_; }

  bool ReadByte(uint8_t* byte) {
    if (remaining() == 0) return false;
    ToNonEmpty();
    *byte = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }
  // The next `n` bytes (at most remaining()) as pieces of the slices, or skipped when `pieces` is null.
  void Take(size_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      ToNonEmpty();
      const grpc::Slice& s = slices_[index_];
      const size_t k = std::min(n, s.size() - offset_);
      if (pieces != nullptr) pieces->emplace_back(reinterpret_cast<const char*>(s.begin()) + offset_, k);
      Advance(k);
      n -= k;
    }
  }

 private:
  // Only while bytes remain: the current slice has one.
  void ToNonEmpty() {
    while (offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  void Advance(size_t k) {
    offset_ += k;
    position_ += k;
  }
  const std::vector<grpc::Slice>& slices_;
  size_t size_ = 0, position_ = 0, index_ = 0, offset_ = 0;
};

enum class Varint { kOk, kCutOff, kTooLong };

// A varint of at most `max_bytes`, its value taken modulo 2^64 as protobuf does.
Varint ReadVarint(SliceReader& r, int max_bytes, uint64_t* value) {
  uint64_t v = 0;
  for (int i = 0; i < max_bytes; ++i) {
    uint8_t byte;
    if (!r.ReadByte(&byte)) return Varint::kCutOff;
    v |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
    if (byte < 0x80) {
      *value = v;
      return Varint::kOk;
    }
  }
  return Varint::kTooLong;
}

// A length-delimited field's length as protobuf reads it (a varint of at
// most 5 bytes, under 2 GiB), within what is left of the message. `at`: the
// field's first byte, for messages.
absl::Status ReadLength(SliceReader& r, const std::string& what, size_t at, uint64_t* length) {
  switch (ReadVarint(r, 5, length)) {
    case Varint::kCutOff:
      return absl::InvalidArgumentError(absl::StrCat(what, ": the length of the field at byte ", at, " is cut off"));
    case Varint::kTooLong:
      return absl::InvalidArgumentError(absl::StrCat(what, ": the length of the field at byte ", at, " overflows 32 bits"));
    case Varint::kOk:
      break;
  }
  if (*length > static_cast<uint64_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": length ", *length, " at byte ", at, " overflows"));
  }
  if (*length > r.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": length ", *length, " at byte ", at,
                                                   " runs past the message's ", r.size(), " bytes"));
  }
  return absl::OkStatus();
}

// Structurally valid UTF-8 (RFC 3629: no overlong forms, no surrogates,
// nothing past U+10FFFF), as protobuf checks a proto3 string field.
bool IsUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  auto cont = [&](const unsigned char* q, unsigned char lo = 0x80, unsigned char hi = 0xbf) {
    return q < end && *q >= lo && *q <= hi;
  };
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
    } else if (c >= 0xc2 && c <= 0xdf) {
      if (!cont(p + 1)) return false;
      p += 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      const unsigned char lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
      if (!cont(p + 1, lo, hi) || !cont(p + 2)) return false;
      p += 3;
    } else if (c >= 0xf0 && c <= 0xf4) {
      const unsigned char lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
      if (!cont(p + 1, lo, hi) || !cont(p + 2) || !cont(p + 3)) return false;
      p += 4;
    } else {
      return false;
    }
  }
  return true;
}

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

grpc::Slice Borrowed(absl::string_view data, std::shared_ptr<const void> owner) {
  if (owner == nullptr) return grpc::Slice(data.data(), data.size(), grpc::Slice::STATIC_SLICE);
  auto* held = new std::shared_ptr<const void>(std::move(owner));
  // gRPC takes a mutable pointer; the bytes are only read.
  return grpc::Slice(
      const_cast<char*>(data.data()), data.size(),
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, held);
}

// Fields 0 are absent from the message.
grpc::ByteBuffer Encode(uint32_t ticket_field, absl::string_view ticket, uint32_t data_field, absl::string_view data,
                        std::shared_ptr<const void> owner) {
  std::string header;
  if (!ticket.empty()) {
    PutVarint(ticket_field << 3 | kLengthDelimited, &header);
    PutVarint(ticket.size(), &header);
    header.append(ticket.data(), ticket.size());
  }
  if (data.empty()) {
    grpc::Slice only(header);
    return grpc::ByteBuffer(&only, 1);
  }
  PutVarint(data_field << 3 | kLengthDelimited, &header);
  PutVarint(data.size(), &header);
  grpc::Slice slices[2] = {grpc::Slice(header), Borrowed(data, std::move(owner))};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace

class ChunkDecoder {
 public:
  // `ticket_field` 0: the message has none (FetchChunk).
  static absl::Status Decode(const grpc::ByteBuffer& message, const char* name, uint32_t ticket_field,
                             uint32_t data_field, DecodedChunk* out) {
    out->Clear();
    if (message.Valid()) {
      grpc::Status dumped = message.Dump(&out->slices_);
      if (!dumped.ok()) return absl::InternalError(absl::StrCat(name, ": ", dumped.error_message()));
    }
    SliceReader r(out->slices_);
    while (r.remaining() > 0) {
      const size_t at = r.position();
      uint64_t tag64 = 0;
      switch (ReadVarint(r, 5, &tag64)) {
        case Varint::kCutOff:
          return absl::InvalidArgumentError(absl::StrCat(name, ": the tag at byte ", at, " is cut off"));
        case Varint::kTooLong:
          return absl::InvalidArgumentError(absl::StrCat(name, ": the tag at byte ", at, " runs over 5 bytes"));
        case Varint::kOk:
          break;
      }
      // A 5-byte tag's bits past 32 are dropped, as protobuf does.
      const uint32_t tag = static_cast<uint32_t>(tag64), field = tag >> 3, wire_type = tag & 7;
      if (field == 0) return absl::InvalidArgumentError(absl::StrCat(name, ": field number 0 at byte ", at));
      if (field == data_field || (ticket_field != 0 && field == ticket_field)) {
        const std::string what = absl::StrCat(name, field == data_field ? ".data" : ".ticket");
        if (wire_type != kLengthDelimited) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": wire type ", wire_type, " at byte ", at, ", not length-delimited (2)"));
        }
        uint64_t length = 0;
        if (auto s = ReadLength(r, what, at, &length); !s.ok()) return s;
        if (field == data_field) {  // the last one wins
          out->data_.clear();
          r.Take(length, &out->data_);
          out->data_size_ = length;
        } else {
          std::vector<absl::string_view> pieces;
          r.Take(length, &pieces);
          out->ticket_.clear();
          for (absl::string_view p : pieces) out->ticket_.append(p.data(), p.size());
          if (!IsUtf8(out->ticket_)) {
            return absl::InvalidArgumentError(absl::StrCat(what, ": the string at byte ", at, " is not UTF-8"));
          }
        }
        continue;
      }
      const std::string what = absl::StrCat(name, ": field ", field);
      uint64_t skip = 0;
      switch (wire_type) {
        case kVarint:
          switch (ReadVarint(r, 10, &skip)) {
            case Varint::kCutOff:
              return absl::InvalidArgumentError(absl::StrCat(what, "'s varint at byte ", at, " is cut off"));
            case Varint::kTooLong:
              return absl::InvalidArgumentError(absl::StrCat(what, "'s varint at byte ", at, " runs over 10 bytes"));
            case Varint::kOk:
              break;
          }
          continue;
        case kFixed64:
        case kFixed32: {
          const size_t n = wire_type == kFixed64 ? 8 : 4;
          if (n > r.remaining()) {
            return absl::InvalidArgumentError(absl::StrCat(what, "'s ", n, " bytes at byte ", at,
                                                           " run past the message's ", r.size(), " bytes"));
          }
          r.Take(n, nullptr);
          continue;
        }
        case kLengthDelimited:
          if (auto s = ReadLength(r, what, at, &skip); !s.ok()) return s;
          r.Take(skip, nullptr);
          continue;
        case kStartGroup:
          return absl::InvalidArgumentError(
              absl::StrCat(what, " at byte ", at, " is a group (wire type 3): groups are not accepted"));
        default:  // 4 (an end of group with none open), 6 and 7
          return absl::InvalidArgumentError(absl::StrCat(what, " at byte ", at, ": invalid wire type ", wire_type));
      }
    }
    return absl::OkStatus();
  }
};

void DecodedChunk::CopyDataTo(char* dest) const {
  for (absl::string_view p : data_) {
    std::memcpy(dest, p.data(), p.size());
    dest += p.size();
  }
}

void DecodedChunk::Clear() {
  data_.clear();
  data_size_ = 0;
  ticket_.clear();
  slices_.clear();
}

absl::Status DecodeStageChunk(const grpc::ByteBuffer& message, DecodedChunk* out) {
  return ChunkDecoder::Decode(message, "StageChunk", 1, 2, out);
}

absl::Status DecodeFetchChunk(const grpc::ByteBuffer& message, DecodedChunk* out) {
  return ChunkDecoder::Decode(message, "FetchChunk", 0, 1, out);
}

grpc::ByteBuffer EncodeStageChunk(absl::string_view ticket, absl::string_view data, std::shared_ptr<const void> owner) {
  return Encode(1, ticket, 2, data, std::move(owner));
}

grpc::ByteBuffer EncodeFetchChunk(absl::string_view data, std::shared_ptr<const void> owner) {
  return Encode(0, {}, 1, data, std::move(owner));
}

}  // namespace shardgemm
