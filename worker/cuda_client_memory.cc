#include "worker/cuda_client_memory.h"

#include <algorithm>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/cuda_device_buffer.h"

namespace shardgemm {
namespace {

// Handles opened and mappings pinned at once; the oldest unused go first.
constexpr size_t kCachedHandles = 8;
constexpr size_t kCachedMappings = 16;

absl::Status IpcError(cudaError_t e, absl::string_view field, absl::string_view what) {
  (void)cudaGetLastError();  // not sticky: the next call must not see it
  return absl::FailedPreconditionError(absl::StrCat(field, ".cuda: ", what, " (", cudaGetErrorName(e), ": ",
                                                    cudaGetErrorString(e),
                                                    "); the allocation must be live in a process on this worker's "
                                                    "host, exported with cudaIpcGetMemHandle"));
}

// The driver's cuMemGetAddressRange (through the runtime, so the worker
// links no libcuda): the allocation a device pointer lies in.
using MemGetAddressRange = int (*)(unsigned long long* base, size_t* bytes, unsigned long long pointer);
MemGetAddressRange AddressRange() {
  static MemGetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<MemGetAddressRange>(nullptr);
    }
    return reinterpret_cast<MemGetAddressRange>(p);
  }();
  return fn;
}

int64_t BlockBytes(const platform::TensorBlock& block) {
  int64_t bytes = block.element_bytes;
  for (int64_t d : block.block_shape) bytes *= d;
  return bytes;
}

}  // namespace

struct CudaClientMemory::Imported {
  std::string handle;
  void* base = nullptr;
  uint64_t bytes = 0;  // the allocation's
  int device = 0;
  ~Imported() {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(base);
  }
};

struct CudaClientMemory::Pinned {
  std::shared_ptr<const platform::SharedMemoryMapping> mapping;
  bool writable = false;
  bool registered = false;
  ~Pinned() {
    if (registered) cudaHostUnregister(mapping->data());
  }
};

namespace {

// Client device memory used in place: keeps its handle open while a step uses it.
class ImportedView : public DeviceBuffer {
 public:
  ImportedView(std::shared_ptr<const void> keep, void* data, int64_t bytes)
      : keep_(std::move(keep)), data_(data), bytes_(bytes) {}
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  std::shared_ptr<const void> keep_;
  void* data_;
  int64_t bytes_;
};

}  // namespace

CudaClientMemory::CudaClientMemory(int device, cudaStream_t stream, std::atomic<int64_t>* uploaded,
                                   std::atomic<int64_t>* downloaded)
    : device_(device), stream_(stream), uploaded_(uploaded), downloaded_(downloaded) {}

CudaClientMemory::~CudaClientMemory() = default;

absl::StatusOr<std::shared_ptr<CudaClientMemory::Imported>> CudaClientMemory::Import(const ClientMemory& memory,
                                                                                  absl::string_view field) {
  if (memory.cuda_ipc_handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".cuda.ipc_handle: ", memory.cuda_ipc_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ", kIpcHandleBytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = imported_.begin(); it != imported_.end(); ++it) {
    if ((*it)->handle == memory.cuda_ipc_handle) {
      auto found = *it;
      imported_.erase(it);
      imported_.push_back(found);
      if (found->bytes < memory.region_bytes) {
        return absl::FailedPreconditionError(absl::StrCat(field, ".cuda: the allocation has ", found->bytes,
                                                          " bytes, fewer than the ", memory.region_bytes,
                                                          " registered"));
      }
      return found;
    }
  }
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    std::shared_ptr<Imported> live = it->lock();
    if (live == nullptr) {
      it = retiring_.erase(it);
      continue;
    }
    if (live->handle != memory.cuda_ipc_handle) {
      ++it;
      continue;
    }
    retiring_.erase(it);  // still open for a step: cached again
    imported_.push_back(live);
    Evict();
    if (live->bytes < memory.region_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(field, ".cuda: the allocation has ", live->bytes,
                                                        " bytes, fewer than the ", memory.region_bytes,
                                                        " registered"));
    }
    return live;
  }
  cudaSetDevice(device_);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, memory.cuda_ipc_handle.data(), kIpcHandleBytes);
  auto imported = std::make_shared<Imported>();
  imported->handle = memory.cuda_ipc_handle;
  imported->device = device_;
  if (cudaError_t e = cudaIpcOpenMemHandle(&imported->base, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    imported->base = nullptr;
    return IpcError(e, field, "the CUDA IPC handle does not open here");
  }
  uint64_t bytes = memory.region_bytes;  // trusted only where the driver cannot say
  if (MemGetAddressRange range = AddressRange(); range != nullptr) {
    unsigned long long base = 0;
    size_t size = 0;
    if (range(&base, &size, reinterpret_cast<unsigned long long>(imported->base)) == 0) {
      bytes = size - (reinterpret_cast<unsigned long long>(imported->base) - base);
    }
  }
  imported->bytes = bytes;
  if (bytes < memory.region_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".cuda: the allocation has ", bytes,
                                                      " bytes, fewer than the ", memory.region_bytes, " registered"));
  }
  imported_.push_back(imported);
  Evict();
  return imported;
}

