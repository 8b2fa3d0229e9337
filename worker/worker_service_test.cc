#include "worker/worker_service.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/step_frame.h"
#include "proto/tensor_codec.h"
#include "worker/backend.h"
#include "worker/step_socket_server.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

// The CPU backend, whose `lose_at`th GroupedGemm fails as a sticky CUDA
// error does: the call's error, and the device lost from then on.
class LosesItsDeviceBackend : public Backend {
 public:
  explicit LosesItsDeviceBackend(int lose_at) : cpu_(MakeCpuBackend(1)), lose_at_(lose_at) {}
  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return "a device that is lost once"; }
  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& gemm) override {
    if (++calls_ == lose_at_) {
      lost_ = absl::InternalError("the CUDA context is lost (cudaErrorIllegalAddress)");
      return absl::InternalError("grouped GEMM: CUDA error cudaErrorIllegalAddress: an illegal memory access");
    }
    return cpu_->GroupedGemm(gemm);
  }
  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override { return cpu_->GroupedQuantize(q); }
  absl::Status DeviceHealth() const override { return lost_; }

 private:
  std::unique_ptr<Backend> cpu_;
  int lose_at_;
  int calls_ = 0;
  absl::Status lost_;
};

// The service on an in-process gRPC server, called through its stub: the
// callback API's handler is only reachable through a server.
class Served {
 public:
  explicit Served(WorkerServiceImpl* service) {
    grpc::ServerBuilder builder;
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    stub_ = v1::Worker::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~Served() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5)); }

  grpc::Status Execute(const v1::Step& step, v1::StepResult* result,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    return stub_->Execute(&context, step, result);
  }
  grpc::Status Status(v1::WorkerStatus* status) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Status(&context, v1::WorkerStatusRequest(), status);
  }

 private:
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

v1::Step GemmStep(uint64_t sequence) {
  v1::Step step;
  step.set_sequence(sequence);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensorToProto(*ZerosTensor(DType::kF32, {4, 3}), g->mutable_lhs());
  HostTensorToProto(*ZerosTensor(DType::kF32, {2, 3, 5}), g->mutable_rhs());
  g->add_group_sizes(1);
  g->add_group_sizes(3);
  g->set_out_dtype(v1::F32);
  return step;
}

TEST(WorkerService, AStepThatLosesTheDeviceIsAnsweredThenTheWorkerGoesUnavailable) {
  LosesItsDeviceBackend backend(/*lose_at=*/2);
  ShardStore store(int64_t{1} << 30);
  Executor executor(&backend, &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, &backend);
  std::vector<std::string> lost;
  service.OnDeviceLost([&](const absl::Status& why) { lost.emplace_back(why.message()); });
  Served served(&service);

  {
    v1::StepResult result;
    EXPECT_TRUE(served.Execute(GemmStep(1), &result).ok());
  }
  EXPECT_TRUE(lost.empty());
  {
    v1::StepResult result;
    grpc::Status s = served.Execute(GemmStep(2), &result);
    // The step that lost the device gets its own error.
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
    EXPECT_THAT(s.error_message(), HasSubstr("cudaErrorIllegalAddress: an illegal memory access"));
  }
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_THAT(lost[0], HasSubstr("the CUDA context is lost"));
  {
    // The heartbeat fails from now on: the coordinator marks the rank down.
    v1::WorkerStatus status;
    grpc::Status s = served.Status(&status);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("exiting for its supervisor to restart it"));
  }
  {
    v1::StepResult result;
    EXPECT_EQ(served.Execute(GemmStep(3), &result).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  EXPECT_EQ(lost.size(), 1u);  // once
}

TEST(WorkerService, AStepsInlineOperandsAreComputedOn) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  ShardStore store(int64_t{1} << 30);
  Executor executor(backend.get(), &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, backend.get());
  v1::Step step;
  step.set_sequence(1);
  v1::GemmStep* g = step.mutable_gemm();
  HostTensor lhs = *ZerosTensor(DType::kF32, {2, 2});
  for (int i = 0; i < 4; ++i) StoreFromFloat(&lhs, i, static_cast<float>(i + 1));  // [[1, 2], [3, 4]]
  HostTensor rhs = *ZerosTensor(DType::kF32, {1, 2, 1});
  StoreFromFloat(&rhs, 0, 10.0f);
  StoreFromFloat(&rhs, 1, 100.0f);
  HostTensorToProto(lhs, g->mutable_lhs());
  HostTensorToProto(rhs, g->mutable_rhs());
  g->add_group_sizes(2);
  g->set_out_dtype(v1::F32);
  Served served(&service);
  v1::StepResult result;
  ASSERT_TRUE(served.Execute(step, &result).ok());
  auto out = HostTensorFromProto(result.out(), "out");
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(out->data<float>()[0], 210.0f);
  EXPECT_EQ(out->data<float>()[1], 430.0f);
}

