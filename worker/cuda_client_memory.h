// Same-host clients' memory on a CUDA worker: blocks of operands copied in
// from a POSIX shared-memory mapping (pinned once per mapping) or read in
// place from a CUDA allocation another process exported
// (cudaIpcOpenMemHandle, each handle opened once and kept), and output
// blocks written back the same ways. All copies run on the backend's stream.
#ifndef SHARDGEMM_WORKER_CUDA_CLIENT_MEMORY_H_
#define SHARDGEMM_WORKER_CUDA_CLIENT_MEMORY_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "platform/shared_memory.h"
#include "worker/backend.h"
#include "worker/shard.h"

namespace shardgemm {

class CudaClientMemory {
 public:
  // `uploaded` / `downloaded` count the bytes that cross PCIe (the backend's counters).
  CudaClientMemory(int device, cudaStream_t stream, std::atomic<int64_t>* uploaded,
                   std::atomic<int64_t>* downloaded);
  ~CudaClientMemory();
  CudaClientMemory(const CudaClientMemory&) = delete;
  CudaClientMemory& operator=(const CudaClientMemory&) = delete;

  // Backend::BlockToDevice / BlockFromDevice / BlockFromHost.
  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> ToDevice(const ClientMemory& memory,
                                                               const platform::TensorBlock& block,
                                                               absl::string_view field);
  absl::Status FromDevice(const void* source, const ClientMemory& memory, const platform::TensorBlock& block,
                          absl::string_view field);
  absl::Status FromHost(const char* source, const ClientMemory& memory, const platform::TensorBlock& block,
                        absl::string_view field);

  // Backend::ForgetClientMemory: closes the handles (those a step still
  // uses when it ends) and unpins the mappings; how many were held.
  int Forget(const std::vector<std::shared_ptr<const platform::SharedMemoryMapping>>& mappings,
             const std::vector<std::string>& cuda_ipc_handles);

  // A cudaIpcMemHandle_t's size: what a registered handle must have.
  static constexpr size_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);

 private:
  struct Imported;  // an opened IPC handle
  struct Pinned;    // a host mapping registered with the driver (or not, where it refused)
  absl::StatusOr<std::shared_ptr<Imported>> Import(const ClientMemory& memory, absl::string_view field);
  // Whether the copies from / to `mapping` may run at pinned speed (it was
  // registered); keeps the mapping while it is in the cache.
  bool Pin(const std::shared_ptr<const platform::SharedMemoryMapping>& mapping, bool writable);
  // Out of the cache: kept in retiring_ while a step holds it.
  void Retire(std::shared_ptr<Imported> imported);
  void Evict();  // the oldest handles past the cache's size
  // The pieces of `block` between `region` and packed `local` memory.
  absl::Status CopyPieces(const platform::TensorBlock& block, char* region, char* local, bool into_region,
                          cudaMemcpyKind kind, absl::string_view field);

  const int device_;
  const cudaStream_t stream_;
  std::atomic<int64_t>* uploaded_;
  std::atomic<int64_t>* downloaded_;
  std::mutex mu_;
  std::deque<std::shared_ptr<Imported>> imported_;  // most recent last
  // Forgotten while a step still used them: open until it ends. Found again
  // by a new registration of the same allocation (a handle is opened once
  // per process), so it is not opened twice.
  std::vector<std::weak_ptr<Imported>> retiring_;
  std::deque<std::shared_ptr<Pinned>> pinned_;      // most recent last
  bool said_unpinned_ = false;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_CUDA_CLIENT_MEMORY_H_
