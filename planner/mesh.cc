#include "planner/mesh.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardgemm {
namespace planner {
namespace {

bool IsIdentifier(absl::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  if (!(absl::ascii_isalpha(s[0]) || s[0] == '_')) return false;
  for (char c : s) {
    if (!(absl::ascii_isalnum(c) || c == '_')) return false;
  }
  return true;
}

// Role slots in a fixed order so loops can treat them uniformly.
struct RoleSlot {
  Role role;
  std::string Roles::*field;
};
constexpr RoleSlot kRoleSlots[] = {
    {Role::kDp, &Roles::dp},
    {Role::kFsdp, &Roles::fsdp},
    {Role::kEp, &Roles::ep},
    {Role::kTp, &Roles::tp},
};

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kDp: return "dp";
    case Role::kFsdp: return "fsdp";
    case Role::kEp: return "ep";
    case Role::kTp: return "tp";
    case Role::kNone: break;
  }
  return "none";
}

absl::Status ValidateMesh(const Mesh& mesh) {
  if (mesh.axes.empty()) {
    return absl::InvalidArgumentError("mesh: no axes (give at least one, e.g. 'dp=1')");
  }
  if (mesh.axes.size() > kMaxMeshAxes) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh: ", mesh.axes.size(), " axes, at most ", kMaxMeshAxes));
  }
  int64_t workers = 1;
  for (size_t i = 0; i < mesh.axes.size(); ++i) {
    const MeshAxis& axis = mesh.axes[i];
    if (!IsIdentifier(axis.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: axis name '", absl::CEscape(axis.name),
          "' is not an identifier ([A-Za-z_][A-Za-z0-9_]*, at most 64 chars)"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (mesh.axes[j].name == axis.name) {
        return absl::InvalidArgumentError(
            absl::StrCat("mesh: axis '", axis.name, "' declared twice"));
      }
    }
    if (axis.size < 1 || axis.size > kMaxWorkers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: axis '", axis.name, "' has size ", axis.size, ", must be in [1, ",
          kMaxWorkers, "]"));
    }
    workers *= axis.size;  // both factors <= kMaxWorkers: no overflow
    if (workers > kMaxWorkers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: more than ", kMaxWorkers, " workers (product of axis sizes)"));
    }
  }
  for (size_t i = 0; i < 4; ++i) {
    const std::string& axis = mesh.roles.*kRoleSlots[i].field;
    if (axis.empty()) continue;
    if (AxisIndex(mesh, axis) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh roles: ", RoleName(kRoleSlots[i].role), " is bound to '",
                       absl::CEscape(axis), "', which is not a mesh axis"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (mesh.roles.*kRoleSlots[j].field == axis) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mesh roles: axis '", axis, "' is bound to both ",
            RoleName(kRoleSlots[j].role), " and ", RoleName(kRoleSlots[i].role)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Mesh> ParseMesh(absl::string_view axes_text,
                               absl::string_view roles_text) {
  Mesh mesh;
  axes_text = absl::StripAsciiWhitespace(axes_text);
  if (axes_text.empty()) {
    return absl::InvalidArgumentError("mesh: empty (expected e.g. 'dp=2,fsdp=2,ep=2')");
  }
  for (absl::string_view item : absl::StrSplit(axes_text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: item '", absl::CEscape(item), "' is not NAME=SIZE"));
    }
    MeshAxis axis;
    axis.name = std::string(absl::StripAsciiWhitespace(kv[0]));
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(kv[1]), &axis.size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: size of axis '", absl::CEscape(axis.name), "' ('",
          absl::CEscape(kv[1]), "') is not an integer"));
    }
    mesh.axes.push_back(std::move(axis));
    if (mesh.axes.size() > kMaxMeshAxes) break;  // ValidateMesh reports it
  }
  bool explicit_role[4] = {false, false, false, false};
  roles_text = absl::StripAsciiWhitespace(roles_text);
  if (!roles_text.empty()) {
    for (absl::string_view item : absl::StrSplit(roles_text, ',')) {
      item = absl::StripAsciiWhitespace(item);
      std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
      if (kv.size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mesh roles: item '", absl::CEscape(item), "' is not ROLE=AXIS"));
      }
      absl::string_view role = absl::StripAsciiWhitespace(kv[0]);
      absl::string_view axis = absl::StripAsciiWhitespace(kv[1]);
      bool found = false;
      for (int i = 0; i < 4; ++i) {
        if (RoleName(kRoleSlots[i].role) != role) continue;
        if (explicit_role[i]) {
          return absl::InvalidArgumentError(
              absl::StrCat("mesh roles: role '", role, "' given twice"));
        }
        explicit_role[i] = true;
        mesh.roles.*kRoleSlots[i].field = std::string(axis);
        found = true;
      }
      if (!found) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mesh roles: unknown role '", absl::CEscape(role),
            "' (roles are dp, fsdp, ep, tp)"));
      }
    }
  }
  // Defaults: an axis named like a role plays it unless told otherwise.
  for (int i = 0; i < 4; ++i) {
    if (explicit_role[i]) continue;
    absl::string_view name = RoleName(kRoleSlots[i].role);
    if (AxisIndex(mesh, name) < 0) continue;
    bool taken = false;
    for (int j = 0; j < 4; ++j) {
      if (explicit_role[j] && mesh.roles.*kRoleSlots[j].field == name) taken = true;
    }
    if (!taken) mesh.roles.*kRoleSlots[i].field = std::string(name);
  }
  absl::Status status = ValidateMesh(mesh);
  if (!status.ok()) return status;
  return mesh;
}

