#include "worker/benches/collective_bench_harness.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gloo/rendezvous/hash_store.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/gloo_collectives.h"
#include "worker/nccl_collectives.h"
#include "worker/nccl_status.h"

ABSL_FLAG(std::string, backend, "nccl",
          "nccl: NCCL alone on device buffers | ours_nccl: our worker layer "
          "(worker/nccl_collectives) on host tensors, as a worker's step calls it | "
          "ours_nccl_device: our worker layer's device path (all_gather: AllGatherDevice on "
          "device buffers, as a CUDA worker gathers an FSDP weight for its GEMM) | gloo: our "
          "worker layer over Gloo on CPU");
ABSL_FLAG(int, ranks, 0,
          "ranks, one thread each; the GPU backends put rank r on GPU r. 0: every visible GPU "
          "(nccl, ours_nccl, ours_nccl_device) or 2 (gloo)");
ABSL_FLAG(int64_t, min_bytes, int64_t{1} << 20, "smallest size (bytes of the full buffer)");
ABSL_FLAG(int64_t, max_bytes, int64_t{1} << 30, "largest size");
ABSL_FLAG(int64_t, step_factor, 2, "each size is the previous one times this");
ABSL_FLAG(int, iters, 20, "timed calls per size");
ABSL_FLAG(int, warmup, 5, "untimed calls per size before the timed ones");
ABSL_FLAG(std::string, dtype, "f32", "f32 | bf16");
ABSL_FLAG(int64_t, groups, 8,
          "our layer (ours_nccl, ours_nccl_device, gloo): a rank's piece is [groups, rows, cols] "
          "and the collective runs along dim 1, as the FSDP all-gather of an expert weight [E, K/n, N] along K");
ABSL_FLAG(int64_t, cols, 4096, "our layer: the piece's innermost dimension (at most; see --groups)");
ABSL_FLAG(int, timeout_s, 300,
          "a size that does not finish within this ends the run (exit 1) instead of hanging; "
          "also our layer's collective timeout");
ABSL_FLAG(int64_t, test_corrupt_output, 0,
          "testing only: change this many output elements on rank 0 before the check, to show "
          "that the check catches them");

