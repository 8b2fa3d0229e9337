// The transport's limit for the service benchmark: a raw gRPC stream that
// moves the bytes a request moves (lhs in, the output back) between the
// same two endpoints, with the service's channel and server settings
// (proto/transport.h) and its message sizes: one message each way as the
// inline GroupedGemm sends them (--chunk_bytes=0), or the chunks PutTensor /
// GetTensor stream (--service_chunks: kTensorChunkBytes). No protobuf and no
// copies: the bytes go out as slices of one buffer and are counted, not
// copied, on arrival, so what is left is gRPC's own cost.
//
//   shardgemm-transport-bench --mode=server --listen=127.0.0.1:0 [--port_file=F]
//   shardgemm-transport-bench --mode=client --target=HOST:PORT --in_bytes=N --out_bytes=M
//       [--chunk_bytes=0 | --service_chunks] [--concurrency=1,2,4] [--iters=20] [--warmup=3] [--label=PRESET] [--json=FILE]
//
// One call is one bidirectional stream: the client writes in_bytes and
// half-closes, the server checks it got them all and answers out_bytes.
// The client checks every answer's length (the wrong-value count); a call
// that fails ends the run. Per concurrency level (N callers at once, each
// its own channel, --iters calls each): a result line with the round
// trip's p50 / p90 / p99, calls/s and GB/s (in + out bytes over the wall
// clock from the release to the last answer), and a JSON line with --json.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/transport.h"

ABSL_FLAG(std::string, mode, "", "server or client");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "server: address to listen on (port 0: one the OS picks)");
ABSL_FLAG(std::string, port_file, "", "server: write the port it listens on here once it serves");
ABSL_FLAG(std::string, target, "", "client: the server's HOST:PORT");
ABSL_FLAG(int64_t, in_bytes, 0, "client: bytes each call sends");
ABSL_FLAG(int64_t, out_bytes, 0, "client: bytes each call gets back");
ABSL_FLAG(int64_t, chunk_bytes, 0, "client: message size both ways (0: one message each way)");
ABSL_FLAG(bool, service_chunks, false,
          "client: messages of the service's stream chunk (kTensorChunkBytes, as PutTensor / GetTensor), "
          "instead of --chunk_bytes");
ABSL_FLAG(std::string, concurrency, "1", "client: callers at once, one count or a list (1,2,4,...)");
ABSL_FLAG(int, iters, 20, "client: timed calls per caller");
ABSL_FLAG(int, warmup, 3, "client: untimed calls per caller first");
ABSL_FLAG(double, call_timeout_s, 60, "client: each call's deadline");
ABSL_FLAG(std::string, label, "", "client: what the bytes are (the preset), for the result lines");
ABSL_FLAG(std::string, json, "", "client: append one JSON line per concurrency level here");

