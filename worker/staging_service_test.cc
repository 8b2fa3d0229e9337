#include "worker/staging_service.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

constexpr char kTicket[] = "0123456789abcdef0123456789abcdef";

class StagingServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    StagingServiceImpl::ConfigureServer(&builder);  // as the worker's staging port
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
    stub_ = v1::Staging::NewStub(channel_);
  }
  void TearDown() override { server_->Shutdown(); }

  // Streams `pieces` (the first with `ticket`) and returns the status.
  grpc::Status Stage(const std::string& ticket, const std::vector<std::string>& pieces,
                     const std::string& second_ticket = "") {
    grpc::ClientContext ctx;
    v1::StageResponse response;
    auto writer = stub_->Stage(&ctx, &response);
    for (size_t i = 0; i < pieces.size(); ++i) {
      v1::StageChunk chunk;
      if (i == 0) chunk.set_ticket(ticket);
      if (i == 1 && !second_ticket.empty()) chunk.set_ticket(second_ticket);
      chunk.set_data(pieces[i]);
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // The area's clock, moved by the tests (read by the server's threads).
  std::atomic<int64_t> now_seconds_{1000};
  StagingArea area_{int64_t{64} << 20, absl::Seconds(60),
                    [this] { return absl::FromUnixSeconds(now_seconds_.load()); }};
  StagingServiceImpl service_{&area_, nullptr};
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Staging::Stub> stub_;
};

// One Stage call whose single message is `wire` as it is (not a protobuf
// message of the client's making): the status.
class RawStage : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RawStage(grpc::GenericStub* stub, const std::string& wire) {
    grpc::Slice slice(wire);
    message_ = grpc::ByteBuffer(&slice, 1);
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    stub->PrepareBidiStreamingCall(&ctx_, "/shardgemm.v1.Staging/Stage", grpc::StubOptions(), this);
    StartWrite(&message_);
    StartRead(&response_);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok) StartWritesDone();
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.Notify();
  }
  grpc::Status Wait() {
    done_.WaitForNotification();  // the deadline bounds it
    return status_;
  }

 private:
  grpc::ClientContext ctx_;
  grpc::ByteBuffer message_, response_;
  grpc::Status status_;
  absl::Notification done_;
};

TEST_F(StagingServiceTest, StagedInPiecesThenClaimed) {
  ASSERT_TRUE(area_.Expect(kTicket, ExpectedBlock{"", "lhs", DType::kF32, {4, 4}}).ok());
  grpc::Status s = Stage(kTicket, {std::string(40, 'a'), std::string(24, 'b')});
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto block = area_.Claim(kTicket, DType::kF32, {4, 4}, "lhs");
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(block->bytes, std::string(40, 'a') + std::string(24, 'b'));
}

TEST_F(StagingServiceTest, BadStreamsAreInvalidArgumentAndHoldNothing) {
  ASSERT_TRUE(area_.Expect(kTicket, ExpectedBlock{"", "lhs", DType::kF32, {4, 4}}).ok());
  grpc::Status s = Stage("", {std::string(64, 'a')});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("ticket"));
  s = Stage(kTicket, {std::string(32, 'a'), std::string(32, 'b')}, "ffffffffffffffffffffffffffffffff");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("one ticket"));
  s = Stage(kTicket, {std::string(63, 'a')});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expects 64"));
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_TRUE(Stage(kTicket, {std::string(64, 'a')}).ok());  // the ticket is still good
}