namespace shardgemm {
namespace bench {

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Layout::FullIndex(int r, int64_t i) const {
  const int64_t block = rows * cols;
  return (i / block) * ranks * block + r * block + i % block;
}

void Layout::Split(int64_t full, int* r, int64_t* i) const {
  const int64_t block = rows * cols;
  const int64_t g = full / (ranks * block), rest = full % (ranks * block);
  *r = static_cast<int>(rest / block);
  *i = g * block + rest % block;
}

absl::Status Collective::Supports(Backend, DType) const { return absl::OkStatus(); }

absl::Status Collective::RunOursDevice(Collectives*, const void*, void*, const Layout&,
                                       const std::vector<std::string>&, cudaStream_t) const {
  return absl::UnimplementedError(absl::StrCat(Name(), ": our layer has no device path"));
}

namespace {

const char* BackendName(Backend b) {
  switch (b) {
    case Backend::kNccl: return "nccl";
    case Backend::kOursNccl: return "ours_nccl";
    case Backend::kOursNcclDevice: return "ours_nccl_device";
    case Backend::kGloo: return "gloo";
  }
  return "?";
}

// Integers in [-bound, bound] that depend on the rank and the index.
double InputValue(int rank, int64_t i, int64_t bound) {
  uint64_t x = (static_cast<uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(i);
  x += 0x9E3779B97F4A7C15ull;  // splitmix64
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(static_cast<int64_t>(x % static_cast<uint64_t>(2 * bound + 1)) - bound);
}

struct Config {
  Backend backend = Backend::kNccl;
  DType dtype = DType::kF32;
  int ranks = 0;
  int64_t min_bytes = 0, max_bytes = 0, step_factor = 2;
  int iters = 0, warmup = 0;
  int64_t groups = 1, cols = 1;
  std::chrono::seconds timeout{300};
  int64_t corrupt = 0;
  int64_t bound = 1;  // input values' magnitude
};

absl::StatusOr<Config> ReadFlags(const Collective& c) {
  Config cfg;
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "nccl") cfg.backend = Backend::kNccl;
  else if (backend == "ours_nccl") cfg.backend = Backend::kOursNccl;
  else if (backend == "ours_nccl_device") cfg.backend = Backend::kOursNcclDevice;
  else if (backend == "gloo") cfg.backend = Backend::kGloo;
  else return absl::InvalidArgumentError(absl::StrCat("--backend=", backend,
                                                      ": expected nccl, ours_nccl, ours_nccl_device or gloo"));
  if (cfg.backend == Backend::kOursNcclDevice && !c.HasOursDevice()) {
    return absl::InvalidArgumentError(absl::StrCat("--backend=ours_nccl_device: our layer has no device path for ",
                                                   c.Name(), " (all_gather has: the FSDP weight gather)"));
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "f32") cfg.dtype = DType::kF32;
  else if (dtype == "bf16") cfg.dtype = DType::kBF16;
  else return absl::InvalidArgumentError(absl::StrCat("--dtype=", dtype, ": expected f32 or bf16"));
  cfg.ranks = absl::GetFlag(FLAGS_ranks);
  cfg.min_bytes = absl::GetFlag(FLAGS_min_bytes);
  cfg.max_bytes = absl::GetFlag(FLAGS_max_bytes);
  cfg.step_factor = absl::GetFlag(FLAGS_step_factor);
  cfg.iters = absl::GetFlag(FLAGS_iters);
  cfg.warmup = absl::GetFlag(FLAGS_warmup);
  cfg.groups = absl::GetFlag(FLAGS_groups);
  cfg.cols = absl::GetFlag(FLAGS_cols);
  cfg.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  cfg.corrupt = absl::GetFlag(FLAGS_test_corrupt_output);
  if (cfg.ranks < 0) return absl::InvalidArgumentError("--ranks must be >= 0");
  if (cfg.min_bytes <= 0 || cfg.max_bytes < cfg.min_bytes) {
    return absl::InvalidArgumentError("need 0 < --min_bytes <= --max_bytes");
  }
  if (cfg.step_factor < 2) return absl::InvalidArgumentError("--step_factor must be >= 2");
  if (cfg.iters < 1 || cfg.warmup < 0) return absl::InvalidArgumentError("need --iters >= 1 and --warmup >= 0");
  if (cfg.groups < 1 || cfg.cols < 1) return absl::InvalidArgumentError("--groups and --cols must be >= 1");
  if (absl::GetFlag(FLAGS_timeout_s) < 1) return absl::InvalidArgumentError("--timeout_s must be >= 1");
  if (auto s = c.Supports(cfg.backend, cfg.dtype); !s.ok()) return s;
  return cfg;
}

// The GPU backends need one GPU per rank; says why not when they are absent.
absl::Status CheckGpus(Config* cfg) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--backend=", BackendName(cfg->backend), " needs one GPU per rank, and CUDA reports ",
        e != cudaSuccess ? absl::StrCat("'", cudaGetErrorString(e), "'") : std::string("0 devices"),
        " (\"driver version is insufficient\" / \"no CUDA-capable device\": no GPU here). Use "
        "--backend=gloo to run on CPU"));
  }
  if (cfg->ranks == 0) cfg->ranks = n;
  if (cfg->ranks > n) {
    return absl::FailedPreconditionError(absl::StrCat("--ranks=", cfg->ranks, " needs ", cfg->ranks,
                                                      " GPUs (one per rank); ", n, " visible"));
  }
  return absl::OkStatus();
}

