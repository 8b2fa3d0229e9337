// Element types shared by the wire format, the planner and the kernels.
#ifndef SHARDGEMM_KERNELS_DTYPE_H_
#define SHARDGEMM_KERNELS_DTYPE_H_

#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"
#include "absl/types/optional.h"

namespace shardgemm {

// Values match shardgemm.v1.DType in proto/shardgemm.proto.
enum class DType : int {
  kInvalid = 0,
  kF32 = 1,
  kBF16 = 2,
  kF16 = 3,
  kF8E4M3 = 4,
  kF8E5M2 = 5,
  kE8M0 = 6,
  kI32 = 7,
  kI64 = 8,
};

// Bytes per element; 0 for kInvalid.
int DTypeSize(DType dtype);
absl::string_view DTypeName(DType dtype);  // "f32", "bf16", ...
absl::optional<DType> DTypeFromName(absl::string_view name);
bool IsFloat8(DType dtype);
// Types a GEMM may take as a 16/32-bit floating input or produce as output.
bool IsGemmFloat(DType dtype);

// Round-to-nearest-even conversions (NaN stays NaN).
inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}
float F16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_DTYPE_H_
