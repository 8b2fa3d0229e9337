// A worker channel whose steps go on the worker's step socket (a Unix stream
// socket of framed StepSocketRequest / StepSocketReply, proto/step_frame.h)
// and everything else on the gRPC channel it wraps. Used for a worker on the
// coordinator's host: one step costs a socket's round trip instead of a gRPC
// call's. A step is sent on gRPC instead when the socket cannot take it now
// (not connected, or the step is larger than the worker reads there); a
// connection that fails fails its calls in flight (UNAVAILABLE, naming the
// worker) and is tried again at most once a second.
#ifndef SHARDGEMM_SERVER_STEP_SOCKET_CHANNEL_H_
#define SHARDGEMM_SERVER_STEP_SOCKET_CHANNEL_H_

#include <memory>
#include <string>

#include "proto/step_frame.h"
#include "server/worker_channel.h"

namespace shardgemm {

// `name`: the worker, for errors ("worker at NAME: ..."). `max_step_bytes`:
// larger steps go on `grpc` (what a worker reads there: proto/step_frame.h).
std::unique_ptr<WorkerChannel> MakeStepSocketChannel(std::unique_ptr<WorkerChannel> grpc,
                                                     const std::string& socket_path, const std::string& name,
                                                     uint64_t max_step_bytes = kMaxStepSocketStepBytes);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_STEP_SOCKET_CHANNEL_H_
