#include "kernels/cuda/fp8_gemm.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cu_dtype.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/heuristics_sm90.h"
#include "kernels/cuda/sm90_fp8_grouped_gemm.h"

namespace shardgemm {
namespace cuda {
namespace {

bool IsTensor(ScalingMode m) { return m == ScalingMode::kCurrent || m == ScalingMode::kDelayed; }

cudaDataType_t Fp8Type(Fp8Format f) { return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

absl::Status Lt(cublasStatus_t s, const std::string& what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLASLt status ", static_cast<int>(s)));
}

// RAII for the descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Multiprocessor count of the current device when it is sm_90 (our kernel's
// only target), else 0; cached per device.
int Sm90SmCount() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices];  // 0: not looked up, -1: not sm_90, else SMs
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  if (cached[dev] == 0) {
    int major = 0, minor = 0, sms = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    cached[dev] = (major == 9 && minor == 0 && sms > 0) ? sms : -1;
  }
  return cached[dev] > 0 ? cached[dev] : 0;
}

}  // namespace

absl::Status Fp8GroupedGemm(const Fp8GroupedGemmArgs& a, cublasLtHandle_t handle, cudaStream_t stream) {
  if (a.m < 0) return absl::InvalidArgumentError("m: negative");
  if (a.n <= 0) return absl::InvalidArgumentError("n: must be positive");
  if (a.k <= 0 || a.k % 16 != 0) return absl::InvalidArgumentError("k: must be a positive multiple of 16 (FP8)");
  if (a.num_groups > 0 && a.group_sizes == nullptr && a.device_group_sizes == nullptr)
    return absl::InvalidArgumentError("group_sizes: null");
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF16 && a.out_dtype != DType::kF32) {
    return absl::InvalidArgumentError("out_dtype: not bf16, f16 or f32");
  }
  if ((a.n * DTypeSize(a.out_dtype)) % 16 != 0) return absl::InvalidArgumentError("n: out rows must be 16-byte multiples");
  if (a.lhs_format == Fp8Format::kE5M2 && a.rhs_format == Fp8Format::kE5M2) {
    return absl::InvalidArgumentError("lhs_format/rhs_format: e5m2 x e5m2 has no FP8 GEMM");
  }
  if (a.lhs == nullptr && a.m > 0) return absl::InvalidArgumentError("lhs: null");
  if (a.rhs == nullptr && a.num_groups > 0) return absl::InvalidArgumentError("rhs: null");
  if (a.lhs_scale_inv == nullptr || a.rhs_scale_inv == nullptr) return absl::InvalidArgumentError("scale_inv: null");
  if (a.out == nullptr && a.m > 0) return absl::InvalidArgumentError("out: null");
  if (a.lhs_mode == ScalingMode::kMxfp8 || a.rhs_mode == ScalingMode::kMxfp8) {
    return absl::UnimplementedError(
        "mxfp8: cuBLASLt's VEC32_UE8M0 block-scaled FP8 GEMM needs Blackwell (sm_100+); not available on Hopper");
  }
  const bool tensor = IsTensor(a.lhs_mode) && IsTensor(a.rhs_mode);
  const bool block = a.lhs_mode == ScalingMode::kBlock1x128 && a.rhs_mode == ScalingMode::kBlock128x128;
  if (!tensor && !block) {
    return absl::UnimplementedError(absl::StrCat("scaling modes lhs=", ScalingModeName(a.lhs_mode), " rhs=",
                                                 ScalingModeName(a.rhs_mode),
                                                 ": supported are tensor x tensor and block_1x128 x block_128x128"));
  }
  // Our sm90 kernel: tensor x tensor or block x block, device sizes given, params it takes.
  if (a.device_group_sizes != nullptr && a.num_groups > 0) {
    Sm90Fp8GroupedGemmParams p;
    p.lhs_format = a.lhs_format == Fp8Format::kE4M3 ? Sm90Fp8Format::kE4M3 : Sm90Fp8Format::kE5M2;
    p.rhs_format = a.rhs_format == Fp8Format::kE4M3 ? Sm90Fp8Format::kE4M3 : Sm90Fp8Format::kE5M2;
    p.out_dtype = ToCu(a.out_dtype);
    p.lhs = a.lhs, p.rhs = a.rhs;
    p.lhs_scale_inv = static_cast<const float*>(a.lhs_scale_inv);
    p.rhs_scale_inv = static_cast<const float*>(a.rhs_scale_inv);
    p.out = a.out;
    p.group_sizes = a.device_group_sizes;
    p.m = a.m, p.k = a.k, p.n = a.n, p.num_groups = a.num_groups;
    p.block_scaling = block;
    Fp8ShapeInfo info;
    info.block_scaling = block;
    info.num_groups = a.num_groups;
    info.m = a.m, info.k = a.k, info.n = a.n;
    if (a.group_sizes != nullptr) {
      info.max_group = 0;
      for (int64_t g = 0; g < a.num_groups; ++g) info.max_group = std::max(info.max_group, a.group_sizes[g]);
    }
    info.fast_accum = a.fast_accum;
    const int sms = Sm90SmCount();
    info.num_sms = sms > 0 ? sms : 132;
    // The tile is chosen first; whether the kernel takes the params does not depend on it.
    info.kernel_ok = sms > 0 && Sm90Fp8GroupedGemmUnsupportedReason(p) == nullptr;
    const Fp8Choice choice = ChooseSm90Fp8(info);
    p.tile_m = choice.tile_m, p.tile_n = choice.tile_n, p.promote = choice.promote, p.tma_store = choice.tma_store;
    if (choice.ours && Sm90Fp8GroupedGemmUnsupportedReason(p) == nullptr) {
      if (a.group_sizes != nullptr) {  // the same checks of the host sizes as the cuBLASLt route
        GroupedQuantizeArgs lq;
        lq.m = a.m, lq.k = a.k, lq.group_sizes = a.group_sizes, lq.num_groups = a.num_groups, lq.mode = a.lhs_mode;
        absl::StatusOr<QuantizeLayout> ll = GetQuantizeLayout(lq);
        if (!ll.ok()) return ll.status();
      }
      const char* detail = "";
      cudaError_t e = LaunchSm90Fp8GroupedGemm(p, sms, stream, &detail);
      if (e != cudaSuccess) return CudaStatus(e, absl::StrCat("sm90 FP8 grouped GEMM: ", detail));
      if (a.stats) {
        a.stats->ours = true;
        a.stats->ours_tile_m = p.tile_m, a.stats->ours_tile_n = p.tile_n, a.stats->ours_promote = p.promote;
        a.stats->ours_tma_store = p.tma_store;
        a.stats->ours_block_scaling = p.block_scaling;
      }
      return absl::OkStatus();
    }
  }
  if (a.group_sizes == nullptr) {
    return absl::InvalidArgumentError("group_sizes: null (the host sizes are needed where our sm90 kernel cannot run)");
  }
  // Scale offsets per group, as GroupedQuantize laid them out.
  GroupedQuantizeArgs lq;
  lq.m = a.m, lq.k = a.k, lq.group_sizes = a.group_sizes, lq.num_groups = a.num_groups, lq.mode = a.lhs_mode;
  absl::StatusOr<QuantizeLayout> ll = GetQuantizeLayout(lq);
  if (!ll.ok()) return ll.status();
  std::vector<int64_t> rgs(static_cast<size_t>(a.num_groups), a.n);
  GroupedQuantizeArgs rq = lq;
  rq.m = a.num_groups * a.n, rq.group_sizes = rgs.data(), rq.mode = a.rhs_mode;
  absl::StatusOr<QuantizeLayout> rl = GetQuantizeLayout(rq);
  if (!rl.ok()) return rl.status();

