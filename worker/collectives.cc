#include "worker/collectives.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm {

int64_t MeshPosition::NumWorkers() const {
  int64_t n = 1;
  for (int64_t s : axis_sizes) n *= s;
  return n;
}

namespace {

absl::StatusOr<int> AxisIndex(const MeshPosition& p, const std::string& axis) {
  auto it = std::find(p.axis_names.begin(), p.axis_names.end(), axis);
  if (it == p.axis_names.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown mesh axis '", axis, "'"));
  }
  return static_cast<int>(it - p.axis_names.begin());
}

}  // namespace

absl::StatusOr<int64_t> MeshPosition::GroupSize(const std::vector<std::string>& axes) const {
  int64_t n = 1;
  for (const auto& a : axes) {
    auto i = AxisIndex(*this, a);
    if (!i.ok()) return i.status();
    n *= axis_sizes[*i];
  }
  return n;
}

absl::StatusOr<int64_t> MeshPosition::GroupIndex(const std::vector<std::string>& axes) const {
  int64_t index = 0;
  for (const auto& a : axes) {
    auto i = AxisIndex(*this, a);
    if (!i.ok()) return i.status();
    index = index * axis_sizes[*i] + coords[*i];
  }
  return index;
}

absl::StatusOr<std::vector<int>> MeshPosition::GroupRanks(
    const std::vector<std::string>& axes) const {
  auto size = GroupSize(axes);
  if (!size.ok()) return size.status();
  std::vector<int> axis_ids;
  for (const auto& a : axes) axis_ids.push_back(*AxisIndex(*this, a));
  std::vector<int> ranks;
  for (int64_t g = 0; g < *size; ++g) {
    std::vector<int64_t> c = coords;
    int64_t rest = g;
    for (int j = static_cast<int>(axis_ids.size()) - 1; j >= 0; --j) {
      c[axis_ids[j]] = rest % axis_sizes[axis_ids[j]];
      rest /= axis_sizes[axis_ids[j]];
    }
    int64_t r = 0;
    for (size_t d = 0; d < c.size(); ++d) r = r * axis_sizes[d] + c[d];
    ranks.push_back(static_cast<int>(r));
  }
  return ranks;
}

std::string MeshPosition::GroupName(const std::vector<std::string>& axes) const {
  std::vector<std::string> other;
  for (size_t d = 0; d < axis_names.size(); ++d) {
    if (std::find(axes.begin(), axes.end(), axis_names[d]) == axes.end()) {
      other.push_back(absl::StrCat(axis_names[d], "=", coords[d]));
    }
  }
  return absl::StrCat(absl::StrJoin(axes, ","), "/", absl::StrJoin(other, ","));
}

MeshPosition SingleWorkerPosition() { return MeshPosition(); }

absl::StatusOr<HostTensor> TakePiece(const HostTensor& t, int dim, int64_t index, int64_t count,
                                     absl::string_view what) {
  if (dim < 0 || dim >= static_cast<int>(t.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", dim, " out of range"));
  }
  if (count <= 0 || t.shape[dim] % count != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", dim, " of size ",
                                                   t.shape[dim], " does not split into ", count));
  }
  std::vector<int64_t> offsets(t.shape.size(), 0), sizes = t.shape;
  sizes[dim] = t.shape[dim] / count;
  offsets[dim] = sizes[dim] * index;
  return SliceBlock(t, offsets, sizes);
}

namespace {

class LocalCollectives : public Collectives {
 public:
  explicit LocalCollectives(MeshPosition p) : position_(std::move(p)) {}

  absl::StatusOr<HostTensor> AllGather(const HostTensor& local, int,
                                       const std::vector<std::string>& axes) override {
    if (auto s = CheckSingle(axes); !s.ok()) return s;
    return local;
  }
  absl::Status AllReduce(HostTensor*, ReduceOp, const std::vector<std::string>& axes) override {
    return CheckSingle(axes);
  }
  absl::StatusOr<HostTensor> ReduceScatter(const HostTensor& t, int,
                                           const std::vector<std::string>& axes) override {
    if (auto s = CheckSingle(axes); !s.ok()) return s;
    return t;
  }
  absl::Status Agree(const absl::Status& local, const std::vector<std::string>&) override { return local; }

 private:
  absl::Status CheckSingle(const std::vector<std::string>& axes) const {
    auto n = position_.GroupSize(axes);
    if (!n.ok()) return n.status();
    if (*n != 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("this worker has no communicator for a group of ", *n, " workers"));
    }
    return absl::OkStatus();
  }
  MeshPosition position_;
};

}  // namespace

std::unique_ptr<Collectives> MakeLocalCollectives(const MeshPosition& position) {
  return std::make_unique<LocalCollectives>(position);
}

}  // namespace shardgemm

namespace shardgemm {

absl::Status RevokedStatus(uint64_t step_epoch, uint64_t epoch, absl::string_view why) {
  return absl::AbortedError(absl::StrCat("the step's collectives (mesh epoch ", step_epoch,
                                         ") were revoked: the mesh moved on to epoch ", epoch,
                                         why.empty() ? "" : " because ", why, "; retry the request"));
}

}  // namespace shardgemm
