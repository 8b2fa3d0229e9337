// The CUDA backend: the grouped GEMM of kernels/cuda (our sm90 kernel and
// cuBLASLt routes, chosen per shape) and the grouped quantize kernels, on one
// stream, with device memory from the runner's pool.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/gemm_scale_layout.h"
#include "kernels/cuda/grouped_gemm.h"
#include "kernels/cuda/quantize.h"
#include "logging/trace_marks.h"
#include "worker/backend.h"
#include "worker/cuda_client_memory.h"
#include "worker/cuda_device_buffer.h"
#include "worker/cuda_staging_memory.h"
#include "worker/fault_injection.h"
#include "worker/fault_injection_kernels.h"

namespace shardgemm {
namespace {

// Device buffers taken from the pool for one call, returned on scope exit.
class Scratch {
 public:
  Scratch(cuda::DevicePool* pool, std::atomic<int64_t>* uploaded) : pool_(pool), uploaded_(uploaded) {}
  ~Scratch() {
    for (void* p : held_) pool_->Free(p);
  }
  absl::StatusOr<void*> Upload(const void* host, int64_t bytes, cudaStream_t stream) {
    auto p = Take(bytes);
    if (!p.ok() || bytes == 0) return p;
    if (auto s = CudaStatus(cudaMemcpyAsync(*p, host, bytes, cudaMemcpyHostToDevice, stream), "upload"); !s.ok()) {
      return s;
    }
    *uploaded_ += bytes;
    return p;
  }
  absl::StatusOr<void*> Take(int64_t bytes) {
    auto p = pool_->Allocate(std::max<int64_t>(bytes, 256));
    if (p.ok()) held_.push_back(*p);
    return p;
  }

 private:
  cuda::DevicePool* pool_;
  std::atomic<int64_t>* uploaded_;
  std::vector<void*> held_;
};

class CudaBackend : public Backend {
 public:
  CudaBackend(int device, int64_t total_memory, std::unique_ptr<cuda::GroupedGemmRunner> runner,
              cudaStream_t stream, std::string name, FaultInjector* faults)
      : device_(device), total_memory_(total_memory), runner_(std::move(runner)), stream_(stream), name_(std::move(name)),
        cpu_(MakeCpuBackend(0)), faults_(faults) {}
  ~CudaBackend() override {
    // The quantize library's workspace for the stream goes with it.
    cudaSetDevice(device_);
    if (small_pinned_ != nullptr) cudaFreeHost(small_pinned_);
    for (int i = 0; i < 2; ++i) {
      if (staging_[i] != nullptr) cudaFreeHost(staging_[i]);
      if (staged_[i] != nullptr) cudaEventDestroy(staged_[i]);
    }
    (void)cuda::ReleaseQuantizeWorkspace(stream_);
    for (auto& [key, cached] : scale_cache_) cudaFree(cached.device);
    if (lt_workspace_ != nullptr) cudaFree(lt_workspace_);
    if (lt_ != nullptr) cublasLtDestroy(lt_);
    cudaStreamDestroy(stream_);
  }

  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return name_; }
  bool CanGatherOnDevice() const override { return true; }
  bool Fp8GemmOnHost(bool ragged_k, bool rhs_transposed) const override { return ragged_k || !rhs_transposed; }
  bool KeepsOutputsOnDevice() const override { return true; }
  int64_t DeviceMemoryBytes() const override { return total_memory_; }
  Transfers TransferCounts() const override { return {uploaded_.load(), downloaded_.load()}; }

  absl::StatusOr<HostTensor> GroupedGemm(const LocalGemm& g) override {
    auto out = Run(g, /*keep=*/false);
    if (!out.ok()) return AfterFailure(out.status());
    return std::move(out->host);
  }

  absl::StatusOr<Shard> GroupedGemmToShard(const LocalGemm& g) override {
    auto out = Run(g, g.keep_on_device);
    if (!out.ok()) return AfterFailure(out.status());
    if (out->device == nullptr) return Shard::OnHost(std::move(out->host));
    Shard shard;
    shard.dtype = out->dtype;
    shard.shape = out->shape;
    shard.device = std::move(out->device);
    return shard;
  }

  absl::StatusOr<HostTensor> Download(const Shard& shard) override {
    if (shard.host != nullptr) return *shard.host;
    if (shard.device == nullptr) return absl::InternalError("a shard with neither host nor device bytes");
    auto out = ZerosTensor(shard.dtype, shard.shape);
    if (!out.ok()) return out.status();
    if (out->NumBytes() > shard.device->bytes()) return absl::InternalError("device shard smaller than its shape");
    cudaSetDevice(device_);
    if (out->NumBytes() > 0) {
      // The step that wrote the shard synchronized its stream before storing it.
      if (auto s = CudaStatus(cudaMemcpy(&out->bytes[0], shard.device->data(), out->NumBytes(), cudaMemcpyDeviceToHost),
                              "download shard");
          !s.ok()) {
        return AfterFailure(s);
      }
    }
    downloaded_ += out->NumBytes();
    return out;
  }

