// An NCCL result as an absl::Status (the collectives and their benches).
#ifndef SHARDGEMM_WORKER_NCCL_STATUS_H_
#define SHARDGEMM_WORKER_NCCL_STATUS_H_

#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardgemm {

// InternalError naming `what`, NCCL's error string and its last message.
inline absl::Status NcclStatus(ncclResult_t r, absl::string_view what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": NCCL ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")"));
}

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_NCCL_STATUS_H_