// The sizes of the sweep. Sizes round down (as nccl-tests does) so that each
// rank's piece splits into [groups, rows, cols]; both GPU backends get the
// same sizes, so their lines compare.
std::vector<Layout> Layouts(const Collective& c, const Config& cfg, std::vector<std::string>* skipped) {
  std::vector<Layout> out;
  const int64_t esize = DTypeSize(cfg.dtype);
  const int pieces = c.PiecesPerBuffer(cfg.ranks);
  for (int64_t b = cfg.min_bytes; b <= cfg.max_bytes; b *= cfg.step_factor) {
    Layout l;
    l.ranks = cfg.ranks;
    l.dtype = cfg.dtype;
    int64_t piece = b / esize / pieces;
    l.groups = piece >= cfg.groups ? cfg.groups : 1;
    piece = piece / l.groups * l.groups;
    if (piece == 0) {
      skipped->push_back(absl::StrCat(b, " bytes: smaller than one element per rank"));
    } else {
      l.piece = piece;
      l.cols = std::gcd(piece / l.groups, cfg.cols);
      l.rows = piece / l.groups / l.cols;
      l.count = piece * pieces;
      l.bytes = l.count * esize;
      if (cfg.backend == Backend::kNccl) l.groups = 1, l.rows = 1, l.cols = piece;
      if (out.empty() || out.back().bytes != l.bytes) out.push_back(l);
    }
    if (b > cfg.max_bytes / cfg.step_factor) break;  // no overflow
  }
  return out;
}

// A barrier for the rank threads.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  uint64_t gen_ = 0;
};

// The ncclUniqueId hand-out our NCCL layer gets from the coordinator's
// store in a worker; here a map in this process.
IdExchange InProcessIdExchange(std::chrono::seconds timeout) {
  struct Store {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, std::string> values;
  };
  auto store = std::make_shared<Store>();
  IdExchange x;
  x.set = [store](const std::string& key, const std::string& value, uint64_t) {
    std::lock_guard<std::mutex> lock(store->mu);
    store->values[key] = value;
    store->cv.notify_all();
    return absl::OkStatus();
  };
  x.get = [store, timeout](const std::string& key, uint64_t) -> absl::StatusOr<std::string> {
    std::unique_lock<std::mutex> lock(store->mu);
    if (!store->cv.wait_for(lock, timeout, [&] { return store->values.count(key) > 0; })) {
      return absl::DeadlineExceededError(absl::StrCat("no value for '", key, "'"));
    }
    return store->values[key];
  };
  return x;
}

[[noreturn]] void Die(const Collective& c, int rank, const absl::Status& s) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s_bench: rank %d: %s\n", c.Name(), rank, s.ToString().c_str());
  std::fflush(stderr);
  std::_Exit(1);  // peers may be stuck inside a collective: do not wait for them
}

// One rank's side of a backend.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual absl::Status Prepare(const Layout& l, HostTensor input) = 0;
  virtual absl::Status Launch() = 0;  // NCCL alone: queue one call; our layer: one blocking call
  virtual absl::Status Sync() = 0;    // wait for what Launch queued
  virtual absl::StatusOr<HostTensor> Output() = 0;
};

// A rank's input and output in device memory on its own stream: uploaded in
// Prepare (the output filled with NaN), downloaded in Output. Launch and
// Sync are the backend's.
class DeviceBuffersRunner : public Runner {
 public:
  DeviceBuffersRunner(const Collective& c, int device) : c_(c), device_(device) {}
  ~DeviceBuffersRunner() override {
    Free();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Prepare(const Layout& l, HostTensor input) override {
    if (auto s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    if (stream_ == nullptr) {
      if (auto s = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); !s.ok()) {
        return s;
      }
    }
    Free();
    layout_ = l;
    out_bytes_ = NumElements(c_.OutputShape(l)) * DTypeSize(l.dtype);
    if (auto s = CudaStatus(cudaMalloc(&send_, std::max<int64_t>(input.NumBytes(), 1)), "cudaMalloc send"); !s.ok()) {
      return s;
    }
    if (auto s = CudaStatus(cudaMalloc(&recv_, std::max<int64_t>(out_bytes_, 1)), "cudaMalloc recv"); !s.ok()) {
      return s;
    }
    // On the rank's stream: a non-blocking stream does not wait for the
    // legacy default stream's copies and memsets.
    if (auto s = CudaStatus(cudaMemsetAsync(recv_, 0xff, out_bytes_, stream_), "cudaMemset"); !s.ok()) return s;  // NaN
    if (auto s = CudaStatus(
            cudaMemcpyAsync(send_, input.bytes.data(), input.NumBytes(), cudaMemcpyHostToDevice, stream_), "upload");
        !s.ok()) {
      return s;
    }
    return CudaStatus(cudaStreamSynchronize(stream_), "upload");
  }

  absl::StatusOr<HostTensor> Output() override {
    HostTensor out;
    out.dtype = layout_.dtype;
    out.shape = c_.OutputShape(layout_);
    out.bytes.resize(out_bytes_);
    if (out_bytes_ == 0) return out;
    if (auto s =
            CudaStatus(cudaMemcpyAsync(&out.bytes[0], recv_, out_bytes_, cudaMemcpyDeviceToHost, stream_), "download");
        !s.ok()) {
      return s;
    }
    if (auto s = CudaStatus(cudaStreamSynchronize(stream_), "download"); !s.ok()) return s;
    return out;
  }

 protected:
  const Collective& c_;
  cudaStream_t stream_ = nullptr;
  Layout layout_;
  void* send_ = nullptr;
  void* recv_ = nullptr;

 private:
  void Free() {
    if (send_ != nullptr) cudaFree(send_);
    if (recv_ != nullptr) cudaFree(recv_);
    send_ = recv_ = nullptr;
  }

  int device_;
  int64_t out_bytes_ = 0;
};

// NCCL alone, on the same buffers.
class NcclRunner : public DeviceBuffersRunner {
 public:
  NcclRunner(const Collective& c, int device, ncclComm_t comm) : DeviceBuffersRunner(c, device), comm_(comm) {}

