// The client-friendly layout: the client sends its rows unsharded and sorted
// by group, with global group sizes; the coordinator lays them out per shard
// (each group's rows on the shards that own the group, split evenly over the
// other row axes) and puts the output rows back in the client's order.
#ifndef SHARDGEMM_SERVER_ROW_ROUTING_H_
#define SHARDGEMM_SERVER_ROW_ROUTING_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace shardgemm {

struct RowRouting {
  int64_t num_shards = 1;
  int64_t shard_rows = 0;                  // rows per shard, padding included
  int64_t groups_per_shard = 0;            // G / ep (or G without ep on the rows)
  std::vector<int64_t> shard_group_sizes;  // num_shards * groups_per_shard, the per-shard layout
  std::vector<int64_t> source_row;         // per laid-out row: the client's row, or -1 (padding)
};

// `row_axis_sizes`: sizes of the axes that split the rows, first axis major;
// `ep_index`: which of them is the expert axis (-1: none). Shard s owns the
// groups of its ep coordinate; a group's rows are split evenly over the shards
// that own it (earlier shards take the remainder).
absl::StatusOr<RowRouting> RouteSortedRows(const std::vector<int64_t>& global_group_sizes,
                                           int64_t rows, const std::vector<int64_t>& row_axis_sizes,
                                           int ep_index);

}  // namespace shardgemm

#endif  // SHARDGEMM_SERVER_ROW_ROUTING_H_
