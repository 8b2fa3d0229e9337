#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

bool IsQuantizeInput(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

float LoadFloat(const void* x, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: return Bf16BitsToFloat(static_cast<const uint16_t*>(x)[i]);
    case DType::kF16: return F16BitsToFloat(static_cast<const uint16_t*>(x)[i]);
    default: return static_cast<const float*>(x)[i];
  }
}

void StoreFloat(void* out, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16: static_cast<uint16_t*>(out)[i] = FloatToBf16Bits(v); break;
    case DType::kF16: static_cast<uint16_t*>(out)[i] = FloatToF16Bits(v); break;
    default: static_cast<float*>(out)[i] = v; break;
  }
}

bool IsTensorMode(ScalingMode m) { return m == ScalingMode::kCurrent || m == ScalingMode::kDelayed; }

}  // namespace

const char* ScalingModeName(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kCurrent: return "current";
    case ScalingMode::kDelayed: return "delayed";
    case ScalingMode::kMxfp8: return "mxfp8";
    case ScalingMode::kBlock1x128: return "block_1x128";
    case ScalingMode::kBlock128x128: return "block_128x128";
  }
  return "invalid";
}

absl::StatusOr<std::pair<int64_t, int64_t>> FlattenToMatrix(const std::vector<int64_t>& dims, int flatten_axis) {
  const int rank = static_cast<int>(dims.size());
  const int axis = flatten_axis < 0 ? flatten_axis + rank : flatten_axis;
  if (rank < 2 || axis < 1 || axis >= rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("flatten_axis: ", flatten_axis, " does not split a rank-", rank, " shape into rows and columns"));
  }
  int64_t m = 1, k = 1;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0) return absl::InvalidArgumentError(absl::StrCat("dims[", i, "]: ", dims[i], " is negative"));
    (i < axis ? m : k) *= dims[i];
  }
  return std::make_pair(m, k);
}

absl::StatusOr<QuantizeLayout> GetQuantizeLayout(const GroupedQuantizeArgs& a) {
  if (!IsQuantizeInput(a.x_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("x_dtype: ", DTypeName(a.x_dtype), " is not bf16, f16 or f32"));
  }
  if (a.format != Fp8Format::kE4M3 && a.format != Fp8Format::kE5M2) {
    return absl::InvalidArgumentError("format: not e4m3 or e5m2");
  }
  switch (a.mode) {
    case ScalingMode::kCurrent: case ScalingMode::kDelayed: case ScalingMode::kMxfp8:
    case ScalingMode::kBlock1x128: case ScalingMode::kBlock128x128: break;
    default: return absl::InvalidArgumentError("mode: unknown scaling mode");
  }
  if (a.m < 0) return absl::InvalidArgumentError(absl::StrCat("m: ", a.m, " is negative"));
  if (a.k <= 0) return absl::InvalidArgumentError(absl::StrCat("k: ", a.k, " must be positive"));
  if (a.num_groups < 0) return absl::InvalidArgumentError("num_groups: negative");
  if (a.num_groups > 0 && a.group_sizes == nullptr) {
    return absl::InvalidArgumentError("group_sizes: null with num_groups > 0");
  }
  if (a.mode == ScalingMode::kMxfp8 && a.k % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("k: ", a.k, " is not a multiple of 32 (mxfp8 blocks)"));
  }
  if (!a.rowwise && !a.colwise) return absl::InvalidArgumentError("rowwise/colwise: neither is requested");
  QuantizeLayout l;
  const int64_t g_count = a.num_groups;
  l.row_offset.assign(g_count + 1, 0);
  for (int64_t g = 0; g < g_count; ++g) {
    if (a.group_sizes[g] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("group_sizes[", g, "]: ", a.group_sizes[g], " is negative"));
    }
    l.row_offset[g + 1] = l.row_offset[g] + a.group_sizes[g];
    if (l.row_offset[g + 1] > a.m) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_sizes: the sum of the first ", g + 1, " is ", l.row_offset[g + 1], ", over m = ", a.m));
    }
  }
  l.data_elems = a.m * a.k;
  l.scale_bytes = a.mode == ScalingMode::kMxfp8 ? 1 : 4;
  l.rowwise_scale_offset.assign(g_count + 1, 0);
  l.colwise_scale_offset.assign(g_count + 1, 0);
  l.rowwise_scale_rows.assign(g_count, 1);
  l.rowwise_scale_cols.assign(g_count, 1);
  l.colwise_scale_rows.assign(g_count, 1);
  l.colwise_scale_cols.assign(g_count, 1);
  const int64_t k = a.k;
  for (int64_t g = 0; g < g_count; ++g) {
    const int64_t mg = a.group_sizes[g];
    int64_t rr = 1, rc = 1, cr = 1, cc = 1;
    switch (a.mode) {
      case ScalingMode::kCurrent:
      case ScalingMode::kDelayed: break;
      case ScalingMode::kMxfp8:
        rr = RoundUp(mg, 128), rc = RoundUp(k / 32, 4);
        cr = RoundUp(CeilDiv(mg, 32), 4), cc = RoundUp(k, 128);
        break;
      case ScalingMode::kBlock1x128:
        rr = CeilDiv(k, 128), rc = RoundUp(mg, 4);
        cr = CeilDiv(mg, 128), cc = RoundUp(k, 4);
        break;
      case ScalingMode::kBlock128x128:
        rr = CeilDiv(mg, 128), rc = RoundUp(CeilDiv(k, 128), 4);
        cr = CeilDiv(k, 128), cc = RoundUp(CeilDiv(mg, 128), 4);
        break;
    }
    l.rowwise_scale_rows[g] = rr, l.rowwise_scale_cols[g] = rc;
    l.colwise_scale_rows[g] = cr, l.colwise_scale_cols[g] = cc;
    l.rowwise_scale_offset[g + 1] = l.rowwise_scale_offset[g] + rr * rc;
    l.colwise_scale_offset[g + 1] = l.colwise_scale_offset[g] + cr * cc;
  }
  l.rowwise_scale_elems = l.rowwise_scale_offset[g_count];
  l.colwise_scale_elems = l.colwise_scale_offset[g_count];
  return l;
}

