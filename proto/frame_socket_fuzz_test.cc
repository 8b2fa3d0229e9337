// Random byte streams on a FrameSocketServer's connections, cut into random
// writes: well-formed calls, payloads that are not requests, oversized
// frames (some cut short), bad headers, noise. The server must never crash
// or hang: every reply is a whole frame answering a call that was sent,
// every connection ends by itself once its peer stops writing, a stream of
// only well-formed frames gets exactly one reply per call, and a client
// afterwards is served as before. Deterministic seeds;
// FRAME_SOCKET_FUZZ_ITERATIONS for longer runs.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>

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

constexpr uint64_t kMaxPayload = 4096;

int Iterations() {
  const char* env = std::getenv("FRAME_SOCKET_FUZZ_ITERATIONS");
  return env != nullptr ? std::atoi(env) : 300;
}

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

// One connection's stream and what a correct server answers to it.
struct Stream {
  std::string bytes;
  std::set<uint64_t> call_ids;  // of the calls sent, well-formed or oversized
  bool only_well_formed = true;
};

Stream MakeStream(Gen& gen) {
  Stream stream;
  const int frames = static_cast<int>(gen.Int(0, 12));
  uint64_t next_id = 1;
  for (int f = 0; f < frames; ++f) {
    const int64_t kind = gen.Int(0, 99);
    if (kind < 55) {  // a well-formed call
      v1::CallSocketRequest request;
      request.set_call_id(next_id);
      stream.call_ids.insert(next_id++);
      request.set_request_id(gen.Bytes(static_cast<size_t>(gen.Int(0, 64)), /*ascii=*/true));  // proto3 strings are UTF-8
      const std::string payload = request.SerializeAsString();
      absl::StrAppend(&stream.bytes, StepFrameHeader(payload.size()), payload);
    } else if (kind < 70) {  // oversized, whole or cut short (the stream ends inside it)
      v1::CallSocketRequest request;
      request.set_call_id(next_id);
      request.set_request_id(std::string(kMaxPayload + static_cast<size_t>(gen.Int(1, 3 * kMaxPayload)), 'x'));
      std::string payload = request.SerializeAsString();
      const bool cut = gen.Coin(30);
      if (!cut) stream.call_ids.insert(next_id);
      ++next_id;
      absl::StrAppend(&stream.bytes, StepFrameHeader(payload.size()),
                      cut ? payload.substr(0, static_cast<size_t>(gen.Int(0, payload.size() - 1))) : payload);
      if (cut) {
        stream.only_well_formed = false;
        break;
      }
    } else {
      stream.only_well_formed = false;
      if (kind < 80) {  // a frame whose payload is not a request: ends the connection
        const std::string junk = gen.Bytes(static_cast<size_t>(gen.Int(1, 64)));
        absl::StrAppend(&stream.bytes, StepFrameHeader(junk.size()), junk);
      } else if (kind < 90) {  // a header mutated
        std::string header = StepFrameHeader(static_cast<uint64_t>(gen.Int(0, 64)));
        header[static_cast<size_t>(gen.Int(0, header.size() - 1))] ^= static_cast<char>(gen.Int(1, 255));
        stream.bytes += header;
      } else {  // noise
        stream.bytes += gen.Bytes(static_cast<size_t>(gen.Int(1, 40)));
      }
      if (gen.Coin(50)) break;
    }
  }
  return stream;
}

// Writes `bytes` in random slices, then ends its writes; returns what the
// server wrote back until it closed (or the bound passed: *ended false).
std::string Exchange(const std::string& path, const std::string& bytes, Gen& gen, bool* ended) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0) << std::strerror(errno);
  std::string received;
  size_t sent = 0;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  bool writing = true;
  *ended = false;
  while (absl::Now() < until) {
    if (writing && sent == bytes.size()) {
      ::shutdown(fd, SHUT_WR);
      writing = false;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    if (p.revents & POLLIN) {
      char buffer[65536];
      const ssize_t r = ::recv(fd, buffer, sizeof(buffer), 0);
      if (r <= 0) {
        *ended = true;
        break;
      }
      received.append(buffer, static_cast<size_t>(r));
    }
    if (writing && (p.revents & POLLOUT)) {
      const size_t slice = std::min(bytes.size() - sent, static_cast<size_t>(gen.Int(1, 8192)));
      const ssize_t w = ::send(fd, bytes.data() + sent, slice, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        sent += static_cast<size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        writing = false;  // the server ended the connection
      }
    }
    if (p.revents & (POLLHUP | POLLERR) && !(p.revents & POLLIN)) {
      *ended = true;
      break;
    }
  }
  ::close(fd);
  return received;
}

