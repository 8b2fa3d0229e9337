// The coordinator's call socket (--call_socket): a client on the
// coordinator's host sends GroupedGemm requests as frames (CallSocketRequest,
// proto/step_frame.h) on a Unix stream socket instead of gRPC calls, and
// reads CallSocketReply frames of the same call_id back, in any order. The
// call is served as a gRPC call is (token, tenant slots, metrics, logs);
// only the transport differs: one socket round trip instead of gRPC's
// thread hand-offs on both sides of the hop.
#ifndef SHARDGEMM_SERVER_CALL_SOCKET_H_
#define SHARDGEMM_SERVER_CALL_SOCKET_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "proto/frame_socket_server.h"
#include "server/service.h"

namespace shardgemm {

// Listens on `path` (which must not exist; the caller claims it and sets
// its mode). Frames larger than `max_request_bytes` end their connection:
// a client sends larger requests on gRPC. `service` must outlive the server.
absl::StatusOr<std::unique_ptr<FrameSocketServer>> StartCallSocket(const std::string& path,
                                                                   ShardGemmService* service,
                                                                   uint64_t max_request_bytes);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_CALL_SOCKET_H_