namespace shardgemm {
namespace {

constexpr char kMethod[] = "/shardgemm.bench.RawStream/Exchange";
constexpr char kInBytesKey[] = "x-in-bytes";
constexpr char kOutBytesKey[] = "x-out-bytes";
constexpr char kChunkBytesKey[] = "x-chunk-bytes";

// A message of `bytes` from `source` without copying it (the source outlives the call).
grpc::ByteBuffer Borrowed(const std::string& source, int64_t bytes) {
  grpc::Slice slice(source.data(), static_cast<size_t>(bytes), grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(&slice, 1);
}

int64_t MessageBytes(int64_t total, int64_t chunk) { return chunk > 0 ? std::min(total, chunk) : total; }

// Buffers the server answers from, one per size asked for, kept for the
// process's life (calls of the same sizes share one).
class AnswerBuffers {
 public:
  std::shared_ptr<const std::string> AtLeast(int64_t bytes) {
    absl::MutexLock lock(&mu_);
    for (const auto& b : buffers_) {
      if (static_cast<int64_t>(b->size()) >= bytes) return b;
    }
    buffers_.push_back(std::make_shared<const std::string>(static_cast<size_t>(bytes), '\x5a'));
    return buffers_.back();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<const std::string>> buffers_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<int64_t> MetadataBytes(const grpc::GenericCallbackServerContext& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(key);
  int64_t value = 0;
  if (it == md.end() || !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &value) ||
      value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("metadata ", key, ": a byte count is required"));
  }
  return value;
}

// One call on the server: count what arrives until the client half-closes,
// check it is what the client announced, then answer out_bytes.
class ExchangeReactor : public grpc::ServerGenericBidiReactor {
 public:
  ExchangeReactor(grpc::GenericCallbackServerContext* ctx, AnswerBuffers* buffers) {
    if (ctx->method() != kMethod) {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, absl::StrCat("method ", ctx->method())));
      return;
    }
    auto in = MetadataBytes(*ctx, kInBytesKey);
    auto out = MetadataBytes(*ctx, kOutBytesKey);
    auto chunk = MetadataBytes(*ctx, kChunkBytesKey);
    for (const auto* s : {&in, &out, &chunk}) {
      if (!s->ok()) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(s->status().message())));
        return;
      }
    }
    want_in_ = *in;
    out_bytes_ = *out;
    chunk_bytes_ = *chunk;
    answer_ = buffers->AtLeast(std::max<int64_t>(1, MessageBytes(out_bytes_, chunk_bytes_)));
    StartRead(&message_);
  }
  void OnReadDone(bool ok) override {
    if (ok) {
      received_ += static_cast<int64_t>(message_.Length());
      message_.Clear();
      StartRead(&message_);
      return;
    }
    if (received_ != want_in_) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("in bytes: got ", received_, ", the call announced ", want_in_)));
      return;
    }
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the client went away mid-answer"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (sent_ >= out_bytes_) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t n = MessageBytes(out_bytes_ - sent_, chunk_bytes_);
    sent_ += n;
    reply_ = Borrowed(*answer_, n);
    StartWrite(&reply_);
  }
  int64_t want_in_ = 0, out_bytes_ = 0, chunk_bytes_ = 0, received_ = 0, sent_ = 0;
  std::shared_ptr<const std::string> answer_;
  grpc::ByteBuffer message_, reply_;
};

class RawStreamService : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new ExchangeReactor(ctx, &buffers_);
  }

 private:
  AnswerBuffers buffers_;
};

int Serve() {
  RawStreamService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  ConfigureTensorServer(&builder);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "--listen: cannot listen on '%s'\n", absl::GetFlag(FLAGS_listen).c_str());
    return 1;
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    // Written whole under another name, then renamed: a reader never sees half a port.
    const std::string file = absl::GetFlag(FLAGS_port_file), partial = file + ".partial";
    std::ofstream(partial) << port << "\n";
    if (std::rename(partial.c_str(), file.c_str()) != 0) {
      std::fprintf(stderr, "--port_file: cannot write '%s'\n", file.c_str());
      return 1;
    }
  }
  std::printf("transport bench server on port %d\n", port);
  std::fflush(stdout);
  ServeUntilSignalled(server.get());
  return 0;
}