TEST(WorkerService, StepsThatArriveEarlyWaitForTheirTurnAndAllAreAnswered) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  ShardStore store(int64_t{1} << 30);
  Executor executor(backend.get(), &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, backend.get());
  Served served(&service);
  // Steps 2..6 arrive first, in reverse: each waits on a thread of its own
  // (none holds up another, nor the call that brings step 1).
  constexpr int kEarly = 5;
  std::vector<grpc::Status> early(kEarly);
  std::vector<double> queue_seconds(kEarly, -1);
  std::vector<std::thread> callers;
  for (int i = kEarly - 1; i >= 0; --i) {
    callers.emplace_back([&, i] {
      v1::StepResult result;
      early[i] = served.Execute(GemmStep(2 + i), &result);
      queue_seconds[i] = result.queue_seconds();
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (executor.steps_waiting() < kEarly && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(executor.steps_waiting(), kEarly);
  v1::StepResult first;
  ASSERT_TRUE(served.Execute(GemmStep(1), &first).ok());
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < kEarly; ++i) {
    EXPECT_TRUE(early[i].ok()) << "step " << 2 + i << ": " << early[i].error_message();
    EXPECT_GT(queue_seconds[i], 0) << "step " << 2 + i << " waited for its turn";
  }
  // The next step in order runs at once again.
  v1::StepResult next;
  EXPECT_TRUE(served.Execute(GemmStep(2 + kEarly), &next).ok());
}

TEST(WorkerService, AnEarlyStepStillWaitingAtItsDeadlineIsAnsweredDeadlineExceeded) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  ShardStore store(int64_t{1} << 30);
  Executor executor(backend.get(), &store);
  executor.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
  WorkerServiceImpl service(&executor, &store, backend.get());
  Served served(&service);
  v1::StepResult result;
  const absl::Time start = absl::Now();
  grpc::Status s = served.Execute(GemmStep(2), &result, std::chrono::milliseconds(300));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Step 1, which never came, is still the next: it runs.
  EXPECT_TRUE(served.Execute(GemmStep(1), &result).ok());
}

// A coordinator's end of the step socket, played by the test.
int ConnectTo(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strcpy(a.sun_path, path.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

class StepSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/worker_step_socket_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    executor_.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()));
    auto started = StepSocketServer::Start(dir_ + "/steps.sock", [this](std::unique_ptr<v1::StepSocketRequest> r,
                                                                        StepSocketServer::Reply reply) {
      service_.ExecuteFromStepSocket(std::move(r), std::move(reply));
    });
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(*started);
  }
  void TearDown() override {
    server_.reset();
    ::rmdir(dir_.c_str());
  }
  static v1::StepSocketRequest Request(uint64_t id, uint64_t sequence, absl::Time deadline) {
    v1::StepSocketRequest r;
    r.set_call_id(id);
    r.set_deadline_unix_us(absl::ToUnixMicros(deadline));
    *r.mutable_step() = GemmStep(sequence);
    return r;
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
  ShardStore store_{int64_t{1} << 30};
  Executor executor_{backend_.get(), &store_};
  WorkerServiceImpl service_{&executor_, &store_, backend_.get()};
  std::string dir_;
  std::unique_ptr<StepSocketServer> server_;
};

