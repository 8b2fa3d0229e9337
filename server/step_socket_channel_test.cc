#include "server/step_socket_channel.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/step_frame.h"

namespace shardgemm {
namespace {

// The gRPC channel the step socket channel wraps: counts the steps it gets
// and answers each at once (its result's queue_seconds says it was gRPC).
class CountingChannel : public WorkerChannel {
 public:
  void ExecuteAsync(v1::Step step, absl::Time, ExecuteDone done) override {
    executes.fetch_add(1);
    v1::StepResult r;
    r.set_queue_seconds(-1);
    done(r);
  }
  absl::StatusOr<v1::LocalTensor> GetShard(const std::string&, absl::Time) override {
    return absl::UnimplementedError("none");
  }
  absl::Status Ping(absl::Time) override { return absl::OkStatus(); }
  std::atomic<int> executes{0};
};

// A worker's step socket, played by the test: accepts one connection at a
// time and answers as `answer` says (nullopt: not at all).
class FakeWorkerSocket {
 public:
  using Answer = std::function<std::optional<v1::StepSocketReply>(const v1::StepSocketRequest&)>;
  explicit FakeWorkerSocket(Answer answer) : answer_(std::move(answer)) {
    char dir[] = "/tmp/step_socket_test_XXXXXX";
    EXPECT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/steps.sock";
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, path_.c_str());
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listen_fd_, 4), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeWorkerSocket() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    DropConnection();
    thread_.join();
    ::close(listen_fd_);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }
  int requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  int connections() {
    absl::MutexLock lock(&mu_);
    return connections_;
  }
  // Ends the connection now (the worker went away).
  void DropConnection() {
    absl::MutexLock lock(&mu_);
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  void Serve() {
    while (true) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      {
        absl::MutexLock lock(&mu_);
        fd_ = fd;
        ++connections_;
      }
      while (true) {
        v1::StepSocketRequest request;
        if (!ReadStepFrame(fd, &request).ok()) break;
        {
          absl::MutexLock lock(&mu_);
          ++requests_;
        }
        if (auto reply = answer_(request)) {
          reply->set_call_id(request.call_id());
          if (!WriteStepFrame(fd, *reply).ok()) break;
        }
      }
      absl::MutexLock lock(&mu_);
      ::close(fd);
      fd_ = -1;
    }
  }

  Answer answer_;
  std::string dir_, path_;
  int listen_fd_ = -1;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  int requests_ ABSL_GUARDED_BY(mu_) = 0;
  int connections_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

v1::Step Step(uint64_t sequence, size_t bytes = 0) {
  v1::Step s;
  s.set_sequence(sequence);
  if (bytes > 0) s.mutable_gemm()->mutable_lhs()->set_data(std::string(bytes, 'x'));
  return s;
}

// Waits for a done, within a bound.
class Result {
 public:
  WorkerChannel::ExecuteDone Done() {
    return [this](absl::StatusOr<v1::StepResult> r) {
      absl::MutexLock lock(&mu_);
      result_ = std::move(r);
      ++calls_;
    };
  }
  absl::StatusOr<v1::StepResult> Wait(absl::Duration bound = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    auto answered = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return calls_ > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&answered), bound)) return absl::InternalError("no answer in time");
    return result_;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  absl::StatusOr<v1::StepResult> result_ = absl::UnknownError("unset");
  int calls_ = 0;
};

v1::StepSocketReply Ok(double kernel_seconds) {
  v1::StepSocketReply reply;
  reply.mutable_result()->set_kernel_seconds(kernel_seconds);
  return reply;
}

TEST(StepSocketChannel, AStepGoesOnTheSocketAndItsReplyAnswersIt) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest& r) {
    EXPECT_GT(r.deadline_unix_us(), absl::ToUnixMicros(absl::Now()));
    return Ok(static_cast<double>(r.step().sequence()));
  });
  auto grpc = std::make_unique<CountingChannel>();
  CountingChannel* counted = grpc.get();
  auto channel = MakeStepSocketChannel(std::move(grpc), worker.path(), "unix:test");
  for (uint64_t seq = 1; seq <= 20; ++seq) {
    Result result;
    channel->ExecuteAsync(Step(seq), absl::Now() + absl::Seconds(10), result.Done());
    auto r = result.Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->kernel_seconds(), static_cast<double>(seq));
  }
  EXPECT_EQ(counted->executes.load(), 0);
  EXPECT_EQ(worker.requests(), 20);
  EXPECT_EQ(worker.connections(), 1);
}

TEST(StepSocketChannel, AWorkersErrorKeepsItsCodeAndNamesTheWorker) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) {
    v1::StepSocketReply reply;
    reply.set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
    reply.set_message("the step is not from this worker's coordinator session");
    reply.mutable_result()->set_kernel_seconds(1);  // not taken
    return reply;
  });
  auto channel = MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
  Result result;
  channel->ExecuteAsync(Step(1), absl::Now() + absl::Seconds(10), result.Done());
  auto r = result.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), "worker at unix:w0: the step is not from this worker's coordinator session");
}

