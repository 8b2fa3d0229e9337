#include "kernels/dtype.h"

#include <cmath>

namespace shardgemm {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kF8E5M2: return 1;
    case DType::kE8M0: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kInvalid: return 0;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "f8e4m3";
    case DType::kF8E5M2: return "f8e5m2";
    case DType::kE8M0: return "e8m0";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kInvalid: return "invalid";
  }
  return "invalid";
}

absl::optional<DType> DTypeFromName(absl::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2,
                  DType::kE8M0, DType::kI32, DType::kI64}) {
    if (DTypeName(d) == name) return d;
  }
  return absl::nullopt;
}

bool IsFloat8(DType dtype) { return dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2; }

bool IsGemmFloat(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | (exp + 112) << 23 | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to Inf
  if (abs < 0x38800000u) {                          // result is subnormal or zero
    // Scale so the half subnormal LSB (2^-24) becomes the integer unit; rint
    // rounds half to even in the default rounding mode.
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  abs += rounding;
  return sign | static_cast<uint16_t>((abs - 0x38000000u) >> 13);
}

}  // namespace shardgemm
