// Frames of the worker's step socket: a coordinator on the same host sends
// steps to its workers over a Unix stream socket instead of one gRPC call per
// step (gRPC's unary round trip costs 100-200 µs a hop on the hosts measured,
// a socket's about 15). One frame: a 16-byte header (the magic "SGS1" and a
// version, little-endian u32 each, then the payload's length, u64) and the
// payload, one serialized StepSocketRequest or StepSocketReply.
#ifndef SHARDGEMM_PROTO_STEP_FRAME_H_
#define SHARDGEMM_PROTO_STEP_FRAME_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"

namespace shardgemm {

inline constexpr uint32_t kStepFrameMagic = 0x31534753;  // "SGS1" read as little-endian bytes
inline constexpr uint32_t kStepFrameVersion = 1;
inline constexpr size_t kStepFrameHeaderBytes = 16;
// Protobuf's own bound on a message.
inline constexpr uint64_t kMaxStepFramePayloadBytes = (uint64_t{1} << 31) - 1;
// The largest step (its encoded Step) a coordinator sends on a step socket;
// a larger one goes on gRPC. A worker reads requests of up to
// kMaxStepSocketRequestBytes: the step and StepSocketRequest's own fields.
inline constexpr uint64_t kMaxStepSocketStepBytes = uint64_t{16} << 20;
inline constexpr uint64_t kMaxStepSocketRequestBytes = kMaxStepSocketStepBytes + 4096;

// The header of a frame whose payload is `payload_bytes` long.
std::string StepFrameHeader(uint64_t payload_bytes);
// The payload's length from a header: DATA_LOSS naming what is wrong (not
// the magic, another version, longer than `max_payload_bytes`).
absl::StatusOr<uint64_t> ParseStepFrameHeader(absl::string_view header,
                                              uint64_t max_payload_bytes = kMaxStepFramePayloadBytes);

// Writes `message` as one frame (blocking; the socket's SO_SNDTIMEO bounds
// it). UNAVAILABLE when the socket fails or times out: the peer then got at
// most part of the frame, which it cannot parse.
absl::Status WriteStepFrame(int fd, const google::protobuf::MessageLite& message);

// Reads one frame's header (blocking): its payload's length, up to
// kMaxStepFramePayloadBytes. UNAVAILABLE when the peer closed the socket at
// a frame boundary or it failed; DATA_LOSS for a bad or cut header.
absl::StatusOr<uint64_t> ReadStepFrameHeader(int fd);
// Reads the `payload_bytes` after a header into `payload` (DATA_LOSS when
// cut short).
absl::Status ReadStepFrameBody(int fd, uint64_t payload_bytes, std::string* payload);
// Reads and drops the `payload_bytes` after a header, keeping the first
// `keep` of them in `head`: a frame too large to take is answered, not
// allowed to end its connection.
absl::Status SkipStepFrameBody(int fd, uint64_t payload_bytes, size_t keep, std::string* head);

// Reads one frame's payload into `payload` (blocking), with the same
// statuses as ReadStepFrame but for the parse.
absl::Status ReadStepFramePayload(int fd, std::string* payload,
                                  uint64_t max_payload_bytes = kMaxStepFramePayloadBytes);

// Reads one frame into `message` (blocking). UNAVAILABLE when the peer
// closed the socket at a frame boundary or it failed; DATA_LOSS for a bad
// header, a frame cut short or a payload `message` does not parse.
absl::Status ReadStepFrame(int fd, google::protobuf::MessageLite* message,
                           uint64_t max_payload_bytes = kMaxStepFramePayloadBytes);

}  // namespace shardgemm

#endif  // SHARDGEMM_PROTO_STEP_FRAME_H_