  const int64_t used = ll->row_offset[a.num_groups];
  const int es = DTypeSize(a.out_dtype);
  if (used < a.m) {
    cudaError_t e = cudaMemsetAsync(static_cast<char*>(a.out) + used * a.n * es, 0,
                                    static_cast<size_t>((a.m - used) * a.n * es), stream);
    if (e != cudaSuccess) return CudaStatus(e, "cudaMemsetAsync");
  }
  const cudaDataType_t out_type =
      a.out_dtype == DType::kBF16 ? CUDA_R_16BF : a.out_dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_32F;
  const float alpha = 1.0f, beta = 0.0f;
  const char* mode_name = tensor ? "tensor scaling" : "block scaling (1x128 x 128x128)";
  const int64_t kb = (a.k + 127) / 128;

  // cuBLASLt wants its scale pointers aligned (a per-group float inside a [G]
  // array is only 4-byte aligned): copy every group's scales to 256-byte slots.
  auto slot_bytes = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  std::vector<int64_t> lslot(static_cast<size_t>(a.num_groups + 1), 0), rslot(lslot);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    const int64_t lb = tensor ? 4 : 4 * (ll->rowwise_scale_offset[g + 1] - ll->rowwise_scale_offset[g]);
    const int64_t rb = tensor ? 4 : 4 * (rl->rowwise_scale_offset[g + 1] - rl->rowwise_scale_offset[g]);
    lslot[g + 1] = lslot[g] + slot_bytes(lb);
    rslot[g + 1] = rslot[g] + slot_bytes(rb);
  }
  char* scratch = nullptr;
  const int64_t scratch_bytes = lslot[a.num_groups] + rslot[a.num_groups];
  if (scratch_bytes > 0) {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&scratch), static_cast<size_t>(scratch_bytes), stream);
    if (e != cudaSuccess) return CudaStatus(e, "cudaMallocAsync");
  }
  struct Freer {
    void* p;
    cudaStream_t s;
    ~Freer() {
      if (p) cudaFreeAsync(p, s);
    }
  } free_scratch{scratch, stream};
  char* lscr = scratch;
  char* rscr = scratch + lslot[a.num_groups];
  for (int side = 0; side < 2 && a.num_groups > 0; ++side) {
    const char* src = static_cast<const char*>(side == 0 ? a.lhs_scale_inv : a.rhs_scale_inv);
    char* dst = side == 0 ? lscr : rscr;
    cudaError_t e = cudaSuccess;
    if (tensor) {
      e = cudaMemcpy2DAsync(dst, 256, src, 4, 4, static_cast<size_t>(a.num_groups), cudaMemcpyDeviceToDevice, stream);
    } else {
      const QuantizeLayout& lay = side == 0 ? *ll : *rl;
      const std::vector<int64_t>& slot = side == 0 ? lslot : rslot;
      for (int64_t g = 0; g < a.num_groups && e == cudaSuccess; ++g) {
        const int64_t bytes = 4 * (lay.rowwise_scale_offset[g + 1] - lay.rowwise_scale_offset[g]);
        if (bytes) {
          e = cudaMemcpyAsync(dst + slot[g], src + 4 * lay.rowwise_scale_offset[g], static_cast<size_t>(bytes),
                              cudaMemcpyDeviceToDevice, stream);
        }
      }
    }
    if (e != cudaSuccess) return CudaStatus(e, "scale copy");
  }

  // One FP8 matmul: D [n x cols] = A^T [n x k] * B [k x cols], trying cuBLASLt's top algorithms in turn.
  std::string last_error;
  auto matmul = [&](const void* A, const void* B, void* D, int64_t cols, const void* a_scale,
                    const void* b_scale) -> bool {
    Descs d;
    if (cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
      last_error = "cublasLtMatmulDescCreate failed";
      return false;
    }
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    const int8_t fast = a.fast_accum ? 1 : 0;
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
    if (!tensor) {
      const cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const cublasLtMatmulMatrixScale_t bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      if (cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am)) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm)) !=
              CUBLAS_STATUS_SUCCESS) {
        last_error = "this cuBLASLt does not take the block scale modes";
        return false;
      }
    }
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
    cublasLtMatrixLayoutCreate(&d.a, Fp8Type(a.rhs_format), a.k, a.n, a.k);
    cublasLtMatrixLayoutCreate(&d.b, Fp8Type(a.lhs_format), a.k, cols, a.k);
    cublasLtMatrixLayoutCreate(&d.d, out_type, a.n, cols, a.n);
    cublasLtMatmulPreferenceCreate(&d.pref);
    size_t ws = a.workspace_bytes;
    cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t heur[8] = {};
    int found = 0;
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.d, d.d, d.pref, 8, heur, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      last_error = absl::StrCat("no cuBLASLt algorithm (heuristic status ", static_cast<int>(hs), ")");
      return false;
    }
    for (int i = 0; i < found; ++i) {
      cublasStatus_t ms = cublasLtMatmul(handle, d.op, &alpha, A, d.a, B, d.b, &beta, D, d.d, D, d.d, &heur[i].algo,
                                         a.workspace, a.workspace_bytes, stream);
      if (ms == CUBLAS_STATUS_SUCCESS) return true;
      last_error = absl::StrCat("cublasLtMatmul status ", static_cast<int>(ms), " for all ", found, " algorithms");
    }
    return false;
  };

  for (int64_t g = 0; g < a.num_groups; ++g) {
    const int64_t mg = a.group_sizes[g];
    if (mg == 0) continue;
    const uint8_t* A = a.rhs + g * a.n * a.k;
    const uint8_t* B = a.lhs + ll->row_offset[g] * a.k;
    char* D = static_cast<char*>(a.out) + ll->row_offset[g] * a.n * es;
    const void* a_scale = rscr + rslot[g];
    const void* b_scale = lscr + lslot[g];
    if (matmul(A, B, D, mg, a_scale, b_scale)) {
      if (a.stats) ++a.stats->direct_groups;
      continue;
    }
    // Fallback: pad the group's rows to a multiple of 16 in scratch (zero rows, zero scales).
    const std::string direct_error = last_error;
    const int64_t mp = (mg + 15) / 16 * 16;
    if (mp == mg) {
      return absl::UnimplementedError(absl::StrCat(mode_name, " FP8 GEMM (", Fp8FormatName(a.rhs_format), " x ",
                                                   Fp8FormatName(a.lhs_format), ", n=", a.n, " k=", a.k,
                                                   " m_g=", mg, "): ", direct_error));
    }
    char* pad = nullptr;
    const int64_t b_bytes = slot_bytes(mp * a.k), d_bytes = slot_bytes(mp * a.n * es), s_bytes = kb * mp * 4;
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&pad), static_cast<size_t>(b_bytes + d_bytes + s_bytes),
                                    stream);
    if (e != cudaSuccess) return CudaStatus(e, "cudaMallocAsync");
    Freer free_pad{pad, stream};
    char* pb = pad;
    char* pd = pad + b_bytes;
    char* ps = pad + b_bytes + d_bytes;
    e = cudaMemsetAsync(pb, 0, static_cast<size_t>(mp * a.k), stream);
    if (e == cudaSuccess) e = cudaMemcpyAsync(pb, B, static_cast<size_t>(mg * a.k), cudaMemcpyDeviceToDevice, stream);
    if (e == cudaSuccess && !tensor) {
      // lhs scales [kb][roundup(mg, 4)] -> [kb][mp].
      e = cudaMemsetAsync(ps, 0, static_cast<size_t>(s_bytes), stream);
      if (e == cudaSuccess) {
        e = cudaMemcpy2DAsync(ps, static_cast<size_t>(mp * 4), b_scale, static_cast<size_t>((mg + 3) / 4 * 4 * 4),
                              static_cast<size_t>(mg * 4), static_cast<size_t>(kb), cudaMemcpyDeviceToDevice, stream);
      }
    }
    if (e != cudaSuccess) return CudaStatus(e, "padding copy");
    if (!matmul(A, pb, pd, mp, a_scale, tensor ? b_scale : ps)) {
      return absl::UnimplementedError(absl::StrCat(mode_name, " FP8 GEMM (", Fp8FormatName(a.rhs_format), " x ",
                                                   Fp8FormatName(a.lhs_format), ", n=", a.n, " k=", a.k,
                                                   " m_g=", mg, "): ", direct_error, "; padded to ", mp, ": ",
                                                   last_error));
    }
    e = cudaMemcpyAsync(D, pd, static_cast<size_t>(mg * a.n * es), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return CudaStatus(e, "padding copy back");
    if (a.stats) ++a.stats->padded_groups;
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace shardgemm
