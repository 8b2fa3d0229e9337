// The fuzzing entry point of the grouped quantize reference, shared by the
// libFuzzer target (quantize_fuzzer.cc) and the bounded gtest driver
// (quantize_fuzz_test.cc).
#ifndef SHARDGEMM_KERNELS_CPU_QUANTIZE_FUZZ_ENTRY_H_
#define SHARDGEMM_KERNELS_CPU_QUANTIZE_FUZZ_ENTRY_H_

#include <cstddef>
#include <cstdint>

namespace shardgemm {
namespace cpu {

// Decodes `data` as a grouped quantize request: mode, format, input dtype and
// flags, m, k, group sizes (negative and oversized ones included), which
// pointers are null, then the bytes of x and the delayed scales. Runs
// validation, the reference quantize into buffers of exactly the layout's
// sizes with guard bytes around them, and the dequantize of each output.
// Anything but these outcomes aborts:
//   - validation fails with INVALID_ARGUMENT and a message, and the quantize
//     returns the same error without touching a buffer; or
//   - the quantize succeeds, writes nothing outside the layout's sizes,
//     zeroes the rows past the groups, returns amax[g] = max |x| over group
//     g's rows (NaN if any is NaN), and dequantizing each output succeeds and
//     gives zeros for the rows past the groups.
// Returns 1 when the quantize ran, 0 when the request was rejected.
int FuzzQuantizeOnce(const uint8_t* data, size_t size);

}  // namespace cpu
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CPU_QUANTIZE_FUZZ_ENTRY_H_
