#include "planner/spec.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm {
namespace planner {
namespace {

// Recursive-descent parser over the spec grammar:
//   spec  := '' | '(' [entry (',' entry)* [',']] ')'
//   entry := 'None' | name | '(' [name (',' name)* [',']] ')'
//   name  := identifier, optionally in '...' or "..."
class SpecParser {
 public:
  explicit SpecParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<PartitionSpec> Parse() {
    PartitionSpec spec;
    SkipSpace();
    if (AtEnd()) return spec;  // "" = fully replicated
    if (!Consume('(')) return Error("expected '('");
    SkipSpace();
    if (Consume(')')) return Finish(spec);
    while (true) {
      std::vector<std::string> entry;
      SkipSpace();
      if (Consume('(')) {
        SkipSpace();
        if (!Consume(')')) {
          while (true) {
            std::string name;
            absl::Status s = ParseName(&name);
            if (!s.ok()) return s;
            if (name != "None") entry.push_back(std::move(name));
            SkipSpace();
            if (Consume(')')) break;
            if (!Consume(',')) return Error("expected ',' or ')' in a nested entry");
            SkipSpace();
            if (Consume(')')) break;
          }
        }
      } else {
        std::string name;
        absl::Status s = ParseName(&name);
        if (!s.ok()) return s;
        if (name != "None") entry.push_back(std::move(name));
      }
      spec.dims.push_back(std::move(entry));
      if (spec.dims.size() > 64) return Error("more than 64 entries");
      SkipSpace();
      if (Consume(')')) break;
      if (!Consume(',')) return Error("expected ',' or ')'");
      SkipSpace();
      if (Consume(')')) break;
    }
    return Finish(spec);
  }

 private:
  absl::StatusOr<PartitionSpec> Finish(PartitionSpec spec) {
    SkipSpace();
    if (!AtEnd()) return Error("unexpected text after the closing ')'");
    return spec;
  }

  absl::Status ParseName(std::string* name) {
    SkipSpace();
    char quote = 0;
    if (Consume('\'')) quote = '\'';
    else if (Consume('"')) quote = '"';
    size_t start = pos_;
    while (!AtEnd() && (absl::ascii_isalnum(text_[pos_]) || text_[pos_] == '_')) ++pos_;
    if (pos_ == start) return Error("expected an axis name or None");
    if (absl::ascii_isdigit(text_[start])) return Error("an axis name cannot start with a digit");
    if (pos_ - start > 64) return Error("axis name longer than 64 characters");
    *name = std::string(text_.substr(start, pos_ - start));
    if (quote != 0 && !Consume(quote)) return Error("unterminated quote");
    return absl::OkStatus();
  }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition spec '", absl::CEscape(text_.substr(0, 200)), "': ", what,
        " at offset ", pos_));
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  bool Consume(char c) {
    if (!AtEnd() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void SkipSpace() {
    while (!AtEnd() && absl::ascii_isspace(text_[pos_])) ++pos_;
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

bool operator==(const PartitionSpec& a, const PartitionSpec& b) { return a.dims == b.dims; }

absl::StatusOr<PartitionSpec> ParsePartitionSpec(absl::string_view text) {
  return SpecParser(text).Parse();
}

std::string FormatAxes(const std::vector<std::string>& axes) {
  if (axes.empty()) return "None";
  if (axes.size() == 1) return axes[0];
  return absl::StrCat("(", absl::StrJoin(axes, ", "), ")");
}

std::string FormatPartitionSpec(const PartitionSpec& spec) {
  std::string out = "(";
  for (size_t i = 0; i < spec.dims.size(); ++i) {
    if (i > 0) out += ", ";
    out += FormatAxes(spec.dims[i]);
  }
  if (spec.dims.size() == 1) out += ",";
  out += ")";
  return out;
}

PartitionSpec PadSpec(const PartitionSpec& spec, size_t rank) {
  PartitionSpec padded = spec;
  if (padded.dims.size() < rank) padded.dims.resize(rank);
  return padded;
}

absl::Status ValidatePartitionSpec(absl::string_view tensor,
                                   const std::vector<int64_t>& shape,
                                   const PartitionSpec& spec, const Mesh& mesh) {
  if (spec.dims.size() > shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        tensor, ": spec ", FormatPartitionSpec(spec), " has ", spec.dims.size(),
        " entries but the tensor has rank ", shape.size()));
  }
  std::vector<absl::string_view> seen;
  for (size_t d = 0; d < spec.dims.size(); ++d) {
    int64_t product = 1;
    for (const std::string& axis : spec.dims[d]) {
      if (AxisIndex(mesh, axis) < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            tensor, " dim ", d, ": unknown mesh axis '", absl::CEscape(axis),
            "' (mesh is ", FormatMesh(mesh), ")"));
      }
      for (absl::string_view s : seen) {
        if (s == axis) {
          return absl::InvalidArgumentError(absl::StrCat(
              tensor, " dim ", d, ": axis '", axis, "' used twice in spec ",
              FormatPartitionSpec(spec)));
        }
      }
      seen.push_back(axis);
      product *= AxisSize(mesh, axis);  // <= kMaxWorkers since axes are distinct
    }
    if (shape[d] % product != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          tensor, " dim ", d, ": size ", shape[d], " is not divisible by ", product,
          ", the product of axes ", FormatAxes(spec.dims[d]), " that split it"));
    }
  }
  return absl::OkStatus();
}

