#include "worker/cuda_staging_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/cuda_status.h"
#include "platform/huge_pages.h"

namespace shardgemm {
namespace {

// Polls `done` until it holds or `deadline` passes: a few yields, then short
// sleeps (a chunk's copy takes tens of microseconds; no wait is unbounded).
template <typename F>
absl::StatusOr<bool> PollUntil(F&& done, absl::Time deadline) {
  for (int i = 0;; ++i) {
    absl::StatusOr<bool> d = done();
    if (!d.ok() || *d) return d;
    if (absl::Now() >= deadline) return false;
    if (i < 64) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(20));
    }
  }
}

// What the memory and everything it hands out share (device blocks, output
// blocks, writers), so that they may outlive the memory itself.
class Shared {
 public:
  Shared(const CudaStagingOptions& options, cudaStream_t stream) : options(options), stream(stream) {}
  ~Shared() {
    cudaSetDevice(options.device);
    (void)cudaStreamSynchronize(stream);  // no copy still reads a chunk
    for (Chunk& c : chunks_) {
      if (c.host != nullptr) cudaFreeHost(c.host);
      if (c.done != nullptr) cudaEventDestroy(c.done);
    }
    for (auto& [registered, t] : free_outputs_) FreeOutput(t);
    cudaStreamDestroy(stream);
  }

  const CudaStagingOptions options;
  const cudaStream_t stream;  // the uploads' copies; device blocks are freed in its order