TEST(StepSocketChannel, AStepLargerThanTheWorkerReadsThereGoesOnGrpc) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) { return Ok(1); });
  auto grpc = std::make_unique<CountingChannel>();
  CountingChannel* counted = grpc.get();
  auto channel = MakeStepSocketChannel(std::move(grpc), worker.path(), "unix:w0", /*max_step_bytes=*/1000);
  Result result;
  channel->ExecuteAsync(Step(1, 5000), absl::Now() + absl::Seconds(10), result.Done());
  auto r = result.Wait();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->queue_seconds(), -1);  // gRPC's
  EXPECT_EQ(counted->executes.load(), 1);
  EXPECT_EQ(worker.requests(), 0);
}

TEST(StepSocketChannel, WithNoSocketToConnectToStepsGoOnGrpc) {
  auto grpc = std::make_unique<CountingChannel>();
  CountingChannel* counted = grpc.get();
  auto channel = MakeStepSocketChannel(std::move(grpc), "/nonexistent/steps.sock", "unix:w0");
  for (int i = 0; i < 3; ++i) {
    Result result;
    channel->ExecuteAsync(Step(i + 1), absl::Now() + absl::Seconds(10), result.Done());
    ASSERT_TRUE(result.Wait().ok());
  }
  EXPECT_EQ(counted->executes.load(), 3);
}

TEST(StepSocketChannel, AStepNotAnsweredByItsDeadlineIsDeadlineExceededSoonAfter) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) { return std::nullopt; });
  auto channel = MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
  Result result;
  const absl::Time start = absl::Now();
  channel->ExecuteAsync(Step(1), start + absl::Milliseconds(300), result.Done());
  auto r = result.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("worker at unix:w0"), std::string::npos);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(result.calls(), 1);
}

TEST(StepSocketChannel, ALostConnectionFailsItsStepsAndALaterStepConnectsAgain) {
  absl::Notification got_first;
  FakeWorkerSocket* worker_ptr = nullptr;
  FakeWorkerSocket worker([&](const v1::StepSocketRequest& r) -> std::optional<v1::StepSocketReply> {
    if (r.step().sequence() == 1) {
      got_first.Notify();
      return std::nullopt;  // the worker goes away with it in flight
    }
    return Ok(2);
  });
  worker_ptr = &worker;
  auto channel = MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
  Result first;
  channel->ExecuteAsync(Step(1), absl::Now() + absl::Seconds(30), first.Done());
  ASSERT_TRUE(got_first.WaitForNotificationWithTimeout(absl::Seconds(10)));
  worker_ptr->DropConnection();
  auto r = first.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("step socket closed"), std::string::npos) << r.status();
  // Within the retry pause a step goes on gRPC; after it, on a new connection.
  absl::SleepFor(absl::Milliseconds(1100));
  Result second;
  channel->ExecuteAsync(Step(2), absl::Now() + absl::Seconds(10), second.Done());
  auto again = second.Wait();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->kernel_seconds(), 2);
  EXPECT_EQ(worker.connections(), 2);
}

TEST(StepSocketChannel, ClosingTheChannelAnswersWhatIsInFlight) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) { return std::nullopt; });
  Result result;
  {
    auto channel = MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
    channel->ExecuteAsync(Step(1), absl::Now() + absl::Seconds(30), result.Done());
    absl::SleepFor(absl::Milliseconds(50));
  }
  auto r = result.Wait(absl::Seconds(1));
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().code(), absl::StatusCode::kInternal) << r.status();  // answered, not timed out here
  EXPECT_EQ(result.calls(), 1);
}

// The last reference to a channel may go in one of its own answers, which
// run on its reader's thread: the channel goes, the reader ends by itself.
TEST(StepSocketChannel, AChannelDroppedInItsOwnAnswerGoesWithoutJoiningItself) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) { return Ok(1); });
  std::shared_ptr<WorkerChannel> channel =
      MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
  std::weak_ptr<WorkerChannel> watch = channel;
  absl::Notification answered;
  auto holder = std::make_shared<std::shared_ptr<WorkerChannel>>(std::move(channel));
  WorkerChannel* raw = holder->get();
  absl::StatusOr<v1::StepResult> got = absl::UnknownError("unset");
  raw->ExecuteAsync(Step(1), absl::Now() + absl::Seconds(10), [holder, &got, &answered](auto r) {
    got = std::move(r);
    holder->reset();  // the channel's last reference, on its reader's thread
    answered.Notify();
  });
  holder.reset();
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(watch.expired());
}

TEST(StepSocketChannel, AStatusCodeThatIsNoneIsUnknownNamingTheCode) {
  FakeWorkerSocket worker([](const v1::StepSocketRequest&) {
    v1::StepSocketReply reply;
    reply.set_code(99);
    reply.set_message("garbled");
    return reply;
  });
  auto channel = MakeStepSocketChannel(std::make_unique<CountingChannel>(), worker.path(), "unix:w0");
  Result result;
  channel->ExecuteAsync(Step(1), absl::Now() + absl::Seconds(10), result.Done());
  auto r = result.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnknown) << r.status();
  EXPECT_NE(r.status().message().find("status code 99"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace shardgemm
