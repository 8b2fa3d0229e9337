// The gRPC worker channel against a Worker service in this process.
#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "server/worker_channel.h"

namespace shardgemm {
namespace {

// Answers Execute with the step's sequence in compute_seconds (after
// `delay`), records CancelSteps.
class FakeWorkerService final : public v1::Worker::Service {
 public:
  grpc::Status Execute(grpc::ServerContext*, const v1::Step* step, v1::StepResult* result) override {
    absl::SleepFor(delay);
    result->set_compute_seconds(static_cast<double>(step->sequence()));
    return grpc::Status::OK;
  }
  grpc::Status CancelSteps(grpc::ServerContext*, const v1::CancelStepsRequest* request,
                           v1::CancelStepsResponse*) override {
    absl::MutexLock lock(&mu);
    for (uint64_t s : request->sequences()) cancelled.push_back(s);
    return grpc::Status::OK;
  }
  // Reads the header, then refuses (as a worker whose staging budget is
  // taken) or reserves and counts the bytes that follow.
  grpc::Status StageShard(grpc::ServerContext* context, grpc::ServerReader<v1::StageShardChunk>* reader,
                          v1::StageResponse* response) override {
    v1::StageShardChunk chunk;
    if (!reader->Read(&chunk)) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no header");
    if (refuse_stage) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "--staging_budget is held");
    context->AddInitialMetadata(kStageReservedMetadataKey, "1");
    reader->SendInitialMetadata();
    int64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += static_cast<int64_t>(chunk.data().size());
    response->set_bytes(bytes);
    return grpc::Status::OK;
  }
  absl::Duration delay = absl::ZeroDuration();
  std::atomic<bool> refuse_stage{false};
  absl::Mutex mu;
  std::vector<uint64_t> cancelled ABSL_GUARDED_BY(mu);
};

class GrpcWorkerChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }
  std::shared_ptr<WorkerChannel> Channel(const std::string& address) {
    return MakeGrpcWorkerChannel(address, grpc::InsecureChannelCredentials());
  }
  std::string Address() const { return "127.0.0.1:" + std::to_string(port_); }

  FakeWorkerService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(GrpcWorkerChannelTest, AnswersComeBackOnceAndCancelsReachTheWorker) {
  std::shared_ptr<WorkerChannel> channel = Channel(Address());
  absl::Notification done;
  absl::StatusOr<v1::StepResult> got = absl::UnknownError("no answer");
  v1::Step step;
  step.set_sequence(7);
  channel->ExecuteAsync(step, absl::Now() + absl::Seconds(10), [&](absl::StatusOr<v1::StepResult> r) {
    got = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->compute_seconds(), 7.0);

  v1::CancelStepsRequest cancel;
  cancel.set_session("s");
  cancel.add_sequences(9);
  channel->CancelSteps(cancel, absl::Now() + absl::Seconds(5));
  const absl::Time until = absl::Now() + absl::Seconds(5);
  absl::MutexLock lock(&service_.mu);
  auto heard = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(service_.mu) { return !service_.cancelled.empty(); };
  ASSERT_TRUE(service_.mu.AwaitWithDeadline(absl::Condition(&heard), until));
  EXPECT_EQ(service_.cancelled, std::vector<uint64_t>{9});
}

// A call still in flight when the dispatcher drops its handle (a worker
// re-registering) completes safely.
TEST_F(GrpcWorkerChannelTest, ACallOutlivesItsChannelHandle) {
  service_.delay = absl::Milliseconds(200);
  absl::Notification done;
  absl::Status status = absl::UnknownError("no answer");
  {
    std::shared_ptr<WorkerChannel> channel = Channel(Address());
    v1::Step step;
    step.set_sequence(3);
    // Connect first (the never-connected path is the next test's).
    absl::Notification warm;
    channel->ExecuteAsync(step, absl::Now() + absl::Seconds(10), [&](absl::StatusOr<v1::StepResult>) { warm.Notify(); });
    ASSERT_TRUE(warm.WaitForNotificationWithTimeout(absl::Seconds(10)));
    channel->ExecuteAsync(step, absl::Now() + absl::Seconds(10), [&](absl::StatusOr<v1::StepResult> r) {
      status = r.status();
      done.Notify();
    });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(status.ok()) << status;
}

// A worker that never connects fails its step UNAVAILABLE within the
// connect timeout, and the caller is not held meanwhile (it sends every
// rank's step in turn).
TEST_F(GrpcWorkerChannelTest, ANeverConnectedWorkerDoesNotHoldTheCaller) {
  int unused_port = 0;
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &unused_port);
    auto s = builder.BuildAndStart();
    s->Shutdown();
  }
  std::shared_ptr<WorkerChannel> channel = Channel("127.0.0.1:" + std::to_string(unused_port));
  absl::Notification done;
  absl::Status status;
  const absl::Time start = absl::Now();
  v1::Step step;
  channel->ExecuteAsync(step, start + absl::Seconds(2), [&](absl::StatusOr<v1::StepResult> r) {
    status = r.status();
    done.Notify();
  });
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "the caller returned at once";
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kDeadlineExceeded)
      << status;
}

TEST_F(GrpcWorkerChannelTest, AStageStreamReportsTheWorkersRefusalBeforeAnyByteIsSent) {
  std::shared_ptr<WorkerChannel> channel = Channel(Address());
  v1::StageShardChunk header;
  header.set_ticket("t");
  service_.refuse_stage = true;
  auto refused = channel->OpenStage(header, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(refused.ok()) << refused.status();  // the header is out; the answer comes with WaitReserved
  const absl::Status answer = (*refused)->WaitReserved();
  EXPECT_EQ(answer.code(), absl::StatusCode::kResourceExhausted) << answer;
  EXPECT_NE(answer.message().find("--staging_budget"), absl::string_view::npos) << answer;

  service_.refuse_stage = false;
  auto accepted = channel->OpenStage(header, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_TRUE((*accepted)->WaitReserved().ok());
  ASSERT_TRUE((*accepted)->Write("abcdef").ok());
  auto staged = (*accepted)->Finish();
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(*staged, 6);
}

// A stalled put's watchdog ends its streams with Cancel (they carry only the
// call's deadline, here none): what the stream does next fails at once.
TEST_F(GrpcWorkerChannelTest, ACancelledStageStreamFailsAtOnce) {
  std::shared_ptr<WorkerChannel> channel = Channel(Address());
  v1::StageShardChunk header;
  header.set_ticket("t");
  auto stream = channel->OpenStage(header, absl::InfiniteFuture());
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->WaitReserved().ok());
  std::thread canceller([&] { (*stream)->Cancel(); });
  canceller.join();
  const absl::Time start = absl::Now();
  auto answer = (*stream)->Finish();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kCancelled) << answer.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace shardgemm
