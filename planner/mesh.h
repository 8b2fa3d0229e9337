// Device mesh: named axes with sizes, and the roles (dp, fsdp, ep, tp) that
// the partition rules key on. Ranks are row-major over the axes in
// declaration order, as jax.sharding.Mesh over a reshaped device list.
#ifndef SHARDGEMM_PLANNER_MESH_H_
#define SHARDGEMM_PLANNER_MESH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardgemm {
namespace planner {

// Upper bounds that keep plans (which list every worker) small and keep all
// size arithmetic far from int64 overflow.
inline constexpr int64_t kMaxWorkers = 4096;
inline constexpr int kMaxMeshAxes = 16;

struct MeshAxis {
  std::string name;
  int64_t size = 1;
};

// Which mesh axis plays each role; an empty string means the role is unset.
struct Roles {
  std::string dp;
  std::string fsdp;
  std::string ep;
  std::string tp;
};

struct Mesh {
  std::vector<MeshAxis> axes;
  Roles roles;
};

enum class Role { kNone, kDp, kFsdp, kEp, kTp };
absl::string_view RoleName(Role role);  // "none", "dp", "fsdp", "ep", "tp"

// Parses "dp=2,fsdp=2,ep=2" and "dp=data,ep=expert" (role=axis; may be
// empty). A role not named in roles_text defaults to the axis of the same
// name when there is one and that axis plays no other role. The result is
// validated.
absl::StatusOr<Mesh> ParseMesh(absl::string_view axes_text,
                               absl::string_view roles_text);

// Checks names (identifiers, unique), sizes (>= 1, product <= kMaxWorkers)
// and roles (existing axes, one role per axis).
absl::Status ValidateMesh(const Mesh& mesh);

// "dp=2,fsdp=2,ep=2" and "dp=data,ep=expert" (unset roles omitted).
std::string FormatMesh(const Mesh& mesh);
std::string FormatRoles(const Roles& roles);

// Product of all axis sizes (1 for a mesh with no axes).
int64_t NumWorkers(const Mesh& mesh);

// Index of the axis called `name`, or -1.
int AxisIndex(const Mesh& mesh, absl::string_view name);
// Size of the axis called `name`; 1 when absent.
int64_t AxisSize(const Mesh& mesh, absl::string_view name);
// The role an axis plays (kNone for an unbound or unknown axis).
Role RoleOf(const Mesh& mesh, absl::string_view axis);

// Row-major (last axis fastest) conversions. Out-of-range input gives an
// InvalidArgument error rather than UB.
absl::StatusOr<std::vector<int64_t>> RankToCoords(const Mesh& mesh, int64_t rank);
absl::StatusOr<int64_t> CoordsToRank(const Mesh& mesh,
                                     const std::vector<int64_t>& coords);

}  // namespace planner
}  // namespace shardgemm

#endif  // SHARDGEMM_PLANNER_MESH_H_
