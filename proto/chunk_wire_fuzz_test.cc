// Random and mutated StageChunk / FetchChunk bytes, cut into random slices:
// every decode must give what protobuf parses from the same bytes, or a
// clean INVALID_ARGUMENT, never a crash (a chunk is any caller's input to
// the worker, and any worker's to the client). Where protobuf accepts and the
// decoder refuses, it must be one of the two things it refuses on purpose (a
// group, a known field of the wrong wire type). Deterministic seeds;
// CHUNK_WIRE_FUZZ_ITERATIONS for longer runs.
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "proto/chunk_wire.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  bool Coin(int percent = 50) { return Int(0, 99) < percent; }
  std::string Bytes(size_t n, bool ascii = false) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(ascii ? Int('0', 'z') : Int(0, 255));
    return s;
  }

 private:
  std::mt19937_64 rng_;
};

int Iterations() {
  const char* env = std::getenv("CHUNK_WIRE_FUZZ_ITERATIONS");
  return env != nullptr ? std::atoi(env) : 20000;
}

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A varint, sometimes padded with redundant continuation bytes (protobuf accepts them).
void PutAnyVarint(Gen& g, uint64_t v, std::string* out) {
  if (!g.Coin(10)) return PutVarint(v, out);
  std::string plain;
  PutVarint(v, &plain);
  const int pad = static_cast<int>(g.Int(1, 4));
  plain.back() = static_cast<char>(plain.back() | 0x80);
  for (int i = 1; i < pad; ++i) plain.push_back('\x80');
  plain.push_back('\0');
  out->append(plain);
}

// One field: mostly the known ones, right, sometimes unknown fields of every wire type.
void PutField(Gen& g, std::string* out) {
  const int field = static_cast<int>(g.Coin(70) ? g.Int(1, 2) : g.Coin(90) ? g.Int(3, 40) : g.Int(0, 1 << 29));
  const int wire_type = static_cast<int>(g.Coin(80) ? 2 : g.Int(0, 7));
  PutAnyVarint(g, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type), out);
  switch (wire_type) {
    case 0:
      PutAnyVarint(g, g.Coin(50) ? g.Int(0, 300) : static_cast<uint64_t>(g.Int(0, INT64_MAX)) * 2, out);
      break;
    case 1:
      out->append(g.Bytes(8));
      break;
    case 5:
      out->append(g.Bytes(4));
      break;
    case 2: {
      const std::string payload = g.Bytes(static_cast<size_t>(g.Coin(90) ? g.Int(0, 64) : g.Int(0, 5000)), g.Coin(70));
      PutAnyVarint(g, payload.size(), out);
      out->append(payload);
      break;
    }
    case 3: {  // a group, sometimes closed
      PutField(g, out);
      if (g.Coin(70)) PutVarint(static_cast<uint64_t>(field) << 3 | 4, out);
      break;
    }
    default:
      break;
  }
}

std::string Mutate(Gen& g, std::string wire) {
  const int edits = static_cast<int>(g.Int(1, 4));
  for (int i = 0; i < edits; ++i) {
    switch (g.Int(0, 3)) {
      case 0:
        if (!wire.empty()) wire[static_cast<size_t>(g.Int(0, wire.size() - 1))] = static_cast<char>(g.Int(0, 255));
        break;
      case 1:
        wire.resize(static_cast<size_t>(g.Int(0, wire.size())));
        break;
      case 2:
        wire.insert(static_cast<size_t>(g.Int(0, wire.size())), g.Bytes(static_cast<size_t>(g.Int(1, 6))));
        break;
      default:
        if (!wire.empty()) wire[static_cast<size_t>(g.Int(0, wire.size() - 1))] ^= static_cast<char>(1 << g.Int(0, 7));
    }
  }
  return wire;
}

grpc::ByteBuffer Split(Gen& g, const std::string& wire) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  while (from < wire.size() || slices.empty()) {
    const size_t n = static_cast<size_t>(g.Coin(20) ? 0 : g.Int(1, std::max<size_t>(1, wire.size() - from)));
    slices.emplace_back(wire.data() + from, std::min(n, wire.size() - from));
    from += std::min(n, wire.size() - from);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string DataOf(const DecodedChunk& chunk) {
  std::string out(chunk.data_size(), '\0');
  chunk.CopyDataTo(out.data());
  return out;
}

bool RefusedOnPurpose(const absl::Status& s) {
  return s.message().find("is a group") != absl::string_view::npos ||
         s.message().find("not length-delimited") != absl::string_view::npos;
}

TEST(ChunkWireFuzzTest, DecodesAsProtobufOrFailsCleanly) {
  google::protobuf::LogSilencer quiet;  // protobuf logs each non-UTF-8 string it refuses
  Gen g(20261203);
  int agreed_ok = 0, refused_on_purpose = 0;
  for (int i = 0; i < Iterations(); ++i) {
    std::string wire;
    const int fields = static_cast<int>(g.Int(0, 6));
    for (int f = 0; f < fields; ++f) PutField(g, &wire);
    if (g.Coin(40)) wire = Mutate(g, wire);
    const bool stage = g.Coin(50);
    DecodedChunk decoded;
    const absl::Status s = stage ? DecodeStageChunk(Split(g, wire), &decoded) : DecodeFetchChunk(Split(g, wire), &decoded);
    v1::StageChunk stage_chunk;
    v1::FetchChunk fetch_chunk;
    const bool parsed = stage ? stage_chunk.ParseFromString(wire) : fetch_chunk.ParseFromString(wire);
    if (s.ok()) {
      ASSERT_TRUE(parsed) << "decoded what protobuf refuses, case " << i;
      ASSERT_EQ(decoded.ticket(), stage ? stage_chunk.ticket() : "") << i;
      ASSERT_EQ(DataOf(decoded), stage ? stage_chunk.data() : fetch_chunk.data()) << i;
      ++agreed_ok;
      continue;
    }
    ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    ASSERT_EQ(s.message().find(stage ? "StageChunk" : "FetchChunk"), 0u) << s;
    if (parsed) {
      ASSERT_TRUE(RefusedOnPurpose(s)) << "refused what protobuf parses, case " << i << ": " << s;
      ++refused_on_purpose;
    }
  }
  // The generator reaches both sides.
  EXPECT_GT(agreed_ok, Iterations() / 10);
  EXPECT_LT(agreed_ok, Iterations());
  EXPECT_GT(refused_on_purpose, 0);
}

TEST(ChunkWireFuzzTest, EncodesAsProtobufSerializes) {
  Gen g(7);
  for (int i = 0; i < Iterations() / 20; ++i) {
    const std::string ticket = g.Coin(30) ? "" : g.Bytes(static_cast<size_t>(g.Int(0, 300)), true);
    const std::string data = g.Coin(10) ? "" : g.Bytes(static_cast<size_t>(g.Int(0, 70000)));
    v1::StageChunk stage;
    stage.set_ticket(ticket);
    stage.set_data(data);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(EncodeStageChunk(ticket, data).Dump(&slices).ok());
    std::string wire;
    for (const grpc::Slice& s : slices) wire.append(reinterpret_cast<const char*>(s.begin()), s.size());
    ASSERT_EQ(wire, stage.SerializeAsString());
    DecodedChunk decoded;
    ASSERT_TRUE(DecodeStageChunk(Split(g, wire), &decoded).ok());
    ASSERT_EQ(decoded.ticket(), ticket);
    ASSERT_EQ(DataOf(decoded), data);
  }
}

}  // namespace
}  // namespace shardgemm
