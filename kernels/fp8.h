// FP8 (OCP E4M3 "e4m3fn", E5M2), E8M0 and 16-bit float conversions, and the
// scale computations of grouped quantize. Header-only and usable from CUDA
// device code: under nvcc every function is `__host__ __device__`, so the CPU
// reference (kernels/cpu/quantize.cc) and the CUDA kernels
// (kernels/cuda/quantize.cu) share one definition, bit for bit.
//
// Definitions (see docs/quantization.md):
// - E4M3 (OCP 8-bit FP spec v1.0, "e4m3fn"): bias 7, max 448 (0x7e), no Inf,
//   NaN = 0x7f / 0xff, min subnormal 2^-9.
// - E5M2: bias 15, max 57344 (0x7b), Inf = 0x7c / 0xfc, NaN = 0x7d..0x7f with
//   sign, min subnormal 2^-16.
// - Float -> FP8 rounds to nearest, ties to even. `saturate` (what quantize
//   uses, as Transformer Engine's cast and PTX `cvt.rn.satfinite` do): any
//   finite value or Inf beyond max becomes +-max. Non-saturating (the OCP /
//   ml_dtypes reference): overflow gives NaN for E4M3 and Inf for E5M2, Inf
//   input gives NaN (E4M3) or Inf (E5M2). NaN input always gives NaN with the
//   input's sign (E4M3 0x7f, E5M2 0x7e, | 0x80 when negative).
// - E8M0 (OCP Microscaling spec v1.0): unsigned exponent, bias 127, value
//   2^(b-127) for b in 0..254, 0xff = NaN. No zero, no sign.
#ifndef SHARDGEMM_KERNELS_FP8_H_
#define SHARDGEMM_KERNELS_FP8_H_

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define SG_HD __host__ __device__ __forceinline__
#else
#define SG_HD inline
#endif

namespace shardgemm {

enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

// Largest finite values.
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
// emax of the element type (exponent of the largest normal), OCP MX spec 6.3.
constexpr int kE4M3Emax = 8;
constexpr int kE5M2Emax = 15;

SG_HD float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max; }
SG_HD int Fp8Emax(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3Emax : kE5M2Emax; }
const char* Fp8FormatName(Fp8Format f);  // "e4m3" / "e5m2" (fp8.cc)

// ---- bit casts -------------------------------------------------------------
SG_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
SG_HD float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
SG_HD int CountLeadingZeros32(uint32_t x) {  // x != 0
#ifdef __CUDA_ARCH__
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}

// ---- 16-bit floats (same results as kernels/dtype.h, device-capable) --------
SG_HD float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }
SG_HD uint16_t FloatToBf16Bits(float f) {
  uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}
SG_HD float F16BitsToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(v) | sign);
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}
// Round-right-shift with ties to even; shift in [1, 31].
SG_HD uint32_t RoundShiftRightEven(uint32_t v, int shift) {
  uint32_t q = v >> shift;
  uint32_t rem = v & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}
SG_HD uint16_t FloatToF16Bits(float f) {
  uint32_t bits = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to Inf
  if (abs < 0x38800000u) {                        // f16 subnormal or zero
    uint32_t e = abs >> 23;
    if (e < 101) return sign;  // below 2^-26: rounds to 0
    uint32_t mant24 = (abs & 0x7fffffu) | 0x800000u;
    // value = mant24 * 2^(e-150); unit 2^-24 -> shift = 126 - e.
    return sign | static_cast<uint16_t>(RoundShiftRightEven(mant24, static_cast<int>(126 - e)));
  }
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  abs += rounding;
  return sign | static_cast<uint16_t>((abs - 0x38000000u) >> 13);
}

// ---- FP8 -------------------------------------------------------------------
namespace fp8_internal {
// m: mantissa bits, bias: exponent bias, max_code: largest finite magnitude
// code, overflow_code: non-saturating result of overflow, nan_code: NaN code.
SG_HD uint8_t FloatToFp8(float f, int m, int bias, uint32_t max_code, uint32_t inf_code,
                         uint32_t nan_code, bool has_inf, bool saturate) {
  uint32_t bits = FloatBits(f);
  uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | nan_code);
  if (abs == 0x7f800000u) {
    if (saturate) return static_cast<uint8_t>(sign | max_code);
    return static_cast<uint8_t>(sign | (has_inf ? inf_code : nan_code));
  }
  uint32_t e = abs >> 23;  // biased float exponent
  // FP8 min normal is 2^(1-bias): biased float exponent 128 - bias.
  uint32_t min_normal_e = static_cast<uint32_t>(128 - bias);
  uint32_t code;
  if (e < min_normal_e) {
    if (e == 0) return static_cast<uint8_t>(sign);  // float subnormals << FP8 unit
    // value = mant24 * 2^(e-150); FP8 unit 2^(1-bias-m): shift = 150 - e + 1 - bias - m.
    int shift = 151 - static_cast<int>(e) - bias - m;
    if (shift > 25) return static_cast<uint8_t>(sign);  // < unit/2: rounds to 0
    uint32_t mant24 = (abs & 0x7fffffu) | 0x800000u;
    code = RoundShiftRightEven(mant24, shift);  // may round up to the min normal
  } else {
    int drop = 23 - m;
    uint32_t rounding = ((1u << (drop - 1)) - 1u) + ((abs >> drop) & 1u);
    uint32_t r = (abs + rounding) >> drop;  // float exp|mant kept to m bits
    uint32_t rebias = static_cast<uint32_t>(127 - bias) << m;
    code = r - rebias;
    if (r < rebias) code = 0;  // cannot happen (e >= min_normal_e)
    if (code > max_code) {
      return static_cast<uint8_t>(sign | (saturate ? max_code : (has_inf ? inf_code : nan_code)));
    }
  }
  return static_cast<uint8_t>(sign | code);
}
}  // namespace fp8_internal

