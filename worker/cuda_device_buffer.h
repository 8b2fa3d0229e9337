// Device memory a CUDA backend hands out beyond one call: kept outputs,
// blocks of clients' memory.
#ifndef SHARDGEMM_WORKER_CUDA_DEVICE_BUFFER_H_
#define SHARDGEMM_WORKER_CUDA_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/shard.h"

namespace shardgemm {

// Stream-ordered device memory (cudaMallocAsync): a kept output, a block of
// client memory copied in. Unlike the runner's pool it may be freed from
// any thread (a GetShard, a delete).
class StreamDeviceBuffer : public DeviceBuffer {
 public:
  static absl::StatusOr<std::shared_ptr<StreamDeviceBuffer>> Allocate(int device, int64_t bytes,
                                                                      cudaStream_t stream) {
    void* p = nullptr;
    if (auto s = CudaStatus(cudaMallocAsync(&p, std::max<int64_t>(bytes, 256), stream), "device output");
        !s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("no device memory for ", bytes, " bytes: ", s.message()));
    }
    return std::shared_ptr<StreamDeviceBuffer>(new StreamDeviceBuffer(device, p, bytes, stream));
  }
  ~StreamDeviceBuffer() override {
    cudaSetDevice(device_);
    cudaFreeAsync(ptr_, stream_);
  }
  void* data() const override { return ptr_; }
  int64_t bytes() const override { return bytes_; }

 private:
  StreamDeviceBuffer(int device, void* ptr, int64_t bytes, cudaStream_t stream)
      : device_(device), ptr_(ptr), bytes_(bytes), stream_(stream) {}
  int device_;
  void* ptr_;
  int64_t bytes_;
  cudaStream_t stream_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_CUDA_DEVICE_BUFFER_H_
