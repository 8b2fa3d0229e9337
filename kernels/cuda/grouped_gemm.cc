#include "kernels/cuda/grouped_gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/cuda/grouped_gemm_kernels.h"
#include "kernels/cuda/sm90_grouped_gemm.h"

namespace shardgemm {
namespace cuda {
namespace {

static_assert(ToCu(DType::kF32) == CuDType::kF32 && ToCu(DType::kBF16) == CuDType::kBF16 &&
                  ToCu(DType::kF16) == CuDType::kF16 && ToCu(DType::kInvalid) == CuDType::kInvalid,
              "cu_dtype.h must match kernels/dtype.h");

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a sticky-free error so the next call starts clean
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}
absl::Status CublasStatus(cublasStatus_t e, absl::string_view what) {
  if (e == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  what = what.substr(0, what.find('('));  // the function's name
  return absl::InternalError(absl::StrCat(what, ": cuBLAS error ", cublasLtGetStatusString(e)));
}
#define SG_RETURN_IF_ERROR(expr)             \
  do {                                       \
    absl::Status _st = (expr);               \
    if (!_st.ok()) return _st;               \
  } while (0)
#define SG_CUDA(expr) SG_RETURN_IF_ERROR(CudaStatus((expr), #expr))
#define SG_CUBLAS(expr) SG_RETURN_IF_ERROR(CublasStatus((expr), #expr))

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF16: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

// A cached cuBLASLt problem: descriptors and the algorithm its heuristic picked.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's top few
  bool tuned = false;
  bool bias = false;
  ~LtPlan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

// Column-major problem D (m x n) = op(A) (m x k) * op(B) (k x n).
struct LtKey {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  int in, out;
  bool bias;
  int64_t batch, stride_a, stride_b, stride_c;
  bool operator<(const LtKey& o) const {
    return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, in, out, bias, batch, stride_a, stride_b, stride_c) <
           std::tie(o.trans_a, o.trans_b, o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.in, o.out, o.bias, o.batch,
                    o.stride_a, o.stride_b, o.stride_c);
  }
};

int64_t ElemSize(DType t) { return DTypeSize(t); }

}  // namespace

struct GroupedGemmRunner::Impl {
  RunnerOptions options;
  int num_sms = 0;
  int cc_major = 0, cc_minor = 0;
  bool sm90_disabled = false;  // kill switch: SHARDGEMM_DISABLE_SM90 set in the environment
  bool sm90_no_cluster = false;  // SHARDGEMM_SM90_NO_CLUSTER: never launch 2x1 clusters
  DevicePool pool;
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  std::vector<cudaStream_t> side;
  std::vector<cudaEvent_t> join;
  cudaEvent_t fork = nullptr;
  cudaEvent_t tune_start = nullptr, tune_stop = nullptr;
  static constexpr int kTuneCandidates = 8;
  static constexpr double kTuneMinFlops = 2e9;  // tune only problems of >= 2 GFLOP
  std::vector<void*> lt_ws;      // one per side stream
  void* blas_ws = nullptr;
  int64_t blas_ws_bytes = 32ll << 20;
  // Pinned staging: sizes copied back, pointer arrays for grouped-batched.
  static constexpr int kSlots = 4;
  struct Slot {
    void* host = nullptr;
    int64_t host_bytes = 0;
    void* dev = nullptr;
    int64_t dev_bytes = 0;
    cudaEvent_t done = nullptr;
    bool used = false;
  };
  std::array<Slot, kSlots> slots;
  int next_slot = 0;
  int64_t* sizes_pinned = nullptr;
  int64_t sizes_pinned_count = 0;
  std::map<LtKey, std::unique_ptr<LtPlan>> plans;
  std::map<std::vector<int64_t>, Choice> choices;
  // Graph cache: exact call (pointers and sizes) -> instantiated graph.
  struct GraphEntry {
    std::vector<int64_t> key;
    cudaGraphExec_t exec;
  };
  std::list<GraphEntry> graphs;  // most recent first
  static constexpr size_t kMaxGraphs = 16;

  ~Impl() {
    for (auto& g : graphs) cudaGraphExecDestroy(g.exec);
    plans.clear();
    if (lt) cublasLtDestroy(lt);
    if (blas) cublasDestroy(blas);
    for (auto s : side) cudaStreamDestroy(s);
    for (auto e : join) cudaEventDestroy(e);
    if (fork) cudaEventDestroy(fork);
    if (tune_start) cudaEventDestroy(tune_start);
    if (tune_stop) cudaEventDestroy(tune_stop);
    for (auto& s : slots) {
      if (s.host) cudaFreeHost(s.host);
      if (s.done) cudaEventDestroy(s.done);
      pool.Free(s.dev);
    }
    if (sizes_pinned) cudaFreeHost(sizes_pinned);
    for (void* w : lt_ws) pool.Free(w);
    pool.Free(blas_ws);
  }