  absl::Status CopyToHost(const Shard& shard, char* dst) override {
    if (shard.device == nullptr) return Backend::CopyToHost(shard, dst);
    const int64_t bytes = shard.NumBytes();
    if (bytes > shard.device->bytes()) return absl::InternalError("device shard smaller than its shape");
    if (bytes == 0) return absl::OkStatus();
    logging::TraceMark("to_host");
    cudaSetDevice(device_);
    // Pinned memory (the staging memory's output pool) takes one copy at
    // full speed; pageable memory the chunks through pinned buffers.
    cudaPointerAttributes attributes;
    const bool pinned =
        cudaPointerGetAttributes(&attributes, dst) == cudaSuccess && attributes.type == cudaMemoryTypeHost;
    (void)cudaGetLastError();
    absl::Status s;
    logging::TraceMark(pinned ? "d2h_pinned" : "d2h_pageable");
    if (pinned) {
      s = CudaStatus(cudaMemcpyAsync(dst, shard.device->data(), bytes, cudaMemcpyDeviceToHost, stream_), "download");
      if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream_), "download");
      logging::TraceMark("d2h_done");
      if (s.ok()) downloaded_ += bytes;
    } else {
      char* at = dst;
      s = DownloadChunked(shard.device->data(), bytes, [&at](const char* p, int64_t n) {
        std::memcpy(at, p, static_cast<size_t>(n));
        at += n;
      });
    }
    return s.ok() ? s : AfterFailure(s);
  }

  absl::StatusOr<std::unique_ptr<StagingMemory>> MakeStagingMemory(int64_t pinned_output_bytes) override {
    CudaStagingOptions options;
    options.device = device_;
    options.device_name = name_;
    options.pinned_output_bytes = pinned_output_bytes;
    return MakeCudaStagingMemory(options);
  }

  absl::Status DeviceHealth() const override {
    std::lock_guard<std::mutex> lock(lost_mu_);
    return lost_;
  }

  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> BlockToDevice(const ClientMemory& memory,
                                                                  const platform::TensorBlock& block,
                                                                  absl::string_view field) override {
    auto buffer = client_memory_.ToDevice(memory, block, field);
    if (!buffer.ok()) return AfterFailure(buffer.status());
    return buffer;
  }
  absl::Status BlockFromDevice(const DeviceBuffer& source, const ClientMemory& memory,
                               const platform::TensorBlock& block, absl::string_view field) override {
    absl::Status s = client_memory_.FromDevice(source.data(), memory, block, field);
    return s.ok() ? s : AfterFailure(s);
  }
  absl::Status BlockFromHost(const char* source, const ClientMemory& memory, const platform::TensorBlock& block,
                             absl::string_view field) override {
    absl::Status s = client_memory_.FromHost(source, memory, block, field);
    return s.ok() ? s : AfterFailure(s);
  }
  int ForgetClientMemory(const std::vector<std::shared_ptr<const platform::SharedMemoryMapping>>& mappings,
                         const std::vector<std::string>& cuda_ipc_handles) override {
    return client_memory_.Forget(mappings, cuda_ipc_handles);
  }

 private:
  // Called with the status of a failed call: waits for what the call left
  // queued on the stream (the next call reuses its scratch memory) and
  // clears the runtime's last error, so that a launch refused for one
  // request leaves nothing behind for the next. A sticky error (an illegal
  // address, a kernel fault) survives that: the context is lost for the
  // process, DeviceHealth reports it, and the worker exits to be restarted.
  absl::Status AfterFailure(absl::Status failed) {
    cudaSetDevice(device_);
    const cudaError_t drained = cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
    const cudaError_t after = cudaStreamSynchronize(stream_);
    if (after == cudaSuccess) return failed;
    const cudaError_t sticky = drained != cudaSuccess ? drained : after;
    {
      std::lock_guard<std::mutex> lock(lost_mu_);
      if (lost_.ok()) {
        lost_ = absl::InternalError(absl::StrCat("the CUDA context of ", name_, " is lost (", cudaGetErrorName(sticky),
                                                 ": ", cudaGetErrorString(sticky), ", a sticky error)"));
      }
    }
    return absl::Status(failed.code(), absl::StrCat(failed.message(),
                                                    "; the CUDA context is lost: this worker stops serving and "
                                                    "exits for its supervisor to restart it"));
  }

  // A device op's kernel launch (`launch`, enqueueing on stream_), or, where
  // --fault_injection names this launch, one that fails for real instead.
  template <typename F>
  absl::Status Launch(absl::string_view what, F&& launch) {
    const FaultInjector::LaunchFault fault =
        faults_ == nullptr ? FaultInjector::LaunchFault::kNone : faults_->NextKernelLaunch();
    switch (fault) {
      case FaultInjector::LaunchFault::kNone:
        return launch();
      case FaultInjector::LaunchFault::kInvalidConfiguration: {
        const std::string where =
            absl::StrCat(what, " kernel launch [--fault_injection kernel_launch:", faults_->plan().kernel_launch, "]");
        const cudaError_t e = LaunchWithInvalidConfiguration(stream_);
        if (e == cudaSuccess) return absl::InternalError(absl::StrCat(where, ": the runtime took the launch"));
        return CudaStatus(e, where);
      }
      case FaultInjector::LaunchFault::kIllegalAddress: {
        const std::string where =
            absl::StrCat(what, " kernel [--fault_injection illegal_address:", faults_->plan().illegal_address, "]");
        cudaError_t e = LaunchIllegalAddressWrite(stream_);
        if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
        if (e == cudaSuccess) return absl::InternalError(absl::StrCat(where, ": the kernel's write went through"));
        return CudaStatus(e, where);
      }
    }
    return absl::InternalError("unknown launch fault");
  }

  struct GemmOutput {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> shape;
    HostTensor host;                              // when not kept on the device
    std::shared_ptr<const DeviceBuffer> device;  // when kept
  };

  absl::StatusOr<GemmOutput> OnHost(absl::StatusOr<HostTensor> t) {
    if (!t.ok()) return t.status();
    GemmOutput out;
    out.dtype = t->dtype;
    out.shape = t->shape;
    out.host = std::move(*t);
    return out;
  }

  // Appends `bytes` of device memory at `src` (written on stream_) to
  // out->bytes, through two pinned staging buffers: the copy of one chunk
  // overlaps the append of the one before, the copies run at pinned speed,
  // and the host bytes are written once (no zero fill).
  absl::Status DownloadInto(const void* src, int64_t bytes, HostTensor* out) {
    out->bytes.clear();
    out->bytes.reserve(static_cast<size_t>(bytes));
    return DownloadChunked(src, bytes, [out](const char* p, int64_t n) { out->bytes.append(p, static_cast<size_t>(n)); });
  }

  // DownloadInto's chunks, each handed to `emit` in order.
  absl::Status DownloadChunked(const void* src, int64_t bytes, const std::function<void(const char*, int64_t)>& emit) {
    for (int i = 0; i < 2; ++i) {
      if (staging_[i] == nullptr) {
        if (auto s = CudaStatus(cudaMallocHost(&staging_[i], kStagingBytes), "pinned staging"); !s.ok()) return s;
        if (auto s = CudaStatus(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming), "event"); !s.ok()) {
          return s;
        }
      }
    }
    const char* from = static_cast<const char*>(src);
    int64_t pending = -1, pending_len = 0;  // the chunk in flight, if any
    for (int64_t offset = 0, chunk = 0; offset < bytes || pending >= 0; ++chunk) {
      if (offset < bytes) {
        const int b = static_cast<int>(chunk % 2);
        const int64_t len = std::min<int64_t>(kStagingBytes, bytes - offset);
        if (auto s = CudaStatus(cudaMemcpyAsync(staging_[b], from + offset, len, cudaMemcpyDeviceToHost, stream_),
                                "download");
            !s.ok()) {
          return s;
        }
        if (auto s = CudaStatus(cudaEventRecord(staged_[b], stream_), "event"); !s.ok()) return s;
        if (pending >= 0) {
          if (auto s = EmitStaged(static_cast<int>(pending % 2), pending_len, emit); !s.ok()) return s;
        }
        pending = chunk;
        pending_len = len;
        offset += len;
      } else {
        if (auto s = EmitStaged(static_cast<int>(pending % 2), pending_len, emit); !s.ok()) return s;
        pending = -1;
      }
    }
    downloaded_ += bytes;
    return absl::OkStatus();
  }

  absl::Status EmitStaged(int b, int64_t len, const std::function<void(const char*, int64_t)>& emit) {
    if (auto s = CudaStatus(cudaEventSynchronize(staged_[b]), "download"); !s.ok()) return s;
    emit(static_cast<const char*>(staging_[b]), len);
    return absl::OkStatus();
  }

  // The FP8 GEMM: cuBLASLt FP8 (kernels/cuda/fp8_gemm.h) for ragged M with
  // [G, N, K] weights and tensor or 1x128 x 128x128 block scales, the lhs
  // quantized on the device when the step asks; other FP8 shapes (ragged K,
  // [G, K, N] weights: cuBLASLt's FP8 is TN only on Hopper) run on the host
  // reference. A kept output is brought to the host.
  absl::StatusOr<GemmOutput> RunFp8(const LocalGemm& g, bool keep) {
    if (g.lhs_device != nullptr || g.rhs_device != nullptr) {
      return absl::InternalError("a device operand reached the FP8 GEMM path");
    }
    if (g.lhs_mode == ScalingMode::kMxfp8 || g.rhs_mode == ScalingMode::kMxfp8) {
      return absl::UnimplementedError(
          "scaling: MXFP8 GEMM needs Blackwell (cuBLASLt's VEC32_UE8M0); not available on Hopper");
    }
    if (g.rhs_gather.enabled) return OnHost(GroupedGemmAfterHostGather(this, g));
    const bool tensor = g.rhs_mode == ScalingMode::kCurrent || g.rhs_mode == ScalingMode::kDelayed;
    // cuBLASLt's FP8 takes K in 16s and output rows in 16-byte multiples.
    const int64_t local_n = g.rhs->shape.size() == 3 ? g.rhs->shape[1] : 0;
    if (Fp8GemmOnHost(g.ragged_k, g.rhs_transposed) || g.bias != nullptr || g.lhs->shape.at(1) % 16 != 0 ||
        (local_n * DTypeSize(g.out_dtype)) % 16 != 0) {
      return OnHost(cpu_->GroupedGemm(g));
    }
    cudaSetDevice(device_);
    if (lt_ == nullptr) {
      if (cublasLtCreate(&lt_) != CUBLAS_STATUS_SUCCESS) return absl::InternalError("cublasLtCreate failed");
      if (auto s = CudaStatus(cudaMalloc(&lt_workspace_, kLtWorkspaceBytes), "cuBLASLt workspace"); !s.ok()) {
        return s;
      }
    }
    const HostTensor& lhs = *g.lhs;
    const HostTensor& rhs = *g.rhs;
    const int64_t m = lhs.shape[0], k = lhs.shape[1], groups = static_cast<int64_t>(g.group_sizes.size());
    const int64_t n = rhs.shape.at(1);
    if (rhs.shape.size() != 3 || rhs.shape[0] != groups || rhs.shape[2] != k) {
      return absl::InvalidArgumentError(absl::StrCat("rhs: ", ShapeToString(rhs.shape), ", expected [", groups,
                                                     ", N, ", k, "] (rhs_transposed)"));
    }
    Scratch scratch(&runner_->pool(), &uploaded_);
    cuda::Fp8GroupedGemmArgs a;
    a.m = m;
    a.n = n;
    a.k = k;
    a.group_sizes = g.group_sizes.data();
    a.num_groups = groups;
    a.out_dtype = g.out_dtype;
    a.lhs_mode = g.lhs_mode;
    a.rhs_mode = g.rhs_mode;
    a.rhs_format = rhs.dtype == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
    a.workspace = lt_workspace_;
    a.workspace_bytes = kLtWorkspaceBytes;
    // Device group sizes let tensor scaling run our one-launch sm90 kernel.
    auto d_sizes = scratch.Upload(g.group_sizes.data(), groups * 8, stream_);
    if (!d_sizes.ok()) return d_sizes.status();
    a.device_group_sizes = static_cast<const int64_t*>(*d_sizes);
    // rhs and its scales: the resident weight's device copy is kept.
    auto d_rhs = g.resident_rhs != nullptr ? DeviceCopy(g.resident_rhs, g.resident_lhs.get())
                                           : scratch.Upload(rhs.bytes.data(), rhs.NumBytes(), stream_);
    if (!d_rhs.ok()) return d_rhs.status();
    a.rhs = static_cast<const uint8_t*>(*d_rhs);
    const std::vector<int64_t> weight_groups(static_cast<size_t>(groups), n);
    HostTensor rhs_scales;
    // A resident weight's scales, in the kernel's layout, stay on the device
    // while the shard lives (their own cache: DeviceCopy's eviction would
    // free them under this call). Others are converted and uploaded.
    if (g.resident_rhs_scale_inv != nullptr) {
      auto d = WeightScales(g, groups * n, k, weight_groups, tensor);
      if (!d.ok()) return d.status();
      a.rhs_scale_inv = *d;
    } else if (tensor) {
      rhs_scales = *g.rhs_scale_inv;
    } else {
      auto converted = QuantizeScalesFromGemm(g.rhs_mode, *g.rhs_scale_inv, groups * n, k, weight_groups);
      if (!converted.ok()) return absl::InvalidArgumentError(absl::StrCat("rhs_", converted.status().message()));
      rhs_scales = std::move(*converted);
    }
    if (a.rhs_scale_inv == nullptr) {
      auto d_rhs_scale = scratch.Upload(rhs_scales.bytes.data(), rhs_scales.NumBytes(), stream_);
      if (!d_rhs_scale.ok()) return d_rhs_scale.status();
      a.rhs_scale_inv = *d_rhs_scale;
    }
    // lhs: uploaded FP8 with its scales, or quantized here from the float lhs.
    auto d_lhs_in = g.resident_lhs != nullptr ? DeviceCopy(g.resident_lhs, g.resident_rhs.get())
                                              : scratch.Upload(lhs.bytes.data(), lhs.NumBytes(), stream_);
    if (!d_lhs_in.ok()) return d_lhs_in.status();
    if (g.quantize_lhs_to != DType::kInvalid) {
      LocalQuantize q;
      q.x = &lhs;
      q.m = m;
      q.k = k;
      q.group_sizes = g.group_sizes;
      q.out_dtype = g.quantize_lhs_to;
      q.mode = g.lhs_mode;
      GroupedQuantizeArgs qa = QuantizeArgs(q, *d_lhs_in);
      auto layout = GetQuantizeLayout(qa);
      if (!layout.ok()) return layout.status();
      auto d_data = scratch.Take(m * k);
      auto d_scale = scratch.Take(layout->rowwise_scale_elems * 4);
      auto d_amax = scratch.Take(groups * 4);  // current scaling's per-group amax (not returned)
      for (const auto* st : {&d_data, &d_scale, &d_amax}) {
        if (!st->ok()) return st->status();
      }
      PointQuantizeOutputs(q, {*d_data, nullptr, *d_scale, nullptr, tensor ? *d_amax : nullptr}, &qa);
      if (auto s = Launch("grouped quantize", [&] { return cuda::GroupedQuantize(qa, stream_); }); !s.ok()) return s;
      a.lhs = static_cast<const uint8_t*>(*d_data);
      a.lhs_scale_inv = *d_scale;
      a.lhs_format = g.quantize_lhs_to == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
    } else {
      a.lhs = static_cast<const uint8_t*>(*d_lhs_in);
      a.lhs_format = lhs.dtype == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
      HostTensor lhs_scales;
      if (tensor) {
        lhs_scales = *g.lhs_scale_inv;
      } else {
        auto converted = QuantizeScalesFromGemm(g.lhs_mode, *g.lhs_scale_inv, m, k, g.group_sizes);
        if (!converted.ok()) return absl::InvalidArgumentError(absl::StrCat("lhs_", converted.status().message()));
        lhs_scales = std::move(*converted);
      }
      auto d_lhs_scale = scratch.Upload(lhs_scales.bytes.data(), lhs_scales.NumBytes(), stream_);
      if (!d_lhs_scale.ok()) return d_lhs_scale.status();
      a.lhs_scale_inv = *d_lhs_scale;
    }
    const int64_t out_bytes = m * n * DTypeSize(g.out_dtype);
    std::shared_ptr<StreamDeviceBuffer> kept;
    absl::StatusOr<void*> d_out = absl::UnknownError("not allocated");
    if (keep) {
      auto buffer = StreamDeviceBuffer::Allocate(device_, out_bytes, stream_);
      if (!buffer.ok()) return buffer.status();
      kept = *buffer;
      d_out = kept->data();
    } else {
      d_out = scratch.Take(out_bytes);
    }
    if (!d_out.ok()) return d_out.status();
    a.out = *d_out;
    if (auto s = Launch("FP8 grouped GEMM", [&] { return cuda::Fp8GroupedGemm(a, lt_, stream_); }); !s.ok()) return s;
    GemmOutput result;
    result.dtype = g.out_dtype;
    result.shape = {m, n};
    if (keep) {
      result.device = std::move(kept);
    } else {
      result.host.dtype = g.out_dtype;
      result.host.shape = {m, n};
      if (auto st = DownloadInto(*d_out, out_bytes, &result.host); !st.ok()) return st;
    }
    if (auto st = CudaStatus(cudaStreamSynchronize(stream_), "FP8 grouped GEMM"); !st.ok()) return st;
    return result;
  }

  absl::StatusOr<GemmOutput> Run(const LocalGemm& g, bool keep) {
    const HostTensor& lhs = *g.lhs;
    const HostTensor& rhs = *g.rhs;
    if (IsFloat8(rhs.dtype)) return RunFp8(g, keep);
    // The GPU kernels take BF16 or F16 operands of one dtype; F32 (and
    // mixed) inputs keep FP32 arithmetic on the host reference kernels.
    if (lhs.dtype != rhs.dtype || !(lhs.dtype == DType::kBF16 || lhs.dtype == DType::kF16)) {
      if (g.lhs_device != nullptr || g.rhs_device != nullptr) {
        return absl::InternalError("a device operand reached the host GEMM path");
      }
      return OnHost(g.rhs_gather.enabled ? GroupedGemmAfterHostGather(cpu_.get(), g) : cpu_->GroupedGemm(g));
    }
    // The weight gather stays on the device for ragged M (the forward GEMM);
    // ragged K (wgrad) gathers on the host.
    const bool gather = g.rhs_gather.enabled;
    if (gather && (g.ragged_k || g.rhs_gather.collectives == nullptr)) {
      if (g.lhs_device != nullptr || g.rhs_device != nullptr) {
        return absl::InternalError("a device operand reached the host gather path");
      }
      return OnHost(GroupedGemmAfterHostGather(this, g));
    }
    // The weight the GEMM reads: the gathered one when gathering.
    const std::vector<int64_t>& rhs_shape = gather ? g.rhs_gather.gathered_shape : rhs.shape;
    // Everything that can fail on this worker alone comes before the gather
    // and is collected in `prep`, so that (with rhs_gather.agree) every
    // worker agrees on it before any of them enters the collective.
    absl::Status prep;
    if (gather && (rhs_shape.size() != rhs.shape.size() || rhs_shape.size() != 3)) {
      prep = absl::InvalidArgumentError(absl::StrCat("gathered rhs ", ShapeToString(rhs_shape),
                                                     " does not match the shard ", ShapeToString(rhs.shape)));
    }
    cudaSetDevice(device_);
    cuda::DeviceGroupedGemmArgs a;
    a.in_dtype = lhs.dtype;
    a.out_dtype = g.out_dtype;
    a.m = lhs.shape[0];
    a.k = lhs.shape[1];
    a.num_groups = static_cast<int64_t>(g.group_sizes.size());
    a.rhs_transposed = g.rhs_transposed;
    std::vector<int64_t> out_shape;
    if (g.ragged_k) {
      a.n = rhs.shape[1];
      out_shape = {a.num_groups, a.k, a.n};
    } else if (prep.ok()) {
      a.n = g.rhs_transposed ? rhs_shape[1] : rhs_shape[2];
      out_shape = {a.m, a.n};
    }
    // A kept output needs no host copy: only its header.
    absl::StatusOr<HostTensor> out = absl::UnknownError("not made");
    if (!prep.ok()) {
      out = prep;
    } else {
      // The output's host bytes are appended as they arrive (DownloadInto):
      // no zero-filling first.
      HostTensor header;
      header.dtype = g.out_dtype;
      header.shape = out_shape;
      out = std::move(header);
    }
    int64_t out_bytes = DTypeSize(g.out_dtype);
    for (int64_t d : out_shape) out_bytes *= d;
    Scratch scratch(&runner_->pool(), &uploaded_);
    std::shared_ptr<const DeviceBuffer> kept;
    const absl::StatusOr<void*> unprepared = absl::FailedPreconditionError("not prepared");
    absl::StatusOr<void*> d_lhs = unprepared, d_rhs = unprepared, d_sizes = unprepared, d_out = unprepared;
    if (out.ok()) {
      d_lhs = g.lhs_device != nullptr      ? absl::StatusOr<void*>(g.lhs_device->data())
              : g.resident_lhs != nullptr ? DeviceCopy(g.resident_lhs, g.resident_rhs.get())
                                          : scratch.Upload(lhs.bytes.data(), lhs.NumBytes(), stream_);
      d_rhs = g.rhs_device != nullptr      ? absl::StatusOr<void*>(g.rhs_device->data())
              : g.resident_rhs != nullptr ? DeviceCopy(g.resident_rhs, g.resident_lhs.get())
                                          : scratch.Upload(rhs.bytes.data(), rhs.NumBytes(), stream_);
      d_sizes = UploadSmall(&scratch, g.group_sizes.data(), a.num_groups * 8);
      if (keep && g.out_device != nullptr) {
        if (g.out_device->bytes() < out_bytes) {
          d_out = absl::InternalError(absl::StrCat("the output's ", out_bytes, " bytes do not fit the ",
                                                   g.out_device->bytes(), " given for it"));
        } else {
          kept = g.out_device;
          d_out = kept->data();
        }
      } else if (keep) {
        auto buffer = StreamDeviceBuffer::Allocate(device_, out_bytes, stream_);
        if (buffer.ok()) {
          kept = *buffer;
          d_out = kept->data();
        } else {
          d_out = buffer.status();
        }
      } else {
        d_out = scratch.Take(out_bytes);
      }
    }
    prep = out.status();
    for (const auto* st : {&d_lhs, &d_rhs, &d_sizes, &d_out}) {
      if (prep.ok() && !st->ok()) prep = st->status();
    }
    // The FSDP weight gather, device to device on this stream, straight into
    // the GEMM's operand (a group of one, gathered_shape == the shard's: the
    // shard itself).
    const bool gathering = gather && rhs_shape != rhs.shape;
    absl::StatusOr<void*> d_gathered = nullptr;
    if (prep.ok() && gathering) {
      int64_t gathered_bytes = DTypeSize(rhs.dtype);
      for (int64_t d : rhs_shape) gathered_bytes *= d;
      d_gathered = scratch.Take(gathered_bytes);
      prep = d_gathered.status();
    }
    logging::TraceMark("device_operands");
    if (gather && g.rhs_gather.agree) prep = g.rhs_gather.collectives->Agree(prep, g.rhs_gather.agree_axes);
    if (!prep.ok()) return prep;
    if (gathering) {
      if (auto st = g.rhs_gather.collectives->AllGatherDevice(*d_rhs, *d_gathered, rhs.shape, rhs.dtype,
                                                              g.rhs_gather.dim, g.rhs_gather.axes, stream_);
          !st.ok()) {
        return st;
      }
      d_rhs = *d_gathered;
      if (!said_device_gather_) {  // once: the logs show which path the weight gather takes
        said_device_gather_ = true;
        std::cerr << "shardgemm-worker: weight all-gather on the device (" << ShapeToString(rhs.shape) << " -> "
                  << ShapeToString(rhs_shape) << " along dim " << g.rhs_gather.dim << "), no host round trip\n";
      }
    }
    if (g.bias != nullptr && !g.ragged_k) {
      auto d_bias = scratch.Upload(g.bias->bytes.data(), g.bias->NumBytes(), stream_);
      if (!d_bias.ok()) return d_bias.status();
      a.bias = *d_bias;
      a.bias_dtype = g.bias->dtype;
    }
    a.lhs = *d_lhs;
    a.rhs = *d_rhs;
    a.out = *d_out;
    a.group_sizes_device = static_cast<const int64_t*>(*d_sizes);
    a.group_sizes_host = g.group_sizes.data();
    absl::Status s =
        Launch("grouped GEMM", [&] { return g.ragged_k ? runner_->RaggedK(a, stream_) : runner_->RaggedM(a, stream_); });
    if (!s.ok()) return s;
    logging::TraceMark("launched");
    if (!keep) {
      if (auto st = DownloadInto(*d_out, out_bytes, &*out); !st.ok()) return st;
    }
    if (auto st = CudaStatus(cudaStreamSynchronize(stream_), "grouped GEMM"); !st.ok()) return st;
    small_pinned_in_flight_ = false;
    logging::TraceMark("synced");
    GemmOutput result;
    result.dtype = g.out_dtype;
    result.shape = out_shape;
    if (keep) {
      result.device = std::move(kept);
    } else {
      result.host = std::move(*out);
    }
    return result;
  }

 public:

  absl::StatusOr<QuantizeOutputs> GroupedQuantize(const LocalQuantize& q) override {
    // The GPU kernel wants K a multiple of 8; other shapes stay exact on the host.
    if (q.k % 8 != 0 || q.group_sizes.size() > 1024) return cpu_->GroupedQuantize(q);
    auto out = RunQuantize(q);
    if (!out.ok()) return AfterFailure(out.status());
    return out;
  }

 private:
  absl::StatusOr<QuantizeOutputs> RunQuantize(const LocalQuantize& q) {
    cudaSetDevice(device_);
    auto out = AllocateQuantizeOutputs(q);
    if (!out.ok()) return out.status();
    Scratch scratch(&runner_->pool(), &uploaded_);
    auto d_x = scratch.Upload(q.x->bytes.data(), q.x->NumBytes(), stream_);
    if (!d_x.ok()) return d_x.status();
    // One device buffer per host output (Take never returns null).
    HostTensor* host[] = {&out->rowwise_data, &out->colwise_data, &out->scale_inv,
                          &out->colwise_scale_inv, &out->amax};
    void* device[5];
    for (int i = 0; i < 5; ++i) {
      auto d = scratch.Take(host[i]->NumBytes());
      if (!d.ok()) return d.status();
      device[i] = *d;
    }
    absl::StatusOr<void*> d_scale = nullptr;
    if (q.scales != nullptr) {
      d_scale = scratch.Upload(q.scales->data(), static_cast<int64_t>(q.scales->size()) * 4, stream_);
      if (!d_scale.ok()) return d_scale.status();
    }
    // Group sizes stay on the host, as the GPU quantize takes them.
    GroupedQuantizeArgs a = QuantizeArgs(q, *d_x);
    a.scale = static_cast<const float*>(*d_scale);
    PointQuantizeOutputs(q, {device[0], device[1], device[2], device[3], device[4]}, &a);
    if (auto s = Launch("grouped quantize", [&] { return cuda::GroupedQuantize(a, stream_); }); !s.ok()) return s;
    for (int i = 0; i < 5; ++i) {
      if (host[i]->NumBytes() == 0) continue;
      if (auto s = CudaStatus(
              cudaMemcpyAsync(&host[i]->bytes[0], device[i], host[i]->NumBytes(), cudaMemcpyDeviceToHost, stream_),
              "download");
          !s.ok()) {
        return s;
      }
      downloaded_ += host[i]->NumBytes();
    }
    if (auto s = CudaStatus(cudaStreamSynchronize(stream_), "grouped quantize"); !s.ok()) return s;
    return out;
  }

  // Device copies of resident shards, kept while the shard is alive on the
  // worker (the store drops its reference on delete or replacement; the next
  // call frees the copy).
  struct Cached {
    std::weak_ptr<const HostTensor> host;
    void* device = nullptr;
  };
  // A step's small upload (the group sizes) from a pinned buffer: the copy
  // is queued, not staged through the driver's pageable path (a blocking
  // host copy of its own). One buffer: a copy that a step which returned
  // early left in flight is waited for before the buffer is written again.
  absl::StatusOr<void*> UploadSmall(Scratch* scratch, const void* host, int64_t bytes) {
    if (bytes > kSmallPinnedBytes || bytes == 0) return scratch->Upload(host, bytes, stream_);
    if (small_pinned_ == nullptr) {
      if (small_pinned_refused_) return scratch->Upload(host, bytes, stream_);
      if (cudaMallocHost(&small_pinned_, kSmallPinnedBytes) != cudaSuccess) {
        (void)cudaGetLastError();
        small_pinned_ = nullptr;
        small_pinned_refused_ = true;  // no pinned memory to spare: the pageable path from now on
        return scratch->Upload(host, bytes, stream_);
      }
    }
    if (small_pinned_in_flight_) {
      if (auto s = CudaStatus(cudaStreamSynchronize(stream_), "upload"); !s.ok()) return s;
      small_pinned_in_flight_ = false;
    }
    auto p = scratch->Take(bytes);
    if (!p.ok()) return p;
    std::memcpy(small_pinned_, host, static_cast<size_t>(bytes));
    if (auto s = CudaStatus(cudaMemcpyAsync(*p, small_pinned_, bytes, cudaMemcpyHostToDevice, stream_), "upload");
        !s.ok()) {
      return s;
    }
    small_pinned_in_flight_ = true;
    uploaded_ += bytes;
    return p;
  }

  // The device copy of a resident shard, kept while the shard lives. When the
  // device is full, copies of other live shards (all but `keep`, the other
  // operand of this call) are dropped and made again when next used.
  absl::StatusOr<void*> DeviceCopy(const std::shared_ptr<const HostTensor>& host, const HostTensor* keep = nullptr) {
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (it->second.host.expired()) {
        runner_->pool().Free(it->second.device);
        it = cache_.erase(it);
      } else {
        ++it;
      }
    }
    auto it = cache_.find(host.get());
    if (it != cache_.end()) return it->second.device;
    auto d = runner_->pool().Allocate(std::max<int64_t>(host->NumBytes(), 256));
    if (!d.ok() && cache_.size() > (keep != nullptr && cache_.count(keep) ? 1u : 0u)) {
      for (auto e = cache_.begin(); e != cache_.end();) {
        if (e->first == keep) {
          ++e;
          continue;
        }
        runner_->pool().Free(e->second.device);
        e = cache_.erase(e);
      }
      d = runner_->pool().Allocate(std::max<int64_t>(host->NumBytes(), 256));
    }
    if (!d.ok()) return d.status();
    if (host->NumBytes() > 0) {
      if (auto s =
              CudaStatus(cudaMemcpyAsync(*d, host->bytes.data(), host->NumBytes(), cudaMemcpyHostToDevice, stream_),
                         "upload resident");
          !s.ok()) {
        runner_->pool().Free(*d);
        return s;
      }
      uploaded_ += host->NumBytes();
    }
    cache_[host.get()] = Cached{host, *d};
    return *d;
  }

  // The device copy of a resident weight's scales in the FP8 kernel's
  // layout, made once per shard and freed after the shard is gone.
  absl::StatusOr<void*> WeightScales(const LocalGemm& g, int64_t rows, int64_t k,
                                     const std::vector<int64_t>& weight_groups, bool tensor) {
    for (auto it = scale_cache_.begin(); it != scale_cache_.end();) {
      if (it->second.host.expired()) {
        cudaFree(it->second.device);
        it = scale_cache_.erase(it);
      } else {
        ++it;
      }
    }
    const std::shared_ptr<const HostTensor>& host = g.resident_rhs_scale_inv;
    if (auto it = scale_cache_.find(host.get()); it != scale_cache_.end()) return it->second.device;
    HostTensor converted;
    if (tensor) {
      converted = *host;
    } else {
      auto c = QuantizeScalesFromGemm(g.rhs_mode, *host, rows, k, weight_groups);
      if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat("rhs_", c.status().message()));
      converted = std::move(*c);
    }
    void* d = nullptr;
    if (auto s = CudaStatus(cudaMalloc(&d, std::max<int64_t>(converted.NumBytes(), 256)), "weight scales"); !s.ok()) {
      return s;
    }
    if (auto s = CudaStatus(cudaMemcpy(d, converted.bytes.data(), converted.NumBytes(), cudaMemcpyHostToDevice),
                            "upload weight scales");
        !s.ok()) {
      cudaFree(d);
      return s;
    }
    uploaded_ += converted.NumBytes();
    scale_cache_[host.get()] = Cached{host, d};
    return d;
  }

  int device_;
  int64_t total_memory_ = 0;
  std::atomic<int64_t> uploaded_{0}, downloaded_{0};
  static constexpr int64_t kStagingBytes = int64_t{16} << 20;
  void* staging_[2] = {nullptr, nullptr};  // pinned, for DownloadInto (the step's thread only)
  cudaEvent_t staged_[2] = {nullptr, nullptr};
  static constexpr int64_t kSmallPinnedBytes = int64_t{64} << 10;
  void* small_pinned_ = nullptr;  // UploadSmall's (the step's thread only)
  bool small_pinned_in_flight_ = false;
  bool small_pinned_refused_ = false;  // cudaMallocHost failed once: not asked again
  bool said_device_gather_ = false;
  static constexpr int64_t kLtWorkspaceBytes = int64_t{32} << 20;
  cublasLtHandle_t lt_ = nullptr;  // the FP8 GEMM's, made on first use
  void* lt_workspace_ = nullptr;
  std::map<const HostTensor*, Cached> cache_;
  std::map<const HostTensor*, Cached> scale_cache_;  // WeightScales
  std::unique_ptr<cuda::GroupedGemmRunner> runner_;
  cudaStream_t stream_;
  CudaClientMemory client_memory_{device_, stream_, &uploaded_, &downloaded_};  // after stream_
  std::string name_;
  std::unique_ptr<Backend> cpu_;
  FaultInjector* faults_;  // --fault_injection's (null: none)
  mutable std::mutex lost_mu_;
  absl::Status lost_;  // set once a sticky error has lost the CUDA context
};

}  // namespace

