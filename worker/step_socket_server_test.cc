#include "worker/step_socket_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/step_frame.h"

namespace shardgemm {
namespace {

class StepSocketServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/step_socket_server_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { ::rmdir(dir_.c_str()); }

  int Connect(const std::string& path) {
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
  // A reply within `bound`, or none.
  static std::optional<v1::StepSocketReply> ReadReply(int fd, absl::Duration bound) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(bound))) != 1) return std::nullopt;
    v1::StepSocketReply reply;
    if (!ReadStepFrame(fd, &reply).ok()) return std::nullopt;
    return reply;
  }
  static v1::StepSocketRequest Request(uint64_t id) {
    v1::StepSocketRequest r;
    r.set_call_id(id);
    r.mutable_step()->set_sequence(id);
    return r;
  }

  std::string dir_;
};

// A step that runs long (one in its turn, inside a collective) does not stop
// the connection: the frames after it are read and answered meanwhile.
TEST_F(StepSocketServerTest, AStepThatRunsLongLeavesTheNextFramesReadAndAnswered) {
  absl::Notification release_first;
  auto server = StepSocketServer::Start(dir_ + "/steps.sock", [&](std::unique_ptr<v1::StepSocketRequest> r,
                                                                  StepSocketServer::Reply reply) {
    if (r->call_id() == 1) {
      EXPECT_TRUE(release_first.WaitForNotificationWithTimeout(absl::Seconds(30)));
    }
    v1::StepSocketReply answer;
    answer.set_call_id(r->call_id());
    reply(std::move(answer));
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->path());
  ASSERT_GE(fd, 0);
  for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(WriteStepFrame(fd, Request(id)).ok());
  for (uint64_t id : {2, 3}) {
    auto reply = ReadReply(fd, absl::Seconds(10));
    ASSERT_TRUE(reply.has_value()) << "call " << id << " was not answered while call 1 runs";
    EXPECT_EQ(reply->call_id(), id);
  }
  release_first.Notify();
  auto first = ReadReply(fd, absl::Seconds(10));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->call_id(), 1u);
  ::close(fd);
}

// Many connections, each sending a step at a time, are each answered; the
// threads that read them are reused, not one more per frame.
TEST_F(StepSocketServerTest, ManyFramesOnManyConnectionsAreAllAnswered) {
  auto server = StepSocketServer::Start(dir_ + "/steps.sock", [](std::unique_ptr<v1::StepSocketRequest> r,
                                                                 StepSocketServer::Reply reply) {
    v1::StepSocketReply answer;
    answer.set_call_id(r->call_id());
    reply(std::move(answer));
  });
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> fds;
  for (int c = 0; c < 8; ++c) {
    fds.push_back(Connect((*server)->path()));
    ASSERT_GE(fds.back(), 0);
  }
  for (uint64_t id = 1; id <= 200; ++id) {
    const int fd = fds[id % fds.size()];
    ASSERT_TRUE(WriteStepFrame(fd, Request(id)).ok());
    auto reply = ReadReply(fd, absl::Seconds(10));
    ASSERT_TRUE(reply.has_value()) << "call " << id;
    EXPECT_EQ(reply->call_id(), id);
  }
  EXPECT_EQ((*server)->connections(), 8);
  for (int fd : fds) ::close(fd);
}

// Stopping waits for a step still running on one of its threads, whose
// reply then goes nowhere; nothing is left running after.
TEST_F(StepSocketServerTest, StoppingWaitsForTheStepsRunningOnItsThreads) {
  absl::Notification started, release;
  std::atomic<bool> finished{false};
  auto server = StepSocketServer::Start(dir_ + "/steps.sock", [&](std::unique_ptr<v1::StepSocketRequest>,
                                                                  StepSocketServer::Reply reply) {
    started.Notify();
    EXPECT_TRUE(release.WaitForNotificationWithTimeout(absl::Seconds(30)));
    reply(v1::StepSocketReply());
    finished.store(true);
  });
  ASSERT_TRUE(server.ok());
  const int fd = Connect((*server)->path());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(WriteStepFrame(fd, Request(1)).ok());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(200));
    release.Notify();
  });
  server->reset();
  EXPECT_TRUE(finished.load()) << "the server stopped with a step still running on its thread";
  releaser.join();
  ::close(fd);
}

}  // namespace
}  // namespace shardgemm
