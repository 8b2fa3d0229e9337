// FrameSocketServer and FrameSocketClient together, on the call socket's
// messages: calls answered out of order reach their own callers, statuses
// pass through, and every way a call can go unanswered ends it in bounded time.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <fstream>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "google/protobuf/io/coded_stream.h"
#include "gtest/gtest.h"
#include "proto/frame_socket_client.h"
#include "proto/frame_socket_server.h"
#include "proto/shardgemm.pb.h"
#include "proto/step_frame.h"

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

// A server that answers each call at once, its request_id + "-answered".
absl::StatusOr<std::unique_ptr<FrameSocketServer>> StartAnswering(const std::string& path,
                                                                  FrameSocketServer::Options options = {}) {
  return FrameSocketServer::Start(path, options, [](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    answer.set_request_id(request.request_id() + "-answered");
    reply(answer);
    return absl::OkStatus();
  });
}

// A server that holds each call unanswered until the test answers them all.
class HeldCalls {
 public:
  absl::StatusOr<std::unique_ptr<FrameSocketServer>> Start(const std::string& path) {
    return FrameSocketServer::Start(path, {}, [this](std::string payload, FrameSocketServer::Reply reply) {
      v1::CallSocketRequest request;
      if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
      absl::MutexLock lock(&mu_);
      held_.emplace_back(std::move(request), std::move(reply));
      return absl::OkStatus();
    });
  }
  // Once `calls` are held (false if not within 10 s), answers them in the
  // reverse order they came, each with its request_id + "-answered".
  bool AnswerInReverse(size_t calls) {
    absl::MutexLock lock(&mu_);
    auto all_held = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return held_.size() == calls; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_held), absl::Seconds(10))) return false;
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) {
      v1::CallSocketReply answer;
      answer.set_call_id(it->first.call_id());
      answer.set_request_id(it->first.request_id() + "-answered");
      it->second(answer);
    }
    return true;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<v1::CallSocketRequest, FrameSocketServer::Reply>> held_ ABSL_GUARDED_BY(mu_);
};