absl::Status ValidateGroupedQuantizeArgs(const GroupedQuantizeArgs& a) {
  auto layout = GetQuantizeLayout(a);
  if (!layout.ok()) return layout.status();
  // A pointer may be null only where its tensor has no elements (no rows;
  // no scale entries, as with MXFP8 or block scaling when every group is
  // empty).
  if (a.x == nullptr && a.m > 0) return absl::InvalidArgumentError("x: null");
  if (a.rowwise && a.rowwise_data == nullptr && a.m > 0) {
    return absl::InvalidArgumentError("rowwise_data: null with rowwise");
  }
  if (a.rowwise && a.rowwise_scale_inv == nullptr && layout->rowwise_scale_elems > 0) {
    return absl::InvalidArgumentError("rowwise_scale_inv: null with rowwise");
  }
  if (a.colwise && a.colwise_data == nullptr && a.m > 0) {
    return absl::InvalidArgumentError("colwise_data: null with colwise");
  }
  if (a.colwise && a.colwise_scale_inv == nullptr && layout->colwise_scale_elems > 0) {
    return absl::InvalidArgumentError("colwise_scale_inv: null with colwise");
  }
  if (IsTensorMode(a.mode) && a.amax == nullptr && a.num_groups > 0) {
    return absl::InvalidArgumentError(absl::StrCat("amax: null (required by ", ScalingModeName(a.mode), " scaling)"));
  }
  if (a.mode == ScalingMode::kDelayed && a.scale == nullptr && a.num_groups > 0) {
    return absl::InvalidArgumentError("scale: null (delayed scaling needs the per-group scales)");
  }
  return absl::OkStatus();
}

namespace cpu {
namespace {

// amax bits (NaN-propagating) of rows [r0, r1) x cols [c0, c1).
uint32_t AmaxBits(const GroupedQuantizeArgs& a, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) m = AbsBitsMax(m, LoadFloat(a.x, a.x_dtype, r * a.k + c));
  }
  return m;
}

}  // namespace