TEST(FrameSocketFuzzTest, RandomStreamsGetWholeRepliesToTheirCallsAndEndByThemselves) {
  char dir[] = "/tmp/frame_fuzz_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/calls.sock";
  FrameSocketServer::Options options;
  options.name = "call socket";
  options.max_payload_bytes = kMaxPayload;
  options.oversized = [](std::string head, uint64_t, FrameSocketServer::Reply reply) {
    google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(head.data()),
                                              static_cast<int>(head.size()));
    uint64_t call_id = 0;
    if (in.ReadTag() != (1u << 3) || !in.ReadVarint64(&call_id)) call_id = 0;
    if (call_id == 0) return absl::DataLossError("an oversized frame names no call");
    v1::CallSocketReply answer;
    answer.set_call_id(call_id);
    answer.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
    reply(answer);
    return absl::OkStatus();
  };
  auto server = FrameSocketServer::Start(path, options, [](std::string payload, FrameSocketServer::Reply reply) {
    v1::CallSocketRequest request;
    if (!request.ParseFromString(payload)) return absl::DataLossError("not a request");
    v1::CallSocketReply answer;
    answer.set_call_id(request.call_id());
    reply(answer);
    return absl::OkStatus();
  });
  ASSERT_TRUE(server.ok()) << server.status();

  for (int i = 0; i < Iterations(); ++i) {
    Gen gen(0x5eed0000u + static_cast<uint64_t>(i));
    const Stream stream = MakeStream(gen);
    bool ended = false;
    const std::string received = Exchange(path, stream.bytes, gen, &ended);
    ASSERT_TRUE(ended) << "iteration " << i << ": the connection did not end by itself";
    // Every reply is a whole frame naming a call that was sent, at most once.
    std::set<uint64_t> answered;
    size_t at = 0;
    while (at < received.size()) {
      ASSERT_GE(received.size() - at, kStepFrameHeaderBytes) << "iteration " << i << ": a cut reply header";
      auto length = ParseStepFrameHeader(absl::string_view(received).substr(at, kStepFrameHeaderBytes));
      ASSERT_TRUE(length.ok()) << "iteration " << i << ": " << length.status();
      at += kStepFrameHeaderBytes;
      ASSERT_GE(received.size() - at, *length) << "iteration " << i << ": a cut reply";
      v1::CallSocketReply reply;
      ASSERT_TRUE(reply.ParseFromArray(received.data() + at, static_cast<int>(*length))) << "iteration " << i;
      at += *length;
      EXPECT_TRUE(stream.call_ids.count(reply.call_id())) << "iteration " << i << ": call " << reply.call_id();
      EXPECT_TRUE(answered.insert(reply.call_id()).second) << "iteration " << i << ": call " << reply.call_id() << " twice";
    }
    if (stream.only_well_formed) {
      EXPECT_EQ(answered, stream.call_ids) << "iteration " << i << ": every call answered once (" << stream.bytes.size() << " bytes sent, " << received.size() << " received)";
    }
  }

  // Served as before, and no connection left open.
  FrameSocketClient<v1::CallSocketRequest, v1::CallSocketReply> client(path, "test server", "call socket");
  absl::Notification done;
  absl::StatusOr<v1::CallSocketReply> outcome = absl::UnknownError("not answered");
  v1::CallSocketRequest request;
  FrameSocketClient<v1::CallSocketRequest, v1::CallSocketReply>::Done callback =
      [&](absl::StatusOr<v1::CallSocketReply> reply) {
        outcome = std::move(reply);
        done.Notify();
      };
  ASSERT_TRUE(client.Send(request, absl::Now() + absl::Seconds(10), &callback));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(outcome.ok()) << outcome.status();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*server)->connections() > 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ((*server)->connections(), 1);  // the client's own
  server->reset();
  ::rmdir(dir);
}

}  // namespace
}  // namespace shardgemm
