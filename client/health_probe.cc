// shardgemm-health-probe: calls grpc.health.v1.Health/Check on a server and
// exits 0 only when it answers SERVING (the images' HEALTHCHECK, and a
// Kubernetes exec probe). Exit codes as grpc_health_probe's: 1 bad flags,
// 2 no connection within the deadline, 3 the call failed, 4 not SERVING.
//
// Debian's gRPC ships no generated health stubs, so the call goes through
// grpc::GenericStub with the two messages encoded here: HealthCheckRequest
// is {string service = 1}, HealthCheckResponse {ServingStatus status = 1}.
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, addr, "", "the server, HOST:PORT");
ABSL_FLAG(std::string, service, "", "the service to ask about (empty: the server as a whole)");
ABSL_FLAG(double, timeout_s, 2, "deadline of the connection and the call, in seconds");

namespace {

using google::protobuf::internal::WireFormatLite;

constexpr char kMethod[] = "/grpc.health.v1.Health/Check";

const char* StatusName(int64_t status) {
  switch (status) {
    case 0: return "UNKNOWN";
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    default: return "UNRECOGNIZED";
  }
}

grpc::ByteBuffer EncodeRequest(const std::string& service) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    if (!service.empty()) WireFormatLite::WriteString(1, service, &out);
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// The status field of a HealthCheckResponse (0, UNKNOWN, when absent); false
// when the bytes are not one.
bool DecodeStatus(const grpc::ByteBuffer& buffer, int64_t* status) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  *status = 0;
  while (uint32_t tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == 1 &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t value = 0;
      if (!in.ReadVarint64(&value)) return false;
      *status = static_cast<int64_t>(value);
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  return in.ConsumedEntireMessage();
}

int Run() {
  const std::string addr = absl::GetFlag(FLAGS_addr);
  const double timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (addr.empty() || !(timeout_s > 0)) {
    std::cerr << "shardgemm-health-probe: --addr=HOST:PORT and a positive --timeout_s are needed\n";
    return 1;
  }
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(deadline)) {
    std::cerr << "shardgemm-health-probe: no connection to " << addr << " within " << timeout_s
              << " s\n";
    return 2;
  }

  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(deadline);
  grpc::CompletionQueue cq;
  const grpc::ByteBuffer request = EncodeRequest(absl::GetFlag(FLAGS_service));
  auto call = stub.PrepareUnaryCall(&context, kMethod, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    std::cerr << "shardgemm-health-probe: the call to " << addr << " did not complete\n";
    return 3;
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    std::cerr << "shardgemm-health-probe: " << kMethod << " on " << addr << " failed: code "
              << status.error_code() << ": " << status.error_message() << "\n";
    return 3;
  }
  int64_t serving = 0;
  if (!DecodeStatus(response, &serving)) {
    std::cerr << "shardgemm-health-probe: " << addr << " sent a malformed HealthCheckResponse\n";
    return 3;
  }
  std::cout << "status: " << StatusName(serving) << "\n";
  return serving == 1 ? 0 : 4;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "shardgemm-health-probe --addr=HOST:PORT [--service=NAME] [--timeout_s=2]; exits 0 only "
      "when the server's grpc.health.v1.Health/Check answers SERVING");
  absl::ParseCommandLine(argc, argv);
  return Run();
}
