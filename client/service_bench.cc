// The service benchmark: per preset, the local grouped GEMM and the same
// request through a running service (coordinator and workers on loopback),
// in one run, so the ratio is honest.
//
//   shardgemm-service-bench --coordinator=HOST:PORT --presets presets.json
//       [--local=cuda|cpu] [--iters 20] [--warmup 3] [--returned] [--scale_rows 1.0]
//       [--lhs_spec '(ep, None)' --rhs_spec '(ep, None, None)' --group_sizes_spec '(ep,)']
//       [--concurrency 1,2,4,8 | --request_rate 100,200 [--arrivals poisson|constant] [--max_outstanding 16]]
//       [--activations resident|inline|shared_memory|cuda_ipc|direct] [--check every|last]
//
// Weights are put resident first; each call then names them, takes its
// activations the --activations way, and keeps its output resident (or,
// with --returned, gets it back). A result line per preset and load level,
// nccl-tests style: the local op's p50, the server's, the slowest worker's
// and the round trip's p50 / p90, the server time over the local op, the
// time it adds, the host<->device bytes one call moved, and whether every
// checked output matched the local one; then the level's throughput (calls/s
// and GB/s of the tensor bytes the client sent and got back), rtt p99, and
// the wrong-value count. --json appends one line per level with p50 / p90 /
// p99 of each, the counts, the bytes, the p50 of each phase of the server
// time (GroupedGemmResponse.phases), and on CUDA the pinned
// host-to-device copy of lhs and device-to-host copy of the output (PCIe's
// floor for those bytes).
// The local op: --local=cuda runs the CUDA grouped GEMM on device buffers
// (cudaEvents around each call), --local=cpu the CPU kernels with
// --threads (wall clock). For a sharded mesh, give the specs: the local op
// is then one worker's share (the preset is per worker, as its note says)
// and the request's global shapes are the preset's times the row shards.
// Load levels, as Triton's perf_analyzer: --concurrency N is N callers at
// once (each its own client, --iters calls each, each its own kept output
// or output region); --request_rate R an open loop, --iters requests due at
// Poisson or constant times, sent by at most --max_outstanding callers, one
// due while all are busy sent late and counted. Percentiles are over all
// calls of a level; throughput is completed calls over the wall clock from
// the release to the last answer.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/connect_flags.h"
#include "client/output_checker.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/cpu/fp8_grouped_gemm.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/grouped_gemm.h"
#include "kernels/cuda/quantize.h"
#include "kernels/fp8.h"
#include "platform/busy_poll.h"
#include "platform/busy_poll_flags.h"
#include "platform/shared_memory.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051",
          "coordinator address: HOST:PORT, or unix:PATH for its --client_socket");
ABSL_FLAG(std::string, call_socket, "",
          "send the GroupedGemm calls as frames on the coordinator's --call_socket at this path (same host and "
          "user) instead of gRPC; the other calls stay on --coordinator");
ABSL_FLAG(std::string, presets, "", "presets JSON (anchors/presets.json format)");
ABSL_FLAG(std::string, only, "", "run only the presets whose name contains this");
ABSL_FLAG(std::string, local, "cuda", "where the local op runs: cuda or cpu");
ABSL_FLAG(int, threads, 0, "CPU local op threads (0: hardware concurrency)");
ABSL_FLAG(int, iters, 20, "timed calls per preset and side");
ABSL_FLAG(int, warmup, 3, "untimed calls first");
ABSL_FLAG(std::string, concurrency, "1",
          "callers at once in the timed calls, one count or a list (1,2,4,8,16,32,64): a result line per "
          "count; each caller its own client, --iters calls each");
ABSL_FLAG(std::string, request_rate, "",
          "an open loop instead of --concurrency: requests per second, one rate or a list (a result line per "
          "rate); --iters requests per rate, due at --arrivals times, sent by at most --max_outstanding callers");
ABSL_FLAG(std::string, arrivals, "poisson", "--request_rate: poisson (exponential gaps) or constant arrivals");
ABSL_FLAG(int, max_outstanding, 16,
          "--request_rate: requests in flight at most; one due while all are busy is sent late (counted)");
ABSL_FLAG(std::string, check, "every",
          "every: each returned output checked (byte for byte against the first answer, else within "
          "tolerance of the local op's); last: each caller's last only. Kept outputs: each caller's last, "
          "read back after the level");
ABSL_FLAG(bool, returned, false, "return the output to the client instead of keeping it resident");
ABSL_FLAG(std::string, activations, "resident",
          "how lhs reaches the workers each call: resident (put once), inline (in every request, through the "
          "coordinator), shared_memory (a POSIX region of this host the workers read; with --returned the output "
          "is written into one too; the coordinator needs --shared_memory), cuda_ipc (lhs in a CUDA allocation "
          "of the bench's, on the workers' GPU, which they read in place; with --returned the output is written "
          "into one too; CUDA workers on this host, the coordinator with --shared_memory), direct (each call "
          "stages lhs's blocks on the workers and, with --returned, fetches the output blocks from them: the "
          "direct path)");
ABSL_FLAG(std::string, output_path, "",
          "with --returned, how the output comes back: coordinator (in the coordinator's answer), direct (held "
          "on the workers, in pinned memory on CUDA, and fetched from them: the direct path's fetch) or "
          "shared_memory (the workers write it into a POSIX region of this host; the coordinator needs "
          "--shared_memory); default: direct with --activations=direct, shared_memory with "
          "--activations=shared_memory, else coordinator. A cuda_ipc output goes into a CUDA region");
ABSL_FLAG(std::string, dtype, "bf16", "operand and output dtype: bf16 or f32");
ABSL_FLAG(double, scale_rows, 1.0, "scale every preset's rows per group (small CPU runs)");
ABSL_FLAG(double, scale_dims, 1.0, "scale every preset's k and n (small CPU runs)");
ABSL_FLAG(std::string, lhs_spec, "", "lhs partition spec of the request");
ABSL_FLAG(std::string, rhs_spec, "", "rhs partition spec of the request");
ABSL_FLAG(std::string, group_sizes_spec, "", "group_sizes partition spec of the request");
ABSL_FLAG(int, row_shards, 1, "row shards of the request's lhs (the product of the lhs spec's row axes)");
ABSL_FLAG(int, expert_shards, 1, "expert shards of the request's rhs (the ep size when rhs dim 0 is split)");
ABSL_FLAG(std::string, json, "", "append one JSON line per preset here");
ABSL_FLAG(std::string, fp8_scaling, "current",
          "--op=fp8: current (per-group tensor scales) or block (1x128 activations x 128x128 weights)");
ABSL_FLAG(std::string, weight_group_sizes_spec, "", "--op=fp8: group_sizes spec of the weights' quantize (ep)");
ABSL_FLAG(std::string, op, "gemm",
          "gemm: the BF16 grouped GEMM; fp8: the fused quantize + FP8 grouped GEMM (per-group current scaling, "
          "E4M3) on weights quantized once and kept resident ([G, N, K]); the local op is the same quantize + "
          "FP8 GEMM");

namespace shardgemm {

namespace {

// For --coordinator: TLS or, on its Unix socket, local credentials.
ClientCredentials CoordinatorCredentials() {
  return ClientCredentialsFromFlags("shardgemm-service-bench", absl::GetFlag(FLAGS_coordinator));
}

// --busy_poll: this process's cores kept from halting while its calls are in
// flight, as the servers' own flag does for theirs (a same-host client's
// wake-up is part of its round trip). Null: off.
platform::BusyPoller* busy_poller = nullptr;

struct Preset {
  std::string name;
  int64_t g, m, k, n;
};

struct Stats {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
// Nearest-rank percentiles (so p50 <= p90 <= p99 always) and the mean.
Stats Percentiles(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  double sum = 0;
  for (double x : v) sum += x;
  return {at(0.5), at(0.9), at(0.99), sum / static_cast<double>(v.size())};
}

HostTensor Random(DType dtype, std::vector<int64_t> shape, uint64_t seed) {
  HostTensor t = *ZerosTensor(DType::kF32, shape);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.data<float>()[i] = u(rng);
  return dtype == DType::kF32 ? t : *ConvertFloatTensor(t, dtype);
}

// The local op, timed per call (seconds).
class LocalOp {
 public:
  virtual ~LocalOp() = default;
  virtual absl::StatusOr<double> Run() = 0;
  virtual absl::StatusOr<HostTensor> Output() = 0;
};

class CpuLocalOp : public LocalOp {
 public:
  CpuLocalOp(const HostTensor& lhs, const HostTensor& rhs, std::vector<int64_t> sizes, int threads)
      : lhs_(lhs), rhs_(rhs), sizes_(std::move(sizes)), threads_(threads) {
    out_ = *ZerosTensor(lhs.dtype, {lhs.shape[0], rhs.shape[2]});
  }
  absl::StatusOr<double> Run() override {
    cpu::GroupedGemmArgs a;
    a.lhs_dtype = a.rhs_dtype = a.out_dtype = lhs_.dtype;
    a.lhs = lhs_.bytes.data();
    a.rhs = rhs_.bytes.data();
    a.out = &out_.bytes[0];
    a.m = lhs_.shape[0];
    a.k = lhs_.shape[1];
    a.n = rhs_.shape[2];
    a.num_groups = static_cast<int64_t>(sizes_.size());
    a.group_sizes = sizes_.data();
    const absl::Time start = absl::Now();
    if (auto s = cpu::GroupedGemmRaggedM(a, threads_); !s.ok()) return s;
    return absl::ToDoubleSeconds(absl::Now() - start);
  }
  absl::StatusOr<HostTensor> Output() override { return out_; }

