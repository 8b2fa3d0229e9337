// A resident tensor's shard on a worker: its bytes in host memory, in the
// backend's device memory, or both. Immutable once stored.
#ifndef SHARDGEMM_WORKER_SHARD_H_
#define SHARDGEMM_WORKER_SHARD_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/host_tensor.h"

namespace shardgemm {

// Memory a backend holds on its device; freed when the last reference goes.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
};

struct Shard {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::shared_ptr<const HostTensor> host;      // null: on the device only
  std::shared_ptr<const DeviceBuffer> device;  // null: on the host only

  int64_t NumBytes() const {
    int64_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t HostBytes() const { return host != nullptr ? host->NumBytes() : 0; }
  int64_t DeviceBytes() const { return device != nullptr ? device->bytes() : 0; }

  static Shard OnHost(HostTensor t) {
    Shard s;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.host = std::make_shared<const HostTensor>(std::move(t));
    return s;
  }
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_SHARD_H_