TEST_F(StepSocketTest, StepsSentOutOfOrderOnTheSocketAreAllAnsweredByCallId) {
  const int fd = ConnectTo(server_->path());
  ASSERT_GE(fd, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  // Steps 3, 2, 1: the first two wait for their turn on threads of their own.
  for (uint64_t seq : {3, 2, 1}) ASSERT_TRUE(WriteStepFrame(fd, Request(100 + seq, seq, deadline)).ok());
  std::set<uint64_t> answered;
  for (int i = 0; i < 3; ++i) {
    v1::StepSocketReply reply;
    ASSERT_TRUE(ReadStepFrame(fd, &reply).ok());
    EXPECT_EQ(reply.code(), 0) << reply.message();
    EXPECT_TRUE(reply.result().has_out());
    answered.insert(reply.call_id());
  }
  EXPECT_EQ(answered, (std::set<uint64_t>{101, 102, 103}));
  ::close(fd);
}

TEST_F(StepSocketTest, AStepOfAnotherSessionIsAnsweredWithItsError) {
  // A worker configured with a session refuses another's steps, on the socket as on gRPC.
  executor_.Configure(SingleWorkerPosition(), MakeLocalCollectives(SingleWorkerPosition()), 1, "session-a");
  const int fd = ConnectTo(server_->path());
  ASSERT_GE(fd, 0);
  v1::StepSocketRequest r = Request(7, 1, absl::Now() + absl::Seconds(30));
  r.mutable_step()->set_session("session-b");
  ASSERT_TRUE(WriteStepFrame(fd, r).ok());
  v1::StepSocketReply reply;
  ASSERT_TRUE(ReadStepFrame(fd, &reply).ok());
  EXPECT_EQ(reply.call_id(), 7u);
  EXPECT_EQ(reply.code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION)) << reply.message();
  EXPECT_FALSE(reply.has_result());
  ::close(fd);
}

TEST_F(StepSocketTest, AFrameThatIsNotOneEndsOnlyItsConnection) {
  const int bad = ConnectTo(server_->path());
  ASSERT_GE(bad, 0);
  const std::string junk = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::write(bad, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  char c;
  EXPECT_LE(::recv(bad, &c, 1, 0), 0);  // closed by the worker (reset, with bytes of it unread)
  ::close(bad);
  // Another connection is served as before.
  const int fd = ConnectTo(server_->path());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(WriteStepFrame(fd, Request(1, 1, absl::Now() + absl::Seconds(30))).ok());
  v1::StepSocketReply reply;
  ASSERT_TRUE(ReadStepFrame(fd, &reply).ok());
  EXPECT_EQ(reply.code(), 0) << reply.message();
  ::close(fd);
}

TEST_F(StepSocketTest, TheLargestStepACoordinatorSendsThereIsReadAndAnswered) {
  const int fd = ConnectTo(server_->path());
  ASSERT_GE(fd, 0);
  v1::StepSocketRequest r = Request(9, 1, absl::Now() + absl::Seconds(30));
  // Inline bytes that do not match the declared shape: answered with the error, not dropped.
  std::string* data = r.mutable_step()->mutable_gemm()->mutable_lhs()->mutable_data();
  data->resize(kMaxStepSocketStepBytes - r.step().ByteSizeLong() - 16 + data->size());
  ASSERT_LE(r.step().ByteSizeLong(), kMaxStepSocketStepBytes);
  ASSERT_TRUE(WriteStepFrame(fd, r).ok());
  v1::StepSocketReply reply;
  ASSERT_TRUE(ReadStepFrame(fd, &reply).ok());
  EXPECT_EQ(reply.call_id(), 9u);
  EXPECT_EQ(reply.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << reply.message();
  ::close(fd);
}

TEST_F(StepSocketTest, StoppingTheServerEndsItsConnections) {
  const int fd = ConnectTo(server_->path());
  ASSERT_GE(fd, 0);
  const std::string path = server_->path();
  server_.reset();
  char c;
  EXPECT_EQ(::recv(fd, &c, 1, 0), 0);
  ::close(fd);
  EXPECT_LT(ConnectTo(path), 0);  // the socket is gone
}

}  // namespace
}  // namespace shardgemm