absl::Status GroupedQuantize(const GroupedQuantizeArgs& a) {
  if (absl::Status s = ValidateGroupedQuantizeArgs(a); !s.ok()) return s;
  QuantizeLayout l = *GetQuantizeLayout(a);
  const int64_t k = a.k;
  const int64_t used_rows = l.row_offset[a.num_groups];
  const float fmax = Fp8Max(a.format);
  
  auto x_at = [&](int64_t r, int64_t c) { return LoadFloat(a.x, a.x_dtype, r * k + c); };
  // Padding: zero everything first (data tail rows, scale padding). Empty
  // tensors may come as null pointers: nothing is written to them.
  auto zero = [](void* p, int64_t bytes) {
    if (bytes > 0) std::memset(p, 0, static_cast<size_t>(bytes));
  };
  if (a.rowwise) {
    zero(a.rowwise_data + used_rows * k, (a.m - used_rows) * k);
    zero(a.rowwise_scale_inv, l.rowwise_scale_elems * l.scale_bytes);
  }
  if (a.colwise) {
    zero(a.colwise_data + used_rows * k, (a.m - used_rows) * k);
    zero(a.colwise_scale_inv, l.colwise_scale_elems * l.scale_bytes);
  }
  float* rs = static_cast<float*>(a.rowwise_scale_inv);
  float* cs = static_cast<float*>(a.colwise_scale_inv);
  uint8_t* rs8 = static_cast<uint8_t*>(a.rowwise_scale_inv);
  uint8_t* cs8 = static_cast<uint8_t*>(a.colwise_scale_inv);

  for (int64_t g = 0; g < a.num_groups; ++g) {
    const int64_t off = l.row_offset[g];
    const int64_t mg = a.group_sizes[g];
    if (a.amax != nullptr) a.amax[g] = BitsToFloat(AmaxBits(a, off, off + mg, 0, k));
    switch (a.mode) {
      case ScalingMode::kCurrent:
      case ScalingMode::kDelayed: {
        const float scale = a.mode == ScalingMode::kCurrent ? ScaleFromAmax(a.amax[g], fmax, a.pow2_scales) : a.scale[g];
        const float sinv = ScaleInv(scale);
        if (a.rowwise) rs[g] = sinv;
        if (a.colwise) cs[g] = sinv;
        for (int64_t r = 0; r < mg; ++r) {
          for (int64_t c = 0; c < k; ++c) {
            const uint8_t v = QuantizeScaled(x_at(off + r, c), scale, a.format);
            if (a.rowwise) a.rowwise_data[(off + r) * k + c] = v;
            if (a.colwise) a.colwise_data[off * k + c * mg + r] = v;
          }
        }
        break;
      }
      case ScalingMode::kMxfp8: {
        if (a.rowwise) {
          uint8_t* sc = rs8 + l.rowwise_scale_offset[g];
          const int64_t ld = l.rowwise_scale_cols[g];
          for (int64_t r = 0; r < mg; ++r) {
            for (int64_t kb = 0; kb < k / 32; ++kb) {
              const uint8_t e = MxScaleFromAmax(BitsToFloat(AmaxBits(a, off + r, off + r + 1, kb * 32, kb * 32 + 32)),
                                                a.format, a.mx_recipe);
              sc[r * ld + kb] = e;
              for (int64_t c = kb * 32; c < kb * 32 + 32; ++c) {
                a.rowwise_data[(off + r) * k + c] = MxQuantize(x_at(off + r, c), e, a.format);
              }
            }
          }
        }
        if (a.colwise) {
          uint8_t* sc = cs8 + l.colwise_scale_offset[g];
          const int64_t ld = l.colwise_scale_cols[g];
          for (int64_t rb = 0; rb < (mg + 31) / 32; ++rb) {
            const int64_t r0 = off + rb * 32, r1 = std::min(off + mg, r0 + 32);
            for (int64_t c = 0; c < k; ++c) {
              const uint8_t e = MxScaleFromAmax(BitsToFloat(AmaxBits(a, r0, r1, c, c + 1)), a.format, a.mx_recipe);
              sc[rb * ld + c] = e;
              for (int64_t r = r0; r < r1; ++r) a.colwise_data[r * k + c] = MxQuantize(x_at(r, c), e, a.format);
            }
          }
        }
        break;
      }
      case ScalingMode::kBlock1x128: {
        if (a.rowwise) {
          float* sc = rs + l.rowwise_scale_offset[g];
          const int64_t ld = l.rowwise_scale_cols[g];  // roundup(m_g, 4)
          for (int64_t r = 0; r < mg; ++r) {
            for (int64_t kb = 0; kb < (k + 127) / 128; ++kb) {
              const int64_t c0 = kb * 128, c1 = std::min(k, c0 + 128);
              const float scale =
                  ScaleFromAmax(BitsToFloat(AmaxBits(a, off + r, off + r + 1, c0, c1)), fmax, a.pow2_scales);
              sc[kb * ld + r] = ScaleInv(scale);
              for (int64_t c = c0; c < c1; ++c) a.rowwise_data[(off + r) * k + c] = QuantizeScaled(x_at(off + r, c), scale, a.format);
            }
          }
        }
        if (a.colwise) {
          float* sc = cs + l.colwise_scale_offset[g];
          const int64_t ld = l.colwise_scale_cols[g];  // roundup(k, 4)
          for (int64_t rb = 0; rb < (mg + 127) / 128; ++rb) {
            const int64_t r0 = off + rb * 128, r1 = std::min(off + mg, r0 + 128);
            for (int64_t c = 0; c < k; ++c) {
              const float scale = ScaleFromAmax(BitsToFloat(AmaxBits(a, r0, r1, c, c + 1)), fmax, a.pow2_scales);
              sc[rb * ld + c] = ScaleInv(scale);
              for (int64_t r = r0; r < r1; ++r) a.colwise_data[off * k + c * mg + (r - off)] = QuantizeScaled(x_at(r, c), scale, a.format);
            }
          }
        }
        break;
      }
      case ScalingMode::kBlock128x128: {
        const int64_t rbs = (mg + 127) / 128, kbs = (k + 127) / 128;
        for (int64_t rb = 0; rb < rbs; ++rb) {
          const int64_t r0 = off + rb * 128, r1 = std::min(off + mg, r0 + 128);
          for (int64_t kb = 0; kb < kbs; ++kb) {
            const int64_t c0 = kb * 128, c1 = std::min(k, c0 + 128);
            const float scale = ScaleFromAmax(BitsToFloat(AmaxBits(a, r0, r1, c0, c1)), fmax, a.pow2_scales);
            const float sinv = ScaleInv(scale);
            if (a.rowwise) rs[l.rowwise_scale_offset[g] + rb * l.rowwise_scale_cols[g] + kb] = sinv;
            if (a.colwise) cs[l.colwise_scale_offset[g] + kb * l.colwise_scale_cols[g] + rb] = sinv;
            for (int64_t r = r0; r < r1; ++r) {
              for (int64_t c = c0; c < c1; ++c) {
                const uint8_t v = QuantizeScaled(x_at(r, c), scale, a.format);
                if (a.rowwise) a.rowwise_data[r * k + c] = v;
                if (a.colwise) a.colwise_data[off * k + c * mg + (r - off)] = v;
              }
            }
          }
        }
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status GroupedDequantize(const GroupedDequantizeArgs& d) {
  GroupedQuantizeArgs a;
  a.x_dtype = DType::kF32;
  a.m = d.m, a.k = d.k, a.group_sizes = d.group_sizes, a.num_groups = d.num_groups;
  a.mode = d.mode, a.format = d.format;
  a.rowwise = !d.colwise, a.colwise = d.colwise;
  auto layout = GetQuantizeLayout(a);
  if (!layout.ok()) return layout.status();
  if (d.data == nullptr && d.m > 0) return absl::InvalidArgumentError("data: null");
  const int64_t scale_elems = d.colwise ? layout->colwise_scale_elems : layout->rowwise_scale_elems;
  if (d.scale_inv == nullptr && scale_elems > 0) return absl::InvalidArgumentError("scale_inv: null");
  if (d.out == nullptr && d.m > 0) return absl::InvalidArgumentError("out: null");
  if (!IsQuantizeInput(d.out_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("out_dtype: ", DTypeName(d.out_dtype), " is not bf16, f16 or f32"));
  }
  const QuantizeLayout& l = *layout;
  const int64_t k = d.k;
  const int64_t used = l.row_offset[d.num_groups];
  for (int64_t i = used * k; i < d.m * k; ++i) StoreFloat(d.out, d.out_dtype, i, 0.0f);
  const float* sf = static_cast<const float*>(d.scale_inv);
  const uint8_t* s8 = static_cast<const uint8_t*>(d.scale_inv);
  const int64_t* so = d.colwise ? l.colwise_scale_offset.data() : l.rowwise_scale_offset.data();
  const int64_t* sld = d.colwise ? l.colwise_scale_cols.data() : l.rowwise_scale_cols.data();
  for (int64_t g = 0; g < d.num_groups; ++g) {
    const int64_t off = l.row_offset[g], mg = d.group_sizes[g];
    for (int64_t r = 0; r < mg; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        // Where the element and its scale live.
        const bool transposed = d.colwise && d.mode != ScalingMode::kMxfp8;
        const uint8_t qv = transposed ? d.data[off * k + c * mg + r] : d.data[(off + r) * k + c];
        float s = 1.0f;
        switch (d.mode) {
          case ScalingMode::kCurrent:
          case ScalingMode::kDelayed: s = sf[g]; break;
          case ScalingMode::kMxfp8:
            s = E8M0ToFloat(d.colwise ? s8[so[g] + (r / 32) * sld[g] + c] : s8[so[g] + r * sld[g] + c / 32]);
            break;
          case ScalingMode::kBlock1x128:
            s = d.colwise ? sf[so[g] + (r / 128) * sld[g] + c] : sf[so[g] + (c / 128) * sld[g] + r];
            break;
          case ScalingMode::kBlock128x128:
            s = d.colwise ? sf[so[g] + (c / 128) * sld[g] + r / 128] : sf[so[g] + (r / 128) * sld[g] + c / 128];
            break;
        }
        StoreFloat(d.out, d.out_dtype, (off + r) * k + c, DequantizeValue(qv, d.format, s));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> DequantizeGroupedGemmReference(const GroupedDequantizeArgs& lhs,
                                                                  const GroupedDequantizeArgs& rhs, int64_t n) {
  if (n <= 0) return absl::InvalidArgumentError("n: must be positive");
  if (rhs.k != lhs.k) return absl::InvalidArgumentError("rhs.k: differs from lhs.k");
  if (rhs.num_groups != lhs.num_groups) return absl::InvalidArgumentError("rhs.num_groups: differs from lhs's");
  if (rhs.m != lhs.num_groups * n) return absl::InvalidArgumentError("rhs.m: must be num_groups * n");
  for (int64_t g = 0; g < rhs.num_groups; ++g) {
    if (rhs.group_sizes == nullptr || rhs.group_sizes[g] != n) {
      return absl::InvalidArgumentError(absl::StrCat("rhs.group_sizes[", g, "]: must be n = ", n));
    }
  }
  std::vector<float> a(static_cast<size_t>(lhs.m * lhs.k)), b(static_cast<size_t>(rhs.m * rhs.k));
  GroupedDequantizeArgs l2 = lhs, r2 = rhs;
  l2.out = a.data(), l2.out_dtype = DType::kF32;
  r2.out = b.data(), r2.out_dtype = DType::kF32;
  if (absl::Status s = GroupedDequantize(l2); !s.ok()) return s;
  if (absl::Status s = GroupedDequantize(r2); !s.ok()) return s;
  std::vector<float> out(static_cast<size_t>(lhs.m * n), 0.0f);
  const int64_t k = lhs.k;
  int64_t off = 0;
  for (int64_t g = 0; g < lhs.num_groups; ++g) {
    for (int64_t r = off; r < off + lhs.group_sizes[g]; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        const float* x = &a[r * k];
        const float* w = &b[(g * n + j) * k];
        double acc = 0;
        for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(x[c]) * w[c];
        out[r * n + j] = static_cast<float>(acc);
      }
    }
    off += lhs.group_sizes[g];
  }
  return out;
}

}  // namespace cpu
}  // namespace shardgemm