std::string FormatMesh(const Mesh& mesh) {
  return absl::StrJoin(mesh.axes, ",", [](std::string* out, const MeshAxis& a) {
    absl::StrAppend(out, a.name, "=", a.size);
  });
}

std::string FormatRoles(const Roles& roles) {
  std::vector<std::string> parts;
  for (const RoleSlot& slot : kRoleSlots) {
    const std::string& axis = roles.*slot.field;
    if (!axis.empty()) parts.push_back(absl::StrCat(RoleName(slot.role), "=", axis));
  }
  return absl::StrJoin(parts, ",");
}

int64_t NumWorkers(const Mesh& mesh) {
  int64_t n = 1;
  for (const MeshAxis& axis : mesh.axes) n *= axis.size;
  return n;
}

int AxisIndex(const Mesh& mesh, absl::string_view name) {
  for (size_t i = 0; i < mesh.axes.size(); ++i) {
    if (mesh.axes[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

int64_t AxisSize(const Mesh& mesh, absl::string_view name) {
  int i = AxisIndex(mesh, name);
  return i < 0 ? 1 : mesh.axes[i].size;
}

Role RoleOf(const Mesh& mesh, absl::string_view axis) {
  if (axis.empty()) return Role::kNone;
  for (const RoleSlot& slot : kRoleSlots) {
    if (mesh.roles.*slot.field == axis) return slot.role;
  }
  return Role::kNone;
}

absl::StatusOr<std::vector<int64_t>> RankToCoords(const Mesh& mesh, int64_t rank) {
  const int64_t n = NumWorkers(mesh);
  if (rank < 0 || rank >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " out of range [0, ", n, ")"));
  }
  std::vector<int64_t> coords(mesh.axes.size());
  for (size_t i = mesh.axes.size(); i-- > 0;) {
    coords[i] = rank % mesh.axes[i].size;
    rank /= mesh.axes[i].size;
  }
  return coords;
}

absl::StatusOr<int64_t> CoordsToRank(const Mesh& mesh,
                                     const std::vector<int64_t>& coords) {
  if (coords.size() != mesh.axes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coords have ", coords.size(), " entries, mesh has ", mesh.axes.size(), " axes"));
  }
  int64_t rank = 0;
  for (size_t i = 0; i < coords.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= mesh.axes[i].size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "coordinate ", coords[i], " out of range for axis '", mesh.axes[i].name,
          "' of size ", mesh.axes[i].size));
    }
    rank = rank * mesh.axes[i].size + coords[i];
  }
  return rank;
}

}  // namespace planner
}  // namespace shardgemm