 private:
  const HostTensor& lhs_;
  const HostTensor& rhs_;
  std::vector<int64_t> sizes_;
  int threads_;
  HostTensor out_;
};

class CudaLocalOp : public LocalOp {
 public:
  static absl::StatusOr<std::unique_ptr<CudaLocalOp>> Create(const HostTensor& lhs, const HostTensor& rhs,
                                                             std::vector<int64_t> sizes) {
    auto runner = cuda::GroupedGemmRunner::Create();
    if (!runner.ok()) return runner.status();
    auto op = std::unique_ptr<CudaLocalOp>(new CudaLocalOp);
    op->runner_ = std::move(*runner);
    op->sizes_ = std::move(sizes);
    op->out_ = *ZerosTensor(lhs.dtype, {lhs.shape[0], rhs.shape[2]});
    op->lhs_bytes_ = lhs.NumBytes();
    cudaStreamCreate(&op->stream_);
    cudaEventCreate(&op->begin_);
    cudaEventCreate(&op->end_);
    auto upload = [&](const void* host, int64_t bytes) -> absl::StatusOr<void*> {
      auto d = op->runner_->pool().Allocate(std::max<int64_t>(bytes, 256));
      if (!d.ok()) return d;
      if (cudaMemcpy(*d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("upload failed");
      }
      return d;
    };
    auto d_lhs = upload(lhs.bytes.data(), lhs.NumBytes());
    auto d_rhs = upload(rhs.bytes.data(), rhs.NumBytes());
    auto d_sizes = upload(op->sizes_.data(), static_cast<int64_t>(op->sizes_.size()) * 8);
    auto d_out = op->runner_->pool().Allocate(op->out_.NumBytes());
    for (auto* s : {&d_lhs, &d_rhs, &d_sizes, &d_out}) {
      if (!s->ok()) return s->status();
    }
    cuda::DeviceGroupedGemmArgs& a = op->args_;
    a.in_dtype = a.out_dtype = lhs.dtype;
    a.lhs = *d_lhs;
    a.rhs = *d_rhs;
    a.out = *d_out;
    a.m = lhs.shape[0];
    a.k = lhs.shape[1];
    a.n = rhs.shape[2];
    a.num_groups = static_cast<int64_t>(op->sizes_.size());
    a.group_sizes_device = static_cast<const int64_t*>(*d_sizes);
    a.group_sizes_host = op->sizes_.data();
    return op;
  }
  absl::StatusOr<double> Run() override {
    cudaEventRecord(begin_, stream_);
    if (auto s = runner_->RaggedM(args_, stream_); !s.ok()) return s;
    cudaEventRecord(end_, stream_);
    if (cudaEventSynchronize(end_) != cudaSuccess) return absl::InternalError("local GEMM failed");
    float ms = 0;
    cudaEventElapsedTime(&ms, begin_, end_);
    return ms * 1e-3;
  }
  // The device-to-host copy of the output from pinned memory (what returning
  // it costs at best), timed per call.
  absl::StatusOr<double> PinnedDownload() {
    if (pinned_ == nullptr && cudaMallocHost(&pinned_, out_.NumBytes()) != cudaSuccess) {
      return absl::ResourceExhaustedError("no pinned memory for the output");
    }
    cudaEventRecord(begin_, stream_);
    cudaMemcpyAsync(pinned_, args_.out, out_.NumBytes(), cudaMemcpyDeviceToHost, stream_);
    cudaEventRecord(end_, stream_);
    if (cudaEventSynchronize(end_) != cudaSuccess) return absl::InternalError("download failed");
    float ms = 0;
    cudaEventElapsedTime(&ms, begin_, end_);
    return ms * 1e-3;
  }
  // The host-to-device copy of lhs from pinned memory (what sending it
  // costs at best), timed per call, into a device buffer of its own.
  absl::StatusOr<double> PinnedUpload() {
    if (pinned_lhs_ == nullptr) {
      if (cudaMallocHost(&pinned_lhs_, lhs_bytes_) != cudaSuccess) {
        return absl::ResourceExhaustedError("no pinned memory for lhs");
      }
      auto d = runner_->pool().Allocate(std::max<int64_t>(lhs_bytes_, 256));
      if (!d.ok()) return d.status();
      upload_target_ = *d;
    }
    cudaEventRecord(begin_, stream_);
    cudaMemcpyAsync(upload_target_, pinned_lhs_, lhs_bytes_, cudaMemcpyHostToDevice, stream_);
    cudaEventRecord(end_, stream_);
    if (cudaEventSynchronize(end_) != cudaSuccess) return absl::InternalError("upload failed");
    float ms = 0;
    cudaEventElapsedTime(&ms, begin_, end_);
    return ms * 1e-3;
  }
  absl::StatusOr<HostTensor> Output() override {
    if (cudaMemcpy(&out_.bytes[0], args_.out, out_.NumBytes(), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return absl::InternalError("download failed");
    }
    return out_;
  }
  ~CudaLocalOp() override {
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    if (pinned_lhs_ != nullptr) cudaFreeHost(pinned_lhs_);
  }

 private:
  CudaLocalOp() = default;
  std::unique_ptr<cuda::GroupedGemmRunner> runner_;
  cuda::DeviceGroupedGemmArgs args_;
  std::vector<int64_t> sizes_;
  HostTensor out_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
  void* pinned_ = nullptr;
  void* pinned_lhs_ = nullptr;
  void* upload_target_ = nullptr;
  int64_t lhs_bytes_ = 0;
};

// The local quantize + FP8 GEMM: lhs (BF16 [M, K]) quantized per group
// (current scaling, E4M3) then the FP8 grouped GEMM against weights
// quantized once ([G, N, K], one scale per expert). BF16 output.
GroupedQuantizeArgs CurrentQuantizeArgs(const void* x, int64_t m, int64_t k, const std::vector<int64_t>& sizes,
                                        ScalingMode mode = ScalingMode::kCurrent) {
  GroupedQuantizeArgs a;
  a.x = x;
  a.x_dtype = DType::kBF16;
  a.m = m;
  a.k = k;
  a.group_sizes = sizes.data();
  a.num_groups = static_cast<int64_t>(sizes.size());
  a.mode = mode;
  a.rowwise = true;
  return a;
}

bool BlockFp8() { return absl::GetFlag(FLAGS_fp8_scaling) == "block"; }

class CudaFp8LocalOp : public LocalOp {
 public:
  static absl::StatusOr<std::unique_ptr<CudaFp8LocalOp>> Create(const HostTensor& lhs, const HostTensor& w,
                                                                std::vector<int64_t> sizes) {
    auto op = std::unique_ptr<CudaFp8LocalOp>(new CudaFp8LocalOp);
    op->m_ = lhs.shape[0];
    op->k_ = lhs.shape[1];
    op->g_ = w.shape[0];
    op->n_ = w.shape[1];
    op->sizes_ = std::move(sizes);
    op->weight_sizes_.assign(static_cast<size_t>(op->g_), op->n_);
    op->out_ = *ZerosTensor(DType::kBF16, {op->m_, op->n_});
    cudaStreamCreate(&op->stream_);
    cudaEventCreate(&op->begin_);
    cudaEventCreate(&op->end_);
    if (cublasLtCreate(&op->lt_) != CUBLAS_STATUS_SUCCESS) return absl::InternalError("cublasLtCreate failed");
    auto alloc = [&](int64_t bytes) -> void* {
      void* p = nullptr;
      if (cudaMalloc(&p, std::max<int64_t>(bytes, 256)) != cudaSuccess) return nullptr;
      op->held_.push_back(p);
      return p;
    };
    void* d_w = alloc(w.NumBytes());
    op->lhs_ = alloc(lhs.NumBytes());
    op->lhs8_ = alloc(op->m_ * op->k_);
    const ScalingMode lhs_mode = BlockFp8() ? ScalingMode::kBlock1x128 : ScalingMode::kCurrent;
    const ScalingMode w_mode = BlockFp8() ? ScalingMode::kBlock128x128 : ScalingMode::kCurrent;
    auto lhs_layout = GetQuantizeLayout(CurrentQuantizeArgs(nullptr, op->m_, op->k_, op->sizes_, lhs_mode));
    auto w_layout = GetQuantizeLayout(CurrentQuantizeArgs(nullptr, op->g_ * op->n_, op->k_, op->weight_sizes_, w_mode));
    if (!lhs_layout.ok()) return lhs_layout.status();
    if (!w_layout.ok()) return w_layout.status();
    op->lhs_scale_ = alloc(lhs_layout->rowwise_scale_elems * 4);
    op->lhs_amax_ = alloc(static_cast<int64_t>(op->sizes_.size()) * 4);
    op->w8_ = alloc(w.NumElements());
    op->w_scale_ = alloc(w_layout->rowwise_scale_elems * 4);
    void* w_amax = alloc(op->g_ * 4);
    op->d_out_ = alloc(op->out_.NumBytes());
    op->workspace_ = alloc(kWorkspace);
    op->d_sizes_ = alloc(static_cast<int64_t>(op->sizes_.size()) * 8);
    for (void* p : op->held_) {
      if (p == nullptr) return absl::ResourceExhaustedError("local FP8 op: cudaMalloc failed");
    }
    cudaMemcpy(d_w, w.bytes.data(), w.NumBytes(), cudaMemcpyHostToDevice);
    cudaMemcpy(op->lhs_, lhs.bytes.data(), lhs.NumBytes(), cudaMemcpyHostToDevice);
    cudaMemcpy(op->d_sizes_, op->sizes_.data(), op->sizes_.size() * 8, cudaMemcpyHostToDevice);
    GroupedQuantizeArgs wq = CurrentQuantizeArgs(d_w, op->g_ * op->n_, op->k_, op->weight_sizes_, w_mode);
    wq.rowwise_data = static_cast<uint8_t*>(op->w8_);
    wq.rowwise_scale_inv = op->w_scale_;
    wq.amax = BlockFp8() ? nullptr : static_cast<float*>(w_amax);
    if (auto s = cuda::GroupedQuantize(wq, op->stream_); !s.ok()) return s;
    if (cudaStreamSynchronize(op->stream_) != cudaSuccess) return absl::InternalError("weight quantize failed");
    return op;
  }
  absl::StatusOr<double> Run() override {
    cudaEventRecord(begin_, stream_);
    GroupedQuantizeArgs q = CurrentQuantizeArgs(lhs_, m_, k_, sizes_,
                                                BlockFp8() ? ScalingMode::kBlock1x128 : ScalingMode::kCurrent);
    q.rowwise_data = static_cast<uint8_t*>(lhs8_);
    q.rowwise_scale_inv = lhs_scale_;
    q.amax = BlockFp8() ? nullptr : static_cast<float*>(lhs_amax_);
    if (auto s = cuda::GroupedQuantize(q, stream_); !s.ok()) return s;
    cuda::Fp8GroupedGemmArgs a;
    if (BlockFp8()) {
      a.lhs_mode = ScalingMode::kBlock1x128;
      a.rhs_mode = ScalingMode::kBlock128x128;
    }
    a.lhs = static_cast<const uint8_t*>(lhs8_);
    a.lhs_scale_inv = lhs_scale_;
    a.rhs = static_cast<const uint8_t*>(w8_);
    a.rhs_scale_inv = w_scale_;
    a.m = m_;
    a.n = n_;
    a.k = k_;
    a.group_sizes = sizes_.data();
    a.device_group_sizes = static_cast<const int64_t*>(d_sizes_);  // our sm90 kernel, as the worker runs it
    a.num_groups = static_cast<int64_t>(sizes_.size());
    a.out = d_out_;
    a.out_dtype = DType::kBF16;
    a.workspace = workspace_;
    a.workspace_bytes = kWorkspace;
    if (auto s = cuda::Fp8GroupedGemm(a, lt_, stream_); !s.ok()) return s;
    cudaEventRecord(end_, stream_);
    if (cudaEventSynchronize(end_) != cudaSuccess) return absl::InternalError("local FP8 GEMM failed");
    float ms = 0;
    cudaEventElapsedTime(&ms, begin_, end_);
    return ms * 1e-3;
  }
  absl::StatusOr<HostTensor> Output() override {
    if (cudaMemcpy(&out_.bytes[0], d_out_, out_.NumBytes(), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return absl::InternalError("download failed");
    }
    return out_;
  }
  ~CudaFp8LocalOp() override {
    for (void* p : held_) {
      if (p != nullptr) cudaFree(p);
    }
    if (lt_ != nullptr) cublasLtDestroy(lt_);
  }

 private:
  static constexpr int64_t kWorkspace = int64_t{32} << 20;
  CudaFp8LocalOp() = default;
  int64_t m_ = 0, k_ = 0, g_ = 0, n_ = 0;
  std::vector<int64_t> sizes_, weight_sizes_;
  std::vector<void*> held_;
  void *lhs_ = nullptr, *lhs8_ = nullptr, *lhs_scale_ = nullptr, *lhs_amax_ = nullptr, *w8_ = nullptr,
       *w_scale_ = nullptr, *d_out_ = nullptr, *workspace_ = nullptr, *d_sizes_ = nullptr;
  HostTensor out_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
};

// The same on the CPU reference kernels (wall clock).
class CpuFp8LocalOp : public LocalOp {
 public:
  CpuFp8LocalOp(const HostTensor& lhs, const HostTensor& w, std::vector<int64_t> sizes, int threads)
      : lhs_(lhs), sizes_(std::move(sizes)), threads_(threads) {
    const int64_t g = w.shape[0], n = w.shape[1], k = w.shape[2];
    std::vector<int64_t> weight_sizes(static_cast<size_t>(g), n);
    w8_ = *ZerosTensor(DType::kF8E4M3, w.shape);
    w_scale_ = *ZerosTensor(DType::kF32, {g});
    HostTensor amax = *ZerosTensor(DType::kF32, {g});
    GroupedQuantizeArgs wq = CurrentQuantizeArgs(w.bytes.data(), g * n, k, weight_sizes);
    wq.rowwise_data = w8_.data<uint8_t>();
    wq.rowwise_scale_inv = w_scale_.data<float>();
    wq.amax = amax.data<float>();
    (void)cpu::GroupedQuantize(wq);
    out_ = *ZerosTensor(DType::kBF16, {lhs.shape[0], n});
  }
  absl::StatusOr<double> Run() override {
    const absl::Time start = absl::Now();
    const int64_t m = lhs_.shape[0], k = lhs_.shape[1];
    HostTensor x8 = *ZerosTensor(DType::kF8E4M3, {m, k});
    HostTensor xs = *ZerosTensor(DType::kF32, {static_cast<int64_t>(sizes_.size())});
    HostTensor amax = xs;
    GroupedQuantizeArgs q = CurrentQuantizeArgs(lhs_.bytes.data(), m, k, sizes_);
    q.rowwise_data = x8.data<uint8_t>();
    q.rowwise_scale_inv = xs.data<float>();
    q.amax = amax.data<float>();
    if (auto s = cpu::GroupedQuantize(q); !s.ok()) return s;
    cpu::Fp8GroupedGemmArgs a;
    a.lhs_dtype = a.rhs_dtype = DType::kF8E4M3;
    a.lhs = x8.data<uint8_t>();
    a.rhs = w8_.data<uint8_t>();
    a.lhs_scale_inv = xs.data<float>();
    a.rhs_scale_inv = w_scale_.data<float>();
    a.m = m;
    a.k = k;
    a.n = w8_.shape[1];
    a.num_groups = static_cast<int64_t>(sizes_.size());
    a.group_sizes = sizes_.data();
    a.rhs_transposed = true;
    a.out_dtype = DType::kBF16;
    a.out = &out_.bytes[0];
    if (auto s = cpu::Fp8GroupedGemm(a, threads_); !s.ok()) return s;
    return absl::ToDoubleSeconds(absl::Now() - start);
  }
  absl::StatusOr<HostTensor> Output() override { return out_; }

 private:
  const HostTensor& lhs_;
  std::vector<int64_t> sizes_;
  int threads_;
  HostTensor w8_, w_scale_, out_;
};

// A POSIX shared-memory region the bench creates, registers under `name`,
// and removes (unregistered, unlinked) when it goes.
class BenchRegion {
 public:
  static absl::StatusOr<std::unique_ptr<BenchRegion>> Create(ShardGemmClient& client, const std::string& name,
                                                             int64_t bytes) {
    const std::string key = absl::StrCat("/shardgemm_bench_", getpid(), "_", name);
    const int fd = shm_open(key.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    if (fd < 0) return absl::InternalError(absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
    const bool sized = ftruncate(fd, bytes) == 0;
    close(fd);
    if (!sized) {
      shm_unlink(key.c_str());
      return absl::InternalError(absl::StrCat("ftruncate ", key, ": ", std::strerror(errno)));
    }
    auto mapping = platform::SharedMemoryMapping::Map(key, static_cast<uint64_t>(bytes), /*writable=*/true, name);
    if (!mapping.ok()) {
      shm_unlink(key.c_str());
      return mapping.status();
    }
    auto region = std::unique_ptr<BenchRegion>(new BenchRegion(client, name, key, std::move(*mapping)));
    if (auto s = client.RegisterSharedMemory(name, key, static_cast<uint64_t>(bytes)); !s.ok()) {
      region->registered_ = false;
      return absl::Status(s.code(), absl::StrCat("register ", name, ": ", s.message()));
    }
    return region;
  }
  ~BenchRegion() {
    if (registered_) (void)client_.UnregisterSharedMemory(name_);
    shm_unlink(key_.c_str());
  }
  char* data() const { return mapping_.data(); }

 private:
  BenchRegion(ShardGemmClient& client, std::string name, std::string key, platform::SharedMemoryMapping mapping)
      : client_(client), name_(std::move(name)), key_(std::move(key)), mapping_(std::move(mapping)) {}
  ShardGemmClient& client_;
  std::string name_, key_;
  platform::SharedMemoryMapping mapping_;
  bool registered_ = true;
};

// A CUDA allocation of the bench's (on the GPU the CUDA workers use), exported
// and registered under `name`; unregistered and freed when it goes.
class BenchCudaRegion {
 public:
  static absl::StatusOr<std::unique_ptr<BenchCudaRegion>> Create(ShardGemmClient& client, const std::string& name,
                                                                 int64_t bytes) {
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(bytes)); e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc ", bytes, ": ", cudaGetErrorString(e)));
    }
    auto region = std::unique_ptr<BenchCudaRegion>(new BenchCudaRegion(client, name, p));
    cudaIpcMemHandle_t handle;
    if (cudaError_t e = cudaIpcGetMemHandle(&handle, p); e != cudaSuccess) {
      return absl::FailedPreconditionError(absl::StrCat("cudaIpcGetMemHandle: ", cudaGetErrorString(e)));
    }
    const std::string bytes_of(reinterpret_cast<const char*>(&handle), sizeof(handle));
    if (auto s = client.RegisterCudaMemory(name, bytes_of, static_cast<uint64_t>(bytes)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("register ", name, ": ", s.message()));
    }
    region->registered_ = true;
    return region;
  }
  ~BenchCudaRegion() {
    if (registered_) (void)client_.UnregisterSharedMemory(name_);
    cudaFree(data_);
  }
  char* data() const { return static_cast<char*>(data_); }

 private:
  BenchCudaRegion(ShardGemmClient& client, std::string name, void* data)
      : client_(client), name_(std::move(name)), data_(data) {}
  ShardGemmClient& client_;
  std::string name_;
  void* data_;
  bool registered_ = false;
};

// GroupedGemmResponse.phases, in the order a request meets them (they add
// up to its server time): the JSON's names and their accessors.
struct Phase {
  const char* name;
  double (v1::RequestPhases::*seconds)() const;
};
constexpr Phase kPhases[] = {
    {"plan", &v1::RequestPhases::plan_seconds},         {"queue", &v1::RequestPhases::queue_seconds},
    {"transfer", &v1::RequestPhases::transfer_seconds}, {"kernel", &v1::RequestPhases::kernel_seconds},
    {"collective", &v1::RequestPhases::collective_seconds},
    {"transport", &v1::RequestPhases::transport_seconds}, {"assemble", &v1::RequestPhases::assemble_seconds},
};
constexpr size_t kNumPhases = sizeof(kPhases) / sizeof(kPhases[0]);

// One caller of the timed calls: its own client (and so its own channel),
// its own kept output name, or, returned through shared memory, its own
// output region.
struct Caller {
  std::unique_ptr<ShardGemmClient> client;
  v1::GroupedGemmRequest request;
  std::string kept_as;        // the output kept resident under this name; empty: returned
  char* out = nullptr;  // returned into shared memory: its slice of the output region
  char* device_out = nullptr;  // returned into a CUDA region: its slice there
  mutable std::string device_out_copy;  // what a check reads of it
  int64_t out_bytes = 0;
  bool direct = false;  // GroupedGemmDirect: stage the inline lhs, fetch a returned output from the workers

  absl::StatusOr<v1::GroupedGemmResponse> Send() {
    return direct ? client->GroupedGemmDirect(request) : client->GroupedGemm(request);
  }
  // Of a serialized message of `bytes` holding `tensor`, what crossed the
  // coordinator's wire: on the direct path the tensor's bytes went to and
  // came from the workers instead.
  int64_t CoordinatorBytes(size_t bytes, const v1::Tensor& tensor) const {
    return static_cast<int64_t>(bytes) - (direct ? static_cast<int64_t>(tensor.data().size()) : 0);
  }

  // Before a checked call (outside its timing): every byte of the output's
  // slice of a region 0xff (a NaN in every float dtype), so an answer that
  // never wrote it fails its check instead of passing on an earlier call's
  // bytes. False when the CUDA region could not be written (counted wrong).
  bool Poison() {
    if (out != nullptr) std::memset(out, 0xff, static_cast<size_t>(out_bytes));
    if (device_out != nullptr) {
      return cudaMemset(device_out, 0xff, static_cast<size_t>(out_bytes)) == cudaSuccess &&
             cudaDeviceSynchronize() == cudaSuccess;
    }
    return true;
  }
  bool poisons() const { return out != nullptr || device_out != nullptr; }

  // A returned answer's output bytes (valid while `response` and the next call wait).
  absl::string_view ReturnedBytes(const v1::GroupedGemmResponse& response) const {
    if (out != nullptr) return absl::string_view(out, static_cast<size_t>(out_bytes));
    if (device_out != nullptr) {
      device_out_copy.resize(static_cast<size_t>(out_bytes));
      if (cudaMemcpy(&device_out_copy[0], device_out, static_cast<size_t>(out_bytes), cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
        device_out_copy.assign(static_cast<size_t>(out_bytes), '\xff');  // counted wrong
      }
      return device_out_copy;
    }
    return response.out().data();
  }
};

// One load to measure: `callers` closed-loop callers at once (each sends its
// next call when its last is answered), or an open loop: requests due at
// `rate` per second, sent by whichever of `callers` slots is free.
struct LoadLevel {
  bool open_loop = false;
  int callers = 1;
  double rate = 0;
  std::string Label() const {
    return open_loop ? absl::StrFormat("rate %g/s (%s, %d outstanding at most)", rate, absl::GetFlag(FLAGS_arrivals),
                                       callers)
                     : absl::StrFormat("concurrency %d", callers);
  }
};

// The levels --concurrency or --request_rate ask for; a bad entry is an
// error naming the flag.
absl::StatusOr<std::vector<LoadLevel>> LoadLevels() {
  std::vector<LoadLevel> levels;
  const std::string rates = absl::GetFlag(FLAGS_request_rate);
  if (!rates.empty()) {
    const int outstanding = absl::GetFlag(FLAGS_max_outstanding);
    if (outstanding < 1) return absl::InvalidArgumentError("--max_outstanding: must be at least 1");
    const std::string arrivals = absl::GetFlag(FLAGS_arrivals);
    if (arrivals != "poisson" && arrivals != "constant") {
      return absl::InvalidArgumentError(absl::StrCat("--arrivals: poisson or constant, not '", arrivals, "'"));
    }
    for (absl::string_view entry : absl::StrSplit(rates, ',', absl::SkipWhitespace())) {
      double rate = 0;
      if (!absl::SimpleAtod(entry, &rate) || !(rate > 0)) {
        return absl::InvalidArgumentError(absl::StrCat("--request_rate: '", entry, "' is not a positive rate"));
      }
      levels.push_back({true, outstanding, rate});
    }
  } else {
    for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',', absl::SkipWhitespace())) {
      int n = 0;
      if (!absl::SimpleAtoi(entry, &n) || n < 1 || n > 1024) {
        return absl::InvalidArgumentError(absl::StrCat("--concurrency: '", entry, "' is not a count of 1 to 1024"));
      }
      levels.push_back({false, n, 0});
    }
  }
  if (levels.empty()) return absl::InvalidArgumentError("--concurrency: no level given");
  return levels;
}

// What one level measured, over all its callers.
struct LoadResult {
  absl::Status status;
  std::vector<double> rtt_s, server_s, worker_s;
  std::vector<std::vector<double>> phase_s;  // one per kPhases entry
  int64_t attempted = 0, completed = 0, late = 0, checked = 0, wrong = 0;
  int64_t wire_sent = 0, wire_received = 0;  // serialized request and response bytes to and from the coordinator
  int64_t h2d = 0, d2h = 0;                  // one call's host<->device bytes
  double wall_s = 0, late_max_s = 0;

  void Merge(LoadResult&& o) {
    if (status.ok()) status = o.status;
    for (auto [to, from] : {std::pair(&rtt_s, &o.rtt_s), std::pair(&server_s, &o.server_s),
                            std::pair(&worker_s, &o.worker_s)}) {
      to->insert(to->end(), from->begin(), from->end());
    }
    phase_s.resize(std::max(phase_s.size(), o.phase_s.size()));
    for (size_t i = 0; i < o.phase_s.size(); ++i) {
      phase_s[i].insert(phase_s[i].end(), o.phase_s[i].begin(), o.phase_s[i].end());
    }
    attempted += o.attempted;
    completed += o.completed;
    late += o.late;
    checked += o.checked;
    wrong += o.wrong;
    wire_sent += o.wire_sent;
    wire_received += o.wire_received;
    h2d = std::max(h2d, o.h2d);
    d2h = std::max(d2h, o.d2h);
    late_max_s = std::max(late_max_s, o.late_max_s);
  }
};

// Runs one level: every caller warms up, then all are released together;
// wall clock from the release to the last answer. Returned outputs are
// checked as they come (--check=every) or each caller's last (--check=last;
// open loop: one more call after the timed ones), each checked call's
// shared-memory or CUDA slice poisoned before it; kept outputs are poisoned
// and read back by the caller of this.
LoadResult RunLoad(const LoadLevel& level, std::vector<std::unique_ptr<Caller>>& callers,
                   const OutputChecker& checker, int warmup, int iters,
                   const std::function<absl::Status()>& before_release) {
  const int n = level.callers;
  const bool check_every = absl::GetFlag(FLAGS_check) == "every";
  std::vector<double> due_s;  // open loop: each request's arrival, seconds after the release
  if (level.open_loop) {
    std::mt19937_64 rng(7);
    std::exponential_distribution<double> gap(level.rate);
    const bool poisson = absl::GetFlag(FLAGS_arrivals) == "poisson";
    double t = 0;
    for (int i = 0; i < iters; ++i) {
      due_s.push_back(t);
      t += poisson ? gap(rng) : 1.0 / level.rate;
    }
  }
  std::atomic<int> next_request{0};
  std::vector<LoadResult> per_caller(n);
  absl::BlockingCounter warm(n);
  absl::Notification go;
  absl::Mutex mu;
  absl::Time last_answer = absl::InfinitePast();
  absl::Time released;
  std::vector<std::thread> threads;
  for (int c = 0; c < n; ++c) {
    threads.emplace_back([&, c] {
      Caller& me = *callers[c];
      LoadResult& out = per_caller[c];
      out.phase_s.resize(kNumPhases);
      for (int i = 0; i < std::max(1, warmup) && out.status.ok(); ++i) {
        auto r = me.Send();
        if (!r.ok()) out.status = r.status();
      }
      warm.DecrementCount();
      go.WaitForNotification();
      const bool returned = me.kept_as.empty();
      // A checked call's output slice is poisoned first (outside its timing).
      auto call = [&](bool checked) -> bool {
        const bool poisoned = !(checked && returned) || me.Poison();
        const platform::BusyPoller::Activity busy = platform::BusyPoller::BusyIfOn(busy_poller);
        const absl::Time start = absl::Now();
        auto r = me.Send();
        const double rtt = absl::ToDoubleSeconds(absl::Now() - start);
        ++out.attempted;
        if (!r.ok()) {
          out.status = r.status();
          return false;
        }
        ++out.completed;
        out.rtt_s.push_back(rtt);
        out.server_s.push_back(r->server_seconds());
        out.worker_s.push_back(r->worker_seconds());
        for (size_t i = 0; i < kNumPhases; ++i) out.phase_s[i].push_back((r->phases().*kPhases[i].seconds)());
        out.wire_sent += me.CoordinatorBytes(me.request.ByteSizeLong(), me.request.lhs());
        out.wire_received += me.CoordinatorBytes(r->ByteSizeLong(), r->out());
        out.h2d = r->host_to_device_bytes();
        out.d2h = r->device_to_host_bytes();
        if (returned && checked) {
          ++out.checked;
          if (!poisoned || !checker.Matches(me.ReturnedBytes(*r))) ++out.wrong;
        }
        return true;
      };
      if (out.status.ok() && !level.open_loop) {
        for (int i = 0; i < iters && call(check_every || i == iters - 1); ++i) {
        }
      } else if (out.status.ok()) {
        // Requests are taken in order by whichever caller is free, so one
        // not taken when it is due found every caller busy: it goes late.
        absl::Time free_since = released;
        for (int i = next_request.fetch_add(1); i < iters; i = next_request.fetch_add(1)) {
          const absl::Time due = released + absl::Seconds(due_s[i]);
          if (free_since > due) {
            ++out.late;
            out.late_max_s = std::max(out.late_max_s, absl::ToDoubleSeconds(free_since - due));
          } else {
            absl::SleepFor(due - absl::Now());
          }
          if (!call(check_every)) break;
          free_since = absl::Now();
        }
      }
      {
        absl::MutexLock lock(&mu);
        last_answer = std::max(last_answer, absl::Now());
      }
      // --check=last, open loop: which call is a caller's last is known only
      // once it was made, so one more, untimed, poisoned first, is checked.
      if (returned && !check_every && level.open_loop && out.status.ok()) {
        const bool poisoned = me.Poison();
        auto r = me.Send();
        ++out.checked;
        if (!poisoned || !r.ok() || !checker.Matches(me.ReturnedBytes(*r))) ++out.wrong;
      }
    });
  }
  warm.Wait();
  const absl::Status ready = before_release();  // untimed: the callers wait for the release
  released = absl::Now();
  go.Notify();
  for (std::thread& t : threads) t.join();
  LoadResult all;
  if (!ready.ok()) all.status = ready;
  all.phase_s.resize(kNumPhases);
  for (LoadResult& r : per_caller) all.Merge(std::move(r));
  all.wall_s = absl::ToDoubleSeconds(last_answer - released);
  return all;
}

int Main() {
  auto busy_poll = platform::BusyPollOptionsFromFlags();
  if (!busy_poll.ok()) {
    std::fprintf(stderr, "%s\n", std::string(busy_poll.status().message()).c_str());
    return 2;
  }
  platform::BusyPoller poller(*busy_poll);
  busy_poller = &poller;
  std::ifstream in(absl::GetFlag(FLAGS_presets));
  if (!in) {
    std::fprintf(stderr, "--presets: cannot read '%s'\n", absl::GetFlag(FLAGS_presets).c_str());
    return 2;
  }
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::vector<Preset> presets;
  for (const auto& p : doc["presets"]) {
    Preset preset{p["name"], p["groups"], p["rows_per_group"], p["k"], p["n"]};
    if (!absl::GetFlag(FLAGS_only).empty() && preset.name.find(absl::GetFlag(FLAGS_only)) == std::string::npos) {
      continue;
    }
    preset.m = std::max<int64_t>(1, std::llround(preset.m * absl::GetFlag(FLAGS_scale_rows)));
    preset.k = std::max<int64_t>(8, std::llround(preset.k * absl::GetFlag(FLAGS_scale_dims)) / 8 * 8);
    preset.n = std::max<int64_t>(8, std::llround(preset.n * absl::GetFlag(FLAGS_scale_dims)) / 8 * 8);
    presets.push_back(preset);
  }
  const DType dtype = absl::GetFlag(FLAGS_dtype) == "f32" ? DType::kF32 : DType::kBF16;
  const bool on_cuda = absl::GetFlag(FLAGS_local) == "cuda";
  const bool returned = absl::GetFlag(FLAGS_returned);
  const bool fp8 = absl::GetFlag(FLAGS_op) == "fp8";
  if (!fp8 && absl::GetFlag(FLAGS_op) != "gemm") {
    std::fprintf(stderr, "--op: gemm or fp8, not '%s'\n", absl::GetFlag(FLAGS_op).c_str());
    return 2;
  }
  const int iters = absl::GetFlag(FLAGS_iters), warmup = absl::GetFlag(FLAGS_warmup);
  if (iters < 1) {
    std::fprintf(stderr, "--iters: at least 1, not %d\n", iters);
    return 2;
  }
  const absl::StatusOr<std::vector<LoadLevel>> parsed_levels = LoadLevels();
  if (!parsed_levels.ok()) {
    std::fprintf(stderr, "%s\n", std::string(parsed_levels.status().message()).c_str());
    return 2;
  }
  const std::vector<LoadLevel>& levels = *parsed_levels;
  if (absl::GetFlag(FLAGS_check) != "every" && absl::GetFlag(FLAGS_check) != "last") {
    std::fprintf(stderr, "--check: every or last, not '%s'\n", absl::GetFlag(FLAGS_check).c_str());
    return 2;
  }
  const int row_shards = absl::GetFlag(FLAGS_row_shards), expert_shards = absl::GetFlag(FLAGS_expert_shards);

  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials());
  auto info = client.WaitUntilReady(absl::Seconds(60));
  if (!info.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", std::string(info.status().message()).c_str());
    return 1;
  }
  std::printf("# service bench: %d workers, local op on %s, %s, output %s, %d calls after %d\n",
              info->workers_size(), on_cuda ? "cuda" : "cpu",
              fp8 ? (BlockFp8() ? "quantize + fp8 gemm (e4m3, 1x128 x 128x128 block scales, bf16 out)"
                                : "quantize + fp8 gemm (e4m3, per-group scales, bf16 out)")
                  : std::string(DTypeName(dtype)).c_str(),
              !returned ? "kept"
              : (absl::GetFlag(FLAGS_output_path) == "direct" || absl::GetFlag(FLAGS_activations) == "direct")
                  ? "returned (fetched from the workers)"
              : (absl::GetFlag(FLAGS_output_path) == "shared_memory" ||
                 absl::GetFlag(FLAGS_activations) == "shared_memory")
                  ? "returned (into shared memory)"
                  : "returned",
              iters, warmup);
  std::printf("# %-18s %9s %9s %9s %9s %9s %9s %9s %9s %7s %9s %11s %11s %s\n", "preset", "local_us",
              "d2h_us", "server50", "server90", "worker50", "worker90", "rtt50", "rtt90", "ratio", "added_us",
              "h2d_bytes", "d2h_bytes", "check");
  std::ofstream json_out;
  if (!absl::GetFlag(FLAGS_json).empty()) json_out.open(absl::GetFlag(FLAGS_json), std::ios::app);
  int failures = 0;
  for (const Preset& p : presets) {
    // One worker's share: m rows per local group, G local experts.
    const int64_t local_rows = p.g * p.m;
    HostTensor lhs_local = Random(dtype, {local_rows, p.k}, 1);
    // FP8 weights are [G, N, K] (Hopper's FP8 GEMM is TN).
    HostTensor rhs_local = Random(dtype, fp8 ? std::vector<int64_t>{p.g, p.n, p.k} : std::vector<int64_t>{p.g, p.k, p.n}, 2);
    std::vector<int64_t> local_sizes(p.g, p.m);
    std::unique_ptr<LocalOp> local;
    CudaLocalOp* cuda_local = nullptr;
    if (fp8) {
      if (on_cuda) {
        auto op = CudaFp8LocalOp::Create(lhs_local, rhs_local, local_sizes);
        if (!op.ok()) {
          std::fprintf(stderr, "%s: local op: %s\n", p.name.c_str(), std::string(op.status().message()).c_str());
          return 1;
        }
        local = std::move(*op);
      } else {
        if (BlockFp8()) {
          std::fprintf(stderr, "--fp8_scaling=block: the CPU local op has per-group scales only\n");
          return 2;
        }
        local = std::make_unique<CpuFp8LocalOp>(lhs_local, rhs_local, local_sizes, absl::GetFlag(FLAGS_threads));
      }
    } else if (on_cuda) {
      auto op = CudaLocalOp::Create(lhs_local, rhs_local, local_sizes);
      if (!op.ok()) {
        std::fprintf(stderr, "%s: local op: %s\n", p.name.c_str(), std::string(op.status().message()).c_str());
        return 1;
      }
      cuda_local = op->get();
      local = std::move(*op);
    } else {
      local = std::make_unique<CpuLocalOp>(lhs_local, rhs_local, local_sizes, absl::GetFlag(FLAGS_threads));
    }
    std::vector<double> local_s, d2h_s, h2d_s;
    for (int i = 0; i < warmup + iters; ++i) {
      auto t = local->Run();
      if (!t.ok()) {
        std::fprintf(stderr, "%s: local op: %s\n", p.name.c_str(), std::string(t.status().message()).c_str());
        return 1;
      }
      if (i >= warmup) local_s.push_back(*t);
      // PCIe's share: pinned host-to-device of lhs, device-to-host of the output.
      if (i >= warmup && cuda_local != nullptr) {
        auto down = cuda_local->PinnedDownload();
        auto up = cuda_local->PinnedUpload();
        if (!down.ok() || !up.ok()) {
          std::fprintf(stderr, "%s: pinned copies: %s\n", p.name.c_str(),
                       std::string((down.ok() ? up.status() : down.status()).message()).c_str());
          return 1;
        }
        d2h_s.push_back(*down);
        h2d_s.push_back(*up);
      }
    }

    // The request: every row shard holds the same block (so the service's
    // output is checkable against the local one), every expert shard the
    // same experts.
    auto tile = [](const HostTensor& t, int times) {
      HostTensor out = t;
      out.shape[0] *= times;
      out.bytes.clear();
      for (int i = 0; i < times; ++i) out.bytes += t.bytes;
      return out;
    };
    const HostTensor lhs = tile(lhs_local, row_shards);
    const HostTensor rhs = tile(rhs_local, expert_shards);
    HostTensor sizes = *ZerosTensor(DType::kI64, {p.g * row_shards});
    for (int64_t i = 0; i < sizes.NumElements(); ++i) sizes.data<int64_t>()[i] = p.m;
    for (const auto& [name, t, spec] : {std::make_tuple("bench_lhs", &lhs, absl::GetFlag(FLAGS_lhs_spec)),
                                        std::make_tuple("bench_rhs", &rhs, absl::GetFlag(FLAGS_rhs_spec))}) {
      if (auto r = client.PutTensor(name, *t, spec, /*overwrite=*/true); !r.ok()) {
        std::fprintf(stderr, "%s: put %s: %s\n", p.name.c_str(), name, std::string(r.status().message()).c_str());
        return 1;
      }
    }
    v1::GroupedGemmRequest request;
    request.mutable_lhs()->set_resident("bench_lhs");
    request.mutable_rhs()->set_resident("bench_rhs");
    const std::string activations = absl::GetFlag(FLAGS_activations);
    std::unique_ptr<BenchRegion> lhs_region;
    std::unique_ptr<BenchCudaRegion> lhs_cuda;
    // The direct path: lhs inline in the request as built here; each call
    // stages its blocks on the workers (GroupedGemmDirect).
    const bool direct = activations == "direct";
    std::string output_path = absl::GetFlag(FLAGS_output_path);
    if (output_path.empty() && direct) output_path = "direct";
    if (output_path.empty() && returned && activations == "shared_memory") output_path = "shared_memory";
    if (output_path.empty()) output_path = "coordinator";
    if (output_path != "coordinator" && output_path != "direct" && output_path != "shared_memory") {
      std::fprintf(stderr, "--output_path: '%s' is not coordinator, direct or shared_memory\n", output_path.c_str());
      return 1;
    }
    if (output_path == "shared_memory" && (!returned || activations == "cuda_ipc")) {
      std::fprintf(stderr, "--output_path=shared_memory needs --returned and --activations other than cuda_ipc\n");
      return 1;
    }
    if (activations == "shared_memory" && returned && output_path != "shared_memory") {
      std::fprintf(stderr, "--activations=shared_memory returns its output into a region: --output_path=shared_memory\n");
      return 1;
    }
    if (output_path == "direct" &&
        (!returned || activations == "shared_memory" || activations == "cuda_ipc")) {
      std::fprintf(stderr, "--output_path=direct needs --returned and --activations resident, inline or direct\n");
      return 1;
    }
    if (direct && output_path != "direct") {
      std::fprintf(stderr, "--activations=direct fetches its output directly: --output_path=direct\n");
      return 1;
    }
    const bool output_direct = output_path == "direct";
    if (activations == "inline" || direct) {
      HostTensorToProto(lhs, request.mutable_lhs());
      request.mutable_lhs()->set_spec(absl::GetFlag(FLAGS_lhs_spec));
    } else if (activations == "shared_memory") {
      auto made = BenchRegion::Create(client, "bench_lhs_shm", lhs.NumBytes());
      if (!made.ok()) {
        std::fprintf(stderr, "%s: %s\n", p.name.c_str(), std::string(made.status().message()).c_str());
        return 1;
      }
      lhs_region = std::move(*made);
      std::memcpy(lhs_region->data(), lhs.bytes.data(), lhs.NumBytes());
      v1::Tensor* t = request.mutable_lhs();
      t->set_dtype(DTypeToProto(lhs.dtype));
      t->mutable_shape()->Assign(lhs.shape.begin(), lhs.shape.end());
      t->set_spec(absl::GetFlag(FLAGS_lhs_spec));
      t->mutable_shared_memory()->set_region("bench_lhs_shm");
      t->mutable_shared_memory()->set_byte_size(lhs.NumBytes());
    } else if (activations == "cuda_ipc") {
      auto made = BenchCudaRegion::Create(client, "bench_lhs_cuda", lhs.NumBytes());
      if (!made.ok()) {
        std::fprintf(stderr, "%s: %s\n", p.name.c_str(), std::string(made.status().message()).c_str());
        return 1;
      }
      lhs_cuda = std::move(*made);
      if (cudaMemcpy(lhs_cuda->data(), lhs.bytes.data(), lhs.NumBytes(), cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaDeviceSynchronize() != cudaSuccess) {
        std::fprintf(stderr, "%s: copying lhs to the device failed\n", p.name.c_str());
        return 1;
      }
      v1::Tensor* t = request.mutable_lhs();
      t->set_dtype(DTypeToProto(lhs.dtype));
      t->mutable_shape()->Assign(lhs.shape.begin(), lhs.shape.end());
      t->set_spec(absl::GetFlag(FLAGS_lhs_spec));
      t->mutable_shared_memory()->set_region("bench_lhs_cuda");
      t->mutable_shared_memory()->set_byte_size(lhs.NumBytes());
    } else if (activations != "resident") {
      std::fprintf(stderr, "--activations: '%s' is not resident, inline, shared_memory, cuda_ipc or direct\n",
                   activations.c_str());
      return 1;
    }
    if (fp8) {
      // The weights quantized once on the workers and kept; each request
      // quantizes lhs in its step.
      v1::GroupedQuantizeRequest wq;
      wq.mutable_x()->set_resident("bench_rhs");
      HostTensor weight_sizes = *ZerosTensor(DType::kI64, {p.g * expert_shards});
      for (int64_t i = 0; i < weight_sizes.NumElements(); ++i) weight_sizes.data<int64_t>()[i] = p.n;
      HostTensorToProto(weight_sizes, wq.mutable_group_sizes());
      wq.mutable_group_sizes()->set_spec(absl::GetFlag(FLAGS_weight_group_sizes_spec));
      wq.set_flatten_axis(2);
      wq.set_rowwise(true);
      if (BlockFp8()) {
        wq.set_scaling(v1::BLOCK_FP8);
        wq.set_block_2d(true);
        request.set_scaling(v1::BLOCK_FP8);
      }
      wq.mutable_keep()->set_rowwise_data("bench_w8");
      wq.mutable_keep()->set_scale_inv("bench_w8_scale");
      wq.mutable_keep()->set_overwrite(true);
      if (auto r = client.GroupedQuantize(wq); !r.ok()) {
        std::fprintf(stderr, "%s: weight quantize: %s\n", p.name.c_str(), std::string(r.status().message()).c_str());
        return 1;
      }
      request.mutable_rhs()->set_resident("bench_w8");
      request.mutable_rhs_scale_inv()->set_resident("bench_w8_scale");
      request.set_rhs_transposed(true);
      request.mutable_quantize_lhs()->set_dtype(v1::F8E4M3);
    }
    HostTensorToProto(sizes, request.mutable_group_sizes());
    request.mutable_group_sizes()->set_spec(absl::GetFlag(FLAGS_group_sizes_spec));
    request.set_out_dtype(DTypeToProto(dtype));
    if (!returned) {
      request.set_keep_output_as("bench_out");
      request.set_overwrite_output(true);
    }
    const int64_t out_bytes = lhs.shape[0] * p.n * DTypeSize(dtype);
    auto want = local->Output();
    if (!want.ok()) {
      std::fprintf(stderr, "%s: local op output: %s\n", p.name.c_str(), std::string(want.status().message()).c_str());
      return 1;
    }
    OutputChecker checker(std::move(*want), dtype, out_bytes);
    // Returned through shared memory: one region, a page-aligned slice of
    // it per caller (a tenant may register only so many regions).
    std::unique_ptr<BenchRegion> out_region;
    const int64_t out_stride = (out_bytes + 4095) / 4096 * 4096;
    int most_callers = 1;  // the output region has a slice for each
    for (const LoadLevel& level : levels) most_callers = std::max(most_callers, level.callers);
    if (returned && output_path == "shared_memory") {
      auto made = BenchRegion::Create(client, "bench_out_shm", out_stride * most_callers);
      if (!made.ok()) {
        std::fprintf(stderr, "%s: %s\n", p.name.c_str(), std::string(made.status().message()).c_str());
        return 1;
      }
      out_region = std::move(*made);
    }
    std::unique_ptr<BenchCudaRegion> out_cuda;
    if (returned && activations == "cuda_ipc") {
      auto made = BenchCudaRegion::Create(client, "bench_out_cuda", out_stride * most_callers);
      if (!made.ok()) {
        std::fprintf(stderr, "%s: %s\n", p.name.c_str(), std::string(made.status().message()).c_str());
        return 1;
      }
      out_cuda = std::move(*made);
    }
    // Callers, made as the levels need them and kept across levels: each its
    // own client, its own kept output name (caller 0 keeps bench_out) or its
    // own slice of the output region.
    std::vector<std::unique_ptr<Caller>> callers;
    auto make_callers = [&](int count) {
      while (static_cast<int>(callers.size()) < count) {
        const int c = static_cast<int>(callers.size());
        auto caller = std::make_unique<Caller>();
        caller->client = std::make_unique<ShardGemmClient>(absl::GetFlag(FLAGS_coordinator),
                                                           CoordinatorCredentials());
        if (const std::string path = absl::GetFlag(FLAGS_call_socket); !path.empty()) {
          caller->client->UseCallSocket(path);
        }
        caller->request = request;
        caller->direct = direct || output_direct;
        if (!returned) {
          caller->kept_as = c == 0 ? "bench_out" : absl::StrCat("bench_out_", c);
          caller->request.set_keep_output_as(caller->kept_as);
        }
        if (out_region != nullptr) {
          caller->out = out_region->data() + c * out_stride;
          caller->request.mutable_out_shared_memory()->set_region("bench_out_shm");
          caller->request.mutable_out_shared_memory()->set_offset(static_cast<uint64_t>(c * out_stride));
          caller->request.mutable_out_shared_memory()->set_byte_size(out_bytes);
        }
        if (out_cuda != nullptr) {
          caller->device_out = out_cuda->data() + c * out_stride;
          caller->request.mutable_out_shared_memory()->set_region("bench_out_cuda");
          caller->request.mutable_out_shared_memory()->set_offset(static_cast<uint64_t>(c * out_stride));
          caller->request.mutable_out_shared_memory()->set_byte_size(out_bytes);
        }
        caller->out_bytes = out_bytes;
        callers.push_back(std::move(caller));
      }
    };
    // The answer every check compares against: caller 0's first, checked
    // against the local op within tolerance.
    make_callers(1);
    std::string first_check = "fail";
    {
      Caller& first = *callers[0];
      const bool poisoned = first.Poison();
      auto r = first.Send();
      absl::StatusOr<HostTensor> kept = absl::UnknownError("not kept");
      if (r.ok() && !first.kept_as.empty()) kept = first.client->GetTensor(first.kept_as);
      const absl::Status s = !r.ok() ? r.status() : first.kept_as.empty() ? absl::OkStatus() : kept.status();
      if (!s.ok()) {
        std::fprintf(stderr, "%s: first request: %s\n", p.name.c_str(), std::string(s.message()).c_str());
        return 1;
      }
      first_check = !poisoned ? "FAIL the output's CUDA region could not be poisoned"
                              : checker.SetReference(first.kept_as.empty() ? first.ReturnedBytes(*r) : kept->bytes);
    }
    // The tensor bytes one call hands the service and gets back, whichever
    // way they travel (in the request, through a region); GB/s counts these.
    const int64_t payload_in = activations == "resident" ? 0 : lhs.NumBytes();
    const int64_t payload_out = returned ? out_bytes : 0;
    // A kept output is overwritten with 0xff bytes (NaNs) after each level's
    // warm-up, before its timed calls: one that no timed call rewrote fails
    // the read-back check.
    HostTensor poison;
    poison.dtype = dtype;
    poison.shape = {out_bytes / DTypeSize(dtype)};
    poison.bytes.assign(static_cast<size_t>(out_bytes), '\xff');
    for (const LoadLevel& level : levels) {
      make_callers(level.callers);
      auto poison_kept = [&]() -> absl::Status {
        for (int c = 0; c < level.callers && !returned; ++c) {
          if (auto put = callers[c]->client->PutTensor(callers[c]->kept_as, poison, "", /*overwrite=*/true);
              !put.ok()) {
            return absl::Status(put.status().code(), absl::StrCat("poisoning the kept output ", callers[c]->kept_as,
                                                                  ": ", put.status().message()));
          }
        }
        return absl::OkStatus();
      };
      LoadResult r = RunLoad(level, callers, checker, warmup, iters, poison_kept);
      if (!r.status.ok()) {
        std::fprintf(stderr, "%s: request: %s\n", p.name.c_str(), std::string(r.status.message()).c_str());
        return 1;
      }
      if (!returned) {  // kept outputs: each caller's last one, read back once
        for (int c = 0; c < level.callers; ++c) {
          auto got = callers[c]->client->GetTensor(callers[c]->kept_as);
          ++r.checked;
          if (!got.ok() || !checker.Matches(got->bytes)) ++r.wrong;
        }
      }
      const std::string check = r.wrong == 0 && first_check.rfind("ok", 0) == 0
                                    ? first_check
                                    : absl::StrFormat("FAIL %lld of %lld wrong (first: %s)",
                                                      static_cast<long long>(r.wrong),
                                                      static_cast<long long>(r.checked), first_check);
      if (check.rfind("ok", 0) != 0) ++failures;
      const Stats l = Percentiles(local_s), dd = Percentiles(d2h_s), uu = Percentiles(h2d_s),
                  sv = Percentiles(r.server_s), wk = Percentiles(r.worker_s), rt = Percentiles(r.rtt_s);
      std::printf("  %-18s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.3f %9.1f %11lld %11lld %s\n",
                  p.name.c_str(), l.p50 * 1e6, dd.p50 * 1e6, sv.p50 * 1e6, sv.p90 * 1e6, wk.p50 * 1e6,
                  wk.p90 * 1e6, rt.p50 * 1e6, rt.p90 * 1e6, sv.p50 / l.p50, (sv.p50 - l.p50) * 1e6,
                  static_cast<long long>(r.h2d), static_cast<long long>(r.d2h), check.c_str());
      const double per_s = r.wall_s > 0 ? static_cast<double>(r.completed) / r.wall_s : 0;
      const int64_t payload_total = r.completed * (payload_in + payload_out);
      const double gbps = r.wall_s > 0 ? static_cast<double>(payload_total) / r.wall_s / 1e9 : 0;
      std::printf("  %-18s %s: %lld calls in %.3f s, %.1f calls/s, %.3f GB/s, rtt p99 %.1f us%s, %lld/%lld wrong\n",
                  p.name.c_str(), level.Label().c_str(), static_cast<long long>(r.completed), r.wall_s, per_s, gbps,
                  rt.p99 * 1e6,
                  level.open_loop ? absl::StrFormat(", %lld sent late", static_cast<long long>(r.late)).c_str() : "",
                  static_cast<long long>(r.wrong), static_cast<long long>(r.checked));
      std::fflush(stdout);
      if (json_out) {
        nlohmann::json j = {{"kind", "service"}, {"preset", p.name}, {"workers", info->workers_size()},
                            {"local", on_cuda ? "cuda" : "cpu"},
                            {"op", fp8 ? "fp8_" + absl::GetFlag(FLAGS_fp8_scaling) : "gemm"},
                            {"activations", activations}, {"returned", returned},
                            {"output_path", returned ? output_path : "kept"},
                            {"local_p50_us", l.p50 * 1e6}, {"d2h_p50_us", dd.p50 * 1e6}, {"h2d_p50_us", uu.p50 * 1e6},
                            {"server_p50_us", sv.p50 * 1e6}, {"server_p90_us", sv.p90 * 1e6},
                            {"server_p99_us", sv.p99 * 1e6}, {"worker_p50_us", wk.p50 * 1e6},
                            {"worker_p90_us", wk.p90 * 1e6}, {"worker_p99_us", wk.p99 * 1e6},
                            {"rtt_p50_us", rt.p50 * 1e6}, {"rtt_p90_us", rt.p90 * 1e6}, {"rtt_p99_us", rt.p99 * 1e6},
                            {"rtt_mean_us", rt.mean * 1e6}, {"h2d_bytes", r.h2d}, {"d2h_bytes", r.d2h},
                            {"check", check}, {"checked", r.checked}, {"wrong", r.wrong},
                            {"mode", level.open_loop ? "rate" : "concurrency"}, {"concurrency", level.callers},
                            {"iters", iters}, {"attempted", r.attempted}, {"completed", r.completed},
                            {"wall_s", r.wall_s}, {"calls_per_s", per_s},
                            {"payload_in_bytes", payload_in}, {"payload_out_bytes", payload_out},
                            {"payload_bytes", payload_total}, {"gbps", gbps},
                            {"wire_sent_bytes", r.wire_sent}, {"wire_received_bytes", r.wire_received},
                            {"wire_gbps", r.wall_s > 0 ? static_cast<double>(r.wire_sent + r.wire_received) / r.wall_s / 1e9 : 0}};
        if (level.open_loop) {
          j["request_rate"] = level.rate;
          j["arrivals"] = absl::GetFlag(FLAGS_arrivals);
          j["max_outstanding"] = level.callers;
          j["late"] = r.late;
          j["late_max_us"] = r.late_max_s * 1e6;
        }
        nlohmann::json phases = nlohmann::json::object();
        for (size_t i = 0; i < kNumPhases; ++i) phases[kPhases[i].name] = Percentiles(r.phase_s[i]).p50 * 1e6;
        j["phases_p50_us"] = phases;
        json_out << j.dump() << "\n";
      }
    }
    for (const char* name : {"bench_lhs", "bench_rhs", "bench_out", "bench_w8", "bench_w8_scale"}) {
      (void)client.DeleteTensor(name);
    }
    for (size_t c = 1; c < callers.size() && !returned; ++c) (void)client.DeleteTensor(callers[c]->kept_as);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardgemm::Main();
}
