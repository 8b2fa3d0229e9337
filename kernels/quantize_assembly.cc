#include "kernels/quantize_assembly.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardgemm {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which dimension of a per-group scale block [rows, cols] indexes the
// group's rows, and how many rows one index covers (docs/quantization.md).
struct RowAxis {
  int axis;
  int64_t unit;
};

RowAxis ScaleRowAxis(ScalingMode mode, bool colwise) {
  switch (mode) {
    case ScalingMode::kMxfp8: return {0, colwise ? 32 : 1};
    case ScalingMode::kBlock1x128: return colwise ? RowAxis{0, 128} : RowAxis{1, 1};
    case ScalingMode::kBlock128x128: return colwise ? RowAxis{1, 128} : RowAxis{0, 128};
    default: return {0, 1};
  }
}

// Where one shard's rows of one group go in the unsharded op.
struct Piece {
  int64_t local_group, global_group;
  int64_t start, rows;  // within the global group
};

// Copies the piece's scale block (local group j) into global group g's.
absl::Status CopyScales(const QuantizeLayout& local, const QuantizeLayout& global, bool colwise,
                        RowAxis ra, const Piece& p, const HostTensor& src, HostTensor* dst) {
  const int bytes = local.scale_bytes;
  const int64_t j = p.local_group, g = p.global_group;
  const auto& l_rows = colwise ? local.colwise_scale_rows : local.rowwise_scale_rows;
  const auto& l_cols = colwise ? local.colwise_scale_cols : local.rowwise_scale_cols;
  const auto& g_rows = colwise ? global.colwise_scale_rows : global.rowwise_scale_rows;
  const auto& g_cols = colwise ? global.colwise_scale_cols : global.rowwise_scale_cols;
  const int64_t lr = l_rows[j], lc = l_cols[j], gr = g_rows[g], gc = g_cols[g];
  const int64_t units = CeilDiv(p.rows, ra.unit), at = p.start / ra.unit;
  const bool fits = ra.axis == 0 ? (lc == gc && units <= lr && at + units <= gr)
                                 : (lr == gr && units <= lc && at + units <= gc);
  if (!fits) {
    return absl::InternalError(absl::StrCat("scale block of local group ", j, " [", lr, "x", lc,
                                            "] does not fit group ", g, "'s [", gr, "x", gc,
                                            "] at row unit ", at));
  }
  const char* s = src.bytes.data() + (colwise ? local.colwise_scale_offset : local.rowwise_scale_offset)[j] * bytes;
  char* d = &dst->bytes[0] + (colwise ? global.colwise_scale_offset : global.rowwise_scale_offset)[g] * bytes;
  if (ra.axis == 0) {
    std::memcpy(d + at * gc * bytes, s, units * lc * bytes);  // whole rows: contiguous
  } else {
    for (int64_t r = 0; r < lr; ++r) std::memcpy(d + (r * gc + at) * bytes, s + r * lc * bytes, units * bytes);
  }
  return absl::OkStatus();
}

// Transposed colwise data: local group j is [K, rows] at its row offset * K;
// global group g is [K, m_g] at its row offset * K.
void CopyTransposed(const QuantizeLayout& local, const QuantizeLayout& global,
                    const std::vector<int64_t>& global_sizes, int64_t k, const Piece& p,
                    const HostTensor& src, HostTensor* dst) {
  if (p.rows == 0) return;
  const int64_t mg = global_sizes[p.global_group];
  const char* s = src.bytes.data() + local.row_offset[p.local_group] * k;
  char* d = &dst->bytes[0] + global.row_offset[p.global_group] * k + p.start;
  for (int64_t c = 0; c < k; ++c) std::memcpy(d + c * mg, s + c * p.rows, p.rows);
}

absl::Status CheckShardTensor(const HostTensor* t, DType dtype, int64_t elems, const char* name,
                              const RowShard& shard) {
  if (t != nullptr && t->dtype == dtype && t->NumElements() == elems) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "the row shard at group_sizes[", shard.sizes_begin, "] returned ",
      t == nullptr ? std::string("no ") : absl::StrCat(t->NumElements(), " ", DTypeName(t->dtype), " "),
      name, ", expected ", elems, " ", DTypeName(dtype)));
}

}  // namespace

absl::StatusOr<GlobalGroups> MakeGlobalGroups(const std::vector<int64_t>& sizes,
                                              const std::vector<RowShard>& shards,
                                              int64_t local_groups, int64_t num_groups) {
  GlobalGroups out;
  out.sizes.assign(num_groups, 0);
  out.group.assign(sizes.size(), -1);
  out.piece_start.assign(sizes.size(), 0);
  for (const RowShard& s : shards) {
    if (s.sizes_begin < 0 || s.sizes_begin + local_groups > static_cast<int64_t>(sizes.size()) ||
        s.first_group < 0 || s.first_group + local_groups > num_groups) {
      return absl::InternalError(absl::StrCat("row shard at group_sizes[", s.sizes_begin,
                                              "], groups from ", s.first_group, ": outside ",
                                              sizes.size(), " entries / ", num_groups, " groups"));
    }
    for (int64_t j = 0; j < local_groups; ++j) {
      const int64_t e = s.sizes_begin + j, g = s.first_group + j;
      out.group[e] = g;
      out.piece_start[e] = out.sizes[g];
      out.sizes[g] += sizes[e];
    }
  }
  return out;
}

