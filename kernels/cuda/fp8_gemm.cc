#include "kernels/cuda/fp8_gemm.h"

#include <string>

#include "absl/strings/str_cat.h"

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

}  // namespace

absl::Status Fp8GroupedGemm(const Fp8GroupedGemmArgs& a, cublasLtHandle_t handle, cudaStream_t stream) {
  if (a.m < 0) return absl::InvalidArgumentError("m: negative");
  if (a.n <= 0) return absl::InvalidArgumentError("n: must be positive");
  if (a.k <= 0 || a.k % 16 != 0) return absl::InvalidArgumentError("k: must be a positive multiple of 16 (FP8)");
  if (a.num_groups > 0 && a.group_sizes == nullptr) return absl::InvalidArgumentError("group_sizes: null");
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
    if (e != cudaSuccess) return absl::InternalError(absl::StrCat("cudaMemsetAsync: ", cudaGetErrorString(e)));
  }
  const cudaDataType_t out_type =
      a.out_dtype == DType::kBF16 ? CUDA_R_16BF : a.out_dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_32F;
  const float alpha = 1.0f, beta = 0.0f;
  const char* mode_name = tensor ? "tensor scaling" : "block scaling (1x128 x 128x128)";
  for (int64_t g = 0; g < a.num_groups; ++g) {
    const int64_t mg = a.group_sizes[g];
    if (mg == 0) continue;
    Descs d;
    if (auto s = Lt(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate"); !s.ok()) {
      return s;
    }
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    const int8_t fast = a.fast_accum ? 1 : 0;
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
    const void* a_scale;
    const void* b_scale;
    if (tensor) {
      a_scale = static_cast<const float*>(a.rhs_scale_inv) + g;
      b_scale = static_cast<const float*>(a.lhs_scale_inv) + g;
    } else {
      a_scale = static_cast<const float*>(a.rhs_scale_inv) + rl->rowwise_scale_offset[g];
      b_scale = static_cast<const float*>(a.lhs_scale_inv) + ll->rowwise_scale_offset[g];
      const cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const cublasLtMatmulMatrixScale_t bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      if (auto s = Lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am)),
                      "A_SCALE_MODE");
          !s.ok()) {
        return absl::UnimplementedError(absl::StrCat(mode_name, ": ", s.message()));
      }
      if (auto s = Lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm)),
                      "B_SCALE_MODE");
          !s.ok()) {
        return absl::UnimplementedError(absl::StrCat(mode_name, ": ", s.message()));
      }
    }
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
    cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
    if (auto s = Lt(cublasLtMatrixLayoutCreate(&d.a, Fp8Type(a.rhs_format), a.k, a.n, a.k), "layout A"); !s.ok()) {
      return s;
    }
    if (auto s = Lt(cublasLtMatrixLayoutCreate(&d.b, Fp8Type(a.lhs_format), a.k, mg, a.k), "layout B"); !s.ok()) {
      return s;
    }
    if (auto s = Lt(cublasLtMatrixLayoutCreate(&d.d, out_type, a.n, mg, a.n), "layout D"); !s.ok()) return s;
    cublasLtMatmulPreferenceCreate(&d.pref);
    size_t ws = a.workspace_bytes;
    cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.d, d.d, d.pref, 1, &heur, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      return absl::UnimplementedError(absl::StrCat(mode_name, " FP8 GEMM (", Fp8FormatName(a.rhs_format), " x ",
                                                   Fp8FormatName(a.lhs_format), ", n=", a.n, " k=", a.k, " m_g=", mg,
                                                   "): cuBLASLt has no algorithm here (status ",
                                                   static_cast<int>(hs), ")"));
    }
    const uint8_t* A = a.rhs + g * a.n * a.k;
    const uint8_t* B = a.lhs + ll->row_offset[g] * a.k;
    void* D = static_cast<char*>(a.out) + ll->row_offset[g] * a.n * es;
    if (auto s = Lt(cublasLtMatmul(handle, d.op, &alpha, A, d.a, B, d.b, &beta, D, d.d, D, d.d, &heur.algo,
                                   a.workspace, a.workspace_bytes, stream),
                    absl::StrCat("cublasLtMatmul group ", g));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace shardgemm