  absl::Status Launch() override {
    const ncclDataType_t type = layout_.dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat32;
    return NcclStatus(c_.RunNccl(send_, recv_, layout_, type, comm_, stream_), c_.Name());
  }

  // Spins on the stream and the communicator's error, as nccl-tests does.
  absl::Status Sync() override {
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, "collective");
      ncclResult_t async;
      if (auto s = NcclStatus(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"); !s.ok()) return s;
      if (async != ncclSuccess && async != ncclInProgress) return NcclStatus(async, "asynchronous error");
    }
  }

 private:
  ncclComm_t comm_;
};

// Our worker layer, over the mesh `fsdp=ranks` (the axis the weight gather
// runs over).
class OursRunner : public Runner {
 public:
  OursRunner(const Collective& c, std::unique_ptr<Collectives> coll)
      : c_(c), coll_(std::move(coll)) {}

  absl::Status Prepare(const Layout&, HostTensor input) override {
    input_ = std::move(input);
    out_ = absl::UnknownError("not run");
    return absl::OkStatus();
  }
  absl::Status Launch() override {
    out_ = absl::UnknownError("not run");  // a step's output is a new tensor; free the last one first
    out_ = c_.RunOurs(coll_.get(), input_, {"fsdp"});
    return out_.status();
  }
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::StatusOr<HostTensor> Output() override { return std::move(out_); }

 private:
  const Collective& c_;
  std::unique_ptr<Collectives> coll_;
  HostTensor input_;
  absl::StatusOr<HostTensor> out_ = absl::UnknownError("not run");
};

// Our layer's device path: the input uploaded once, each call gathers
// device to device (what a CUDA worker's GEMM step does with an FSDP weight
// shard already on its device), the output downloaded once for the check.
class OursDeviceRunner : public DeviceBuffersRunner {
 public:
  OursDeviceRunner(const Collective& c, int device, std::unique_ptr<Collectives> coll)
      : DeviceBuffersRunner(c, device), coll_(std::move(coll)) {}

  absl::Status Launch() override {
    return c_.RunOursDevice(coll_.get(), send_, recv_, layout_, {"fsdp"}, stream_);
  }
  absl::Status Sync() override { return absl::OkStatus(); }  // each call returns once done

 private:
  std::unique_ptr<Collectives> coll_;
};

MeshPosition FsdpPosition(int rank, int ranks) {
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {ranks};
  p.coords = {rank};
  p.rank = rank;
  return p;
}

// Filling and checking a GiB per rank is seconds on one core: spread them
// over the cores this rank may use.
template <typename F>
void ParallelFor(int64_t n, int threads, F fn) {
  if (threads <= 1 || n < (int64_t{1} << 20)) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t b = 0; b < n; b += chunk) pool.emplace_back(fn, b, std::min(n, b + chunk));
  for (auto& t : pool) t.join();
}