// Many calls in flight on one connection, answered in the reverse order
// they came: each caller gets the reply to its own request.
TEST_F(FrameSocketTest, CallsAnsweredOutOfOrderReachTheirOwnCallers) {
  constexpr int kCalls = 16;
  HeldCalls held;
  auto server = held.Start(path_);
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  std::vector<std::shared_ptr<Outcome>> outcomes;
  for (int i = 0; i < kCalls; ++i) {
    bool sent = false;
    outcomes.push_back(Send(client, "call-" + std::to_string(i), absl::Seconds(30), &sent));
    ASSERT_TRUE(sent) << "call " << i;
  }
  ASSERT_TRUE(held.AnswerInReverse(kCalls));
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
  EXPECT_EQ(a->reply.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->reply.status().message(), "lhs.dtype: not one of f32, bf16, f16");
  // The failed reply travels with the status, so the caller keeps its ids.
  auto carried = a->reply.status().GetPayload(kFrameReplyUrl);
  ASSERT_TRUE(carried.has_value());
  v1::CallSocketReply carried_reply;
  ASSERT_TRUE(carried_reply.ParseFromString(std::string(*carried)));
  EXPECT_EQ(carried_reply.message(), "lhs.dtype: not one of f32, bf16, f16");
  EXPECT_FALSE(FrameCallNotRun(a->reply.status()));

  Client named(path_, "test server", "call socket");
  auto b = Send(named, "b", absl::Seconds(30));
  ASSERT_TRUE(b->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(b->reply.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->reply.status().message(), "test server: lhs.dtype: not one of f32, bf16, f16");

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

  auto answering = StartAnswering(path_);
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

// A frame past the bound, with `oversized` set, is read and dropped and
// answered under its call id; the connection goes on with the next call.
TEST_F(FrameSocketTest, AnOversizedFrameIsAnsweredAndItsConnectionGoesOn) {
  FrameSocketServer::Options options;
  options.max_payload_bytes = 1024;
  std::atomic<uint64_t> oversized_bytes{0};
  options.oversized = [&](std::string head, uint64_t bytes, FrameSocketServer::Reply reply) {
    oversized_bytes = bytes;
    EXPECT_LE(head.size(), FrameSocketServer::kOversizedHeadBytes);
    google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(head.data()),
                                              static_cast<int>(head.size()));
    uint64_t call_id = 0;
    EXPECT_EQ(in.ReadTag(), 1u << 3);
    EXPECT_TRUE(in.ReadVarint64(&call_id));
    v1::CallSocketReply answer;
    answer.set_call_id(call_id);
    answer.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
    answer.set_message("too large");
    reply(answer);
    return absl::OkStatus();
  };
  auto server = StartAnswering(path_, options);
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/false);
  auto large = Send(client, std::string(4096, 'x'), absl::Seconds(30));
  ASSERT_TRUE(large->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(large->reply.status().code(), absl::StatusCode::kResourceExhausted) << large->reply.status();
  EXPECT_EQ(large->reply.status().message(), "too large");
  EXPECT_GT(oversized_bytes.load(), 4096u);
  auto small = Send(client, "small", absl::Seconds(30));
  ASSERT_TRUE(small->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(small->reply.ok()) << small->reply.status();
  EXPECT_EQ(small->reply->request_id(), "small-answered");
  EXPECT_EQ((*server)->connections(), 1);
}

// Past max_connections a connection gets the refusal and is closed unread:
// its call ends "not run" (the caller takes another way), and the
// connections already open go on.
TEST_F(FrameSocketTest, AConnectionPastTheLimitIsRefusedAndItsCallsAreNotRun) {
  FrameSocketServer::Options options;
  options.max_connections = 1;
  v1::CallSocketReply refusal;
  refusal.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
  refusal.set_message("one connection at once");
  options.refusal = refusal.SerializeAsString();
  std::atomic<int> handled{0};
  auto server = FrameSocketServer::Start(path_, options, [&](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    ++handled;
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client first(path_, "test server", "call socket");
  auto a = Send(first, "a", absl::Seconds(30));
  ASSERT_TRUE(a->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(a->reply.ok()) << a->reply.status();

  Client second(path_, "test server", "call socket");
  bool sent = false;
  auto b = Send(second, "b", absl::Seconds(30), &sent);
  ASSERT_TRUE(b->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  if (sent) {  // written before the refusal was read: it ends "not run"
    EXPECT_TRUE(FrameCallNotRun(b->reply.status())) << b->reply.status();
    EXPECT_NE(b->reply.status().message().find("one connection at once"), std::string::npos) << b->reply.status();
  } else {
    EXPECT_EQ(b->reply.status().code(), absl::StatusCode::kFailedPrecondition);  // handed back, not sent
  }
  EXPECT_EQ(handled.load(), 1);

  auto c = Send(first, "c", absl::Seconds(30));
  ASSERT_TRUE(c->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(c->reply.ok()) << c->reply.status();
}

// A reply far larger than the socket's buffer is written in full (the rest
// by a thread of the server's), and a small reply after it arrives whole.
TEST_F(FrameSocketTest, AReplyLargerThanTheSocketBufferArrivesWhole) {
  auto server = FrameSocketServer::Start(path_, {}, [](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    answer.set_request_id(request.request_id() == "large" ? std::string(32 << 20, 'r') : "small");
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  auto large = Send(client, "large", absl::Seconds(60));
  auto small = Send(client, "small", absl::Seconds(60));
  ASSERT_TRUE(large->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(small->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(large->reply.ok()) << large->reply.status();
  EXPECT_EQ(large->reply->request_id(), std::string(32 << 20, 'r'));
  ASSERT_TRUE(small->reply.ok()) << small->reply.status();
  EXPECT_EQ(small->reply->request_id(), "small");
}

// StopReading, as a shutdown does: new connections are refused and no frame
// more is run, but a call in flight is still answered on its connection, in
// full before the server goes when FlushReplies is called.
TEST_F(FrameSocketTest, StopReadingLetsTheCallsInFlightBeAnswered) {
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, FrameSocketServer::Reply>> held;
  std::atomic<int> handled{0};
  auto server = FrameSocketServer::Start(path_, {}, [&](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    ++handled;
    absl::MutexLock lock(&mu);
    held.emplace_back(request.call_id(), std::move(reply));
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket");
  auto in_flight = Send(client, "in flight", absl::Seconds(60));
  {
    absl::MutexLock lock(&mu);
    auto one_held = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return held.size() == 1; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&one_held), absl::Seconds(10)));
  }
  EXPECT_TRUE((*server)->StopReading(absl::Seconds(10)));

  Client late(path_, "test server", "call socket");
  bool sent = true;
  auto refused = Send(late, "late", absl::Seconds(5), &sent);
  ASSERT_TRUE(refused->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(refused->reply.ok());

  // A call on the open connection is not sent (the server reads no more),
  // and that does not end the connection's replies.
  bool after_sent = true;
  auto after = Send(client, "after", absl::Seconds(5), &after_sent);
  EXPECT_FALSE(after_sent);

  // The answer is far larger than the socket's buffer: FlushReplies waits
  // for it to be written before the server goes.
  const std::string large(32 << 20, 'a');
  {
    absl::MutexLock lock(&mu);
    v1::CallSocketReply answer;
    answer.set_call_id(held[0].first);
    answer.set_request_id(large);
    held[0].second(answer);
  }
  EXPECT_TRUE((*server)->FlushReplies(absl::Seconds(20)));
  server->reset();
  ASSERT_TRUE(in_flight->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(in_flight->reply.ok()) << in_flight->reply.status();
  EXPECT_EQ(in_flight->reply->request_id(), large);
  EXPECT_EQ(handled.load(), 1);
}

// ---- Call, and callers that read their own replies (FrameReader::kCallers) ----

using CallResult = std::optional<absl::StatusOr<v1::CallSocketReply>>;

CallResult CallTagged(Client& client, const std::string& tag, absl::Duration timeout) {
  v1::CallSocketRequest request;
  request.set_request_id(tag);
  return client.Call(request, absl::Now() + timeout);
}

int ThreadsOfThisProcess() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Callers waiting at once, answered in the reverse order they called: each
// gets the reply to its own request, whichever of them reads (and with the
// client's reader thread the same).
TEST_F(FrameSocketTest, CallersWaitingAtOnceEachGetTheirOwnReply) {
  for (const FrameReader reader : {FrameReader::kCallers, FrameReader::kThread}) {
    SCOPED_TRACE(reader == FrameReader::kCallers ? "callers read" : "reader thread");
    constexpr int kCalls = 8;
    HeldCalls held;
    auto server = held.Start(path_);
    ASSERT_TRUE(server.ok()) << server.status();
    Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, reader);
    std::vector<CallResult> results(kCalls);
    std::vector<std::unique_ptr<absl::Notification>> finished;
    std::vector<std::thread> callers;
    for (int i = 0; i < kCalls; ++i) {
      finished.push_back(std::make_unique<absl::Notification>());
      callers.emplace_back([&, i] {
        results[i] = CallTagged(client, "call-" + std::to_string(i), absl::Seconds(30));
        finished[i]->Notify();
      });
    }
    ASSERT_TRUE(held.AnswerInReverse(kCalls));
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(finished[i]->WaitForNotificationWithTimeout(absl::Seconds(10))) << "call " << i;
    }
    for (std::thread& t : callers) t.join();
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(results[i].has_value()) << "call " << i << " not sent";
      ASSERT_TRUE(results[i]->ok()) << results[i]->status();
      EXPECT_EQ((*results[i])->request_id(), "call-" + std::to_string(i) + "-answered");
    }
    server->reset();
  }
}

// With callers reading, the client starts no thread, and Send (whose Done
// nothing would run) is never sent.
TEST_F(FrameSocketTest, CallersThatReadNeedNoThreadOfTheClients) {
  auto server = StartAnswering(path_);
  ASSERT_TRUE(server.ok()) << server.status();
  {
    // The server's first threads are there before the count (the client
    // connects at its first call, not before).
    Client warm(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
    CallResult warmed = CallTagged(warm, "warm", absl::Seconds(30));
    ASSERT_TRUE(warmed.has_value() && warmed->ok());
  }
  const int before = ThreadsOfThisProcess();
  ASSERT_GT(before, 0);
  {
    Client threaded(path_, "test server", "call socket");
    EXPECT_EQ(ThreadsOfThisProcess(), before + 1);
  }
  Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  EXPECT_EQ(ThreadsOfThisProcess(), before);
  CallResult answered = CallTagged(client, "a", absl::Seconds(30));
  ASSERT_TRUE(answered.has_value());
  ASSERT_TRUE(answered->ok()) << answered->status();
  EXPECT_EQ((*answered)->request_id(), "a-answered");

  bool sent = true;
  auto outcome = Send(client, "b", absl::Seconds(30), &sent);
  EXPECT_FALSE(sent);
  EXPECT_EQ(outcome->reply.status().code(), absl::StatusCode::kFailedPrecondition);  // handed back
}

// No server: Call sends nothing and says so (the caller takes another way).
TEST_F(FrameSocketTest, CallWithNoServerIsNotSent) {
  for (const FrameReader reader : {FrameReader::kCallers, FrameReader::kThread}) {
    Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, reader);
    EXPECT_FALSE(CallTagged(client, "a", absl::Seconds(30)).has_value());
  }
}

// A caller that reads ends DEADLINE_EXCEEDED by its deadline; the answer
// that comes after it is dropped, and the next call on the same connection
// gets its own.
TEST_F(FrameSocketTest, ACallerThatReadsEndsByItsDeadlineAndALateReplyIsDropped) {
  absl::Mutex mu;
  std::vector<std::pair<v1::CallSocketRequest, FrameSocketServer::Reply>> held;
  auto server = FrameSocketServer::Start(path_, {}, [&](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    absl::MutexLock lock(&mu);
    if (request.request_id() == "late") {
      held.emplace_back(std::move(request), std::move(reply));
      return absl::OkStatus();
    }
    // The late call's answer first, then this one's.
    for (auto& [late, late_reply] : held) {
      v1::CallSocketReply answer;
      answer.set_call_id(late.call_id());
      answer.set_request_id("late-answered");
      late_reply(answer);
    }
    held.clear();
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    answer.set_request_id(request.request_id() + "-answered");
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  const absl::Time start = absl::Now();
  CallResult late = CallTagged(client, "late", absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(late.has_value());
  EXPECT_EQ(late->status().code(), absl::StatusCode::kDeadlineExceeded) << late->status();
  EXPECT_NE(late->status().message().find("test server: no answer on its call socket"), std::string::npos);
  EXPECT_GE(took, absl::Milliseconds(290));
  EXPECT_LT(took, absl::Seconds(5));

  CallResult next = CallTagged(client, "next", absl::Seconds(30));
  ASSERT_TRUE(next.has_value());
  ASSERT_TRUE(next->ok()) << next->status();
  EXPECT_EQ((*next)->request_id(), "next-answered");
  EXPECT_EQ((*server)->connections(), 1);
}

// The server going with a caller waiting fails it UNAVAILABLE at once; a
// server started later at the path takes the next call on a new
// connection, at once, though nothing read the old one's end meanwhile.
TEST_F(FrameSocketTest, ACallerThatReadsSeesTheServerGoAndReachesTheNextAtOnce) {
  absl::Notification received;
  auto silent = FrameSocketServer::Start(path_, {}, [&](std::string, FrameSocketServer::Reply) {
    received.Notify();
    return absl::OkStatus();  // never answered
  });
  ASSERT_TRUE(silent.ok()) << silent.status();
  Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  CallResult in_flight;
  absl::Notification finished;
  std::thread caller([&] {
    in_flight = CallTagged(client, "a", absl::Seconds(60));
    finished.Notify();
  });
  ASSERT_TRUE(received.WaitForNotificationWithTimeout(absl::Seconds(10)));
  silent->reset();
  ASSERT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(10)));
  caller.join();
  ASSERT_TRUE(in_flight.has_value());
  EXPECT_EQ(in_flight->status().code(), absl::StatusCode::kUnavailable) << in_flight->status();
  EXPECT_NE(in_flight->status().message().find("closed with the call in flight"), std::string::npos);

  // An idle connection whose server went, then a new server: the first call
  // after it is answered (not failed on the dead connection).
  auto first = StartAnswering(path_);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::SleepFor(absl::Milliseconds(1100));  // past the reconnect pause after the failure
  CallResult one = CallTagged(client, "one", absl::Seconds(10));
  ASSERT_TRUE(one.has_value());
  ASSERT_TRUE(one->ok()) << one->status();
  first->reset();
  auto second = StartAnswering(path_);
  ASSERT_TRUE(second.ok()) << second.status();
  CallResult two = CallTagged(client, "two", absl::Seconds(10));
  ASSERT_TRUE(two.has_value()) << "not sent";
  ASSERT_TRUE(two->ok()) << two->status();
  EXPECT_EQ((*two)->request_id(), "two-answered");
}

// Past the server's max_connections the caller's call ends "not run", as
// with the reader thread.
TEST_F(FrameSocketTest, ACallerThatReadsPastTheConnectionLimitIsNotRun) {
  FrameSocketServer::Options options;
  options.max_connections = 1;
  v1::CallSocketReply refusal;
  refusal.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
  refusal.set_message("one connection at once");
  options.refusal = refusal.SerializeAsString();
  auto server = StartAnswering(path_, options);
  ASSERT_TRUE(server.ok()) << server.status();
  Client first(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  CallResult a = CallTagged(first, "a", absl::Seconds(30));
  ASSERT_TRUE(a.has_value() && a->ok());
  Client second(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  CallResult b = CallTagged(second, "b", absl::Seconds(30));
  if (b.has_value()) {  // written before the refusal was read
    EXPECT_TRUE(FrameCallNotRun(b->status())) << b->status();
    EXPECT_NE(b->status().message().find("one connection at once"), std::string::npos) << b->status();
  }
  CallResult c = CallTagged(first, "c", absl::Seconds(30));
  ASSERT_TRUE(c.has_value());
  EXPECT_TRUE(c->ok()) << c->status();
}

// A bare Unix socket server: each accepted connection goes to `serve` on a
// thread of its own (the test's script of how a server misbehaves).
class BareServer {
 public:
  BareServer(const std::string& path, std::function<void(int fd, int index)> serve) : serve_(std::move(serve)) {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    ok_ = listener_ >= 0 && ::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
          ::listen(listener_, 8) == 0;
    if (ok_) accepter_ = std::thread([this] { Accept(); });
  }
  ~BareServer() {
    ::shutdown(listener_, SHUT_RDWR);
    if (accepter_.joinable()) accepter_.join();
    for (std::thread& t : served_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(listener_);
  }
  bool ok() const { return ok_; }
  int accepted() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(fds_.size());
  }

 private:
  void Accept() {
    while (true) {
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      absl::MutexLock lock(&mu_);
      const int index = static_cast<int>(fds_.size());
      fds_.push_back(fd);
      served_.emplace_back([this, fd, index] { serve_(fd, index); });
    }
  }
  std::function<void(int, int)> serve_;
  int listener_ = -1;
  bool ok_ = false;
  std::thread accepter_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> served_;
};

// A caller that reads is not held by a server that stops mid-way: one that
// reads no more fails the send (not sent), and that connection goes, so the
// next call is made on a new one; one that stops inside its reply's frame
// ends the call UNAVAILABLE by the socket's receive timeout, not never.
TEST_F(FrameSocketTest, ACallerThatReadsIsNotHeldByAServerThatStopsMidWay) {
  absl::Notification done, reads_no_more;
  BareServer server(path_, [&](int fd, int index) {
    std::string payload;
    if (index == 0) {  // answers one call, then reads no more: the client's next write fails (EPIPE)
      v1::CallSocketRequest request;
      if (ReadStepFramePayload(fd, &payload).ok() && request.ParseFromString(payload)) {
        v1::CallSocketReply answer;
        answer.set_call_id(request.call_id());
        (void)WriteStepFrame(fd, answer);
      }
      ::shutdown(fd, SHUT_RD);
      reads_no_more.Notify();
    } else if (ReadStepFramePayload(fd, &payload).ok()) {  // sends a reply frame's header and no more
      const std::string header = StepFrameHeader(64);
      (void)::send(fd, header.data(), header.size(), MSG_NOSIGNAL);
    }
    done.WaitForNotificationWithTimeout(absl::Seconds(60));
  });
  ASSERT_TRUE(server.ok());
  Client client(path_, "test server", "call socket", /*name_peer_in_replies=*/true, FrameReader::kCallers);
  CallResult first = CallTagged(client, "a", absl::Seconds(10));
  ASSERT_TRUE(first.has_value() && first->ok());
  ASSERT_TRUE(reads_no_more.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(CallTagged(client, "b", absl::Seconds(10)).has_value()) << "its write failed: not sent";
  absl::SleepFor(absl::Milliseconds(1100));  // past the reconnect pause
  const absl::Time start = absl::Now();
  CallResult stalled = CallTagged(client, "c", absl::Seconds(60));
  EXPECT_EQ(server.accepted(), 2) << "the connection no call could use was ended and another made";
  ASSERT_TRUE(stalled.has_value());
  EXPECT_EQ(stalled->status().code(), absl::StatusCode::kUnavailable) << stalled->status();
  EXPECT_NE(stalled->status().message().find("receive timeout"), std::string::npos) << stalled->status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  done.Notify();
}

}  // namespace
}  // namespace shardgemm