// One call on the client: write in_bytes in messages of chunk_bytes,
// half-close, count the answer.
class ExchangeCall : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ExchangeCall(grpc::GenericStub* stub, const std::string& payload, int64_t in_bytes, int64_t out_bytes,
               int64_t chunk_bytes, absl::Duration timeout)
      : payload_(payload), in_bytes_(in_bytes), chunk_bytes_(chunk_bytes) {
    ctx_.AddMetadata(kInBytesKey, absl::StrCat(in_bytes));
    ctx_.AddMetadata(kOutBytesKey, absl::StrCat(out_bytes));
    ctx_.AddMetadata(kChunkBytesKey, absl::StrCat(chunk_bytes));
    ctx_.set_deadline(ToGrpcDeadline(absl::Now() + timeout));
    stub->PrepareBidiStreamingCall(&ctx_, kMethod, grpc::StubOptions(), this);
    StartRead(&message_);
    WriteNext();
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    received_ += static_cast<int64_t>(message_.Length());
    message_.Clear();
    StartRead(&message_);
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.Notify();
  }
  // The call's status and the bytes it got back (the deadline bounds the wait).
  std::pair<grpc::Status, int64_t> Wait() {
    done_.WaitForNotification();
    return {status_, received_};
  }

 private:
  void WriteNext() {
    if (sent_ >= in_bytes_) {
      StartWritesDone();
      return;
    }
    const int64_t n = MessageBytes(in_bytes_ - sent_, chunk_bytes_);
    sent_ += n;
    request_ = Borrowed(payload_, n);
    StartWrite(&request_);
  }
  grpc::ClientContext ctx_;
  const std::string& payload_;
  int64_t in_bytes_, chunk_bytes_, sent_ = 0, received_ = 0;
  grpc::ByteBuffer request_, message_;
  grpc::Status status_;
  absl::Notification done_;
};

