// The coordinator's call socket (--call_socket): a client on the
// coordinator's host sends GroupedGemm and GroupedQuantize requests as frames (CallSocketRequest,
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
#include "absl/strings/string_view.h"
#include "proto/frame_socket_server.h"
#include "server/service.h"

namespace shardgemm {

// Connections served at once; one past it is answered with a refusal
// (call id 0, RESOURCE_EXHAUSTED) and closed, and its client takes gRPC.
inline constexpr int kMaxCallSocketConnections = 256;

// GroupedQuantize calls run at once on the socket (each holds a thread of
// the frame server's while it runs); one past them is answered
// RESOURCE_EXHAUSTED.
inline constexpr int kMaxCallSocketQuantizes = 256;

// The call_id of a CallSocketRequest from its payload's first bytes (an
// oversized call is answered under it unread). Protobuf writes field 1
// first, but a writer may order fields as it likes: fields before it are
// skipped while they lie within `head`. 0 (no call's id) when it is not
// found there.
uint64_t CallIdOfRequestHead(absl::string_view head);

// Listens on `path` (which must not exist; the caller claims it and sets
// its mode). A request larger than `max_request_bytes` is read, dropped and
// answered RESOURCE_EXHAUSTED, as gRPC answers one over its limit (its
// connection ends instead when its call id is not in its first bytes).
// `service` must outlive the server; the coordinator stops its reading
// (StopReading) and waits for the service's socket calls to finish
// (ShardGemmService::WaitForSocketCalls) before either goes.
absl::StatusOr<std::unique_ptr<FrameSocketServer>> StartCallSocket(const std::string& path,
                                                                   ShardGemmService* service,
                                                                   uint64_t max_request_bytes);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_CALL_SOCKET_H_
