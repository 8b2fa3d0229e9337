#include "proto/step_frame.h"

#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

class SocketPair {
 public:
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  ~SocketPair() {
    CloseWriter();
    ::close(fds_[1]);
  }
  int writer() const { return fds_[0]; }
  int reader() const { return fds_[1]; }
  void CloseWriter() {
    if (fds_[0] >= 0) ::close(fds_[0]);
    fds_[0] = -1;
  }
  void WriteRaw(const std::string& bytes) {
    ASSERT_EQ(::write(writer(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }

 private:
  int fds_[2] = {-1, -1};
};

v1::StepSocketRequest Request(uint64_t id, size_t lhs_bytes) {
  v1::StepSocketRequest r;
  r.set_call_id(id);
  r.set_deadline_unix_us(1234567);
  r.mutable_step()->set_sequence(id + 10);
  r.mutable_step()->mutable_gemm()->mutable_lhs()->set_data(std::string(lhs_bytes, 'x'));
  return r;
}

TEST(StepFrame, FramesRoundTripInOrderWhateverTheirSize) {
  SocketPair p;
  // Larger than a socket's buffer: the reader drains while the writer writes.
  const std::vector<size_t> sizes = {0, 1, 100, 3 << 20, 17};
  std::thread writer([&] {
    for (size_t i = 0; i < sizes.size(); ++i) EXPECT_TRUE(WriteStepFrame(p.writer(), Request(i, sizes[i])).ok());
  });
  for (size_t i = 0; i < sizes.size(); ++i) {
    v1::StepSocketRequest got;
    ASSERT_TRUE(ReadStepFrame(p.reader(), &got).ok());
    EXPECT_EQ(got.call_id(), i);
    EXPECT_EQ(got.deadline_unix_us(), 1234567);
    EXPECT_EQ(got.step().sequence(), i + 10);
    EXPECT_EQ(got.step().gemm().lhs().data().size(), sizes[i]);
  }
  writer.join();
}

TEST(StepFrame, TheEndOfTheStreamAtAFrameBoundaryIsUnavailable) {
  SocketPair p;
  p.CloseWriter();
  v1::StepSocketReply got;
  EXPECT_EQ(ReadStepFrame(p.reader(), &got).code(), absl::StatusCode::kUnavailable);
}

TEST(StepFrame, AFrameCutShortIsDataLossNamingHowMuchCame) {
  SocketPair p;
  v1::StepSocketRequest r = Request(1, 1000);
  std::string frame = StepFrameHeader(r.ByteSizeLong()) + r.SerializeAsString();
  p.WriteRaw(frame.substr(0, 500));
  p.CloseWriter();
  v1::StepSocketRequest got;
  absl::Status s = ReadStepFrame(p.reader(), &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("cut short after 484 of its"), std::string::npos) << s;
}

TEST(StepFrame, BadHeadersAreRefusedNamingWhy) {
  std::string header = StepFrameHeader(10);
  EXPECT_EQ(*ParseStepFrameHeader(header), 10u);
  std::string magic = header;
  magic[0] = 'X';
  EXPECT_NE(ParseStepFrameHeader(magic).status().message().find("SGS1"), std::string::npos);
  std::string version = header;
  version[4] = 2;
  EXPECT_NE(ParseStepFrameHeader(version).status().message().find("version 2"), std::string::npos);
  EXPECT_NE(ParseStepFrameHeader(StepFrameHeader(101), 100).status().message().find("101 bytes"),
            std::string::npos);
  EXPECT_EQ(ParseStepFrameHeader(header.substr(0, 8)).status().code(), absl::StatusCode::kDataLoss);
  // Too long to allocate is refused before anything is read or allocated.
  SocketPair p;
  p.WriteRaw(StepFrameHeader(uint64_t{1} << 40));
  v1::StepSocketRequest got;
  EXPECT_EQ(ReadStepFrame(p.reader(), &got, 1 << 20).code(), absl::StatusCode::kDataLoss);
}

TEST(StepFrame, APayloadThatDoesNotParseIsDataLoss) {
  SocketPair p;
  const std::string junk = "\xff\xff\xff\xff\xff";
  p.WriteRaw(StepFrameHeader(junk.size()) + junk);
  v1::StepSocketRequest got;
  EXPECT_EQ(ReadStepFrame(p.reader(), &got).code(), absl::StatusCode::kDataLoss);
}

// Random bytes after a valid header and random headers: an error or a parse, never a crash or a hang.
TEST(StepFrame, RandomBytesNeverCrash) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 300; ++i) {
    SocketPair p;
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    const bool framed = i % 2 == 0;
    if (framed) bytes = StepFrameHeader(bytes.size()) + bytes;
    p.WriteRaw(bytes);
    p.CloseWriter();
    v1::StepSocketRequest got;
    absl::Status s = ReadStepFrame(p.reader(), &got, 1 << 16);
    if (!framed) EXPECT_FALSE(s.ok());
  }
}

}  // namespace
}  // namespace shardgemm
