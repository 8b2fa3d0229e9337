#include "kernels/cpu/quantize_fuzz_entry.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/quantize.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cpu {
namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "quantize fuzz invariant broken: %s\n", what);
  std::abort();
}

// Reads the input front to back; past the end every byte is 0.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(Byte() | (Byte() << 8)); }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// A buffer of n bytes between two guard regions of a known pattern.
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kPattern = 0xcd;
  explicit Guarded(size_t n, uint8_t fill = 0x5a) : n_(n), bytes_(n + 2 * kGuard, kPattern) {
    std::memset(bytes_.data() + kGuard, fill, n);
  }
  uint8_t* data() { return bytes_.data() + kGuard; }
  size_t size() const { return n_; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (bytes_[i] != kPattern || bytes_[kGuard + n_ + i] != kPattern) return false;
    }
    return true;
  }
  // Whether every byte of [from, to) inside the buffer is `value`.
  bool All(size_t from, size_t to, uint8_t value) const {
    for (size_t i = from; i < to; ++i) {
      if (bytes_[kGuard + i] != value) return false;
    }
    return true;
  }

 private:
  size_t n_;
  std::vector<uint8_t> bytes_;
};

}  // namespace

int FuzzQuantizeOnce(const uint8_t* data, size_t size) {
  Reader in(data, size);
  GroupedQuantizeArgs a;
  const uint8_t mode = in.Byte();
  a.mode = static_cast<ScalingMode>(mode >= 250 ? 7 : mode % 5);  // now and then not a mode
  const uint8_t flags = in.Byte();
  a.format = (flags & 1) ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  const DType dtypes[4] = {DType::kBF16, DType::kF16, DType::kF32, DType::kI32};
  a.x_dtype = dtypes[(flags >> 1) & 3];
  a.rowwise = (flags >> 3) & 1;
  a.colwise = (flags >> 4) & 1;
  a.pow2_scales = (flags >> 5) & 1;
  a.mx_recipe = ((flags >> 6) & 1) ? MxScaleRecipe::kNvidiaRoundUp : MxScaleRecipe::kOcp;
  const bool amax_null = (flags >> 7) & 1;
  const uint16_t m16 = in.U16(), k16 = in.U16();
  a.m = (m16 & 0x8000) ? -1 - (m16 & 3) : m16 % 300;
  a.k = (k16 & 0x8000) ? -(k16 & 3) : k16 % 520;
  const uint8_t g8 = in.Byte();
  a.num_groups = g8 >= 250 ? -1 : g8 % 10;
  std::vector<int64_t> sizes;
  for (int64_t g = 0; g < a.num_groups; ++g) sizes.push_back(static_cast<int64_t>(in.U16() % 400) - 40);
  a.group_sizes = sizes.empty() ? nullptr : sizes.data();
  if (a.num_groups > 0 && (in.Byte() & 0x3f) == 0x3f) a.group_sizes = nullptr;
  const uint8_t nulls = in.Byte();

  // x and the delayed scales from the rest of the input (cycled).
  const bool shape_ok = a.m >= 0 && a.k > 0;
  const size_t x_bytes = shape_ok ? static_cast<size_t>(a.m * a.k) * 4 : 0;
  std::vector<uint8_t> x(x_bytes);
  for (size_t i = 0; i < x_bytes; ++i) x[i] = static_cast<uint8_t>(in.Byte() ^ (i * 131));
  std::vector<float> scale(static_cast<size_t>(a.num_groups > 0 ? a.num_groups : 0));
  for (float& s : scale) {
    const uint32_t bits = static_cast<uint32_t>(in.U16()) << 16 | in.U16();
    s = BitsToFloat(bits);
  }
  a.x = (nulls & 1) ? nullptr : x.data();
  a.scale = (nulls & 32) || scale.empty() ? nullptr : scale.data();

  absl::StatusOr<QuantizeLayout> layout = GetQuantizeLayout(a);
  const size_t data_bytes = layout.ok() ? static_cast<size_t>(layout->data_elems) : 0;
  const size_t rs_bytes = layout.ok() ? static_cast<size_t>(layout->rowwise_scale_elems * layout->scale_bytes) : 0;
  const size_t cs_bytes = layout.ok() ? static_cast<size_t>(layout->colwise_scale_elems * layout->scale_bytes) : 0;
  Guarded row(data_bytes), col(data_bytes), rs(rs_bytes), cs(cs_bytes), amax(scale.size() * 4);
  a.rowwise_data = (nulls & 2) ? nullptr : row.data();
  a.colwise_data = (nulls & 4) ? nullptr : col.data();
  a.rowwise_scale_inv = (nulls & 8) ? nullptr : rs.data();
  a.colwise_scale_inv = (nulls & 16) ? nullptr : cs.data();
  a.amax = amax_null ? nullptr : reinterpret_cast<float*>(amax.data());

  const absl::Status valid = ValidateGroupedQuantizeArgs(a);
  const absl::Status run = GroupedQuantize(a);
  for (const Guarded* b : {&row, &col, &rs, &cs, &amax}) {
    if (!b->GuardsIntact()) Fail("a write outside an output's layout size");
  }
  if (!valid.ok()) {
    if (valid.code() != absl::StatusCode::kInvalidArgument || valid.message().empty()) {
      Fail("validation failed without INVALID_ARGUMENT and a message");
    }
    if (run.code() != valid.code() || run.message() != valid.message()) Fail("quantize and validation disagree");
    if (!row.All(0, row.size(), 0x5a) || !col.All(0, col.size(), 0x5a) || !rs.All(0, rs.size(), 0x5a) ||
        !cs.All(0, cs.size(), 0x5a) || !amax.All(0, amax.size(), 0x5a)) {
      Fail("a rejected request wrote an output");
    }
    return 0;
  }
  if (!run.ok()) Fail("validation passed but the quantize failed");

  const QuantizeLayout& l = *layout;
  const int64_t used = l.row_offset[a.num_groups];
  const size_t used_bytes = static_cast<size_t>(used * a.k);
  if (a.rowwise && !row.All(used_bytes, data_bytes, 0)) Fail("rowwise rows past the groups are not zero");
  if (a.colwise && !col.All(used_bytes, data_bytes, 0)) Fail("colwise rows past the groups are not zero");
  if (a.amax != nullptr) {
    for (int64_t g = 0; g < a.num_groups; ++g) {
      uint32_t want = 0;  // max |x| bits over the group's rows; NaN bits sort above Inf
      for (int64_t i = l.row_offset[g] * a.k; i < l.row_offset[g + 1] * a.k; ++i) {
        float v = 0.0f;
        if (a.x_dtype == DType::kF32) {
          std::memcpy(&v, x.data() + 4 * i, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, x.data() + 2 * i, 2);
          v = a.x_dtype == DType::kBF16 ? Bf16BitsToFloat(h) : F16BitsToFloat(h);
        }
        const uint32_t bits = FloatBits(v) & 0x7fffffffu;
        if (bits > want) want = bits;
      }
      const float got = a.amax[g], want_f = BitsToFloat(want);
      if (std::isnan(want_f) != std::isnan(got) || (!std::isnan(got) && got != want_f)) Fail("amax");
    }
  }
  for (bool colwise : {false, true}) {
    if (colwise ? !a.colwise : !a.rowwise) continue;
    GroupedDequantizeArgs d;
    d.data = colwise ? col.data() : row.data();
    d.scale_inv = colwise ? cs.data() : rs.data();
    d.colwise = colwise, d.mode = a.mode, d.format = a.format, d.m = a.m, d.k = a.k;
    d.group_sizes = a.group_sizes, d.num_groups = a.num_groups, d.out_dtype = DType::kF32;
    Guarded out(data_bytes * 4, 0x77);
    d.out = out.data();
    const absl::Status ds = GroupedDequantize(d);
    if (!ds.ok()) Fail("dequantize of a quantize's output failed");
    if (!out.GuardsIntact()) Fail("dequantize wrote outside its output");
    if (!out.All(used_bytes * 4, data_bytes * 4, 0)) Fail("dequantized rows past the groups are not zero");
  }
  return 1;
}

}  // namespace cpu
}  // namespace shardgemm
