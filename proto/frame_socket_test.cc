// FrameSocketServer and FrameSocketClient together, on the call socket's
// messages: calls answered out of order reach their own callers, statuses
// pass through, and every way a call can go unanswered ends it in bounded time.
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/frame_socket_client.h"
#include "proto/frame_socket_server.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

using Client = FrameSocketClient<v1::CallSocketRequest, v1::CallSocketReply>;

class FrameSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/frame_socket_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/calls.sock";
  }
  void TearDown() override {
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }

  // Sends a call whose request_id is `tag`; its outcome lands in the returned slot.
  struct Outcome {
    absl::Notification done;
    absl::StatusOr<v1::CallSocketReply> reply = absl::UnknownError("not answered");
  };
  static std::shared_ptr<Outcome> Send(Client& client, const std::string& tag, absl::Duration timeout,
                                       bool* sent = nullptr) {
    auto outcome = std::make_shared<Outcome>();
    v1::CallSocketRequest request;
    request.set_request_id(tag);
    Client::Done done = [outcome](absl::StatusOr<v1::CallSocketReply> reply) {
      outcome->reply = std::move(reply);
      outcome->done.Notify();
    };
    const bool went = client.Send(request, absl::Now() + timeout, &done);
    if (sent != nullptr) *sent = went;
    if (!went && done != nullptr) {
      outcome->reply = absl::FailedPreconditionError("not sent");
      outcome->done.Notify();
    }
    return outcome;
  }

  std::string dir_, path_;
};

// Many calls in flight on one connection, answered in the reverse order
// they came: each caller gets the reply to its own request.
TEST_F(FrameSocketTest, CallsAnsweredOutOfOrderReachTheirOwnCallers) {
  constexpr int kCalls = 16;
  absl::Mutex mu;
  std::vector<std::pair<v1::CallSocketRequest, FrameSocketServer::Reply>> held;
  auto server = FrameSocketServer::Start(path_, {}, [&](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    absl::MutexLock lock(&mu);
    held.emplace_back(std::move(request), std::move(reply));
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  std::vector<std::shared_ptr<Outcome>> outcomes;
  for (int i = 0; i < kCalls; ++i) {
    bool sent = false;
    outcomes.push_back(Send(client, "call-" + std::to_string(i), absl::Seconds(30), &sent));
    ASSERT_TRUE(sent) << "call " << i;
  }
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](decltype(held)* h) { return h->size() == kCalls; }, &held),
                                    absl::Seconds(10)));
    for (int i = kCalls - 1; i >= 0; --i) {
      v1::CallSocketReply reply;
      reply.set_call_id(held[i].first.call_id());
      reply.set_request_id(held[i].first.request_id() + "-answered");
      held[i].second(reply);
    }
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(outcomes[i]->done.WaitForNotificationWithTimeout(absl::Seconds(10))) << "call " << i;
    ASSERT_TRUE(outcomes[i]->reply.ok()) << outcomes[i]->reply.status();
    EXPECT_EQ(outcomes[i]->reply->request_id(), "call-" + std::to_string(i) + "-answered");
  }
}

