#include "kernels/cuda/device_pool.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace cuda {

DevicePool::~DevicePool() {
  for (auto& [size, list] : free_)
    for (void* p : list) cudaFree(p);
  for (auto& [p, size] : live_) cudaFree(p);
}

int64_t DevicePool::RoundUp(int64_t bytes) {
  int64_t r = 256;
  while (r < bytes) r <<= 1;
  return r;
}

absl::StatusOr<void*> DevicePool::Allocate(int64_t bytes) {
  if (bytes < 0) return absl::InvalidArgumentError("negative allocation");
  const int64_t size = RoundUp(bytes);
  auto it = free_.find(size);
  void* p = nullptr;
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    cached_ -= size;
  } else {
    cudaError_t e = cudaMalloc(&p, size);
    if (e != cudaSuccess && cached_ > 0) {
      // Out of memory with blocks of other sizes parked on the free lists:
      // give those back (cudaFree waits for the device, so no queued work
      // still uses them) and try once more.
      cudaGetLastError();
      for (auto& [sz, list] : free_)
        for (void* q : list) cudaFree(q);
      free_.clear();
      cached_ = 0;
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMalloc(", size, "): ", cudaGetErrorString(e)));
    }
    ++mallocs_;
  }
  live_[p] = size;
  in_use_ += size;
  return p;
}

void DevicePool::Free(void* ptr) {
  if (ptr == nullptr) return;
  auto it = live_.find(ptr);
  if (it == live_.end()) return;
  free_[it->second].push_back(ptr);
  cached_ += it->second;
  in_use_ -= it->second;
  live_.erase(it);
}

absl::Status DevicePool::Reserve(int64_t bytes, int count) {
  std::vector<void*> got;
  for (int i = 0; i < count; ++i) {
    auto p = Allocate(bytes);
    if (!p.ok()) {
      for (void* q : got) Free(q);
      return p.status();
    }
    got.push_back(*p);
  }
  for (void* q : got) Free(q);
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace shardgemm