struct Stats {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
Stats Percentiles(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  double sum = 0;
  for (double x : v) sum += x;
  return {at(0.5), at(0.9), at(0.99), sum / static_cast<double>(v.size())};
}

int RunClient() {
  const std::string target = absl::GetFlag(FLAGS_target);
  const int64_t in_bytes = absl::GetFlag(FLAGS_in_bytes), out_bytes = absl::GetFlag(FLAGS_out_bytes);
  const int64_t chunk = absl::GetFlag(FLAGS_service_chunks) ? kTensorChunkBytes : absl::GetFlag(FLAGS_chunk_bytes);
  const int iters = absl::GetFlag(FLAGS_iters), warmup = absl::GetFlag(FLAGS_warmup);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_call_timeout_s));
  if (target.empty()) return std::fprintf(stderr, "--target: required with --mode=client\n"), 2;
  if (in_bytes < 0 || out_bytes < 0 || chunk < 0) {
    return std::fprintf(stderr, "--in_bytes, --out_bytes, --chunk_bytes: not negative\n"), 2;
  }
  if (iters < 1) return std::fprintf(stderr, "--iters: at least 1\n"), 2;
  if (!(timeout > absl::ZeroDuration())) return std::fprintf(stderr, "--call_timeout_s: must be positive\n"), 2;
  std::vector<int> levels;
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',', absl::SkipWhitespace())) {
    int n = 0;
    if (!absl::SimpleAtoi(entry, &n) || n < 1 || n > 1024) {
      std::fprintf(stderr, "--concurrency: '%s' is not a count of 1 to 1024\n", std::string(entry).c_str());
      return 2;
    }
    levels.push_back(n);
  }
  if (levels.empty()) return std::fprintf(stderr, "--concurrency: no level given\n"), 2;
  const std::string payload(static_cast<size_t>(std::max<int64_t>(1, MessageBytes(in_bytes, chunk))), '\xa5');
  std::ofstream json_out;
  if (!absl::GetFlag(FLAGS_json).empty()) json_out.open(absl::GetFlag(FLAGS_json), std::ios::app);
  const std::string label = absl::GetFlag(FLAGS_label);
  std::printf("# transport bench: %s, %lld bytes in, %lld out, %s, %d calls after %d\n", target.c_str(),
              static_cast<long long>(in_bytes), static_cast<long long>(out_bytes),
              chunk > 0 ? absl::StrCat(chunk, "-byte messages").c_str() : "one message each way", iters, warmup);
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;  // one channel per caller, kept across levels
  for (int n : levels) {
    while (static_cast<int>(stubs.size()) < n) {
      stubs.push_back(std::make_unique<grpc::GenericStub>(
          grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), TensorChannelArguments())));
    }
    struct PerCaller {
      std::vector<double> rtt_s;
      int64_t checked = 0, wrong = 0;
      grpc::Status failure;
    };
    std::vector<PerCaller> per(n);
    absl::BlockingCounter warm(n);
    absl::Notification go;
    absl::Mutex mu;
    absl::Time last_answer = absl::InfinitePast();
    std::vector<std::thread> threads;
    for (int c = 0; c < n; ++c) {
      threads.emplace_back([&, c] {
        PerCaller& me = per[c];
        auto one = [&]() -> std::pair<grpc::Status, int64_t> {
          ExchangeCall call(stubs[c].get(), payload, in_bytes, out_bytes, chunk, timeout);
          return call.Wait();
        };
        for (int i = 0; i < warmup && me.failure.ok(); ++i) me.failure = one().first;
        warm.DecrementCount();
        go.WaitForNotification();
        for (int i = 0; i < iters && me.failure.ok(); ++i) {
          const absl::Time start = absl::Now();
          auto [status, received] = one();
          const double rtt = absl::ToDoubleSeconds(absl::Now() - start);
          if (!status.ok()) {
            me.failure = status;
            break;
          }
          me.rtt_s.push_back(rtt);
          ++me.checked;
          if (received != out_bytes) ++me.wrong;
        }
        absl::MutexLock lock(&mu);
        last_answer = std::max(last_answer, absl::Now());
      });
    }
    warm.Wait();
    const absl::Time released = absl::Now();
    go.Notify();
    for (std::thread& t : threads) t.join();
    const double wall_s = absl::ToDoubleSeconds(last_answer - released);
    std::vector<double> rtt_s;
    int64_t checked = 0, wrong = 0;
    for (PerCaller& p : per) {
      if (!p.failure.ok()) {
        std::fprintf(stderr, "%s: call: %s\n", target.c_str(), p.failure.error_message().c_str());
        return 1;
      }
      rtt_s.insert(rtt_s.end(), p.rtt_s.begin(), p.rtt_s.end());
      checked += p.checked;
      wrong += p.wrong;
    }
    const int64_t completed = static_cast<int64_t>(rtt_s.size());
    const Stats rt = Percentiles(rtt_s);
    const double per_s = wall_s > 0 ? static_cast<double>(completed) / wall_s : 0;
    const int64_t total_bytes = completed * (in_bytes + out_bytes);
    const double gbps = wall_s > 0 ? static_cast<double>(total_bytes) / wall_s / 1e9 : 0;
    std::printf("  %-18s concurrency %d: rtt p50 %.1f p90 %.1f p99 %.1f us, %lld calls in %.3f s, %.1f calls/s, "
                "%.3f GB/s, %lld/%lld wrong\n",
                label.c_str(), n, rt.p50 * 1e6, rt.p90 * 1e6, rt.p99 * 1e6, static_cast<long long>(completed),
                wall_s, per_s, gbps, static_cast<long long>(wrong), static_cast<long long>(checked));
    std::fflush(stdout);
    if (json_out) {
      nlohmann::json j = {{"kind", "transport"}, {"preset", label}, {"in_bytes", in_bytes},
                          {"out_bytes", out_bytes}, {"chunk_bytes", chunk}, {"concurrency", n},
                          {"iters", iters}, {"completed", completed}, {"checked", checked}, {"wrong", wrong},
                          {"wall_s", wall_s}, {"calls_per_s", per_s}, {"payload_bytes", total_bytes},
                          {"gbps", gbps}, {"rtt_p50_us", rt.p50 * 1e6}, {"rtt_p90_us", rt.p90 * 1e6},
                          {"rtt_p99_us", rt.p99 * 1e6}, {"rtt_mean_us", rt.mean * 1e6}};
      json_out << j.dump() << "\n";
    }
    if (wrong > 0) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "server") return shardgemm::Serve();
  if (mode == "client") return shardgemm::RunClient();
  std::fprintf(stderr, "--mode: server or client, not '%s'\n", mode.c_str());
  return 2;
}
