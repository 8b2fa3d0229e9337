// A tiny caching device-memory pool: blocks are rounded up to a power of two
// (at least 256 bytes) and kept on a free list when returned, so after warm-up
// no request calls cudaMalloc. Reserve() pre-allocates. Blocks returned with
// Free() may be handed out again at once: callers free in stream order (the
// runner uses one stream order per pool). Not thread-safe.
#ifndef SHARDGEMM_KERNELS_CUDA_DEVICE_POOL_H_
#define SHARDGEMM_KERNELS_CUDA_DEVICE_POOL_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"

namespace shardgemm {
namespace cuda {

class DevicePool {
 public:
  DevicePool() = default;
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  absl::StatusOr<void*> Allocate(int64_t bytes);
  void Free(void* ptr);
  // Allocates and frees `count` blocks of `bytes` so later requests hit the cache.
  absl::Status Reserve(int64_t bytes, int count = 1);

  int64_t bytes_in_use() const { return in_use_; }
  int64_t bytes_cached() const { return cached_; }
  int64_t cuda_mallocs() const { return mallocs_; }

 private:
  static int64_t RoundUp(int64_t bytes);
  std::map<int64_t, std::vector<void*>> free_;  // by rounded size
  std::map<void*, int64_t> live_;               // ptr -> rounded size
  int64_t in_use_ = 0, cached_ = 0, mallocs_ = 0;
};

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_DEVICE_POOL_H_
