#include "kernels/cuda/grouped_gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/cuda/grouped_gemm_kernels.h"
#include "kernels/cuda/sm90_grouped_gemm.h"

namespace shardgemm {
namespace cuda {
namespace {

static_assert(ToCu(DType::kF32) == CuDType::kF32 && ToCu(DType::kBF16) == CuDType::kBF16 &&
                  ToCu(DType::kF16) == CuDType::kF16 && ToCu(DType::kInvalid) == CuDType::kInvalid,
              "cu_dtype.h must match kernels/dtype.h");

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

static_assert(kLtTryClusters[0] == CUBLASLT_CLUSTER_SHAPE_1x1x1 && kLtTryClusters[1] == CUBLASLT_CLUSTER_SHAPE_2x1x1 &&
                  kLtTryClusters[2] == CUBLASLT_CLUSTER_SHAPE_1x2x1 && kLtTryClusters[3] == CUBLASLT_CLUSTER_SHAPE_2x2x1,
              "heuristics_sm90.h's cluster shapes must match cublasLtClusterShape_t");

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

// A cached cuBLASLt problem: descriptors and the algorithm it runs.
struct LtPlan {
  LtKey key;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo;      // what runs
  cublasLtMatmulAlgo_t fallback;  // the heuristic's first pick (also taken when `algo` is refused at run time)
  bool algo_is_fallback = true;
  bool noted_refusal = false;  // tune_note already says a tuned pick was refused
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's top few (narrow tuning)
  int tune_level = 0;             // the LtTune reached
  std::string tune_note = "heuristic's first pick";  // how `algo` was picked
  bool bias = false;
  ~LtPlan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

int64_t ElemSize(DType t) { return DTypeSize(t); }

// The knobs of one cuBLASLt algorithm (cublasLtMatmulAlgoConfigAttributes_t),
// in the storage types cublasLt.h gives (Set/Get check the size).
struct LtConfig {
  int32_t id = -1;
  uint32_t tile = 0, stages = 0;
  int32_t splitk = 1;
  uint32_t reduction = 0, swizzle = 0, custom = 0;
  uint16_t inner = 0, cluster = 0;
  auto Tie() const { return std::tie(id, tile, stages, splitk, reduction, swizzle, custom, inner, cluster); }
  bool operator<(const LtConfig& o) const { return Tie() < o.Tie(); }
  bool operator==(const LtConfig& o) const { return Tie() == o.Tie(); }
};

template <typename T>
void GetConfigAttr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T* v) {
  T x{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &x, sizeof(x), &written) == CUBLAS_STATUS_SUCCESS &&
      written == sizeof(x))
    *v = x;
}

LtConfig ReadConfig(const cublasLtMatmulAlgo_t& algo) {
  LtConfig c;
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_ID, &c.id);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swizzle);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c.custom);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c.inner);
  GetConfigAttr(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c.cluster);
  return c;
}

// Writes every knob but the id (which cublasLtMatmulAlgoInit fixes).
bool WriteConfig(cublasLtMatmulAlgo_t* algo, const LtConfig& c) {
  auto set = [&](cublasLtMatmulAlgoConfigAttributes_t attr, const auto& v) {
    return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &v, sizeof(v)) == CUBLAS_STATUS_SUCCESS;
  };
  return set(CUBLASLT_ALGO_CONFIG_TILE_ID, c.tile) && set(CUBLASLT_ALGO_CONFIG_STAGES_ID, c.stages) &&
         set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, c.splitk) && set(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, c.reduction) &&
         set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, c.swizzle) && set(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, c.custom) &&
         set(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, c.inner) && set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, c.cluster);
}

std::string DescribeConfig(const LtConfig& c) {
  std::string s = absl::StrCat("algo ", c.id, " tile ", LtTileName(c.tile), " stages ", LtStagesName(c.stages),
                               " cluster ", LtClusterName(c.cluster), " swizzle ", c.swizzle, " custom ", c.custom);
  if (c.splitk > 1) absl::StrAppend(&s, " splitK ", c.splitk, " reduction ", c.reduction);
  return s;
}

