#include "server/replica_placement.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"

namespace shardgemm {

std::string StandbyShardName(const std::string& shard_name, int block_rank) {
  return absl::StrCat(shard_name, "/standby-of-", block_rank);
}

absl::StatusOr<std::vector<int>> BlockOwners(const planner::Mesh& mesh, absl::string_view name,
                                             const std::vector<int64_t>& shape, const planner::PartitionSpec& spec) {
  const int ranks = static_cast<int>(planner::NumWorkers(mesh));
  std::map<std::vector<int64_t>, int> owner_of_offsets;
  std::vector<int> owners(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto offsets = planner::BlockOffsets(name, shape, spec, mesh, r);
    if (!offsets.ok()) return offsets.status();
    owners[r] = owner_of_offsets.emplace(*offsets, r).first->second;
  }
  return owners;
}

absl::StatusOr<std::vector<StandbyCopy>> PlaceStandbyCopies(const std::vector<int>& block_owners, int replicas,
                                                            int64_t block_bytes, std::vector<int64_t> load_bytes) {
  const int ranks = static_cast<int>(block_owners.size());
  if (replicas < 1 || replicas > ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replicas=", replicas, " must be within 1 and the mesh's ", ranks, " workers"));
  }
  if (static_cast<int>(load_bytes.size()) != ranks) {
    return absl::InvalidArgumentError(absl::StrCat(load_bytes.size(), " loads for ", ranks, " ranks"));
  }
  std::map<int, std::set<int>> holders;  // by block rank
  for (int r = 0; r < ranks; ++r) holders[block_owners[r]].insert(r);
  std::vector<StandbyCopy> copies;
  for (auto& [block, have] : holders) {
    for (int need = replicas - static_cast<int>(have.size()); need > 0; --need) {
      int best = -1;
      for (int step = 1; step < ranks; ++step) {
        const int r = (block + step) % ranks;
        if (have.count(r) > 0) continue;
        if (best < 0 || load_bytes[r] < load_bytes[best]) best = r;
      }
      if (best < 0) break;  // unreachable: replicas <= ranks
      have.insert(best);
      load_bytes[best] += block_bytes;
      copies.push_back({block, best});
    }
  }
  return copies;
}

int CopiesOfBlock(const std::vector<int>& block_owners, const std::vector<StandbyCopy>& standby, int block_rank) {
  int n = static_cast<int>(std::count(block_owners.begin(), block_owners.end(), block_rank));
  for (const StandbyCopy& c : standby) n += c.block_rank == block_rank;
  return n;
}

}  // namespace shardgemm