int64_t AxesProduct(const Mesh& mesh, const std::vector<std::string>& axes) {
  int64_t product = 1;
  for (const std::string& axis : axes) product *= AxisSize(mesh, axis);
  return product;
}

int64_t BlockIndex(const Mesh& mesh, const std::vector<std::string>& axes,
                   const std::vector<int64_t>& coords) {
  int64_t index = 0;
  for (const std::string& axis : axes) {
    int i = AxisIndex(mesh, axis);
    if (i < 0) continue;
    int64_t c = static_cast<size_t>(i) < coords.size() ? coords[i] : 0;
    index = index * mesh.axes[i].size + c;
  }
  return index;
}

absl::StatusOr<std::vector<int64_t>> PeerRanks(const Mesh& mesh,
                                               const std::vector<std::string>& axes,
                                               int64_t rank) {
  absl::StatusOr<std::vector<int64_t>> coords = RankToCoords(mesh, rank);
  if (!coords.ok()) return coords.status();
  std::vector<int> index;
  for (const std::string& axis : axes) {
    int i = AxisIndex(mesh, axis);
    if (i < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer group: unknown mesh axis '", absl::CEscape(axis), "'"));
    }
    for (int j : index) {
      if (j == i) {
        return absl::InvalidArgumentError(absl::StrCat("peer group: axis '", axis, "' twice"));
      }
    }
    index.push_back(i);
  }
  const int64_t p = AxesProduct(mesh, axes);
  std::vector<int64_t> peers(p);
  std::vector<int64_t> c = *coords;
  for (int64_t piece = 0; piece < p; ++piece) {
    int64_t rest = piece;  // decompose first axis major
    for (size_t k = index.size(); k-- > 0;) {
      c[index[k]] = rest % mesh.axes[index[k]].size;
      rest /= mesh.axes[index[k]].size;
    }
    peers[piece] = *CoordsToRank(mesh, c);
  }
  return peers;
}

absl::StatusOr<std::vector<int64_t>> LocalShape(absl::string_view tensor,
                                                const std::vector<int64_t>& shape,
                                                const PartitionSpec& spec,
                                                const Mesh& mesh) {
  absl::Status s = ValidatePartitionSpec(tensor, shape, spec, mesh);
  if (!s.ok()) return s;
  std::vector<int64_t> local = shape;
  for (size_t d = 0; d < spec.dims.size(); ++d) local[d] /= AxesProduct(mesh, spec.dims[d]);
  return local;
}

absl::StatusOr<std::vector<int64_t>> BlockOffsets(absl::string_view tensor,
                                                  const std::vector<int64_t>& shape,
                                                  const PartitionSpec& spec,
                                                  const Mesh& mesh, int64_t rank) {
  absl::StatusOr<std::vector<int64_t>> local = LocalShape(tensor, shape, spec, mesh);
  if (!local.ok()) return local.status();
  absl::StatusOr<std::vector<int64_t>> coords = RankToCoords(mesh, rank);
  if (!coords.ok()) return coords.status();
  std::vector<int64_t> offsets(shape.size(), 0);
  for (size_t d = 0; d < spec.dims.size(); ++d) {
    offsets[d] = BlockIndex(mesh, spec.dims[d], *coords) * (*local)[d];
  }
  return offsets;
}

}  // namespace planner
}  // namespace shardgemm