TEST_F(StagingServiceTest, AnOutputIsFetchedInChunksOnce) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {3, 1 << 18};  // 3 MiB: several messages
  out.bytes.resize(static_cast<size_t>(3) << 20);
  for (size_t i = 0; i < out.bytes.size(); ++i) out.bytes[i] = static_cast<char>(i * 131);
  ASSERT_TRUE(area_.Hold(kTicket, "", out).ok());
  v1::FetchRequest request;
  request.set_ticket(kTicket);
  std::string got;
  int chunks = 0;
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Fetch(&ctx, request);
    v1::FetchChunk chunk;
    while (reader->Read(&chunk)) {
      EXPECT_LE(chunk.ByteSizeLong(), size_t{1} << 20);  // within the smallest message limit
      got += chunk.data();
      ++chunks;
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  EXPECT_EQ(got, out.bytes);
  EXPECT_GE(chunks, 4);
  EXPECT_EQ(area_.held_bytes(), 0);
  grpc::ClientContext ctx;
  auto again = stub_->Fetch(&ctx, request);
  v1::FetchChunk chunk;
  EXPECT_FALSE(again->Read(&chunk));
  EXPECT_EQ(again->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(StagingServiceTest, AMessageLargerThanAChunkIsRefusedBeforeAnythingIsChecked) {
  // No ticket is expected: were the message received, the answer would be NOT_FOUND.
  grpc::Status s = Stage(kTicket, {std::string(size_t{2} << 20, 'a')});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(area_.held_bytes(), 0);
  // A chunk of the clients' size, with its header, goes.
  const int64_t floats = kTensorChunkBytes / 4;
  ASSERT_TRUE(area_.Expect(kTicket, ExpectedBlock{"", "lhs", DType::kF32, {floats}}).ok());
  s = Stage(kTicket, {std::string(static_cast<size_t>(floats * 4), 'a')});
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(StagingServiceTest, AStreamStalledPastItsTicketsExpiryIsCancelledAndHoldsNothing) {
  ASSERT_TRUE(area_.Expect(kTicket, ExpectedBlock{"", "lhs", DType::kF32, {4, 4}}).ok());
  grpc::ClientContext ctx;
  const auto give_up = std::chrono::system_clock::now() + std::chrono::seconds(10);
  ctx.set_deadline(give_up);
  v1::StageResponse response;
  auto writer = stub_->Stage(&ctx, &response);
  v1::StageChunk chunk;
  chunk.set_ticket(kTicket);
  chunk.set_data(std::string(16, 'a'));  // of 64 bytes; then the client sends nothing more
  ASSERT_TRUE(writer->Write(chunk));
  for (int i = 0; i < 500 && area_.held_bytes() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(area_.held_bytes(), 64);  // reserved by the open stream
  now_seconds_ += 61;
  area_.Sweep();
  grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LT(std::chrono::system_clock::now(), give_up - std::chrono::seconds(5));  // the worker ended it
  for (int i = 0; i < 500 && area_.held_bytes() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingServiceTest, AMalformedChunkIsInvalidArgumentNamingStageChunkAndHoldsNothing) {
  ASSERT_TRUE(area_.Expect(kTicket, ExpectedBlock{"", "lhs", DType::kF32, {4, 4}}).ok());
  grpc::GenericStub stub(channel_);
  // The ticket, then data whose length runs past the message.
  const std::string wire = std::string("\x0a\x20") + kTicket + std::string("\x12\x40", 2) + std::string(16, 'a');
  grpc::Status s = RawStage(&stub, wire).Wait();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("StageChunk.data: length 64"));
  s = RawStage(&stub, std::string("\x0a\x20", 2) + kTicket + std::string("\x13", 1)).Wait();  // a group
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("StageChunk"));
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_TRUE(Stage(kTicket, {std::string(64, 'a')}).ok());  // the ticket is still good
}

TEST_F(StagingServiceTest, AFetchWhoseClientGoesAwayMidStreamLeavesTheBlockFetchableAgain) {
  HostTensor out;
  out.dtype = DType::kF32;
  // 32 MiB, past what the client's default flow-control window lets the worker write ahead: the client
  // leaves after its first message, with most of the block unsent.
  out.shape = {32, 1 << 18};
  out.bytes.resize(static_cast<size_t>(32) << 20);
  for (size_t i = 0; i < out.bytes.size(); ++i) out.bytes[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(area_.Hold(kTicket, "", out).ok());
  v1::FetchRequest request;
  request.set_ticket(kTicket);
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Fetch(&ctx, request);
    v1::FetchChunk chunk;
    ASSERT_TRUE(reader->Read(&chunk));
    ctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The worker sees the cancellation a moment later; until then the block is being fetched.
  std::string got;
  grpc::Status last;
  for (int i = 0; i < 500; ++i) {
    grpc::ClientContext ctx;
    auto reader = stub_->Fetch(&ctx, request);
    v1::FetchChunk chunk;
    got.clear();
    while (reader->Read(&chunk)) got += chunk.data();
    last = reader->Finish();
    if (last.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(last.ok()) << last.error_message();
  EXPECT_EQ(got, out.bytes);
  EXPECT_EQ(area_.held_bytes(), 0);  // fetched whole: used
}

TEST_F(StagingServiceTest, AnEmptyBlockIsFetchedAsOneEmptyMessage) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {0, 4};
  ASSERT_TRUE(area_.Hold(kTicket, "", out).ok());
  v1::FetchRequest request;
  request.set_ticket(kTicket);
  grpc::ClientContext ctx;
  auto reader = stub_->Fetch(&ctx, request);
  v1::FetchChunk chunk;
  int messages = 0;
  while (reader->Read(&chunk)) ++messages;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(messages, 1);
}

}  // namespace
}  // namespace shardgemm