// A reply's status is the caller's: its code, and its message as the server
// wrote it or after the peer's name.
TEST_F(FrameSocketTest, AReplysCodeAndMessageAreTheCallersStatus) {
  auto server = FrameSocketServer::Start(path_, {}, [](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    answer.set_code(request.request_id() == "bogus" ? 99 : static_cast<int>(absl::StatusCode::kInvalidArgument));
    answer.set_message("lhs.dtype: not one of f32, bf16, f16");
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client plain(path_, "test server", "call socket", /*name_peer_in_replies=*/false);
  auto a = Send(plain, "a", absl::Seconds(30));
  ASSERT_TRUE(a->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(a->reply.status(), absl::InvalidArgumentError("lhs.dtype: not one of f32, bf16, f16"));

  Client named(path_, "test server", "call socket");
  auto b = Send(named, "b", absl::Seconds(30));
  ASSERT_TRUE(b->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(b->reply.status(), absl::InvalidArgumentError("test server: lhs.dtype: not one of f32, bf16, f16"));

  auto c = Send(named, "bogus", absl::Seconds(30));
  ASSERT_TRUE(c->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(c->reply.status().code(), absl::StatusCode::kUnknown);
  EXPECT_NE(c->reply.status().message().find("status code 99"), std::string::npos) << c->reply.status();
}

// With no server at the path the call is not sent, and its callback is the
// caller's again (it takes another way).
TEST_F(FrameSocketTest, NoServerLeavesTheCallWithItsCaller) {
  Client client(path_, "test server", "call socket");
  bool sent = true;
  auto outcome = Send(client, "a", absl::Seconds(30), &sent);
  EXPECT_FALSE(sent);
  EXPECT_EQ(outcome->reply.status().code(), absl::StatusCode::kFailedPrecondition);  // handed back, not answered
}

// A server that never answers: the call ends DEADLINE_EXCEEDED by its deadline.
TEST_F(FrameSocketTest, AnUnansweredCallEndsByItsDeadline) {
  std::vector<FrameSocketServer::Reply> kept;
  absl::Mutex mu;
  auto server = FrameSocketServer::Start(path_, {}, [&](std::string, FrameSocketServer::Reply reply) {
    absl::MutexLock lock(&mu);
    kept.push_back(std::move(reply));
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  const absl::Time start = absl::Now();
  auto outcome = Send(client, "a", absl::Milliseconds(300));
  ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outcome->reply.status().code(), absl::StatusCode::kDeadlineExceeded) << outcome->reply.status();
  EXPECT_NE(outcome->reply.status().message().find("test server: no answer on its call socket"), std::string::npos);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
}

// The server stopping with a call in flight fails the call UNAVAILABLE at
// once; a call after that is not sent (no server), and one after a new
// server started goes on a new connection.
TEST_F(FrameSocketTest, AServerThatGoesFailsItsCallsInFlightAndAnotherIsReachedLater) {
  absl::Notification received;
  auto server = FrameSocketServer::Start(path_, {}, [&](std::string, FrameSocketServer::Reply) {
    received.Notify();
    return absl::OkStatus();  // never answered
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  auto outcome = Send(client, "a", absl::Seconds(60));
  ASSERT_TRUE(received.WaitForNotificationWithTimeout(absl::Seconds(10)));
  server->reset();
  ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outcome->reply.status().code(), absl::StatusCode::kUnavailable) << outcome->reply.status();
  EXPECT_NE(outcome->reply.status().message().find("closed with the call in flight"), std::string::npos);

  auto answering = FrameSocketServer::Start(path_, {}, [](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(answering.ok()) << answering.status();
  // Reconnects are tried at most once a second.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  bool answered = false;
  while (!answered && absl::Now() < until) {
    bool sent = false;
    auto later = Send(client, "b", absl::Seconds(10), &sent);
    if (sent) {
      ASSERT_TRUE(later->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
      answered = later->reply.ok();
    } else {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_TRUE(answered);
}

// A frame that is not a request, or one past the size bound, ends its
// connection (the peer speaks something else): the calls in flight on it fail.
TEST_F(FrameSocketTest, AFrameTheServerRefusesEndsItsConnection) {
  FrameSocketServer::Options options;
  options.max_payload_bytes = 1024;
  auto server = FrameSocketServer::Start(path_, options, [](std::string payload, FrameSocketServer::Reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload) || request.request_id() == "refused") {
      return absl::DataLossError("not a request");
    }
    return absl::OkStatus();  // held unanswered
  });
  ASSERT_TRUE(server.ok()) << server.status();
  {
    Client client(path_, "test server", "call socket");
    auto held = Send(client, "held", absl::Seconds(60));
    auto refused = Send(client, "refused", absl::Seconds(60));
    ASSERT_TRUE(held->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(refused->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_EQ(held->reply.status().code(), absl::StatusCode::kUnavailable) << held->reply.status();
    EXPECT_EQ(refused->reply.status().code(), absl::StatusCode::kUnavailable) << refused->reply.status();
  }
  Client client(path_, "test server", "call socket");
  auto outcome = Send(client, std::string(2048, 'x'), absl::Seconds(60));
  ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outcome->reply.status().code(), absl::StatusCode::kUnavailable) << outcome->reply.status();
}

}  // namespace
}  // namespace shardgemm
