#include "kernels/gemm_scale_layout.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {

// One group's block of scales: `rows` x `cols` in the GEMM layout, stored
// in the quantize layout at `offset` with row stride `stride` and, when
// `transposed`, the GEMM's rows as the quantize's columns.
struct GroupBlock {
  int64_t gemm_row = 0;  // first GEMM-layout row of the group
  int64_t rows = 0, cols = 0;
  int64_t offset = 0, stride = 0;
  bool transposed = false;
};

struct Mapping {
  DType dtype = DType::kF32;
  std::vector<int64_t> gemm_shape;
  int64_t gemm_cols = 0;
  int64_t quantize_elems = 0;
  std::vector<GroupBlock> blocks;
};

absl::StatusOr<Mapping> MakeMapping(ScalingMode mode, int64_t m, int64_t k, const std::vector<int64_t>& group_sizes) {
  GroupedQuantizeArgs args;
  args.m = m;
  args.k = k;
  args.group_sizes = group_sizes.data();
  args.num_groups = static_cast<int64_t>(group_sizes.size());
  args.mode = mode;
  args.rowwise = true;
  auto layout = GetQuantizeLayout(args);
  if (!layout.ok()) return layout.status();
  Mapping map;
  map.quantize_elems = layout->rowwise_scale_elems;
  const int64_t groups = args.num_groups;
  switch (mode) {
    case ScalingMode::kCurrent:
    case ScalingMode::kDelayed:
      map.gemm_shape = {groups};
      map.gemm_cols = 1;
      for (int64_t g = 0; g < groups; ++g) map.blocks.push_back({g, 1, 1, g, 1, false});
      return map;
    case ScalingMode::kBlock1x128:
    case ScalingMode::kMxfp8: {
      const int64_t b = mode == ScalingMode::kMxfp8 ? 32 : 128;
      if (k % b != 0) return absl::InvalidArgumentError(absl::StrCat("k: ", k, " is not a multiple of ", b));
      map.dtype = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
      map.gemm_shape = {m, k / b};
      map.gemm_cols = k / b;
      for (int64_t g = 0; g < groups; ++g) {
        // 1x128: [K/128, roundup(m_g, 4)], rows innermost; MXFP8: [roundup(m_g, 128), roundup(K/32, 4)].
        const bool transposed = mode == ScalingMode::kBlock1x128;
        map.blocks.push_back({layout->row_offset[g], group_sizes[g], k / b, layout->rowwise_scale_offset[g],
                              layout->rowwise_scale_cols[g], transposed});
      }
      return map;
    }
    case ScalingMode::kBlock128x128: {
      const int64_t n = groups > 0 ? group_sizes[0] : 0;
      for (int64_t s : group_sizes) {
        if (s != n || s % 128 != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "group_sizes: 128x128 weight scales need every group of one size, a multiple of 128 (got ", s, ")"));
        }
      }
      if (k % 128 != 0) return absl::InvalidArgumentError(absl::StrCat("k: ", k, " is not a multiple of 128"));
      map.gemm_shape = {groups, n / 128, k / 128};
      map.gemm_cols = k / 128;
      for (int64_t g = 0; g < groups; ++g) {
        map.blocks.push_back({g * (n / 128), n / 128, k / 128, layout->rowwise_scale_offset[g],
                              layout->rowwise_scale_cols[g], false});
      }
      return map;
    }
  }
  return absl::InvalidArgumentError("mode: unknown scaling mode");
}

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Copies every group's scales between the two layouts (to_gemm: quantize -> GEMM).
void CopyBlocks(const Mapping& map, const char* from, char* to, bool to_gemm) {
  const int es = map.dtype == DType::kE8M0 ? 1 : 4;
  for (const GroupBlock& b : map.blocks) {
    for (int64_t r = 0; r < b.rows; ++r) {
      for (int64_t c = 0; c < b.cols; ++c) {
        const int64_t gemm_index = (b.gemm_row + r) * map.gemm_cols + c;
        const int64_t quantize_index = b.offset + (b.transposed ? c * b.stride + r : r * b.stride + c);
        if (to_gemm) {
          std::memcpy(to + gemm_index * es, from + quantize_index * es, es);
        } else {
          std::memcpy(to + quantize_index * es, from + gemm_index * es, es);
        }
      }
    }
  }
}

}  // namespace

absl::StatusOr<HostTensor> GemmScalesFromQuantize(ScalingMode mode, const HostTensor& quantize_scales, int64_t m,
                                                  int64_t k, const std::vector<int64_t>& group_sizes) {
  auto map = MakeMapping(mode, m, k, group_sizes);
  if (!map.ok()) return map.status();
  if (quantize_scales.dtype != map->dtype || quantize_scales.NumElements() != map->quantize_elems) {
    return absl::InvalidArgumentError(absl::StrCat("scale_inv: ", DTypeName(quantize_scales.dtype), " ",
                                                   ShapeToString(quantize_scales.shape), ", expected ",
                                                   map->quantize_elems, " ", DTypeName(map->dtype), " (",
                                                   ScalingModeName(mode), " quantize layout)"));
  }
  auto out = ZerosTensor(map->dtype, map->gemm_shape);
  if (!out.ok()) return out.status();
  if (out->NumBytes() > 0) CopyBlocks(*map, quantize_scales.bytes.data(), &out->bytes[0], /*to_gemm=*/true);
  return out;
}

absl::StatusOr<HostTensor> QuantizeScalesFromGemm(ScalingMode mode, const HostTensor& gemm_scales, int64_t m,
                                                  int64_t k, const std::vector<int64_t>& group_sizes) {
  auto map = MakeMapping(mode, m, k, group_sizes);
  if (!map.ok()) return map.status();
  if (gemm_scales.dtype != map->dtype || gemm_scales.NumElements() != Product(map->gemm_shape)) {
    return absl::InvalidArgumentError(absl::StrCat("scale_inv: ", DTypeName(gemm_scales.dtype), " ",
                                                   ShapeToString(gemm_scales.shape), ", expected ",
                                                   DTypeName(map->dtype), " ", ShapeToString(map->gemm_shape), " (",
                                                   ScalingModeName(mode), " GEMM layout)"));
  }
  auto out = ZerosTensor(map->dtype, {map->quantize_elems});
  if (!out.ok()) return out.status();
  if (out->NumBytes() > 0) CopyBlocks(*map, gemm_scales.bytes.data(), &out->bytes[0], /*to_gemm=*/false);
  return out;
}

}  // namespace shardgemm