HostTensor MakeInput(const Collective& c, const Layout& l, int rank, int64_t bound, int threads) {
  HostTensor t;
  t.dtype = l.dtype;
  t.shape = c.InputShape(l);
  t.bytes.resize(NumElements(t.shape) * DTypeSize(l.dtype));
  ParallelFor(t.NumElements(), threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) StoreFromFloat(&t, i, static_cast<float>(InputValue(rank, i, bound)));
  });
  return t;
}

// Output elements that differ from the expected value (exact: the inputs are
// integers whose sums are exact in the dtype).
int64_t CountWrong(const Collective& c, const Layout& l, int rank, const HostTensor& out,
                   int64_t bound, int threads) {
  const std::vector<int64_t> shape = c.OutputShape(l);
  if (out.dtype != l.dtype || out.shape != shape || out.NumBytes() != NumElements(shape) * DTypeSize(l.dtype)) {
    std::fprintf(stderr, "%s_bench: rank %d: output is %s %s, expected %s %s: every element counts as wrong\n",
                 c.Name(), rank, std::string(DTypeName(out.dtype)).c_str(), ShapeToString(out.shape).c_str(),
                 std::string(DTypeName(l.dtype)).c_str(), ShapeToString(shape).c_str());
    return NumElements(shape);
  }
  const InputValues in = [bound](int r, int64_t i) { return InputValue(r, i, bound); };
  std::atomic<int64_t> wrong{0};
  ParallelFor(out.NumElements(), threads, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const double want = c.Expected(l, rank, o, in);
      const float got = LoadAsFloat(out, o);
      if (got != want) {
        if (wrong.fetch_add(1) < 3) {
          std::fprintf(stderr, "%s_bench: rank %d, %lld bytes: output element %lld is %.9g, expected %.9g\n",
                       c.Name(), rank, static_cast<long long>(l.bytes), static_cast<long long>(o), got, want);
        }
      }
    }
  });
  return wrong.load();
}

void Corrupt(HostTensor* out, int64_t k) {
  const int64_t n = out->NumElements();
  k = std::min(k, n);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t o = j * (n / k);
    const float v = LoadAsFloat(*out, o);
    StoreFromFloat(out, o, v > 0 ? v - 1 : v + 1);
  }
}

std::string GpuLine(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "?";
  char bus[32] = "?";
  cudaDeviceGetPCIBusId(bus, sizeof(bus), device);
  return absl::StrCat(prop.name, " (", bus, ")");
}

struct RankResult {
  double seconds = 0;
  int64_t wrong = 0;
};

}  // namespace