SG_HD uint8_t FloatToE4M3(float f, bool saturate = true) {
  return fp8_internal::FloatToFp8(f, 3, 7, 0x7eu, 0x7fu, 0x7fu, false, saturate);
}
SG_HD uint8_t FloatToE5M2(float f, bool saturate = true) {
  return fp8_internal::FloatToFp8(f, 2, 15, 0x7bu, 0x7cu, 0x7eu, true, saturate);
}
SG_HD uint8_t FloatToFp8(float f, Fp8Format fmt, bool saturate = true) {
  return fmt == Fp8Format::kE4M3 ? FloatToE4M3(f, saturate) : FloatToE5M2(f, saturate);
}

SG_HD float E4M3ToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xfu;
  uint32_t mant = v & 0x7u;
  if (exp == 0xfu && mant == 0x7u) return BitsToFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    float x = static_cast<float>(mant) * 0.001953125f;  // 2^-9
    return BitsToFloat(FloatBits(x) | sign);
  }
  return BitsToFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}
SG_HD float E5M2ToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t exp = (v >> 2) & 0x1fu;
  uint32_t mant = v & 0x3u;
  if (exp == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mant ? 0x400000u : 0u));
  if (exp == 0) {
    float x = static_cast<float>(mant) * 1.52587890625e-05f;  // 2^-16
    return BitsToFloat(FloatBits(x) | sign);
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 21));
}
SG_HD float Fp8ToFloat(uint8_t v, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? E4M3ToFloat(v) : E5M2ToFloat(v);
}
SG_HD bool Fp8IsNan(uint8_t v, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? (v & 0x7fu) == 0x7fu : (v & 0x7fu) > 0x7cu;
}

// ---- E8M0 (OCP MX v1.0) ----------------------------------------------------
constexpr uint8_t kE8M0Nan = 0xff;
// 2^(b-127); b = 0 gives 2^-127 (a float subnormal, exact); 0xff gives NaN.
SG_HD float E8M0ToFloat(uint8_t b) {
  if (b == 0xffu) return BitsToFloat(0x7fc00000u);
  if (b == 0) return BitsToFloat(0x00400000u);
  return BitsToFloat(static_cast<uint32_t>(b) << 23);
}
// The biased E8M0 code of 2^e, e clamped to [-127, 127].
SG_HD uint8_t E8M0FromExponent(int e) {
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return static_cast<uint8_t>(e + 127);
}
// 2^-(b-127), the factor that maps a block onto the element range; exact.
// For b = 0 this is 2^127; for b = 254, 2^-127 (subnormal). b must not be 0xff.
SG_HD float E8M0ReciprocalToFloat(uint8_t b) {
  int e = 127 - static_cast<int>(b);  // exponent of the reciprocal, in [-127, 127]
  if (e >= -126) return BitsToFloat(static_cast<uint32_t>(e + 127) << 23);
  return BitsToFloat(0x00400000u);  // 2^-127
}
// floor(log2(x)) for finite x > 0 (subnormals included).
SG_HD int FloorLog2(float x) {
  uint32_t abs = FloatBits(x) & 0x7fffffffu;
  uint32_t e = abs >> 23;
  if (e != 0) return static_cast<int>(e) - 127;
  return (31 - CountLeadingZeros32(abs)) - 149;
}

// MXFP8 block scale recipes.
enum class MxScaleRecipe : int {
  // OCP Microscaling spec v1.0, section 6.3: shared_exp = floor(log2(amax)) -
  // emax_elem, clamped to E8M0's range; elements then saturate (a block whose
  // amax mantissa exceeds the element max's clips at +-max).
  kOcp = 0,
  // NVIDIA / Transformer Engine MXFP8 recipe: code = round-up to a power of
  // two of amax * (1 / fp8_max) (TE's float_to_e8m0), so nothing clips.
  kNvidiaRoundUp = 1,
};