std::unique_ptr<Backend> MakeCudaBackend(int device, FaultInjector* faults, std::string* error) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    *error = cudaGetErrorString(err);
    return nullptr;
  }
  cudaDeviceProp prop;
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess) {
    *error = cudaGetErrorString(err);
    return nullptr;
  }
  cuda::RunnerOptions options;
  options.device = device;
  auto runner = cuda::GroupedGemmRunner::Create(options);
  if (!runner.ok()) {
    *error = std::string(runner.status().message());
    return nullptr;
  }
  cudaStream_t stream;
  if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); err != cudaSuccess) {
    *error = cudaGetErrorString(err);
    return nullptr;
  }
  // Kept outputs come from the device's stream-ordered pool: it keeps what
  // they free for the next ones instead of handing it back to the driver.
  cudaMemPool_t mempool;
  if (cudaDeviceGetDefaultMemPool(&mempool, device) == cudaSuccess) {
    uint64_t keep_all = UINT64_MAX;
    cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &keep_all);
  }
  return std::make_unique<CudaBackend>(
      device, static_cast<int64_t>(prop.totalGlobalMem), std::move(*runner), stream,
      absl::StrCat("cuda:", device, " ", prop.name, " (sm_", prop.major, prop.minor, ")"), faults);
}

}  // namespace shardgemm