  // The ring, allocated on first use; its error for good if that failed.
  absl::Status EnsureRing() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ring_made_) return ring_status_;
    ring_made_ = true;
    chunks_.resize(static_cast<size_t>(std::max(options.chunks, 2)));
    for (Chunk& c : chunks_) {
      ring_status_ = CudaStatus(cudaMallocHost(reinterpret_cast<void**>(&c.host), options.chunk_bytes),
                                "pinned staging chunk");
      if (ring_status_.ok()) {
        ring_status_ = CudaStatus(cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming), "staging chunk event");
      }
      if (!ring_status_.ok()) break;
    }
    if (!ring_status_.ok()) {
      (void)cudaGetLastError();
      for (Chunk& c : chunks_) {
        if (c.host != nullptr) cudaFreeHost(c.host);
        if (c.done != nullptr) cudaEventDestroy(c.done);
      }
      chunks_.clear();
    }
    return ring_status_;
  }

  struct Taken {
    int index;
    uint64_t serial;
    char* host;
    cudaEvent_t done;  // recorded after its copy
  };
  // A free chunk to fill: one never used, or one whose copy completed.
  absl::StatusOr<Taken> Acquire(absl::Time deadline) {
    Taken taken{-1, 0, nullptr, nullptr};
    auto got = PollUntil(
        [&]() -> absl::StatusOr<bool> {
          std::lock_guard<std::mutex> lock(mu_);
          for (size_t i = 0; i < chunks_.size(); ++i) {
            Chunk& c = chunks_[i];
            if (c.state == Chunk::kInFlight) {
              const cudaError_t q = cudaEventQuery(c.done);
              if (q == cudaSuccess) {
                c.state = Chunk::kFree;
              } else if (q != cudaErrorNotReady) {
                (void)cudaGetLastError();
                return CudaStatus(q, "staging copy");
              }
            }
            if (c.state == Chunk::kFree) {
              c.state = Chunk::kFilling;
              ++c.serial;
              taken = Taken{static_cast<int>(i), c.serial, c.host, c.done};
              return true;
            }
          }
          return false;
        },
        deadline);
    if (!got.ok()) return got.status();
    if (!*got) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no pinned staging chunk came free within ", absl::FormatDuration(options.copy_timeout),
          ": the host-to-device copies on ", options.device_name, " stalled"));
    }
    return taken;
  }
  // The chunk's copy is queued and its event recorded after it (or, with
  // `queued` false, nothing was queued: free again).
  void Release(int index, bool queued) {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_[index].state = queued ? Chunk::kInFlight : Chunk::kFree;
  }
  // Waits until the copy queued from chunk `index` at `serial` completed.
  absl::Status Wait(int index, uint64_t serial, absl::Time deadline) {
    auto done = PollUntil(
        [&]() -> absl::StatusOr<bool> {
          std::lock_guard<std::mutex> lock(mu_);
          Chunk& c = chunks_[index];
          if (c.serial != serial || c.state == Chunk::kFree) return true;  // taken again only once done
          const cudaError_t q = cudaEventQuery(c.done);
          if (q == cudaSuccess) {
            c.state = Chunk::kFree;
            return true;
          }
          if (q != cudaErrorNotReady) {
            (void)cudaGetLastError();
            return CudaStatus(q, "staging copy");
          }
          return false;
        },
        deadline);
    if (!done.ok()) return done.status();
    if (!*done) {
      return absl::DeadlineExceededError(absl::StrCat("the block's host-to-device copies on ", options.device_name,
                                                      " did not finish within ",
                                                      absl::FormatDuration(options.copy_timeout)));
    }
    return absl::OkStatus();
  }

  // Pinned host memory for an output, from the pool (best fit, at most
  // twice its size) or newly registered while the bound allows; null when
  // it does not (the caller falls back to pageable memory).
  std::shared_ptr<HostTensor> TakeOutput(const std::shared_ptr<Shared>& self, int64_t bytes) {
    HostTensor* t = nullptr;
    int64_t registered = 0;
    std::vector<HostTensor*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_outputs_.lower_bound(bytes);
      if (it != free_outputs_.end() && it->first <= 2 * bytes) {
        registered = it->first;
        t = it->second;
        free_outputs_.erase(it);
      } else {
        // Room for a new one: free pooled ones that do not fit this size.
        while (pinned_output_bytes_ + bytes > options.pinned_output_bytes && !free_outputs_.empty()) {
          auto last = std::prev(free_outputs_.end());
          pinned_output_bytes_ -= last->first;
          evicted.push_back(last->second);
          free_outputs_.erase(last);
        }
        if (pinned_output_bytes_ + bytes <= options.pinned_output_bytes) {
          pinned_output_bytes_ += bytes;
          registered = bytes;
        }
      }
    }
    for (HostTensor* e : evicted) FreeOutput(e);
    if (registered == 0) return nullptr;
    if (t == nullptr) {
      t = new HostTensor;
      t->bytes.reserve(static_cast<size_t>(bytes));
      platform::AdviseHugePages(&t->bytes[0], t->bytes.capacity());
      t->bytes.resize(static_cast<size_t>(bytes));
      cudaSetDevice(options.device);
      const cudaError_t e = cudaHostRegister(&t->bytes[0], static_cast<size_t>(bytes), cudaHostRegisterPortable);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (!said_unpinned_.exchange(true)) {
          std::cerr << "shardgemm-worker: host memory for outputs held for fetch could not be pinned ("
                    << cudaGetErrorName(e) << "); they are held in pageable memory\n";
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          pinned_output_bytes_ -= bytes;
        }
        return std::shared_ptr<HostTensor>(t);  // pageable: freed as any
      }
    }
    // Within what was registered: the string never reallocates (its capacity covers it).
    t->bytes.resize(static_cast<size_t>(bytes));
    std::shared_ptr<Shared> keep = self;
    return std::shared_ptr<HostTensor>(t, [keep, registered](HostTensor* p) { keep->ReturnOutput(p, registered); });
  }

  void ReturnOutput(HostTensor* t, int64_t registered) {
    std::lock_guard<std::mutex> lock(mu_);
    free_outputs_.emplace(registered, t);
  }

  void SayPoolFull() {
    if (!said_pool_full_.exchange(true)) {
      std::cerr << "shardgemm-worker: the " << options.pinned_output_bytes
                << " bytes of pinned memory for outputs held for fetch (--staging_pinned_mb) are taken; "
                   "further outputs are held in pageable memory until some are fetched\n";
    }
  }
  void SayHostRing(const absl::Status& why) {
    if (!said_host_ring_.exchange(true)) {
      std::cerr << "shardgemm-worker: no pinned staging chunks (" << why.message()
                << "): staged blocks stay in host memory and are uploaded when their step runs\n";
    }
  }

 private:
  struct Chunk {
    enum State { kFree, kFilling, kInFlight };
    char* host = nullptr;
    cudaEvent_t done = nullptr;
    uint64_t serial = 0;  // counts its uses: a waiter on an older one knows it completed
    State state = kFree;
  };
  void FreeOutput(HostTensor* t) {
    cudaSetDevice(options.device);
    cudaHostUnregister(&t->bytes[0]);
    delete t;
  }

  std::mutex mu_;
  bool ring_made_ = false;
  absl::Status ring_status_;
  std::vector<Chunk> chunks_;
  std::multimap<int64_t, HostTensor*> free_outputs_;  // by registered bytes
  int64_t pinned_output_bytes_ = 0;  // registered, held or pooled
  std::atomic<bool> said_unpinned_{false}, said_pool_full_{false}, said_host_ring_{false};
};

// A staged block's device memory, stream-ordered on the memory's stream:
// freed after the copies queued into it (a step that read it synchronized
// its own stream before letting go of it).
class StagedDeviceBuffer : public DeviceBuffer {
 public:
  StagedDeviceBuffer(std::shared_ptr<Shared> shared, void* ptr, int64_t bytes)
      : shared_(std::move(shared)), ptr_(ptr), bytes_(bytes) {}
  ~StagedDeviceBuffer() override {
    cudaSetDevice(shared_->options.device);
    cudaFreeAsync(ptr_, shared_->stream);
  }
  void* data() const override { return ptr_; }
  int64_t bytes() const override { return bytes_; }