int64_t ScaleRowBlock(ScalingMode mode, bool rowwise, bool colwise) {
  switch (mode) {
    case ScalingMode::kMxfp8: return colwise ? 32 : 1;
    case ScalingMode::kBlock1x128: return colwise ? 128 : 1;
    case ScalingMode::kBlock128x128: return rowwise || colwise ? 128 : 1;
    default: return 1;
  }
}

absl::Status CheckBlockAligned(const std::vector<int64_t>& sizes, const GlobalGroups& groups,
                               int64_t row_block, absl::string_view what) {
  if (row_block <= 1) return absl::OkStatus();
  for (size_t e = 0; e < sizes.size(); ++e) {
    const int64_t start = groups.piece_start[e];
    if (groups.group[e] < 0 || sizes[e] == 0 || start % row_block == 0) continue;
    const int64_t g = groups.group[e];
    return absl::InvalidArgumentError(absl::StrCat(
        "group_sizes[", e, "]: ", what, " cover ", row_block, "-row blocks from each group's "
        "first row, but group ", g, " has ", start, " rows on the row shards before this one, "
        "so this shard's ", sizes[e], " rows of it start inside a block and its scales would "
        "differ from the unsharded quantize's; give every row shard but the last a multiple of ",
        row_block, " rows of a group, or keep each group on one row shard"));
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizeLayout> BlockLayout(ScalingMode mode, int64_t m, int64_t k, bool rowwise,
                                           bool colwise, const std::vector<int64_t>& sizes) {
  GroupedQuantizeArgs a;
  a.x_dtype = DType::kF32;
  a.mode = mode;
  a.m = m;
  a.k = k;
  a.rowwise = rowwise;
  a.colwise = colwise;
  a.group_sizes = sizes.data();
  a.num_groups = static_cast<int64_t>(sizes.size());
  return GetQuantizeLayout(a);
}

absl::StatusOr<BlockOutputs> AssembleBlockOutputs(const BlockQuantize& q,
                                                  const std::vector<int64_t>& sizes,
                                                  int64_t local_groups, const GlobalGroups& groups,
                                                  const std::vector<ShardBlockOutputs>& shards) {
  auto global = BlockLayout(q.mode, q.m, q.k, q.rowwise, q.colwise, groups.sizes);
  if (!global.ok()) return global.status();
  const DType sdt = q.mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
  const bool transposed = q.colwise && q.mode != ScalingMode::kMxfp8;
  BlockOutputs out;
  if (q.rowwise) out.scale_inv = *ZerosTensor(sdt, {global->rowwise_scale_elems});
  if (q.colwise) out.colwise_scale_inv = *ZerosTensor(sdt, {global->colwise_scale_elems});
  if (transposed) out.colwise_data = *ZerosTensor(q.data_dtype, {q.m, q.k});
  const RowAxis row_ra = ScaleRowAxis(q.mode, false), col_ra = ScaleRowAxis(q.mode, true);
  for (const ShardBlockOutputs& s : shards) {
    const auto first = sizes.begin() + s.shard.sizes_begin;
    const std::vector<int64_t> local_sizes(first, first + local_groups);
    auto local = BlockLayout(q.mode, s.m, q.k, q.rowwise, q.colwise, local_sizes);
    if (!local.ok()) return local.status();
    absl::Status st;
    if (q.rowwise) st.Update(CheckShardTensor(s.scale_inv, sdt, local->rowwise_scale_elems, "scale_inv", s.shard));
    if (q.colwise) st.Update(CheckShardTensor(s.colwise_scale_inv, sdt, local->colwise_scale_elems, "colwise_scale_inv", s.shard));
    if (transposed) st.Update(CheckShardTensor(s.colwise_data, q.data_dtype, s.m * q.k, "colwise_data", s.shard));
    if (!st.ok()) return st;
    for (int64_t j = 0; j < local_groups; ++j) {
      const int64_t e = s.shard.sizes_begin + j;
      const Piece p{j, groups.group[e], groups.piece_start[e], sizes[e]};
      if (q.rowwise) st.Update(CopyScales(*local, *global, false, row_ra, p, *s.scale_inv, &out.scale_inv));
      if (q.colwise) st.Update(CopyScales(*local, *global, true, col_ra, p, *s.colwise_scale_inv, &out.colwise_scale_inv));
      if (!st.ok()) return st;
      if (transposed) CopyTransposed(*local, *global, groups.sizes, q.k, p, *s.colwise_data, &out.colwise_data);
    }
  }
  return out;
}

}  // namespace shardgemm
