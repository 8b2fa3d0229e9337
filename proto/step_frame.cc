#include "proto/step_frame.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {

void PutU32(uint32_t v, char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void PutU64(uint64_t v, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}
uint64_t GetU64(const char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}

// Reads exactly `n` bytes. `*got` says how many came before an error or EOF.
absl::Status ReadFully(int fd, char* out, size_t n, size_t* got) {
  *got = 0;
  while (*got < n) {
    const ssize_t r = ::recv(fd, out + *got, n - *got, 0);
    if (r > 0) {
      *got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("the socket was closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {  // a receive timeout (SO_RCVTIMEO) passed with no byte
      return absl::UnavailableError("the peer sent nothing more of its frame within the socket's receive timeout");
    }
    return absl::UnavailableError(absl::StrCat("the socket failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

std::string StepFrameHeader(uint64_t payload_bytes) {
  std::string header(kStepFrameHeaderBytes, '\0');
  PutU32(kStepFrameMagic, header.data());
  PutU32(kStepFrameVersion, header.data() + 4);
  PutU64(payload_bytes, header.data() + 8);
  return header;
}

absl::StatusOr<uint64_t> ParseStepFrameHeader(absl::string_view header, uint64_t max_payload_bytes) {
  if (header.size() != kStepFrameHeaderBytes) {
    return absl::DataLossError(absl::StrCat("a frame's header is ", kStepFrameHeaderBytes, " bytes, not ",
                                            header.size()));
  }
  if (GetU32(header.data()) != kStepFrameMagic) {
    return absl::DataLossError("not a frame of ours (its first four bytes are not \"SGS1\")");
  }
  if (const uint32_t version = GetU32(header.data() + 4); version != kStepFrameVersion) {
    return absl::DataLossError(
        absl::StrCat("a frame of version ", version, "; this build speaks version ", kStepFrameVersion));
  }
  const uint64_t bytes = GetU64(header.data() + 8);
  if (bytes > max_payload_bytes) {
    return absl::DataLossError(
        absl::StrCat("a frame of ", bytes, " bytes, more than the ", max_payload_bytes, " allowed"));
  }
  return bytes;
}

absl::Status WriteStepFrame(int fd, const google::protobuf::MessageLite& message) {
  const size_t payload = message.ByteSizeLong();
  if (payload > kMaxStepFramePayloadBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a frame of ", payload, " bytes, more than the ", kMaxStepFramePayloadBytes, " allowed"));
  }
  std::string frame = StepFrameHeader(payload);
  frame.resize(kStepFrameHeaderBytes + payload);
  if (!message.SerializeToArray(frame.data() + kStepFrameHeaderBytes, static_cast<int>(payload))) {
    return absl::InternalError("a frame's message did not serialize");
  }
  size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t w = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (w > 0) {
      sent += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return absl::UnavailableError("the socket's peer read nothing for its send timeout");
    }
    return absl::UnavailableError(absl::StrCat("the socket failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ReadStepFrameHeader(int fd) {
  char header[kStepFrameHeaderBytes];
  size_t got = 0;
  if (absl::Status s = ReadFully(fd, header, sizeof(header), &got); !s.ok()) {
    if (got == 0) return s;
    return absl::DataLossError(absl::StrCat("a frame's header was cut short: ", s.message()));
  }
  return ParseStepFrameHeader(absl::string_view(header, sizeof(header)));
}

absl::Status ReadStepFrameBody(int fd, uint64_t payload_bytes, std::string* payload) {
  payload->assign(payload_bytes, '\0');
  size_t got = 0;
  if (absl::Status s = ReadFully(fd, payload->data(), payload->size(), &got); !s.ok()) {
    return absl::DataLossError(absl::StrCat("a frame was cut short after ", got, " of its ", payload_bytes,
                                            " bytes: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status SkipStepFrameBody(int fd, uint64_t payload_bytes, size_t keep, std::string* head) {
  const size_t kept = static_cast<size_t>(std::min<uint64_t>(keep, payload_bytes));
  if (absl::Status s = ReadStepFrameBody(fd, kept, head); !s.ok()) return s;
  std::string scratch(size_t{1} << 20, '\0');
  uint64_t left = payload_bytes - kept;
  while (left > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
    size_t got = 0;
    if (absl::Status s = ReadFully(fd, scratch.data(), n, &got); !s.ok()) {
      return absl::DataLossError(absl::StrCat("a frame was cut short after ", payload_bytes - left + got,
                                              " of its ", payload_bytes, " bytes: ", s.message()));
    }
    left -= n;
  }
  return absl::OkStatus();
}

absl::Status ReadStepFramePayload(int fd, std::string* payload, uint64_t max_payload_bytes) {
  auto bytes = ReadStepFrameHeader(fd);
  if (!bytes.ok()) return bytes.status();
  if (*bytes > max_payload_bytes) {
    return absl::DataLossError(
        absl::StrCat("a frame of ", *bytes, " bytes, more than the ", max_payload_bytes, " allowed"));
  }
  return ReadStepFrameBody(fd, *bytes, payload);
}

absl::Status ReadStepFrame(int fd, google::protobuf::MessageLite* message, uint64_t max_payload_bytes) {
  std::string payload;
  if (absl::Status s = ReadStepFramePayload(fd, &payload, max_payload_bytes); !s.ok()) return s;
  if (!message->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError("a frame's payload does not parse");
  }
  return absl::OkStatus();
}

}  // namespace shardgemm
