#include "server/row_routing.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardgemm {

absl::StatusOr<RowRouting> RouteSortedRows(const std::vector<int64_t>& sizes, int64_t rows,
                                           const std::vector<int64_t>& row_axis_sizes,
                                           int ep_index) {
  RowRouting r;
  for (int64_t s : row_axis_sizes) r.num_shards *= s;
  const int64_t groups = static_cast<int64_t>(sizes.size());
  const int64_t ep = ep_index >= 0 ? row_axis_sizes[ep_index] : 1;
  if (groups % ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("group_sizes: ", groups,
                                                   " groups do not split over ", ep, " expert shards"));
  }
  r.groups_per_shard = groups / ep;
  int64_t total = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("group_sizes[", g, "] is negative (", sizes[g], ")"));
    }
    if (sizes[g] > rows - total) {  // also keeps the sum from overflowing
      return absl::InvalidArgumentError(
          absl::StrCat("group_sizes[0:", g + 1, "] sum past the ", rows, " rows of lhs"));
    }
    total += sizes[g];
  }
  // Shard s's ep coordinate, from its index over the row axes.
  auto ep_coord = [&](int64_t s) -> int64_t {
    if (ep_index < 0) return 0;
    int64_t rest = s;
    for (int d = static_cast<int>(row_axis_sizes.size()) - 1; d > ep_index; --d) rest /= row_axis_sizes[d];
    return rest % row_axis_sizes[ep_index];
  };
  std::vector<std::vector<int64_t>> owners(ep);
  for (int64_t s = 0; s < r.num_shards; ++s) owners[ep_coord(s)].push_back(s);
  // shard_sizes[s][j]: rows of local group j on shard s; first[g]: first
  // source row of group g.
  r.shard_group_sizes.assign(r.num_shards * r.groups_per_shard, 0);
  std::vector<int64_t> shard_total(r.num_shards, 0);
  for (int64_t g = 0; g < groups; ++g) {
    const auto& own = owners[g / r.groups_per_shard];
    const int64_t d = static_cast<int64_t>(own.size());
    for (int64_t i = 0; i < d; ++i) {
      const int64_t part = sizes[g] / d + (i < sizes[g] % d ? 1 : 0);
      r.shard_group_sizes[own[i] * r.groups_per_shard + g % r.groups_per_shard] = part;
      shard_total[own[i]] += part;
    }
  }
  r.shard_rows = std::max<int64_t>(1, *std::max_element(shard_total.begin(), shard_total.end()));
  r.source_row.assign(r.num_shards * r.shard_rows, -1);
  std::vector<int64_t> next_row(r.num_shards, 0);
  int64_t source = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const auto& own = owners[g / r.groups_per_shard];
    for (int64_t s : own) {
      const int64_t part = r.shard_group_sizes[s * r.groups_per_shard + g % r.groups_per_shard];
      for (int64_t i = 0; i < part; ++i) {
        r.source_row[s * r.shard_rows + next_row[s]++] = source++;
      }
    }
  }
  return r;
}

}  // namespace shardgemm