  absl::Status Init(const RunnerOptions& o) {
    options = o;
    SG_CUDA(cudaSetDevice(o.device));
    cudaDeviceProp prop;
    SG_CUDA(cudaGetDeviceProperties(&prop, o.device));
    num_sms = prop.multiProcessorCount;
    cc_major = prop.major;
    sm90_disabled = std::getenv("SHARDGEMM_DISABLE_SM90") != nullptr;
    sm90_no_cluster = std::getenv("SHARDGEMM_SM90_NO_CLUSTER") != nullptr;
    cc_minor = prop.minor;
    SG_CUBLAS(cublasLtCreate(&lt));
    SG_CUBLAS(cublasCreate(&blas));
    auto ws = pool.Allocate(blas_ws_bytes);
    if (!ws.ok()) return ws.status();
    blas_ws = *ws;
    SG_CUBLAS(cublasSetWorkspace(blas, blas_ws, blas_ws_bytes));
    const int ns = std::max(1, o.side_streams);
    for (int i = 0; i < ns; ++i) {
      cudaStream_t s;
      SG_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      side.push_back(s);
      cudaEvent_t e;
      SG_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      join.push_back(e);
      auto w = pool.Allocate(o.lt_workspace_bytes);
      if (!w.ok()) return w.status();
      lt_ws.push_back(*w);
    }
    SG_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    SG_CUDA(cudaEventCreate(&tune_start));
    SG_CUDA(cudaEventCreate(&tune_stop));
    for (auto& s : slots) SG_CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    return absl::OkStatus();
  }

  // --- validation ---
  absl::Status Validate(const DeviceGroupedGemmArgs& a, bool ragged_k) const {
    if (a.in_dtype != DType::kBF16 && a.in_dtype != DType::kF16)
      return absl::InvalidArgumentError(absl::StrCat("grouped gemm: inputs must be bf16 or f16, got ",
                                                     DTypeName(a.in_dtype)));
    if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF16 && a.out_dtype != DType::kF32)
      return absl::InvalidArgumentError(absl::StrCat("grouped gemm: output must be bf16, f16 or f32, got ",
                                                     DTypeName(a.out_dtype)));
    if (a.num_groups < 1) return absl::InvalidArgumentError("grouped gemm: num_groups must be >= 1");
    if (a.m < 0 || a.k < 0 || a.n < 0) return absl::InvalidArgumentError("grouped gemm: negative dimension");
    if (a.group_sizes_device == nullptr)
      return absl::InvalidArgumentError("grouped gemm: group_sizes_device is required");
    if (a.bias != nullptr) {
      if (ragged_k) return absl::InvalidArgumentError("grouped gemm: ragged K takes no bias");
      if (a.bias_dtype != DType::kF32 && a.bias_dtype != DType::kBF16 && a.bias_dtype != DType::kF16)
        return absl::InvalidArgumentError("grouped gemm: bias must be f32, bf16 or f16");
    }
    if (a.group_sizes_host != nullptr) {
      int64_t sum = 0;
      for (int64_t i = 0; i < a.num_groups; ++i) {
        if (a.group_sizes_host[i] < 0)
          return absl::InvalidArgumentError(absl::StrCat("grouped gemm: group ", i, " has negative size"));
        sum += a.group_sizes_host[i];
      }
      if (sum > a.m)
        return absl::InvalidArgumentError(
            absl::StrCat("grouped gemm: group sizes sum to ", sum, ", more than the ", a.m, " rows"));
    }
    if (a.m * std::max(a.k, a.n) > 0 && (a.lhs == nullptr || a.rhs == nullptr || a.out == nullptr))
      return absl::InvalidArgumentError("grouped gemm: null operand");
    return absl::OkStatus();
  }

  Sm90GroupedGemmParams Sm90Params(const DeviceGroupedGemmArgs& a, int tile_m, int tile_n = 256,
                                   int cluster = 1) const {
    Sm90GroupedGemmParams p;
    p.in_dtype = ToCu(a.in_dtype);
    p.out_dtype = ToCu(a.out_dtype);
    p.bias_dtype = ToCu(a.bias_dtype);
    p.lhs = a.lhs;
    p.rhs = a.rhs;
    p.bias = a.bias;
    p.out = a.out;
    p.group_sizes = a.group_sizes_device;
    p.m = a.m;
    p.k = a.k;
    p.n = a.n;
    p.num_groups = a.num_groups;
    p.rhs_transposed = a.rhs_transposed;
    p.tile_m = tile_m == 64 ? Sm90TileM::k64 : Sm90TileM::k128;
    p.tile_n = tile_n;
    p.cluster = cluster;
    return p;
  }

