// CPU reference FP8 grouped GEMM: dequantize each operand to FP32 with its
// scales, then the FP32 grouped GEMM.
//
// Every recipe is described by one table entry per operand (OperandScales):
// the operand viewed as a row-major [d0, d1, d2] tensor (matrices as
// [rows, cols, 1]) and, per dimension, how many consecutive elements share a
// scale. One generic loop dequantizes any entry, so the six layouts of the
// header are six table entries, not six loops.

#include "kernels/cpu/fp8_grouped_gemm.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/grouped_gemm.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cpu {
namespace {

constexpr int64_t kMxBlock = 32;
constexpr int64_t kScaleBlock = 128;
// A block size meaning "the whole dimension shares one scale": that dimension
// does not appear in the scale tensor's shape.
constexpr int64_t kWhole = 0;

enum class Recipe { kNone, kTensor, kMxfp8, kBlock };

bool IsTensorMode(ScalingMode m) { return m == ScalingMode::kCurrent || m == ScalingMode::kDelayed; }

bool IsKnownMode(ScalingMode m) {
  switch (m) {
    case ScalingMode::kCurrent:
    case ScalingMode::kDelayed:
    case ScalingMode::kMxfp8:
    case ScalingMode::kBlock1x128:
    case ScalingMode::kBlock128x128:
      return true;
  }
  return false;
}

Recipe RecipeOf(const Fp8GroupedGemmArgs& a) {
  if (IsTensorMode(a.lhs_mode) && IsTensorMode(a.rhs_mode)) return Recipe::kTensor;
  if (a.lhs_mode == ScalingMode::kMxfp8 && a.rhs_mode == ScalingMode::kMxfp8) return Recipe::kMxfp8;
  // Ragged K contracts over rows, so both operands are activations-like
  // (128x1 blocks along rows); ragged M's rhs is a weight (128x128 blocks).
  const ScalingMode block_rhs = a.ragged_k ? ScalingMode::kBlock1x128 : ScalingMode::kBlock128x128;
  if (a.lhs_mode == ScalingMode::kBlock1x128 && a.rhs_mode == block_rhs) return Recipe::kBlock;
  return Recipe::kNone;
}

// How one operand's elements map to its scale tensor. Element (i0, i1, i2)
// uses scale [s0][s1][s2] of an [extent0, extent1, extent2] tensor with
// s_d = i_d / block_d; with group_rows, s0 is instead the group of row i0.
struct OperandScales {
  int64_t dims[3] = {0, 0, 1};
  const char* dim_names[3] = {"", "", ""};  // the args' field of each dimension
  int64_t block[3] = {1, 1, 1};             // >= 1
  int64_t extent[3] = {1, 1, 1};
  bool group_rows = false;
  bool e8m0 = false;
  int64_t rows_used = 0;             // rows of dim 0 that are read
  std::vector<int64_t> scale_shape;  // the contract's shape (extents of scaled dims)
};

struct Dim {
  int64_t size;
  const char* name;
  int64_t block;  // kWhole or the block size
};

OperandScales MakeScales(Dim d0, Dim d1, Dim d2, bool group_rows, bool e8m0, int64_t num_groups,
                         int64_t rows_used) {
  OperandScales s;
  const Dim d[3] = {d0, d1, d2};
  for (int i = 0; i < 3; ++i) {
    s.dims[i] = d[i].size;
    s.dim_names[i] = d[i].name;
    if (i == 0 && group_rows) {
      s.extent[0] = num_groups;
      s.scale_shape.push_back(num_groups);
    } else if (d[i].block == kWhole) {
      s.block[i] = d[i].size > 0 ? d[i].size : 1;
    } else {
      s.block[i] = d[i].block;
      s.extent[i] = d[i].size / d[i].block;
      s.scale_shape.push_back(s.extent[i]);
    }
  }
  s.group_rows = group_rows;
  s.e8m0 = e8m0;
  s.rows_used = rows_used;
  return s;
}

// The table: each operand's layout for each recipe (see the header).
OperandScales LhsScales(const Fp8GroupedGemmArgs& a, Recipe r, int64_t used) {
  const Dim none{1, "", kWhole};
  switch (r) {
    case Recipe::kTensor:
      return MakeScales({a.m, "m", kWhole}, {a.k, "k", kWhole}, none, true, false, a.num_groups, used);
    case Recipe::kMxfp8:
      return a.ragged_k ? MakeScales({a.m, "m", kMxBlock}, {a.k, "k", 1}, none, false, true, a.num_groups, used)
                        : MakeScales({a.m, "m", 1}, {a.k, "k", kMxBlock}, none, false, true, a.num_groups, used);
    case Recipe::kBlock:
      return a.ragged_k
                 ? MakeScales({a.m, "m", kScaleBlock}, {a.k, "k", 1}, none, false, false, a.num_groups, used)
                 : MakeScales({a.m, "m", 1}, {a.k, "k", kScaleBlock}, none, false, false, a.num_groups, used);
    case Recipe::kNone:
      break;
  }
  return OperandScales{};
}

OperandScales RhsScales(const Fp8GroupedGemmArgs& a, Recipe r, int64_t used) {
  const Dim none{1, "", kWhole};
  if (a.ragged_k) {
    switch (r) {
      case Recipe::kTensor:
        return MakeScales({a.m, "m", kWhole}, {a.n, "n", kWhole}, none, true, false, a.num_groups, used);
      case Recipe::kMxfp8:
        return MakeScales({a.m, "m", kMxBlock}, {a.n, "n", 1}, none, false, true, a.num_groups, used);
      case Recipe::kBlock:
        return MakeScales({a.m, "m", kScaleBlock}, {a.n, "n", 1}, none, false, false, a.num_groups, used);
      case Recipe::kNone:
        break;
    }
    return OperandScales{};
  }
  // Ragged M: [G, K, N], or [G, N, K] transposed; every expert is read.
  const bool t = a.rhs_transposed;
  const Dim g{a.num_groups, "num_groups", 1};
  auto kn = [&](int64_t k_block, int64_t n_block, bool e8m0) {
    const Dim k{a.k, "k", k_block}, n{a.n, "n", n_block};
    return t ? MakeScales(g, n, k, false, e8m0, a.num_groups, a.num_groups)
             : MakeScales(g, k, n, false, e8m0, a.num_groups, a.num_groups);
  };
  switch (r) {
    case Recipe::kTensor:
      return kn(kWhole, kWhole, false);
    case Recipe::kMxfp8:
      return kn(kMxBlock, 1, true);
    case Recipe::kBlock:
      return kn(kScaleBlock, kScaleBlock, false);
    case Recipe::kNone:
      break;
  }
  return OperandScales{};
}

// out[i] = fp8_to_float(data[i]) * (its scale) for the rows_used first rows;
// later rows (and their scales) are not read and out keeps its zeros there.
void Dequantize(const uint8_t* data, Fp8Format fmt, const void* scale_inv, const OperandScales& s,
                const int64_t* group_sizes, float* out) {
  const int64_t d1 = s.dims[1], d2 = s.dims[2];
  const float* sf = static_cast<const float*>(scale_inv);
  const uint8_t* s8 = static_cast<const uint8_t*>(scale_inv);
  int64_t g = 0, group_end = 0;
  for (int64_t r = 0; r < s.rows_used; ++r) {
    int64_t s0;
    if (s.group_rows) {
      // r < sum(group_sizes), so this stops at a group that holds r.
      while (r >= group_end) group_end += group_sizes[g++];
      s0 = g - 1;
    } else {
      s0 = r / s.block[0];
    }
    for (int64_t i1 = 0; i1 < d1; ++i1) {
      const int64_t scale_base = (s0 * s.extent[1] + i1 / s.block[1]) * s.extent[2];
      const uint8_t* q = data + (r * d1 + i1) * d2;
      float* o = out + (r * d1 + i1) * d2;
      for (int64_t i2 = 0; i2 < d2; ++i2) {
        const int64_t si = scale_base + i2 / s.block[2];
        const float scale = s.e8m0 ? E8M0ToFloat(s8[si]) : sf[si];
        o[i2] = DequantizeValue(q[i2], fmt, scale);
      }
    }
  }
}

int64_t NumElements(const OperandScales& s) {
  return s.dims[0] * s.dims[1] * s.dims[2];  // validated not to overflow
}

bool IsFp8(DType d) { return d == DType::kF8E4M3 || d == DType::kF8E5M2; }
Fp8Format FormatOf(DType d) { return d == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }

// The FP32 problem the GEMM runs; the dequantized operands are plugged in by
// the caller (validation uses the FP8 pointers, which have the same nullness).
GroupedGemmArgs Fp32Args(const Fp8GroupedGemmArgs& a, const void* lhs, const void* rhs) {
  GroupedGemmArgs g;
  g.lhs_dtype = DType::kF32;
  g.rhs_dtype = DType::kF32;
  g.out_dtype = a.out_dtype;
  g.bias_dtype = a.bias_dtype;
  g.lhs = lhs;
  g.rhs = rhs;
  g.bias = a.bias;
  g.out = a.out;
  g.m = a.m;
  g.k = a.k;
  g.n = a.n;
  g.num_groups = a.num_groups;
  g.group_sizes = a.group_sizes;
  g.rhs_transposed = a.rhs_transposed;
  return g;
}

absl::Status CheckScales(const char* field, const char* operand, ScalingMode mode, const OperandScales& s,
                         const void* scale_inv) {
  // Block sizes must divide their dimensions: the layouts are unpadded.
  for (int i = 0; i < 3; ++i) {
    if (s.block[i] > 1 && s.extent[i] * s.block[i] != s.dims[i] && !(i == 0 && s.group_rows)) {
      return absl::InvalidArgumentError(absl::StrCat(s.dim_names[i], ": ", s.dims[i], " is not a multiple of ",
                                                     s.block[i], " (", operand, " ", ScalingModeName(mode),
                                                     " scales come in blocks of ", s.block[i], ")"));
    }
  }
  int64_t elements = 1;
  for (int64_t e : s.scale_shape) {
    if (__builtin_mul_overflow(elements, e, &elements)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": size overflows int64"));
    }
  }
  if (scale_inv == nullptr && elements > 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": null pointer for ", elements, " scales (",
                                                   ScalingModeName(mode), ")"));
  }
  return absl::OkStatus();
}