void CudaClientMemory::Retire(std::shared_ptr<Imported> imported) {
  // Closed here unless a step holds it; then when that step lets it go.
  if (imported.use_count() > 1) retiring_.push_back(imported);
}

void CudaClientMemory::Evict() {
  while (imported_.size() > kCachedHandles) {
    Retire(std::move(imported_.front()));
    imported_.pop_front();
  }
}

int CudaClientMemory::Forget(const std::vector<std::shared_ptr<const platform::SharedMemoryMapping>>& mappings,
                             const std::vector<std::string>& cuda_ipc_handles) {
  std::vector<std::shared_ptr<Imported>> closing;  // closed after the lock is let go
  std::vector<std::shared_ptr<Pinned>> unpinning;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& handle : cuda_ipc_handles) {
      for (auto it = imported_.begin(); it != imported_.end();) {
        if ((*it)->handle != handle) {
          ++it;
          continue;
        }
        Retire(*it);
        closing.push_back(std::move(*it));
        it = imported_.erase(it);
      }
    }
    for (const auto& mapping : mappings) {
      for (auto it = pinned_.begin(); it != pinned_.end();) {
        if ((*it)->mapping != mapping) {
          ++it;
          continue;
        }
        unpinning.push_back(std::move(*it));
        it = pinned_.erase(it);
      }
    }
  }
  return static_cast<int>(closing.size());
}

bool CudaClientMemory::Pin(const std::shared_ptr<const platform::SharedMemoryMapping>& mapping, bool writable) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pinned_.begin(); it != pinned_.end(); ++it) {
    if ((*it)->mapping == mapping && (*it)->writable == writable) {
      auto found = *it;
      pinned_.erase(it);
      pinned_.push_back(found);
      return found->registered;
    }
  }
  auto pinned = std::make_shared<Pinned>();
  pinned->mapping = mapping;
  pinned->writable = writable;
  cudaSetDevice(device_);
  // A read-only mapping registers read-only; where the system refuses
  // either, the copies stay pageable (slower, still right).
  const unsigned flags = cudaHostRegisterPortable | (writable ? 0u : cudaHostRegisterReadOnly);
  cudaError_t e = cudaHostRegister(mapping->data(), mapping->size(), flags);
  pinned->registered = e == cudaSuccess;
  if (!pinned->registered) {
    (void)cudaGetLastError();
    if (!said_unpinned_) {
      said_unpinned_ = true;
      std::cerr << "shardgemm-worker: a shared-memory mapping could not be pinned (" << cudaGetErrorName(e)
                << "); its copies run at pageable speed\n";
    }
  }
  pinned_.push_back(pinned);
  while (pinned_.size() > kCachedMappings) pinned_.pop_front();
  return pinned->registered;
}