  absl::Status Supports(const DeviceGroupedGemmArgs& a, bool ragged_k, Strategy s) const {
    switch (s) {
      case Strategy::kAuto:
      case Strategy::kLtLoop:
      case Strategy::kLtLoopGraph:
        return absl::OkStatus();
      case Strategy::kLtBatched: {
        if (a.group_sizes_host == nullptr)
          return absl::FailedPreconditionError("lt_batched needs the host group sizes");
        for (int64_t i = 1; i < a.num_groups; ++i)
          if (a.group_sizes_host[i] != a.group_sizes_host[0])
            return absl::FailedPreconditionError("lt_batched needs equal groups");
        if (a.group_sizes_host[0] == 0) return absl::FailedPreconditionError("lt_batched needs non-empty groups");
        return absl::OkStatus();
      }
      case Strategy::kGroupedBatched:
        if (a.out_dtype != a.in_dtype)
          return absl::FailedPreconditionError("grouped_batched: cuBLAS takes output dtype == input dtype only");
        if (a.m >= (int64_t{1} << 31) || a.n >= (int64_t{1} << 31) || a.k >= (int64_t{1} << 31))
          return absl::FailedPreconditionError("grouped_batched takes 32-bit dimensions");
        if (a.bias != nullptr && a.num_groups > kBiasAddMaxGroups)
          return absl::FailedPreconditionError("too many groups for the bias kernel");
        return absl::OkStatus();
      case Strategy::kSm90: {
        if (ragged_k) return absl::FailedPreconditionError("sm90 kernel: ragged M only");
        if (sm90_disabled) return absl::FailedPreconditionError("sm90 kernel disabled by SHARDGEMM_DISABLE_SM90");
        if (cc_major != 9) return absl::FailedPreconditionError("sm90 kernel needs an sm_90 GPU");
        const char* why = Sm90GroupedGemmUnsupportedReason(Sm90Params(a, 128));
        if (why != nullptr) return absl::FailedPreconditionError(absl::StrCat("sm90 kernel: ", why));
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError("unknown strategy");
  }

  Choice ChooseCached(const DeviceGroupedGemmArgs& a, bool ragged_k) {
    ShapeInfo s;
    s.ragged_k = ragged_k;
    s.num_groups = a.num_groups;
    s.m = a.m;
    s.k = a.k;
    s.n = a.n;
    s.rhs_transposed = a.rhs_transposed;
    s.has_host_sizes = a.group_sizes_host != nullptr;
    s.num_sms = num_sms;
    if (s.has_host_sizes) {
      s.equal_groups = true;
      for (int64_t i = 0; i < a.num_groups; ++i) {
        s.max_group = std::max(s.max_group, a.group_sizes_host[i]);
        if (a.group_sizes_host[i] != a.group_sizes_host[0]) s.equal_groups = false;
      }
    }
    std::vector<int64_t> key = {ragged_k, s.num_groups, s.m, s.k, s.n, s.rhs_transposed, s.has_host_sizes,
                                s.equal_groups, s.max_group, static_cast<int64_t>(a.in_dtype),
                                static_cast<int64_t>(a.out_dtype), a.bias != nullptr,
                                static_cast<int64_t>(a.bias_dtype),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.lhs) & 15),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.rhs) & 15),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.out) & 15)};
    auto it = choices.find(key);
    if (it != choices.end()) return it->second;
    for (int i = 1; i < kNumStrategies; ++i)
      if (Supports(a, ragged_k, static_cast<Strategy>(i)).ok()) s.eligible |= 1u << i;
    Choice c = ChooseSm90(s);
    if (choices.size() > 4096) choices.clear();
    choices[key] = c;
    return c;
  }

  // --- host sizes ---
  // Blocking: copies the device sizes back (only when a cuBLAS route runs
  // without a host copy).
  absl::Status FetchSizes(const DeviceGroupedGemmArgs& a, cudaStream_t stream, std::vector<int64_t>* out) {
    if (sizes_pinned_count < a.num_groups) {
      if (sizes_pinned) cudaFreeHost(sizes_pinned);
      sizes_pinned = nullptr;
      SG_CUDA(cudaMallocHost(&sizes_pinned, a.num_groups * sizeof(int64_t)));
      sizes_pinned_count = a.num_groups;
    }
    SG_CUDA(cudaMemcpyAsync(sizes_pinned, a.group_sizes_device, a.num_groups * sizeof(int64_t),
                            cudaMemcpyDeviceToHost, stream));
    SG_CUDA(cudaStreamSynchronize(stream));
    out->assign(sizes_pinned, sizes_pinned + a.num_groups);
    return absl::OkStatus();
  }

  // A staging slot whose previous copy has finished.
  absl::StatusOr<Slot*> GetSlot(int64_t bytes) {
    Slot& s = slots[next_slot];
    next_slot = (next_slot + 1) % kSlots;
    if (s.used) SG_CUDA(cudaEventSynchronize(s.done));
    if (s.host_bytes < bytes) {
      if (s.host) cudaFreeHost(s.host);
      s.host = nullptr;
      SG_CUDA(cudaMallocHost(&s.host, bytes));
      s.host_bytes = bytes;
    }
    if (s.dev_bytes < bytes) {
      pool.Free(s.dev);
      s.dev = nullptr;
      auto d = pool.Allocate(bytes);
      if (!d.ok()) return d.status();
      s.dev = *d;
      s.dev_bytes = bytes;
    }
    return &s;
  }

  // --- cuBLASLt ---
  absl::StatusOr<LtPlan*> GetPlan(const LtKey& k) {
    auto it = plans.find(k);
    if (it != plans.end()) return it->second.get();
    auto plan = std::make_unique<LtPlan>();
    const cudaDataType_t in = CudaType(static_cast<DType>(k.in)), out = CudaType(static_cast<DType>(k.out));
    SG_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (k.bias) {
      cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
      if (k.batch > 1) {
        int64_t bstride = k.m;
        SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bstride,
                                                 sizeof(bstride)));
      }
      plan->bias = true;
    }
    const int64_t a_rows = k.trans_a ? k.k : k.m, a_cols = k.trans_a ? k.m : k.k;
    const int64_t b_rows = k.trans_b ? k.n : k.k, b_cols = k.trans_b ? k.k : k.n;
    SG_CUBLAS(cublasLtMatrixLayoutCreate(&plan->a, in, a_rows, a_cols, k.lda));
    SG_CUBLAS(cublasLtMatrixLayoutCreate(&plan->b, in, b_rows, b_cols, k.ldb));
    SG_CUBLAS(cublasLtMatrixLayoutCreate(&plan->c, out, k.m, k.n, k.ldc));
    if (k.batch > 1) {
      int32_t batch = static_cast<int32_t>(k.batch);
      for (auto [l, stride] : {std::make_pair(plan->a, k.stride_a), std::make_pair(plan->b, k.stride_b),
                               std::make_pair(plan->c, k.stride_c)}) {
        SG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
        SG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                   sizeof(stride)));
      }
    }
    cublasLtMatmulPreference_t pref;
    SG_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = options.lt_workspace_bytes;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t results[kTuneCandidates];
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                          kTuneCandidates, results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    SG_CUBLAS(st);
    if (found == 0)
      return absl::UnimplementedError(absl::StrCat("cuBLASLt has no algorithm for m=", k.m, " n=", k.n,
                                                   " k=", k.k));
    plan->algo = results[0].algo;
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->candidates.push_back(results[i].algo);
    LtPlan* p = plan.get();
    plans[k] = std::move(plan);
    return p;
  }

  // Times the heuristic's candidates once for a big problem (first call of
  // the shape; blocks the host for a few runs) and keeps the fastest.
  absl::Status MaybeTune(LtPlan* plan, const void* a, const void* b, void* c, const void* bias, int ws_index,
                         cudaStream_t stream, double flops) {
    if (plan->tuned) return absl::OkStatus();
    plan->tuned = true;
    if (!options.autotune || plan->candidates.size() < 2 || flops < kTuneMinFlops) return absl::OkStatus();
    cudaStreamCaptureStatus cap;
    SG_CUDA(cudaStreamIsCapturing(stream, &cap));
    if (cap != cudaStreamCaptureStatusNone) {
      plan->tuned = false;
      return absl::OkStatus();
    }
    if (plan->bias)
      SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)));
    const float alpha = 1.f, beta = 0.f;
    float best = 1e30f;
    cublasLtMatmulAlgo_t best_algo = plan->algo;
    for (const cublasLtMatmulAlgo_t& algo : plan->candidates) {
      bool ok = true;
      for (int rep = 0; rep < 4 && ok; ++rep) {
        if (rep == 1) SG_CUDA(cudaEventRecord(tune_start, stream));
        ok = cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c, c, plan->c, &algo,
                            lt_ws[ws_index], options.lt_workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
      }
      if (!ok) continue;
      SG_CUDA(cudaEventRecord(tune_stop, stream));
      SG_CUDA(cudaEventSynchronize(tune_stop));
      float ms = 0;
      SG_CUDA(cudaEventElapsedTime(&ms, tune_start, tune_stop));
      if (ms < best) {
        best = ms;
        best_algo = algo;
      }
    }
    plan->algo = best_algo;
    return absl::OkStatus();
  }

  absl::Status LtMatmul(LtPlan* plan, const void* a, const void* b, void* c, const void* bias, int ws_index,
                        cudaStream_t stream, double flops = 0) {
    if (!plan->tuned) SG_RETURN_IF_ERROR(MaybeTune(plan, a, b, c, bias, ws_index, stream, flops));
    if (plan->bias)
      SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)));
    const float alpha = 1.f, beta = 0.f;
    SG_CUBLAS(cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c, c, plan->c,
                             &plan->algo, lt_ws[ws_index], options.lt_workspace_bytes, stream));
    return absl::OkStatus();
  }

  // One group's column-major problem. Ragged M: D^T (N x m_g) = op(rhs_g) . lhs_g^T.
  // Ragged K: out_g^T (N x K) = rhs_g^T (N x m_g) . lhs_g (m_g x K).
  LtKey GroupKey(const DeviceGroupedGemmArgs& a, bool ragged_k, int64_t rows, bool lt_bias) const {
    LtKey k{};
    k.in = static_cast<int>(a.in_dtype);
    k.out = static_cast<int>(a.out_dtype);
    k.batch = 1;
    if (!ragged_k) {
      k.trans_a = a.rhs_transposed;
      k.trans_b = false;
      k.m = a.n;
      k.n = rows;
      k.k = a.k;
      k.lda = a.rhs_transposed ? a.k : a.n;
      k.ldb = a.k;
      k.ldc = a.n;
      k.bias = lt_bias;
    } else {
      k.trans_a = false;
      k.trans_b = true;
      k.m = a.n;
      k.n = a.k;
      k.k = rows;
      k.lda = a.n;
      k.ldb = a.k;
      k.ldc = a.n;
    }
    return k;
  }

  bool LtCanFuseBias(const DeviceGroupedGemmArgs& a) const {
    return a.bias != nullptr && a.bias_dtype == a.out_dtype;
  }

  absl::Status ZeroTail(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                        cudaStream_t stream) {
    const int64_t es = ElemSize(a.out_dtype);
    if (!ragged_k) {
      int64_t total = 0;
      for (int64_t s : sizes) total += s;
      if (total < a.m)
        SG_CUDA(cudaMemsetAsync(static_cast<char*>(a.out) + total * a.n * es, 0, (a.m - total) * a.n * es, stream));
    } else {
      for (int64_t g = 0; g < a.num_groups; ++g)
        if (sizes[g] == 0 && a.k * a.n > 0)
          SG_CUDA(cudaMemsetAsync(static_cast<char*>(a.out) + g * a.k * a.n * es, 0, a.k * a.n * es, stream));
    }
    return absl::OkStatus();
  }

  absl::Status BiasAfter(const DeviceGroupedGemmArgs& a, cudaStream_t stream) {
    return CudaStatus(LaunchBiasAddRaggedM(a.out, ToCu(a.out_dtype), a.bias, ToCu(a.bias_dtype), a.group_sizes_device,
                                           a.num_groups, a.m, a.n, stream),
                      "bias add kernel");
  }

  // Per-group cuBLASLt calls spread round-robin over the side streams.
  absl::Status RunLtLoop(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                         cudaStream_t stream, int max_streams = 0) {
    const int64_t es_in = ElemSize(a.in_dtype), es_out = ElemSize(a.out_dtype);
    const bool fuse = !ragged_k && LtCanFuseBias(a);
    SG_RETURN_IF_ERROR(ZeroTail(a, ragged_k, sizes, stream));
    int nonempty = 0;
    for (int64_t s : sizes) nonempty += s > 0;
    const size_t streams = max_streams > 0 ? std::min<size_t>(side.size(), max_streams) : side.size();
    const bool fan = nonempty > 1 && streams > 1;
    const int ns = fan ? static_cast<int>(std::min<size_t>(streams, nonempty)) : 1;
    if (fan) {
      SG_CUDA(cudaEventRecord(fork, stream));
      for (int i = 0; i < ns; ++i) SG_CUDA(cudaStreamWaitEvent(side[i], fork, 0));
    }
    int64_t row = 0;
    int idx = 0;
    const bool k_ok = a.k > 0 && a.n > 0;
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const int64_t rows = sizes[g];
      if (rows == 0 || !k_ok) {
        row += rows;
        continue;
      }
      auto plan = GetPlan(GroupKey(a, ragged_k, rows, fuse));
      if (!plan.ok()) return plan.status();
      const int si = idx % ns;
      cudaStream_t st = fan ? side[si] : stream;
      const char* lhs = static_cast<const char*>(a.lhs) + row * a.k * es_in;
      if (!ragged_k) {
        const char* rhs = static_cast<const char*>(a.rhs) + g * a.k * a.n * es_in;
        char* out = static_cast<char*>(a.out) + row * a.n * es_out;
        const void* bias = fuse ? static_cast<const char*>(a.bias) + g * a.n * es_out : nullptr;
        SG_RETURN_IF_ERROR(LtMatmul(*plan, rhs, lhs, out, bias, si, st, 2.0 * rows * a.k * a.n));
      } else {
        const char* rhs = static_cast<const char*>(a.rhs) + row * a.n * es_in;
        char* out = static_cast<char*>(a.out) + g * a.k * a.n * es_out;
        SG_RETURN_IF_ERROR(LtMatmul(*plan, rhs, lhs, out, nullptr, si, st, 2.0 * rows * a.k * a.n));
      }
      row += rows;
      ++idx;
    }
    if (fan) {
      for (int i = 0; i < ns; ++i) {
        SG_CUDA(cudaEventRecord(join[i], side[i]));
        SG_CUDA(cudaStreamWaitEvent(stream, join[i], 0));
      }
    }
    if (!ragged_k && a.bias != nullptr && !fuse) SG_RETURN_IF_ERROR(BiasAfter(a, stream));
    return absl::OkStatus();
  }

  absl::Status RunLtLoopGraph(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                              cudaStream_t stream, int max_streams) {
    std::vector<int64_t> key = {ragged_k, a.num_groups, a.m, a.k, a.n, a.rhs_transposed,
                                static_cast<int64_t>(a.in_dtype), static_cast<int64_t>(a.out_dtype),
                                static_cast<int64_t>(a.bias_dtype),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.lhs)),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.rhs)),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.bias)),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.out)),
                                static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.group_sizes_device))};
    key.insert(key.end(), sizes.begin(), sizes.end());
    for (auto it = graphs.begin(); it != graphs.end(); ++it) {
      if (it->key == key) {
        graphs.splice(graphs.begin(), graphs, it);
        return CudaStatus(cudaGraphLaunch(graphs.front().exec, stream), "cudaGraphLaunch");
      }
    }
    // Capture on a side stream of our own (the caller's stream may be the
    // legacy default stream, which cannot be captured), then replay there.
    cudaStream_t cap;
    SG_CUDA(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
    SG_CUDA(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
    absl::Status st = RunLtLoop(a, ragged_k, sizes, cap, max_streams);
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(cap, &graph);
    cudaStreamDestroy(cap);
    if (!st.ok()) {
      if (graph) cudaGraphDestroy(graph);
      return st;
    }
    SG_CUDA(e);
    cudaGraphExec_t exec;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    SG_CUDA(e);
    graphs.push_front({std::move(key), exec});
    if (graphs.size() > kMaxGraphs) {
      cudaGraphExecDestroy(graphs.back().exec);
      graphs.pop_back();
    }
    return CudaStatus(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  }

  absl::Status RunLtBatched(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                            cudaStream_t stream) {
    const int64_t rows = sizes[0];
    SG_RETURN_IF_ERROR(ZeroTail(a, ragged_k, sizes, stream));
    if (a.k == 0 || a.n == 0) {
      if (!ragged_k && a.bias) return BiasAfter(a, stream);
      return absl::OkStatus();
    }
    const bool fuse = !ragged_k && LtCanFuseBias(a);
    LtKey k = GroupKey(a, ragged_k, rows, fuse);
    k.batch = a.num_groups;
    if (!ragged_k) {
      k.stride_a = a.k * a.n;
      k.stride_b = rows * a.k;
      k.stride_c = rows * a.n;
    } else {
      k.stride_a = rows * a.n;
      k.stride_b = rows * a.k;
      k.stride_c = a.k * a.n;
    }
    auto plan = GetPlan(k);
    if (!plan.ok()) return plan.status();
    SG_RETURN_IF_ERROR(LtMatmul(*plan, a.rhs, a.lhs, a.out, fuse ? a.bias : nullptr, 0, stream,
                                2.0 * rows * a.num_groups * a.k * a.n));
    if (!ragged_k && a.bias != nullptr && !fuse) SG_RETURN_IF_ERROR(BiasAfter(a, stream));
    return absl::OkStatus();
  }

  absl::Status RunGroupedBatched(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                                 cudaStream_t stream) {
    SG_RETURN_IF_ERROR(ZeroTail(a, ragged_k, sizes, stream));
    const int64_t es_in = ElemSize(a.in_dtype), es_out = ElemSize(a.out_dtype);
    std::vector<cublasOperation_t> ta, tb;
    std::vector<int> mm, nn, kk, lda, ldb, ldc, gs;
    std::vector<float> alpha, beta;
    std::vector<const void*> pa, pb;
    std::vector<void*> pc;
    int64_t row = 0;
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const int64_t rows = sizes[g];
      if (rows == 0 || a.k == 0 || a.n == 0) {
        row += rows;
        continue;
      }
      LtKey k = GroupKey(a, ragged_k, rows, false);
      ta.push_back(k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
      tb.push_back(k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
      mm.push_back(static_cast<int>(k.m));
      nn.push_back(static_cast<int>(k.n));
      kk.push_back(static_cast<int>(k.k));
      lda.push_back(static_cast<int>(k.lda));
      ldb.push_back(static_cast<int>(k.ldb));
      ldc.push_back(static_cast<int>(k.ldc));
      gs.push_back(1);
      alpha.push_back(1.f);
      beta.push_back(0.f);
      const char* lhs = static_cast<const char*>(a.lhs) + row * a.k * es_in;
      if (!ragged_k) {
        pa.push_back(static_cast<const char*>(a.rhs) + g * a.k * a.n * es_in);
        pc.push_back(static_cast<char*>(a.out) + row * a.n * es_out);
      } else {
        pa.push_back(static_cast<const char*>(a.rhs) + row * a.n * es_in);
        pc.push_back(static_cast<char*>(a.out) + g * a.k * a.n * es_out);
      }
      pb.push_back(lhs);
      row += rows;
    }
    const int count = static_cast<int>(pa.size());
    if (count > 0) {
      const int64_t bytes = 3 * count * sizeof(void*);
      auto slot = GetSlot(bytes);
      if (!slot.ok()) return slot.status();
      Slot* s = *slot;
      void** h = static_cast<void**>(s->host);
      std::memcpy(h, pa.data(), count * sizeof(void*));
      std::memcpy(h + count, pb.data(), count * sizeof(void*));
      std::memcpy(h + 2 * count, pc.data(), count * sizeof(void*));
      SG_CUDA(cudaMemcpyAsync(s->dev, s->host, bytes, cudaMemcpyHostToDevice, stream));
      SG_CUDA(cudaEventRecord(s->done, stream));
      s->used = true;
      void** d = static_cast<void**>(s->dev);
      SG_CUBLAS(cublasSetStream(blas, stream));
      const cudaDataType_t in = CudaType(a.in_dtype), out = CudaType(a.out_dtype);
      SG_CUBLAS(cublasGemmGroupedBatchedEx(blas, ta.data(), tb.data(), mm.data(), nn.data(), kk.data(),
                                           alpha.data(), reinterpret_cast<const void* const*>(d), in, lda.data(),
                                           reinterpret_cast<const void* const*>(d + count), in, ldb.data(),
                                           beta.data(), d + 2 * count, out, ldc.data(), count, gs.data(),
                                           CUBLAS_COMPUTE_32F));
    }
    if (!ragged_k && a.bias != nullptr) SG_RETURN_IF_ERROR(BiasAfter(a, stream));
    return absl::OkStatus();
  }

  absl::Status Run(const DeviceGroupedGemmArgs& in, bool ragged_k, cudaStream_t stream) {
    SG_RETURN_IF_ERROR(Validate(in, ragged_k));
    DeviceGroupedGemmArgs a = in;
    const int64_t out_elems = ragged_k ? a.num_groups * a.k * a.n : a.m * a.n;
    if (out_elems == 0) return absl::OkStatus();
    if (a.k == 0 || (ragged_k && a.m == 0)) {  // empty contraction: zeros (+ bias)
      SG_CUDA(cudaMemsetAsync(a.out, 0, out_elems * ElemSize(a.out_dtype), stream));
      if (!ragged_k && a.bias != nullptr) return BiasAfter(a, stream);
      return absl::OkStatus();
    }
    Strategy s = a.strategy;
    Choice choice;
    if (s == Strategy::kAuto) {
      choice = ChooseCached(a, ragged_k);
      s = choice.strategy;
    } else {
      SG_RETURN_IF_ERROR(Supports(a, ragged_k, s));
      a.strategy = Strategy::kAuto;
      choice = ChooseCached(a, ragged_k);  // for the sm90 tile shape
    }
    if (a.sm90_tile_m != 0) choice.sm90_tile_m = a.sm90_tile_m;
    if (a.sm90_tile_n != 0) choice.sm90_tile_n = a.sm90_tile_n;
    if (a.sm90_cluster != 0) choice.sm90_cluster = a.sm90_cluster;
    if (choice.sm90_tile_m == 64) choice.sm90_tile_n = 256;
    if (choice.sm90_tile_m != 128 || choice.sm90_tile_n != 256 || sm90_no_cluster) choice.sm90_cluster = 1;
    if (s == Strategy::kSm90 && a.k > 0 && a.m > 0) {
      const char* detail = nullptr;
      cudaError_t e = LaunchSm90GroupedGemm(
          Sm90Params(a, choice.sm90_tile_m, choice.sm90_tile_n, choice.sm90_cluster), num_sms, stream, &detail);
      return CudaStatus(e, absl::StrCat("sm90 grouped gemm ", detail));
    }
    std::vector<int64_t> sizes;
    if (a.group_sizes_host != nullptr) {
      sizes.assign(a.group_sizes_host, a.group_sizes_host + a.num_groups);
    } else {
      SG_RETURN_IF_ERROR(FetchSizes(a, stream, &sizes));
      int64_t sum = 0;
      for (int64_t v : sizes) {
        if (v < 0) return absl::InvalidArgumentError("grouped gemm: negative group size on the device");
        sum += v;
      }
      if (sum > a.m) return absl::InvalidArgumentError("grouped gemm: device group sizes sum past the rows");
      a.group_sizes_host = sizes.data();
      if (in.strategy == Strategy::kAuto) {
        Choice c2 = ChooseCached(a, ragged_k);
        s = c2.strategy == Strategy::kSm90 ? Strategy::kLtLoop : c2.strategy;
        choice.lt_streams = c2.lt_streams;
      }
    }
    if (s == Strategy::kSm90) s = Strategy::kLtLoop;  // k == 0 or m == 0
    switch (s) {
      case Strategy::kLtLoopGraph: return RunLtLoopGraph(a, ragged_k, sizes, stream, choice.lt_streams);
      case Strategy::kLtBatched:
        if (Supports(a, ragged_k, s).ok()) return RunLtBatched(a, ragged_k, sizes, stream);
        return RunLtLoop(a, ragged_k, sizes, stream, choice.lt_streams);
      case Strategy::kGroupedBatched: return RunGroupedBatched(a, ragged_k, sizes, stream);
      default: return RunLtLoop(a, ragged_k, sizes, stream, choice.lt_streams);
    }
  }
};

GroupedGemmRunner::GroupedGemmRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupedGemmRunner::~GroupedGemmRunner() = default;

absl::StatusOr<std::unique_ptr<GroupedGemmRunner>> GroupedGemmRunner::Create(const RunnerOptions& options) {
  auto impl = std::make_unique<Impl>();
  absl::Status st = impl->Init(options);
  if (!st.ok()) return st;
  return std::unique_ptr<GroupedGemmRunner>(new GroupedGemmRunner(std::move(impl)));
}

absl::Status GroupedGemmRunner::RaggedM(const DeviceGroupedGemmArgs& args, cudaStream_t stream) {
  return impl_->Run(args, false, stream);
}
absl::Status GroupedGemmRunner::RaggedK(const DeviceGroupedGemmArgs& args, cudaStream_t stream) {
  return impl_->Run(args, true, stream);
}
Strategy GroupedGemmRunner::Choose(const DeviceGroupedGemmArgs& args, bool ragged_k) {
  return impl_->ChooseCached(args, ragged_k).strategy;
}
absl::Status GroupedGemmRunner::Supports(const DeviceGroupedGemmArgs& args, bool ragged_k, Strategy s) const {
  absl::Status v = impl_->Validate(args, ragged_k);
  if (!v.ok()) return v;
  return impl_->Supports(args, ragged_k, s);
}
DevicePool& GroupedGemmRunner::pool() { return impl_->pool; }
int GroupedGemmRunner::num_sms() const { return impl_->num_sms; }

}  // namespace cuda
}  // namespace shardgemm