template <typename T>
bool GetCap(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, T* v) {
  T x{};
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &x, sizeof(x), &written) != CUBLAS_STATUS_SUCCESS) return false;
  *v = x;
  return true;
}

// An array capability (tile ids, stage ids): asked for its size first.
std::vector<uint32_t> GetCapIds(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t need = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &need) != CUBLAS_STATUS_SUCCESS || need == 0)
    return {};
  std::vector<uint32_t> ids((need + sizeof(uint32_t) - 1) / sizeof(uint32_t));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, ids.data(), ids.size() * sizeof(uint32_t), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return {};
  ids.resize(std::min(ids.size(), written / sizeof(uint32_t)));
  return ids;
}

// Whether the algorithm takes operands aligned to `bytes` (unknown: yes).
bool AlignmentOk(const cublasLtMatmulAlgo_t& algo, uint32_t bytes) {
  for (auto attr : {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES}) {
    uint32_t v = 0;
    if (GetCap(algo, attr, &v) && v > bytes) return false;
  }
  return true;
}

float Median(std::vector<float> v) {
  if (v.empty()) return std::numeric_limits<float>::infinity();
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5f * (v[h - 1] + v[h]);
}

struct LtCandidate {
  cublasLtMatmulAlgo_t algo;
  LtConfig cfg;
  std::string src;  // "h3": the heuristic's 4th; "h0+cluster 2x1x1": a neighbour; "enum id 21"
};
struct LtCounts {
  int heuristic = 0, variants = 0, enumerated = 0, checks = 0;
};

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
  cudaEvent_t route_start = nullptr, route_stop = nullptr;
  static constexpr int kTuneCandidates = 8;  // narrow tuning (heuristics_sm90.cc, T2)
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
  // The last call, for LastRun().
  Strategy last_strategy = Strategy::kAuto;
  Choice last_choice;
  const LtPlan* last_plan = nullptr;

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
    if (route_start) cudaEventDestroy(route_start);
    if (route_stop) cudaEventDestroy(route_stop);
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
    SG_CUDA(cudaEventCreate(&route_start));
    SG_CUDA(cudaEventCreate(&route_stop));
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

  // The per-shape cache key of ChooseCached, and the shape it describes.
  std::vector<int64_t> ChoiceKey(const DeviceGroupedGemmArgs& a, bool ragged_k, ShapeInfo* info) const {
    ShapeInfo& s = *info;
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
    return {ragged_k, s.num_groups, s.m, s.k, s.n, s.rhs_transposed, s.has_host_sizes,
            s.equal_groups, s.max_group, static_cast<int64_t>(a.in_dtype),
            static_cast<int64_t>(a.out_dtype), a.bias != nullptr,
            static_cast<int64_t>(a.bias_dtype),
            static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.lhs) & 15),
            static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.rhs) & 15),
            static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.out) & 15)};
  }

  Choice ChooseCached(const DeviceGroupedGemmArgs& a, bool ragged_k) {
    ShapeInfo s;
    std::vector<int64_t> key = ChoiceKey(a, ragged_k, &s);
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
    plan->key = k;
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
    plan->fallback = results[0].algo;
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->candidates.push_back(results[i].algo);
    LtPlan* p = plan.get();
    plans[k] = std::move(plan);
    return p;
  }

  // --- cuBLASLt autotuning (how much: ChooseLtTune in heuristics_sm90.cc) ---

  // Tunes `plan` once per level (first call of the problem at that level;
  // blocks the host while it times). Never while `stream` is being captured.
  absl::Status MaybeTune(LtPlan* plan, const void* a, const void* b, void* c, const void* bias, int ws_index,
                         cudaStream_t stream, double flops, bool repeats) {
    const LtTune want = ChooseLtTune(flops, repeats);
    if (static_cast<int>(want) <= plan->tune_level) return absl::OkStatus();
    cudaStreamCaptureStatus cap;
    SG_CUDA(cudaStreamIsCapturing(stream, &cap));
    if (cap != cudaStreamCaptureStatusNone) return absl::OkStatus();  // a later, uncaptured call tunes
    plan->tune_level = static_cast<int>(want);
    if (plan->bias)
      SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)));
    if (want == LtTune::kWide) return TuneWide(plan, a, b, c, ws_index, stream, flops);
    // Narrow: the heuristic's top few, one warm-up and 3 timed calls each.
    if (plan->candidates.size() < 2) return absl::OkStatus();
    float best = 1e30f;
    cublasLtMatmulAlgo_t best_algo = plan->algo;
    for (const cublasLtMatmulAlgo_t& algo : plan->candidates) {
      auto warm = TimeCalls(plan, algo, a, b, c, ws_index, stream, 1);
      if (!warm.ok()) return warm.status();
      if (*warm < 0) continue;
      auto ms = TimeCalls(plan, algo, a, b, c, ws_index, stream, 3);
      if (!ms.ok()) return ms.status();
      if (*ms >= 0 && *ms < best) {
        best = *ms;
        best_algo = algo;
      }
    }
    plan->algo = best_algo;
    plan->algo_is_fallback = std::memcmp(&best_algo, &plan->fallback, sizeof(best_algo)) == 0;
    plan->tune_note = absl::StrCat("narrow: fastest of the heuristic's top ", plan->candidates.size());
    return absl::OkStatus();
  }

  // Milliseconds per call of `calls` back-to-back matmuls with `algo`; -1
  // when cuBLASLt refuses the algorithm for these operands.
  absl::StatusOr<float> TimeCalls(LtPlan* plan, const cublasLtMatmulAlgo_t& algo, const void* a, const void* b,
                                  void* c, int ws_index, cudaStream_t stream, int calls) {
    const float alpha = 1.f, beta = 0.f;
    SG_CUDA(cudaEventRecord(tune_start, stream));
    for (int i = 0; i < calls; ++i) {
      if (cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c, c, plan->c, &algo,
                         lt_ws[ws_index], options.lt_workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();  // a refused launch may leave a (non-sticky) launch error behind
        SG_CUDA(cudaStreamSynchronize(stream));
        return -1.f;
      }
    }
    SG_CUDA(cudaEventRecord(tune_stop, stream));
    SG_CUDA(cudaEventSynchronize(tune_stop));
    float ms = 0;
    SG_CUDA(cudaEventElapsedTime(&ms, tune_start, tune_stop));
    return ms / calls;
  }

  // The wide tuning's candidates (heuristics_sm90.cc, T3), best guesses
  // first: the heuristic's, then neighbours of its first picks, then
  // configurations built from cublasLtMatmulAlgoGetIds. `built`: whether
  // configurations of our own may be tried at all (16-byte-aligned operands).
  std::vector<LtCandidate> CollectWide(LtPlan* plan, const LtTunePolicy& pol, bool built, LtCounts* n) {
    std::vector<LtCandidate> out;
    std::set<LtConfig> seen;  // every configuration met, refused ones included
    const uint64_t ws = options.lt_workspace_bytes;
    const LtKey& k = plan->key;
    auto check = [&](const cublasLtMatmulAlgo_t& algo, float* waves) {
      if (n->checks >= pol.max_checks) return false;
      ++n->checks;
      cublasLtMatmulHeuristicResult_t r;
      std::memset(&r, 0, sizeof(r));
      if (cublasLtMatmulAlgoCheck(lt, plan->desc, plan->a, plan->b, plan->c, plan->c, &algo, &r) !=
          CUBLAS_STATUS_SUCCESS)
        return false;
      if (r.workspaceSize > ws || !AlignmentOk(algo, 16)) return false;
      if (waves != nullptr) *waves = r.wavesCount;
      return true;
    };

    // a. The heuristic's ranking.
    std::vector<cublasLtMatmulHeuristicResult_t> res(pol.heuristic_candidates);
    int found = 0;
    cublasLtMatmulPreference_t pref;
    if (cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
      if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                         pol.heuristic_candidates, res.data(), &found) != CUBLAS_STATUS_SUCCESS)
        found = 0;
      cublasLtMatmulPreferenceDestroy(pref);
    }
    for (int i = 0; i < found && n->heuristic < pol.max_heuristic; ++i) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ws) continue;
      const LtConfig cfg = ReadConfig(res[i].algo);
      if (!seen.insert(cfg).second) continue;
      out.push_back({res[i].algo, cfg, absl::StrCat("h", i)});
      ++n->heuristic;
    }
    if (!built) return out;

    // b. Neighbours of the first picks: one knob changed, split-K off.
    const std::vector<LtCandidate> seeds(out.begin(), out.begin() + std::min<size_t>(out.size(), pol.seeds));
    auto variant = [&](const LtCandidate& seed, LtConfig cfg, const std::string& tag) {
      if (static_cast<int>(out.size()) >= pol.max_with_variants) return;
      cfg.splitk = 1;
      cfg.reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
      if (!seen.insert(cfg).second) return;
      cublasLtMatmulAlgo_t algo = seed.algo;
      if (!WriteConfig(&algo, cfg) || !check(algo, nullptr)) return;
      out.push_back({algo, cfg, absl::StrCat(seed.src, "+", tag)});
      ++n->variants;
    };
    // The first pick's neighbourhood first, then the next pick's, ...
    for (const LtCandidate& s : seeds) {
      variant(s, s.cfg, "splitK 1");
      for (uint16_t cl : kLtTryClusters) {
        LtConfig cfg = s.cfg;
        cfg.cluster = cl;
        variant(s, cfg, absl::StrCat("cluster ", LtClusterName(cl)));
      }
      uint32_t swz = 0;
      if (GetCap(s.algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swz) && swz != 0) {
        std::vector<uint16_t> clusters = {s.cfg.cluster};
        clusters.insert(clusters.end(), std::begin(kLtTryClusters), std::end(kLtTryClusters));
        for (uint16_t cl : clusters) {
          LtConfig cfg = s.cfg;
          cfg.swizzle = s.cfg.swizzle ? 0 : 1;
          cfg.cluster = cl;
          variant(s, cfg, absl::StrCat("swizzle ", cfg.swizzle, " cluster ", LtClusterName(cl)));
        }
      }
      for (uint32_t t : GetCapIds(s.algo, CUBLASLT_ALGO_CAP_TILE_IDS)) {
        int r, c;
        LtTileDims(t, &r, &c);
        if (r < pol.min_tile_side || c < pol.min_tile_side) continue;
        LtConfig cfg = s.cfg;
        cfg.tile = t;
        variant(s, cfg, absl::StrCat("tile ", LtTileName(t)));
      }
      int32_t max_opt = 0;
      if (GetCap(s.algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &max_opt)) {
        for (int32_t o = 0; o <= std::min(max_opt, pol.max_custom_option); ++o) {
          LtConfig cfg = s.cfg;
          cfg.custom = static_cast<uint32_t>(o);
          variant(s, cfg, absl::StrCat("custom ", o));
        }
      }
      for (uint32_t st : GetCapIds(s.algo, CUBLASLT_ALGO_CAP_STAGES_IDS)) {
        LtConfig cfg = s.cfg;
        cfg.stages = st;
        variant(s, cfg, absl::StrCat("stages ", LtStagesName(st)));
      }
    }
    if (static_cast<int>(out.size()) >= pol.max_candidates) return out;

    // c. The other tensor-core algorithms, one configuration per big tile
    //    (the first stage setting accepted; cluster shape left to cuBLAS).
    std::set<int32_t> seed_ids;
    for (const LtCandidate& s : seeds) seed_ids.insert(s.cfg.id);
    const cudaDataType_t in = CudaType(static_cast<DType>(k.in)), o = CudaType(static_cast<DType>(k.out));
    int ids[256];
    int num_ids = 0;
    if (cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, in, in, o, o, 256, ids, &num_ids) !=
        CUBLAS_STATUS_SUCCESS)
      num_ids = 0;
    struct Ranked {
      LtCandidate c;
      double rank;
    };
    std::vector<Ranked> enumerated;
    for (int i = 0; i < num_ids && n->checks < pol.max_checks; ++i) {
      if (seed_ids.count(ids[i])) continue;
      cublasLtMatmulAlgo_t base;
      if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, in, in, o, o, ids[i], &base) !=
          CUBLAS_STATUS_SUCCESS)
        continue;
      uint64_t impl = 0;
      if (GetCap(base, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &impl) &&
          (impl & CUBLASLT_NUMERICAL_IMPL_FLAGS_TENSOR_OP_MASK) == 0)
        continue;
      int32_t strided = 1;
      if (k.batch > 1 && GetCap(base, CUBLASLT_ALGO_CAP_STRIDED_BATCH_SUPPORT, &strided) && strided == 0) continue;
      uint32_t epilogues = 0;
      if (plan->bias && GetCap(base, CUBLASLT_ALGO_CAP_EPILOGUE_MASK, &epilogues) &&
          (epilogues & CUBLASLT_EPILOGUE_BIAS) != CUBLASLT_EPILOGUE_BIAS)
        continue;
      std::vector<uint32_t> tiles = GetCapIds(base, CUBLASLT_ALGO_CAP_TILE_IDS);
      std::vector<uint32_t> stages = GetCapIds(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
      if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
      if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
      const LtConfig base_cfg = ReadConfig(base);
      for (uint32_t t : tiles) {
        int r, c;
        LtTileDims(t, &r, &c);
        if (t != CUBLASLT_MATMUL_TILE_UNDEFINED && (r < pol.min_tile_side || c < pol.min_tile_side)) continue;
        for (auto st = stages.rbegin(); st != stages.rend() && n->checks < pol.max_checks; ++st) {
          LtConfig cfg = base_cfg;
          cfg.tile = t;
          cfg.stages = *st;
          cfg.splitk = 1;
          cfg.reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
          if (!seen.insert(cfg).second) continue;
          cublasLtMatmulAlgo_t algo = base;
          float waves = 0;
          if (!WriteConfig(&algo, cfg) || !check(algo, &waves)) continue;
          enumerated.push_back({{algo, cfg, absl::StrCat("enum id ", ids[i])}, LtEnumRank(t, waves)});
          break;
        }
      }
    }
    std::stable_sort(enumerated.begin(), enumerated.end(),
                     [](const Ranked& x, const Ranked& y) { return x.rank > y.rank; });
    for (const Ranked& e : enumerated) {
      if (static_cast<int>(out.size()) >= pol.max_candidates) break;
      out.push_back(e.c);
      ++n->enumerated;
    }
    return out;
  }

  // Wide tuning (heuristics_sm90.cc, T3): screen every candidate, re-time
  // the fastest few in alternation, keep the lowest median (the heuristic's
  // first pick unless beaten by keep_margin).
  absl::Status TuneWide(LtPlan* plan, const void* a, const void* b, void* c, int ws_index, cudaStream_t stream,
                        double flops) {
    const LtTunePolicy& pol = WideLtTunePolicy();
    const auto t0 = std::chrono::steady_clock::now();
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c)) & 15) == 0;
    LtCounts counts;
    std::vector<LtCandidate> cands = CollectWide(plan, pol, aligned, &counts);
    // The incumbent: the heuristic's first pick, as the plan got it.
    const LtConfig inc_cfg = ReadConfig(plan->fallback);
    int inc = -1;
    for (size_t i = 0; i < cands.size(); ++i)
      if (cands[i].cfg == inc_cfg) inc = static_cast<int>(i);
    if (inc < 0) {
      cands.insert(cands.begin(), LtCandidate{plan->fallback, inc_cfg, "h0"});
      inc = 0;
    }
    const double est_ms = std::max(1e-3, flops / (pol.assumed_tflops * 1e9));
    const int calls = std::clamp(static_cast<int>(std::ceil(pol.sample_ms / est_ms)), 1, pol.max_sample_calls);
    const float kInf = std::numeric_limits<float>::infinity();
    std::vector<float> score(cands.size(), kInf);
    std::vector<bool> ran(cands.size(), false);
    float best = kInf;
    double spent = 0;
    int screened = 0, refused = 0, dropped = 0, skipped = 0;
    for (size_t i = 0; i < cands.size(); ++i) {
      if (spent > pol.budget_ms && static_cast<int>(i) != inc) {
        ++skipped;
        continue;
      }
      auto warm = TimeCalls(plan, cands[i].algo, a, b, c, ws_index, stream, 1);
      if (!warm.ok()) return warm.status();
      if (*warm < 0) {
        ++refused;
        continue;
      }
      spent += *warm;
      auto s1 = TimeCalls(plan, cands[i].algo, a, b, c, ws_index, stream, calls);
      if (!s1.ok()) return s1.status();
      if (*s1 < 0) {
        ++refused;
        continue;
      }
      spent += *s1 * calls;
      ++screened;
      ran[i] = true;
      if (*s1 > pol.drop_ratio * best) {
        ++dropped;
        continue;
      }
      auto s2 = TimeCalls(plan, cands[i].algo, a, b, c, ws_index, stream, calls);
      if (!s2.ok()) return s2.status();
      spent += std::max(0.f, *s2) * calls;
      score[i] = *s2 < 0 ? *s1 : std::min(*s1, *s2);
      best = std::min(best, score[i]);
    }
    // Finalists: the fastest few, and the incumbent whenever it ran.
    std::vector<int> order;
    for (size_t i = 0; i < cands.size(); ++i)
      if (score[i] < kInf) order.push_back(static_cast<int>(i));
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return score[x] < score[y]; });
    if (static_cast<int>(order.size()) > pol.finalists) order.resize(pol.finalists);
    if (ran[inc] && std::find(order.begin(), order.end(), inc) == order.end()) order.push_back(inc);
    if (order.empty()) {
      plan->tune_note = "wide: no candidate ran; the heuristic's first pick";
      return absl::OkStatus();
    }
    const int final_calls =
        std::clamp(static_cast<int>(std::ceil(pol.final_sample_ms / est_ms)), 1, pol.max_final_calls);
    std::vector<std::vector<float>> times(order.size());
    for (int r = 0; r < pol.final_rounds; ++r) {
      for (size_t j = 0; j < order.size(); ++j) {
        const size_t f = (j + r) % order.size();  // each round starts with another finalist
        auto t = TimeCalls(plan, cands[order[f]].algo, a, b, c, ws_index, stream, final_calls);
        if (!t.ok()) return t.status();
        times[f].push_back(*t < 0 ? kInf : *t);
      }
    }
    size_t win = 0;
    std::vector<float> med(order.size());
    for (size_t f = 0; f < order.size(); ++f) {
      med[f] = Median(times[f]);
      if (med[f] < med[win]) win = f;
    }
    const auto inc_pos = std::find(order.begin(), order.end(), inc) - order.begin();
    const bool have_inc = inc_pos < static_cast<long>(order.size()) && med[inc_pos] < kInf;
    if (have_inc && med[win] > (1.0 - pol.keep_margin) * med[inc_pos]) win = inc_pos;
    if (med[win] == kInf) {
      plan->tune_note = "wide: every finalist refused; the heuristic's first pick";
      return absl::OkStatus();
    }
    const LtCandidate& w = cands[order[win]];
    plan->algo = w.algo;
    plan->algo_is_fallback = order[win] == inc;
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    plan->tune_note = absl::StrFormat(
        "wide: %d candidates (%d heuristic, %d neighbours, %d enumerated; %d checks), %d timed, %d refused, "
        "%d dropped, %d skipped; won %s at %.1f us/call, heuristic's first %s; %.0f ms",
        static_cast<int>(cands.size()), counts.heuristic, counts.variants, counts.enumerated, counts.checks, screened,
        refused, dropped, skipped, w.src, med[win] * 1e3,
        have_inc ? absl::StrFormat("%.1f us", med[inc_pos] * 1e3) : std::string("not timed"), wall_ms);
    return absl::OkStatus();
  }

  absl::Status LtMatmul(LtPlan* plan, const void* a, const void* b, void* c, const void* bias, int ws_index,
                        cudaStream_t stream, double flops = 0, bool repeats = false) {
    if (options.autotune && plan->tune_level < static_cast<int>(LtTune::kWide))
      SG_RETURN_IF_ERROR(MaybeTune(plan, a, b, c, bias, ws_index, stream, flops, repeats));
    if (plan->bias)
      SG_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)));
    const float alpha = 1.f, beta = 0.f;
    cublasStatus_t st = cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c, c, plan->c,
                                       &plan->algo, lt_ws[ws_index], options.lt_workspace_bytes, stream);
    if (st != CUBLAS_STATUS_SUCCESS && !plan->algo_is_fallback) {
      // A tuned configuration refused for these operands (the plan's key has
      // no alignment, and a tuned pick may assume 16 bytes): the heuristic's
      // first pick for this call; the tuned one stays for aligned calls.
      cudaGetLastError();
      st = cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c, c, plan->c,
                          &plan->fallback, lt_ws[ws_index], options.lt_workspace_bytes, stream);
      if (st == CUBLAS_STATUS_SUCCESS && !plan->noted_refusal) {
        plan->noted_refusal = true;
        absl::StrAppend(&plan->tune_note, " (tuned pick refused for some operands: the heuristic's first for those)");
      }
    }
    return CublasStatus(st, "cublasLtMatmul");
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
    bool equal = true;  // every non-empty group the same size: the per-group problem repeats
    int64_t first = 0, biggest = 0;
    for (int64_t s : sizes) {
      nonempty += s > 0;
      if (s > 0 && first == 0) first = s;
      if (s > 0 && s != first) equal = false;
    }
    last_plan = nullptr;
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
      if (rows > biggest) {
        biggest = rows;
        last_plan = *plan;
      }
      const int si = idx % ns;
      cudaStream_t st = fan ? side[si] : stream;
      const char* lhs = static_cast<const char*>(a.lhs) + row * a.k * es_in;
      if (!ragged_k) {
        const char* rhs = static_cast<const char*>(a.rhs) + g * a.k * a.n * es_in;
        char* out = static_cast<char*>(a.out) + row * a.n * es_out;
        const void* bias = fuse ? static_cast<const char*>(a.bias) + g * a.n * es_out : nullptr;
        SG_RETURN_IF_ERROR(LtMatmul(*plan, rhs, lhs, out, bias, si, st, 2.0 * rows * a.k * a.n, equal));
      } else {
        const char* rhs = static_cast<const char*>(a.rhs) + row * a.n * es_in;
        char* out = static_cast<char*>(a.out) + g * a.k * a.n * es_out;
        SG_RETURN_IF_ERROR(LtMatmul(*plan, rhs, lhs, out, nullptr, si, st, 2.0 * rows * a.k * a.n, equal));
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
    last_plan = *plan;
    SG_RETURN_IF_ERROR(LtMatmul(*plan, a.rhs, a.lhs, a.out, fuse ? a.bias : nullptr, 0, stream,
                                2.0 * rows * a.num_groups * a.k * a.n, /*repeats=*/true));
    if (!ragged_k && a.bias != nullptr && !fuse) SG_RETURN_IF_ERROR(BiasAfter(a, stream));
    return absl::OkStatus();
  }

  absl::Status RunGroupedBatched(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                                 cudaStream_t stream) {
    last_plan = nullptr;
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

  // Rule 2b (heuristics_sm90.cc): times lt_loop against lt_batched once per
  // shape, each after a first run that tunes its cuBLASLt algorithm, in
  // alternating rounds; caches the faster (the loop unless the batched call
  // wins by kRouteMargin) with both timings. Not while capturing.
  absl::Status TuneRoute(const DeviceGroupedGemmArgs& a, bool ragged_k, const std::vector<int64_t>& sizes,
                         cudaStream_t stream, Choice* choice) {
    cudaStreamCaptureStatus cap;
    SG_CUDA(cudaStreamIsCapturing(stream, &cap));
    if (cap != cudaStreamCaptureStatusNone) return absl::OkStatus();  // the loop, this time
    SG_RETURN_IF_ERROR(RunLtLoop(a, ragged_k, sizes, stream, choice->lt_streams));
    const bool batched_ok = Supports(a, ragged_k, Strategy::kLtBatched).ok() &&
                            RunLtBatched(a, ragged_k, sizes, stream).ok();
    Strategy winner = Strategy::kLtLoop;
    float loop_ms = 0, batched_ms = 0;
    if (batched_ok) {
      double flops = 0;
      for (int64_t rows : sizes) flops += 2.0 * rows * a.k * a.n;
      const double est_ms = std::max(1e-3, flops / (WideLtTunePolicy().assumed_tflops * 1e9));
      const int calls = std::clamp(static_cast<int>(std::ceil(kRouteSampleMs / est_ms)), 1, 5);
      std::vector<float> tl, tb;
      for (int r = 0; r < kRouteRounds; ++r) {
        for (int half = 0; half < 2; ++half) {
          const bool loop = (half == 0) == (r % 2 == 0);  // loop first in even rounds
          SG_CUDA(cudaEventRecord(route_start, stream));
          for (int i = 0; i < calls; ++i)
            SG_RETURN_IF_ERROR(loop ? RunLtLoop(a, ragged_k, sizes, stream, choice->lt_streams)
                                    : RunLtBatched(a, ragged_k, sizes, stream));
          SG_CUDA(cudaEventRecord(route_stop, stream));
          SG_CUDA(cudaEventSynchronize(route_stop));
          float ms = 0;
          SG_CUDA(cudaEventElapsedTime(&ms, route_start, route_stop));
          (loop ? tl : tb).push_back(ms / calls);
        }
      }
      loop_ms = Median(tl);
      batched_ms = Median(tb);
      if (batched_ms < loop_ms * (1.0 - kRouteMargin)) winner = Strategy::kLtBatched;
    }
    choice->strategy = winner;
    choice->time_routes = false;
    choice->route_loop_ms = loop_ms;
    choice->route_batched_ms = batched_ms;
    ShapeInfo info;
    auto it = choices.find(ChoiceKey(a, ragged_k, &info));
    if (it != choices.end()) {
      it->second.strategy = winner;
      it->second.time_routes = false;
      it->second.route_loop_ms = loop_ms;
      it->second.route_batched_ms = batched_ms;
    }
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
    last_choice = choice;
    last_plan = nullptr;
    last_strategy = s;
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
        choice.time_routes = c2.time_routes;
        choice.route_loop_ms = c2.route_loop_ms;
        choice.route_batched_ms = c2.route_batched_ms;
      }
    }
    if (s == Strategy::kSm90) s = Strategy::kLtLoop;  // k == 0 or m == 0
    if (in.strategy == Strategy::kAuto && s == Strategy::kLtLoop && choice.time_routes && options.autotune) {
      SG_RETURN_IF_ERROR(TuneRoute(a, ragged_k, sizes, stream, &choice));
      s = choice.strategy;
    }
    last_choice = choice;
    last_strategy = s;
    switch (s) {
      case Strategy::kLtLoopGraph: return RunLtLoopGraph(a, ragged_k, sizes, stream, choice.lt_streams);
      case Strategy::kLtBatched:
        if (Supports(a, ragged_k, s).ok()) return RunLtBatched(a, ragged_k, sizes, stream);
        last_strategy = Strategy::kLtLoop;
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
RunInfo GroupedGemmRunner::LastRun() const {
  RunInfo r;
  r.strategy = impl_->last_strategy;
  const Choice& c = impl_->last_choice;
  if (r.strategy == Strategy::kSm90) {
    r.detail = absl::StrCat("tile ", c.sm90_tile_m, "x", c.sm90_tile_n, ", cluster ", c.sm90_cluster);
  } else if (impl_->last_plan != nullptr) {
    r.detail = absl::StrCat(DescribeConfig(ReadConfig(impl_->last_plan->algo)), " [", impl_->last_plan->tune_note,
                            "]");
  } else if (r.strategy == Strategy::kGroupedBatched) {
    r.detail = "cublasGemmGroupedBatchedEx (cuBLAS's own algorithm)";
  } else if (r.strategy == Strategy::kLtLoopGraph) {
    r.detail = "graph replay";
  }
  if (c.route_loop_ms > 0)
    absl::StrAppend(&r.detail, absl::StrFormat("; routes timed: lt_loop %.1f us, lt_batched %.1f us per call",
                                               c.route_loop_ms * 1e3, c.route_batched_ms * 1e3));
  return r;
}
DevicePool& GroupedGemmRunner::pool() { return impl_->pool; }
int GroupedGemmRunner::num_sms() const { return impl_->num_sms; }

}  // namespace cuda
}  // namespace shardgemm