absl::Status CudaClientMemory::CopyPieces(const platform::TensorBlock& block, char* region, char* local,
                                          bool into_region, cudaMemcpyKind kind, absl::string_view field) {
  for (const platform::BlockPiece& p : platform::BlockPieces(block)) {
    char* r = region + p.region_offset;
    char* l = local + p.block_offset;
    cudaError_t e;
    if (p.rows == 1 || p.region_pitch == p.row_bytes) {
      e = cudaMemcpyAsync(into_region ? r : l, into_region ? l : r, p.row_bytes * p.rows, kind, stream_);
    } else if (into_region) {
      e = cudaMemcpy2DAsync(r, p.region_pitch, l, p.row_bytes, p.row_bytes, p.rows, kind, stream_);
    } else {
      e = cudaMemcpy2DAsync(l, p.row_bytes, r, p.region_pitch, p.row_bytes, p.rows, kind, stream_);
    }
    if (e != cudaSuccess) return CudaStatus(e, absl::StrCat(field, ": copying a block"));
  }
  return CudaStatus(cudaStreamSynchronize(stream_), absl::StrCat(field, ": copying a block"));
}

absl::StatusOr<std::shared_ptr<const DeviceBuffer>> CudaClientMemory::ToDevice(const ClientMemory& memory,
                                                                              const platform::TensorBlock& block,
                                                                              absl::string_view field) {
  if (auto s = platform::CheckTensorBlock(block, memory.region_bytes, field); !s.ok()) return s;
  const int64_t bytes = BlockBytes(block);
  cudaSetDevice(device_);
  if (memory.mapping == nullptr) {
    auto imported = Import(memory, field);
    if (!imported.ok()) return imported.status();
    char* base = static_cast<char*>((*imported)->base);
    if (platform::BlockIsContiguous(block)) {  // in place: no copy
      auto pieces = platform::BlockPieces(block);
      const uint64_t at = pieces.empty() ? block.offset : pieces[0].region_offset;
      return std::shared_ptr<const DeviceBuffer>(std::make_shared<ImportedView>(*imported, base + at, bytes));
    }
    auto buffer = StreamDeviceBuffer::Allocate(device_, bytes, stream_);
    if (!buffer.ok()) return buffer.status();
    if (auto s = CopyPieces(block, base, static_cast<char*>((*buffer)->data()), false, cudaMemcpyDeviceToDevice,
                            field);
        !s.ok()) {
      return s;
    }
    return std::shared_ptr<const DeviceBuffer>(*buffer);
  }
  (void)Pin(memory.mapping, /*writable=*/false);
  auto buffer = StreamDeviceBuffer::Allocate(device_, bytes, stream_);
  if (!buffer.ok()) return buffer.status();
  if (auto s = CopyPieces(block, memory.mapping->data(), static_cast<char*>((*buffer)->data()), false,
                          cudaMemcpyHostToDevice, field);
      !s.ok()) {
    return s;
  }
  *uploaded_ += bytes;
  return std::shared_ptr<const DeviceBuffer>(*buffer);
}

absl::Status CudaClientMemory::FromDevice(const void* source, const ClientMemory& memory,
                                          const platform::TensorBlock& block, absl::string_view field) {
  if (auto s = platform::CheckTensorBlock(block, memory.region_bytes, field); !s.ok()) return s;
  cudaSetDevice(device_);
  char* from = const_cast<char*>(static_cast<const char*>(source));
  if (memory.mapping == nullptr) {
    auto imported = Import(memory, field);
    if (!imported.ok()) return imported.status();
    return CopyPieces(block, static_cast<char*>((*imported)->base), from, true, cudaMemcpyDeviceToDevice, field);
  }
  (void)Pin(memory.mapping, /*writable=*/true);
  if (auto s = CopyPieces(block, memory.mapping->data(), from, true, cudaMemcpyDeviceToHost, field); !s.ok()) return s;
  *downloaded_ += BlockBytes(block);
  return absl::OkStatus();
}

absl::Status CudaClientMemory::FromHost(const char* source, const ClientMemory& memory,
                                        const platform::TensorBlock& block, absl::string_view field) {
  if (memory.mapping != nullptr) return platform::CopyBlockIn(*memory.mapping, block, source, field);
  if (auto s = platform::CheckTensorBlock(block, memory.region_bytes, field); !s.ok()) return s;
  cudaSetDevice(device_);
  auto imported = Import(memory, field);
  if (!imported.ok()) return imported.status();
  if (auto s = CopyPieces(block, static_cast<char*>((*imported)->base), const_cast<char*>(source), true,
                          cudaMemcpyHostToDevice, field);
      !s.ok()) {
    return s;
  }
  *uploaded_ += BlockBytes(block);
  return absl::OkStatus();
}

}  // namespace shardgemm