 private:
  std::shared_ptr<Shared> shared_;
  void* ptr_;
  int64_t bytes_;
};

class DeviceWriter : public StagingMemory::Writer {
 public:
  DeviceWriter(std::shared_ptr<Shared> shared, std::shared_ptr<StagedDeviceBuffer> block)
      : shared_(std::move(shared)), block_(std::move(block)) {}

  absl::Status Append(absl::string_view data) override {
    cudaSetDevice(shared_->options.device);
    const absl::Time deadline = absl::Now() + shared_->options.copy_timeout;
    while (!data.empty()) {
      const int64_t n = std::min<int64_t>(shared_->options.chunk_bytes, static_cast<int64_t>(data.size()));
      if (offset_ + n > block_->bytes()) return absl::InternalError("past the staged block's device memory");
      auto chunk = shared_->Acquire(deadline);
      if (!chunk.ok()) return chunk.status();
      std::memcpy(chunk->host, data.data(), static_cast<size_t>(n));
      absl::Status s = CudaStatus(cudaMemcpyAsync(static_cast<char*>(block_->data()) + offset_, chunk->host, n,
                                                  cudaMemcpyHostToDevice, shared_->stream),
                                  "staging copy");
      if (s.ok()) s = CudaStatus(cudaEventRecord(chunk->done, shared_->stream), "staging copy event");
      shared_->Release(chunk->index, s.ok());
      if (!s.ok()) {
        (void)cudaGetLastError();
        return s;
      }
      last_ = *chunk;
      have_last_ = true;
      offset_ += n;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<StagedBytes> Finish() override {
    // The copies share one stream: the last one done, all of them are.
    if (have_last_) {
      if (auto s = shared_->Wait(last_.index, last_.serial, absl::Now() + shared_->options.copy_timeout); !s.ok()) {
        return s;
      }
    }
    StagedBytes out;
    out.device = std::move(block_);
    return out;
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<StagedDeviceBuffer> block_;
  int64_t offset_ = 0;
  Shared::Taken last_{-1, 0, nullptr, nullptr};
  bool have_last_ = false;
};

class CudaStagingMemory : public StagingMemory {
 public:
  explicit CudaStagingMemory(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)), host_(MakeHostStagingMemory()) {}

  absl::StatusOr<std::unique_ptr<Writer>> BeginBlock(const ExpectedBlock& block, int64_t bytes) override {
    // What the device GEMM reads; every other block is read on the host.
    const bool device = block.gemm_operand && (block.dtype == DType::kBF16 || block.dtype == DType::kF16);
    if (!device) return host_->BeginBlock(block, bytes);
    if (absl::Status ring = shared_->EnsureRing(); !ring.ok()) {
      shared_->SayHostRing(ring);
      return host_->BeginBlock(block, bytes);
    }
    cudaSetDevice(shared_->options.device);
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, static_cast<size_t>(std::max<int64_t>(bytes, 256)), shared_->stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("no device memory for its ", bytes, " bytes on ",
                                                       shared_->options.device_name, " (", cudaGetErrorName(e),
                                                       "); nothing held there was given up for it"));
    }
    auto buffer = std::make_shared<StagedDeviceBuffer>(shared_, p, bytes);
    return std::unique_ptr<Writer>(new DeviceWriter(shared_, std::move(buffer)));
  }

  absl::StatusOr<std::shared_ptr<HostTensor>> OutputBlock(DType dtype, const std::vector<int64_t>& shape,
                                                          int64_t bytes) override {
    if (bytes < shared_->options.pinned_output_min_bytes) return host_->OutputBlock(dtype, shape, bytes);
    std::shared_ptr<HostTensor> t = shared_->TakeOutput(shared_, bytes);
    if (t == nullptr) {
      shared_->SayPoolFull();
      return host_->OutputBlock(dtype, shape, bytes);
    }
    t->dtype = dtype;
    t->shape = shape;
    return t;
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<StagingMemory> host_;  // the blocks host paths read, and the fallbacks
};

}  // namespace

absl::StatusOr<std::unique_ptr<StagingMemory>> MakeCudaStagingMemory(const CudaStagingOptions& options) {
  if (options.chunk_bytes <= 0 || options.chunks <= 0 || options.pinned_output_bytes < 0) {
    return absl::InvalidArgumentError("staging memory: chunk_bytes and chunks must be positive, "
                                      "pinned_output_bytes not negative");
  }
  if (auto s = CudaStatus(cudaSetDevice(options.device), "staging memory"); !s.ok()) return s;
  cudaStream_t stream;
  if (auto s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "staging stream"); !s.ok()) {
    return s;
  }
  return std::unique_ptr<StagingMemory>(new CudaStagingMemory(std::make_shared<Shared>(options, stream)));
}

}  // namespace shardgemm