// The E8M0 scale code of a 32-element block with absolute maximum `amax`
// (NaN-propagating: NaN if any element is NaN; Inf if any is Inf and none is
// NaN). NaN/Inf amax -> 0xff (NaN scale: the block decodes as NaN); amax 0 ->
// 0x00 (2^-127) for kOcp, 0x00 for kNvidiaRoundUp.
SG_HD uint8_t MxScaleFromAmax(float amax, Fp8Format fmt, MxScaleRecipe recipe = MxScaleRecipe::kOcp) {
  uint32_t abs = FloatBits(amax) & 0x7fffffffu;
  if (abs >= 0x7f800000u) return kE8M0Nan;
  if (abs == 0) return 0;
  if (recipe == MxScaleRecipe::kOcp) return E8M0FromExponent(FloorLog2(amax) - Fp8Emax(fmt));
  // TE: float_to_e8m0(amax * max_norm_rcp), round up, satfinite at 0xfe.
  const float rcp = fmt == Fp8Format::kE4M3 ? (1.0f / kE4M3Max) : (1.0f / kE5M2Max);
  float v = BitsToFloat(abs) * rcp;
  uint32_t vb = FloatBits(v);
  if (vb == 0) return 0;
  uint32_t exponent = vb >> 23;
  uint32_t mantissa = vb & 0x7fffffu;
  if ((mantissa > 0 && exponent != 0xfeu) && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return static_cast<uint8_t>(exponent);
}

SG_HD uint8_t Fp8NanWithSignOf(float x, Fp8Format fmt) {
  uint32_t sign = (FloatBits(x) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | (fmt == Fp8Format::kE4M3 ? 0x7fu : 0x7eu));
}
SG_HD bool IsNanBits(float x) { return (FloatBits(x) & 0x7fffffffu) > 0x7f800000u; }

// The quantized element: saturate(x * scale). A NaN x gives NaN with x's sign,
// decided on x itself (GPUs return a canonical NaN from x * scale, CPUs keep
// x's sign), so CPU and GPU agree bit for bit.
SG_HD uint8_t QuantizeScaled(float x, float scale, Fp8Format fmt) {
  if (IsNanBits(x)) return Fp8NanWithSignOf(x, fmt);
  return FloatToFp8(x * scale, fmt, true);
}

// Quantize one element of an MX block with scale code `b`: x * 2^-(b-127),
// saturating. A NaN scale gives NaN (with x's sign).
SG_HD uint8_t MxQuantize(float x, uint8_t b, Fp8Format fmt) {
  if (b == kE8M0Nan) return Fp8NanWithSignOf(x, fmt);
  return QuantizeScaled(x, E8M0ReciprocalToFloat(b), fmt);
}

// The dequantized element: fp8_to_float(q) * s, where s is scale_inv (or the
// E8M0 scale's value). A NaN q or a NaN s gives the quiet NaN with q's sign.
SG_HD float DequantizeValue(uint8_t q, Fp8Format fmt, float s) {
  if (Fp8IsNan(q, fmt) || IsNanBits(s)) return BitsToFloat((static_cast<uint32_t>(q & 0x80u) << 24) | 0x7fc00000u);
  return Fp8ToFloat(q, fmt) * s;
}

// ---- tensor / block scales ---------------------------------------------------
// scale = fp8_max / amax for finite amax > 0 (FLT_MAX if that overflows);
// 1 for amax 0, Inf or NaN. With pow2, the scale is rounded down to a power of
// two (Transformer Engine's force_pow_2_scales). IEEE division, no fast math:
// the same bits on CPU and GPU.
SG_HD float ScaleFromAmax(float amax, float fp8_max, bool pow2 = false) {
  uint32_t abs = FloatBits(amax) & 0x7fffffffu;
  if (abs == 0 || abs >= 0x7f800000u) return 1.0f;
  float scale = fp8_max / BitsToFloat(abs);
  uint32_t sb = FloatBits(scale);
  if (sb >= 0x7f800000u) scale = BitsToFloat(0x7f7fffffu);  // FLT_MAX
  if (pow2) scale = BitsToFloat(FloatBits(scale) & 0xff800000u);
  return scale;
}
// 1 / scale (IEEE division).
SG_HD float ScaleInv(float scale) { return 1.0f / scale; }

// NaN-propagating |x| maximum on float bits: a non-negative float's bits order
// like its value, and NaN bits sort above Inf. Exact and order-independent.
SG_HD uint32_t AbsBitsMax(uint32_t a, float x) {
  uint32_t b = FloatBits(x) & 0x7fffffffu;
  return a > b ? a : b;
}

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_FP8_H_