int BenchMain(int argc, char** argv, const Collective& c) {
  const std::string prog = absl::StrCat(c.Name(), "_bench");
  absl::SetProgramUsageMessage(absl::StrCat(
      c.Name(), " bus bandwidth and correctness, nccl-tests style, N ranks as threads.\n  ", prog,
      " --backend=nccl|ours_nccl|ours_nccl_device|gloo [--ranks=N] [--dtype=f32|bf16] [--min_bytes=B] "
      "[--max_bytes=B] [--step_factor=F] [--iters=N] [--warmup=N]\nEvery flag: --help=collective_bench. "
      "Exit: 0 every output element right, 1 some wrong or a collective failed, 2 bad flags or no "
      "usable GPU."));
  absl::ParseCommandLine(argc, argv);
  auto cfg_or = ReadFlags(c);
  if (!cfg_or.ok()) {
    std::fprintf(stderr, "%s: %s\n", prog.c_str(), std::string(cfg_or.status().message()).c_str());
    return 2;
  }
  Config cfg = *cfg_or;
  const bool gpu = cfg.backend != Backend::kGloo;
  if (gpu) {
    if (auto s = CheckGpus(&cfg); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", prog.c_str(), std::string(s.message()).c_str());
      return 2;
    }
  } else if (cfg.ranks == 0) {
    cfg.ranks = 2;
  }
  cfg.bound = (cfg.dtype == DType::kBF16 ? 256 : int64_t{1} << 24) / (c.Sums() ? cfg.ranks : 1);
  std::vector<std::string> skipped;
  const std::vector<Layout> layouts = Layouts(c, cfg, &skipped);
  if (layouts.empty()) {
    std::fprintf(stderr, "%s: no size to measure between --min_bytes and --max_bytes for %d ranks\n",
                 prog.c_str(), cfg.ranks);
    return 2;
  }

  // Header.
  std::printf("# %s  backend: %s  ranks: %d  dtype: %s  iters: %d  warmup: %d\n", c.Name(), BackendName(cfg.backend),
              cfg.ranks, std::string(DTypeName(cfg.dtype)).c_str(), cfg.iters, cfg.warmup);
  switch (cfg.backend) {
    case Backend::kNccl:
      std::printf("# path: NCCL alone on device buffers, out of place; %d calls queued on each rank's stream, "
                  "then one wait (as nccl-tests)\n", cfg.iters);
      break;
    case Backend::kOursNccl:
    case Backend::kOursNcclDevice:
    case Backend::kGloo:
      std::printf("# path: our worker layer (%s), one blocking call at a time, as a worker's step makes it:\n"
                  "#       %s\n", cfg.backend == Backend::kGloo ? "worker/gloo_collectives.cc, TCP loopback" :
                  "worker/nccl_collectives.cc", c.OursPath(cfg.backend).c_str());
      std::printf("#       a rank's piece is [groups, rows, cols] = [%lld, *, <=%lld] (dim 1 is the one split "
                  "over ranks), mesh fsdp=%d\n", static_cast<long long>(cfg.groups),
                  static_cast<long long>(cfg.cols), cfg.ranks);
      break;
  }
  std::printf("# time: per call, slowest rank (host clock); algbw = size / time; busbw = algbw * %s "
              "(nccl-tests)\n", c.BusFactorText());
  std::printf("# check: inputs are integers depending on rank and index (|x| <= %lld), so every output "
              "element has one exact expected value; #wrong counts those that differ\n",
              static_cast<long long>(cfg.bound));
  if (gpu) {
    int version = 0;
    ncclGetVersion(&version);
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    std::printf("# NCCL %d, NCCL_NVLS_ENABLE=%s\n", version, nvls == nullptr ? "(unset)" : nvls);
    for (int r = 0; r < cfg.ranks; ++r) std::printf("#   rank %d -> GPU %d: %s\n", r, r, GpuLine(r).c_str());
  }
  for (const auto& s : skipped) std::printf("# skipped %s\n", s.c_str());
  std::printf("#\n# %13s %13s %6s %12s %12s %12s %8s\n", "size(B)", "count(elts)", "type", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "#wrong");
  std::fflush(stdout);

  // NCCL alone: one communicator per GPU, made here for all ranks.
  std::vector<ncclComm_t> comms;
  if (cfg.backend == Backend::kNccl) {
    comms.resize(cfg.ranks);
    std::vector<int> devices(cfg.ranks);
    std::iota(devices.begin(), devices.end(), 0);
    if (auto s = NcclStatus(ncclCommInitAll(comms.data(), cfg.ranks, devices.data()), "ncclCommInitAll"); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", prog.c_str(), std::string(s.message()).c_str());
      return 1;
    }
  }
  IdExchange ids = InProcessIdExchange(cfg.timeout);
  auto gloo_store = std::make_shared<gloo::rendezvous::HashStore>();

  // A watchdog: NCCL alone has no timeout of its own, and a rank that failed
  // leaves its peers inside the collective.
  std::atomic<int64_t> progress_ns{std::chrono::steady_clock::now().time_since_epoch().count()};
  std::atomic<int64_t> current_bytes{0};
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const auto idle = std::chrono::steady_clock::now().time_since_epoch() -
                        std::chrono::steady_clock::duration(progress_ns.load());
      if (!done.load() && idle > cfg.timeout) {
        std::fflush(stdout);
        std::fprintf(stderr, "%s: no progress for %lld s at size %lld bytes (a rank is stuck in a collective); "
                     "giving up\n", prog.c_str(), static_cast<long long>(cfg.timeout.count()),
                     static_cast<long long>(current_bytes.load()));
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
  });

  const int helpers = std::max(1, std::min<int>(8, std::thread::hardware_concurrency() / cfg.ranks));
  Barrier barrier(cfg.ranks);
  std::vector<RankResult> results(cfg.ranks);
  int64_t total_wrong = 0;
  double busbw_sum = 0;
  auto rank_main = [&](int rank) {
    std::unique_ptr<Runner> runner;
    switch (cfg.backend) {
      case Backend::kNccl:
        runner = std::make_unique<NcclRunner>(c, rank, comms[rank]);
        break;
      case Backend::kOursNccl:
        if (auto s = CudaStatus(cudaSetDevice(rank), "cudaSetDevice"); !s.ok()) Die(c, rank, s);
        runner =
            std::make_unique<OursRunner>(c, MakeNcclCollectives(FsdpPosition(rank, cfg.ranks), rank, ids, cfg.timeout));
        break;
      case Backend::kOursNcclDevice:
        if (auto s = CudaStatus(cudaSetDevice(rank), "cudaSetDevice"); !s.ok()) Die(c, rank, s);
        runner = std::make_unique<OursDeviceRunner>(
            c, rank, MakeNcclCollectives(FsdpPosition(rank, cfg.ranks), rank, ids, cfg.timeout));
        break;
      case Backend::kGloo:
        runner = std::make_unique<OursRunner>(
            c, MakeGlooCollectives(FsdpPosition(rank, cfg.ranks), gloo_store, "127.0.0.1", cfg.timeout));
        break;
    }
    for (const Layout& l : layouts) {
      if (rank == 0) current_bytes = l.bytes;
      if (auto s = runner->Prepare(l, MakeInput(c, l, rank, cfg.bound, helpers)); !s.ok()) Die(c, rank, s);
      barrier.Wait();
      // At least one call before the first timed size: our layer connects
      // its communicator in its first collective.
      const int warmup = &l == &layouts[0] ? std::max(cfg.warmup, 1) : cfg.warmup;
      for (int i = 0; i < warmup; ++i) {
        if (auto s = runner->Launch(); !s.ok()) Die(c, rank, s);
        if (auto s = runner->Sync(); !s.ok()) Die(c, rank, s);
      }
      barrier.Wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < cfg.iters; ++i) {
        if (auto s = runner->Launch(); !s.ok()) Die(c, rank, s);
      }
      if (auto s = runner->Sync(); !s.ok()) Die(c, rank, s);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto out = runner->Output();
      if (!out.ok()) Die(c, rank, out.status());
      if (rank == 0 && cfg.corrupt > 0) Corrupt(&*out, cfg.corrupt);
      results[rank] = {seconds / cfg.iters, CountWrong(c, l, rank, *out, cfg.bound, helpers)};
      barrier.Wait();
      if (rank == 0) {
        double t = 0;
        int64_t wrong = 0;
        for (const auto& r : results) t = std::max(t, r.seconds), wrong += r.wrong;
        const double algbw = l.bytes / t / 1e9, busbw = algbw * c.BusFactor(cfg.ranks);
        std::printf("  %13lld %13lld %6s %12.2f %12.2f %12.2f %8lld\n", static_cast<long long>(l.bytes),
                    static_cast<long long>(l.count), std::string(DTypeName(l.dtype)).c_str(), t * 1e6, algbw,
                    busbw, static_cast<long long>(wrong));
        std::fflush(stdout);
        total_wrong += wrong;
        busbw_sum += busbw;
        progress_ns = std::chrono::steady_clock::now().time_since_epoch().count();
      }
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < cfg.ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  done = true;
  watchdog.join();
  for (ncclComm_t comm : comms) ncclCommDestroy(comm);

  std::printf("# avg busbw: %.2f GB/s over %zu sizes\n", layouts.empty() ? 0.0 : busbw_sum / layouts.size(),
              layouts.size());
  std::printf("# %s %s, %d ranks, %s: %s (%lld wrong elements)\n", c.Name(), BackendName(cfg.backend), cfg.ranks,
              std::string(DTypeName(cfg.dtype)).c_str(), total_wrong == 0 ? "PASS" : "FAIL",
              static_cast<long long>(total_wrong));
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace bench
}  // namespace shardgemm