int64_t UsedRows(const Fp8GroupedGemmArgs& a) {
  int64_t used = 0;
  for (int64_t g = 0; g < a.num_groups; ++g) used += a.group_sizes[g];
  return used;
}

}  // namespace

std::vector<int64_t> Fp8LhsScaleShape(const Fp8GroupedGemmArgs& args) {
  return LhsScales(args, RecipeOf(args), 0).scale_shape;
}

std::vector<int64_t> Fp8RhsScaleShape(const Fp8GroupedGemmArgs& args) {
  return RhsScales(args, RecipeOf(args), 0).scale_shape;
}

absl::Status ValidateFp8GroupedGemmArgs(const Fp8GroupedGemmArgs& a) {
  const struct {
    const char* name;
    DType dtype;
  } operands[] = {{"lhs_dtype", a.lhs_dtype}, {"rhs_dtype", a.rhs_dtype}};
  for (const auto& o : operands) {
    if (!IsFp8(o.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.name, ": ", DTypeName(o.dtype), " is not an FP8 dtype (want f8e4m3 or f8e5m2)"));
    }
  }
  if (a.lhs_dtype == DType::kF8E5M2 && a.rhs_dtype == DType::kF8E5M2) {
    // What the FP8 tensor cores (and cuBLASLt) accept: E5M2 is for gradients,
    // paired with E4M3 activations or weights.
    return absl::InvalidArgumentError(
        "lhs_dtype/rhs_dtype: f8e5m2 x f8e5m2 is not supported (at most one operand may be f8e5m2)");
  }
  if (!IsKnownMode(a.lhs_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lhs_mode: unknown scaling mode ", static_cast<int>(a.lhs_mode)));
  }
  if (!IsKnownMode(a.rhs_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rhs_mode: unknown scaling mode ", static_cast<int>(a.rhs_mode)));
  }
  const Recipe recipe = RecipeOf(a);
  if (recipe == Recipe::kNone) {
    return absl::UnimplementedError(absl::StrCat(
        "lhs_mode/rhs_mode: ", ScalingModeName(a.lhs_mode), " x ", ScalingModeName(a.rhs_mode),
        " is not an FP8 GEMM recipe; ", a.ragged_k ? "ragged K" : "ragged M",
        " takes tensor scaling (current/delayed x current/delayed), mxfp8 x mxfp8 or ",
        a.ragged_k ? "block_1x128 x block_1x128" : "block_1x128 x block_128x128"));
  }
  // The shared checks (out_dtype, dims, groups, bias, pointers, sizes) are
  // the FP32 GEMM's own, on FP32 stand-ins: the FP32 copies are what this
  // allocates, so their byte sizes are the ones that must not overflow.
  const GroupedGemmArgs fp32 = Fp32Args(a, a.lhs, a.rhs);
  if (auto s = ValidateGroupedGemmArgs(fp32, a.ragged_k); !s.ok()) return s;
  const int64_t used = UsedRows(a);
  if (auto s = CheckScales("lhs_scale_inv", "lhs", a.lhs_mode, LhsScales(a, recipe, used), a.lhs_scale_inv);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckScales("rhs_scale_inv", "rhs", a.rhs_mode, RhsScales(a, recipe, used), a.rhs_scale_inv);
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

absl::Status Fp8GroupedGemm(const Fp8GroupedGemmArgs& args, int num_threads) {
  if (auto s = ValidateFp8GroupedGemmArgs(args); !s.ok()) return s;
  const Recipe recipe = RecipeOf(args);
  const int64_t used = UsedRows(args);
  const OperandScales ls = LhsScales(args, recipe, used);
  const OperandScales rs = RhsScales(args, recipe, used);
  // Zero-filled, so rows that are not read (past sum(group_sizes)) hold no
  // garbage even though the GEMM never reads them.
  std::vector<float> lhs(static_cast<size_t>(NumElements(ls)));
  std::vector<float> rhs(static_cast<size_t>(NumElements(rs)));
  Dequantize(args.lhs, FormatOf(args.lhs_dtype), args.lhs_scale_inv, ls, args.group_sizes, lhs.data());
  Dequantize(args.rhs, FormatOf(args.rhs_dtype), args.rhs_scale_inv, rs, args.group_sizes, rhs.data());
  const GroupedGemmArgs fp32 = Fp32Args(args, lhs.data(), rhs.data());
  return args.ragged_k ? GroupedGemmRaggedK(fp32, num_threads) : GroupedGemmRaggedM(fp32, num_threads);
}

}  // namespace cpu
}  // namespace shardgemm
