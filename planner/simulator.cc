#include "planner/simulator.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm {
namespace planner {
namespace {

using Axes = std::vector<std::string>;

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> Strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * shape[i];
  return s;
}

HostTensor Zeros(const std::vector<int64_t>& shape) {
  return HostTensor{shape, std::vector<float>(Numel(shape), 0.0f)};
}

// Visits every multi-index of `shape` (row-major).
template <typename F>
void ForEachIndex(const std::vector<int64_t>& shape, F f) {
  if (Numel(shape) == 0) return;
  std::vector<int64_t> idx(shape.size(), 0);
  while (true) {
    f(idx);
    size_t d = shape.size();
    while (d > 0) {
      --d;
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (shape.empty()) return;
  }
}

HostTensor Extract(const HostTensor& t, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& shape) {
  HostTensor out = Zeros(shape);
  std::vector<int64_t> st = Strides(t.shape);
  int64_t i = 0;
  ForEachIndex(shape, [&](const std::vector<int64_t>& idx) {
    int64_t src = 0;
    for (size_t d = 0; d < idx.size(); ++d) src += (idx[d] + offsets[d]) * st[d];
    out.data[i++] = t.data[src];
  });
  return out;
}

// Writes `block` at `offsets`; with `written` tracks coverage and checks
// that replicas agree.
bool Insert(HostTensor* t, std::vector<char>* written, const HostTensor& block,
            const std::vector<int64_t>& offsets) {
  std::vector<int64_t> st = Strides(t->shape);
  int64_t i = 0;
  bool agree = true;
  ForEachIndex(block.shape, [&](const std::vector<int64_t>& idx) {
    int64_t dst = 0;
    for (size_t d = 0; d < idx.size(); ++d) dst += (idx[d] + offsets[d]) * st[d];
    float v = block.data[i++];
    if ((*written)[dst]) {
      if (!(t->data[dst] == v)) agree = false;
    } else {
      t->data[dst] = v;
      (*written)[dst] = 1;
    }
  });
  return agree;
}

HostTensor Concat(const std::vector<const HostTensor*>& parts, int dim) {
  std::vector<int64_t> shape = parts[0]->shape;
  shape[dim] = 0;
  for (const HostTensor* p : parts) shape[dim] += p->shape[dim];
  HostTensor out = Zeros(shape);
  std::vector<int64_t> offsets(shape.size(), 0);
  std::vector<char> written(out.data.size(), 0);
  for (const HostTensor* p : parts) {
    Insert(&out, &written, *p, offsets);
    offsets[dim] += p->shape[dim];
  }
  return out;
}

HostTensor Piece(const HostTensor& t, int dim, int64_t index, int64_t count) {
  std::vector<int64_t> shape = t.shape;
  shape[dim] /= count;
  std::vector<int64_t> offsets(shape.size(), 0);
  offsets[dim] = index * shape[dim];
  return Extract(t, offsets, shape);
}

// ---------------------------------------------------------------------------
// Local kernels. Accumulation is in a fixed order (k ascending, rows
// ascending) in FP32.

// out[rows of local group j] = lhs[rows] @ rhs[g0 + j] (+ bias[g0 + j]).
HostTensor GemmRaggedM(const HostTensor& lhs, const HostTensor& rhs, bool transposed,
                       const std::vector<int64_t>& gs, int64_t g0, const HostTensor* bias,
                       bool apply_bias) {
  const int64_t m = lhs.shape[0], k = lhs.shape[1];
  const int64_t n = transposed ? rhs.shape[1] : rhs.shape[2];
  HostTensor out = Zeros({m, n});
  int64_t row = 0;
  for (size_t j = 0; j < gs.size(); ++j) {
    const int64_t g = g0 + static_cast<int64_t>(j);
    const float* w = rhs.data.data() + g * k * n;
    for (int64_t r = row; r < row + gs[j]; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        float acc = 0.0f;
        for (int64_t i = 0; i < k; ++i) {
          acc += lhs.data[r * k + i] * (transposed ? w[c * k + i] : w[i * n + c]);
        }
        if (bias != nullptr && apply_bias) acc += bias->data[g * n + c];
        out.data[r * n + c] = acc;
      }
    }
    row += gs[j];
  }
  return out;
}

// out[j] = lhs[rows of j]^T @ rhs[rows of j]; out has `groups` entries.
HostTensor GemmRaggedK(const HostTensor& lhs, const HostTensor& rhs,
                       const std::vector<int64_t>& gs) {
  const int64_t k = lhs.shape[1], n = rhs.shape[1];
  HostTensor out = Zeros({static_cast<int64_t>(gs.size()), k, n});
  int64_t row = 0;
  for (size_t j = 0; j < gs.size(); ++j) {
    for (int64_t a = 0; a < k; ++a) {
      for (int64_t b = 0; b < n; ++b) {
        float acc = 0.0f;
        for (int64_t r = row; r < row + gs[j]; ++r) acc += lhs.data[r * k + a] * rhs.data[r * n + b];
        out.data[(j * k + a) * n + b] = acc;
      }
    }
    row += gs[j];
  }
  return out;
}

// FP8 inputs: data x scale_inv (see the scale layouts in planner.cc).
// Tensor scaling: rows of group j (or expert j of rhs) times scale[j].
HostTensor DequantRows(const HostTensor& t, const HostTensor& scale,
                       const std::vector<int64_t>& gs) {
  HostTensor out = t;
  const int64_t cols = Numel(t.shape) / t.shape[0];
  int64_t row = 0;
  for (size_t j = 0; j < gs.size(); ++j) {
    for (int64_t r = row; r < row + gs[j]; ++r) {
      for (int64_t c = 0; c < cols; ++c) out.data[r * cols + c] *= scale.data[j];
    }
    row += gs[j];
  }
  return out;
}

// Block scales: element (i0, i1, ...) times scale[i0 / b0, i1 / b1, ...].
HostTensor DequantBlocks(const HostTensor& t, const HostTensor& scale) {
  HostTensor out = t;
  std::vector<int64_t> block(t.shape.size());
  for (size_t d = 0; d < t.shape.size(); ++d) block[d] = t.shape[d] / scale.shape[d];
  std::vector<int64_t> sst = Strides(scale.shape);
  int64_t i = 0;
  ForEachIndex(t.shape, [&](const std::vector<int64_t>& idx) {
    int64_t si = 0;
    for (size_t d = 0; d < idx.size(); ++d) si += idx[d] / block[d] * sst[d];
    out.data[i++] *= scale.data[si];
  });
  return out;
}

// Expert j of rhs [G, ...] times scale[j].
HostTensor DequantExperts(const HostTensor& t, const HostTensor& scale) {
  HostTensor out = t;
  const int64_t per = Numel(t.shape) / t.shape[0];
  for (int64_t g = 0; g < t.shape[0]; ++g) {
    for (int64_t e = 0; e < per; ++e) out.data[g * per + e] *= scale.data[g];
  }
  return out;
}

bool BlockScaled(const PlanRequest& req) {
  return req.attrs.scaling_mode == ScalingMode::kMxfp8 ||
         req.attrs.scaling_mode == ScalingMode::kBlock;
}

// Dequantizes lhs/rhs in place when the request has scale_inv operands.
void Dequant(const PlanRequest& req, const std::vector<int64_t>& gs, HostTensor* lhs,
             HostTensor* rhs, const HostTensor* ls, const HostTensor* rs) {
  if (ls == nullptr || rs == nullptr) return;
  if (BlockScaled(req)) {
    *lhs = DequantBlocks(*lhs, *ls);
    *rhs = DequantBlocks(*rhs, *rs);
  } else if (req.op == OpKind::kGroupedGemmRaggedM) {
    *lhs = DequantRows(*lhs, *ls, gs);
    *rhs = DequantExperts(*rhs, *rs);
  } else {
    *lhs = DequantRows(*lhs, *ls, gs);
    *rhs = DequantRows(*rhs, *rs, gs);
  }
}

float ScaleInvFromAmax(float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; }

// Per-group amax of the (flattened [m, k]) rows.
std::vector<float> GroupAmax(const HostTensor& x, int64_t m, const std::vector<int64_t>& gs) {
  const int64_t k = Numel(x.shape) / m;
  std::vector<float> amax(gs.size(), 0.0f);
  int64_t row = 0;
  for (size_t j = 0; j < gs.size(); ++j) {
    for (int64_t r = row; r < row + gs[j]; ++r) {
      for (int64_t c = 0; c < k; ++c) amax[j] = std::max(amax[j], std::fabs(x.data[r * k + c]));
    }
    row += gs[j];
  }
  return amax;
}

// The cast pass of grouped quantize, given the (possibly shared) amax.
TensorMap QuantizeCast(const PlanRequest& req, const HostTensor& x, int64_t m,
                       const std::vector<int64_t>& gs, const std::vector<float>& amax) {
  const OpAttrs& a = req.attrs;
  const int64_t k = Numel(x.shape) / m;
  TensorMap out;
  HostTensor data = Zeros(x.shape);
  if (a.scaling_mode == ScalingMode::kCurrent || a.scaling_mode == ScalingMode::kDelayed) {
    HostTensor scale = Zeros({static_cast<int64_t>(gs.size())});
    int64_t row = 0;
    for (size_t j = 0; j < gs.size(); ++j) {
      float s = a.scaling_mode == ScalingMode::kCurrent ? ScaleInvFromAmax(amax[j]) : 1.0f;
      scale.data[j] = s;
      for (int64_t r = row; r < row + gs[j]; ++r) {
        for (int64_t c = 0; c < k; ++c) data.data[r * k + c] = x.data[r * k + c] / s;
      }
      row += gs[j];
    }
    if (a.rowwise) out["data"] = data;
    if (a.colwise) out["colwise_data"] = data;
    out["scale_inv"] = scale;
    out["amax"] = HostTensor{{static_cast<int64_t>(gs.size())}, amax};
    return out;
  }
  const int64_t block = a.scaling_mode == ScalingMode::kMxfp8 ? 32 : 128;
  if (a.rowwise) {
    HostTensor scale = Zeros({m, k / block});
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t b = 0; b < k / block; ++b) {
        float am = 0.0f;
        for (int64_t c = b * block; c < (b + 1) * block; ++c) am = std::max(am, std::fabs(x.data[r * k + c]));
        float s = ScaleInvFromAmax(am);
        scale.data[r * (k / block) + b] = s;
        for (int64_t c = b * block; c < (b + 1) * block; ++c) data.data[r * k + c] = x.data[r * k + c] / s;
      }
    }
    out["data"] = data;
    out["scale_inv"] = scale;
  }
  if (a.colwise) {
    HostTensor cdata = Zeros(x.shape);
    // The shard's rows as one group; a partial last block, as the kernels do.
    const int64_t blocks = (m + block - 1) / block;
    HostTensor scale = Zeros({blocks, k});
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t end = std::min(m, (b + 1) * block);
      for (int64_t c = 0; c < k; ++c) {
        float am = 0.0f;
        for (int64_t r = b * block; r < end; ++r) am = std::max(am, std::fabs(x.data[r * k + c]));
        float s = ScaleInvFromAmax(am);
        scale.data[b * k + c] = s;
        for (int64_t r = b * block; r < end; ++r) cdata.data[r * k + c] = x.data[r * k + c] / s;
      }
    }
    out["colwise_data"] = cdata;
    out["colwise_scale_inv"] = scale;
  }
  return out;
}

int FlattenAxis(const PlanRequest& req, size_t rank) {
  int fa = req.attrs.flatten_axis;
  return fa < 0 ? fa + static_cast<int>(rank) : fa;
}

int64_t FlatRows(const std::vector<int64_t>& shape, int fa) {
  int64_t m = 1;
  for (int d = 0; d < fa; ++d) m *= shape[d];
  return m;
}

std::vector<int64_t> ToInts(const HostTensor& t) {
  std::vector<int64_t> v;
  for (float f : t.data) v.push_back(static_cast<int64_t>(f));
  return v;
}

const OperandRequest* FindOperand(const PlanRequest& req, const std::string& name) {
  for (const OperandRequest& op : req.operands) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

// Worker state: one buffer per tensor name.
using Buffers = std::map<std::string, HostTensor>;

absl::Status Apply(const Mesh& mesh, const Collective& c, std::vector<Buffers>* workers) {
  const int64_t n = NumWorkers(mesh);
  std::vector<std::vector<int64_t>> coords(n);
  for (int64_t r = 0; r < n; ++r) coords[r] = *RankToCoords(mesh, r);
  const int64_t p = AxesProduct(mesh, c.axes);
  std::vector<HostTensor> result(n);
  for (int64_t r = 0; r < n; ++r) {
    auto it = (*workers)[r].find(c.tensor);
    if (it == (*workers)[r].end()) {
      return absl::InternalError(absl::StrCat("collective on unknown tensor '", c.tensor, "'"));
    }
    const HostTensor& mine = it->second;
    if (c.dim >= static_cast<int>(mine.shape.size()) ||
        (c.dim < 0 && (c.kind != CollectiveKind::kAllReduceSum &&
                       c.kind != CollectiveKind::kAllReduceMax))) {
      return absl::InternalError(absl::StrCat("bad dim ", c.dim, " for ", c.tensor));
    }
    if (c.kind == CollectiveKind::kSlice) {
      if (mine.shape[c.dim] % p != 0) return absl::InternalError("slice not divisible");
      result[r] = Piece(mine, c.dim, BlockIndex(mesh, c.axes, coords[r]), p);
      continue;
    }
    // Peers: same coordinates except on c.axes, ordered first axis major.
    absl::StatusOr<std::vector<int64_t>> ranks = PeerRanks(mesh, c.axes, r);
    if (!ranks.ok()) return ranks.status();
    if (static_cast<int64_t>(ranks->size()) != p ||
        (*ranks)[BlockIndex(mesh, c.axes, coords[r])] != r) {
      return absl::InternalError("peer group inconsistent with BlockIndex");
    }
    std::vector<const HostTensor*> peers(p, nullptr);
    for (int64_t i = 0; i < p; ++i) {
      const HostTensor& t = (*workers)[(*ranks)[i]].at(c.tensor);
      if (t.shape != mine.shape) return absl::InternalError("peer shapes differ");
      peers[i] = &t;
    }
    if (c.kind == CollectiveKind::kAllGather) {
      result[r] = Concat(peers, c.dim);
      continue;
    }
    HostTensor acc = *peers[0];
    for (int64_t i = 1; i < p; ++i) {
      for (size_t e = 0; e < acc.data.size(); ++e) {
        acc.data[e] = c.kind == CollectiveKind::kAllReduceMax
                          ? std::max(acc.data[e], peers[i]->data[e])
                          : acc.data[e] + peers[i]->data[e];
      }
    }
    if (c.kind == CollectiveKind::kReduceScatter) {
      if (acc.shape[c.dim] % p != 0) return absl::InternalError("scatter not divisible");
      acc = Piece(acc, c.dim, BlockIndex(mesh, c.axes, coords[r]), p);
    }
    result[r] = std::move(acc);
  }
  for (int64_t r = 0; r < n; ++r) (*workers)[r][c.tensor] = std::move(result[r]);
  return absl::OkStatus();
}

// Bytes a worker sends for `c` on its current buffer (ring algorithms), to
// check the plan's cost model against the buffers actually moved.
int64_t SentBytes(const Mesh& mesh, const Collective& c, const HostTensor& t, int64_t esize) {
  const int64_t p = AxesProduct(mesh, c.axes);
  const int64_t b = Numel(t.shape) * esize;
  switch (c.kind) {
    case CollectiveKind::kAllGather: return (p - 1) * b;
    case CollectiveKind::kAllReduceSum:
    case CollectiveKind::kAllReduceMax: return 2 * (p - 1) * b / p;
    case CollectiveKind::kReduceScatter: return (p - 1) * b / p;
    case CollectiveKind::kSlice: return 0;
  }
  return -1;
}

int64_t TensorDTypeSize(const Plan& plan, const std::string& name) {
  for (const PlanOperand& op : plan.operands) {
    if (op.name == name) return DTypeSize(op.dtype);
  }
  for (const PlanOutput& o : plan.outputs) {
    if (o.name == name) return DTypeSize(o.dtype);
  }
  return 0;
}

absl::Status ApplyPhase(const Mesh& mesh, const Plan& plan, Phase phase,
                        std::vector<Buffers>* workers) {
  for (const Collective& c : plan.collectives) {
    if (c.phase != phase) continue;
    auto it = (*workers)[0].find(c.tensor);
    if (it != (*workers)[0].end()) {
      // Partial sums travel in FP32 until reduced (as the workers keep them).
      const int64_t esize = c.phase == Phase::kAfter && !plan.reduced_axes.empty()
                                ? DTypeSize(DType::kF32)
                                : TensorDTypeSize(plan, c.tensor);
      int64_t sent = SentBytes(mesh, c, it->second, esize);
      if (sent != c.bytes_per_worker) {
        return absl::InternalError(absl::StrCat(
            CollectiveKindName(c.kind), " on ", c.tensor, ": plan says ", c.bytes_per_worker,
            " bytes per worker, the buffers moved ", sent));
      }
    }
    absl::Status s = Apply(mesh, c, workers);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Row shard r's coordinates on the row axes (first axis major) and the
// index of its expert block.
int64_t ExpertIndexOfRowShard(const Mesh& mesh, const Axes& rows, int64_t r) {
  int64_t e = 0;
  for (size_t i = rows.size(); i-- > 0;) {
    int64_t size = AxisSize(mesh, rows[i]);
    if (!mesh.roles.ep.empty() && rows[i] == mesh.roles.ep) e = r % size;
    r /= size;
  }
  return e;
}

}  // namespace

std::string CompareTensors(const std::string& name, const HostTensor& got, const HostTensor& want) {
  if (got.shape != want.shape) {
    return absl::StrCat(name, ": shape [", absl::StrJoin(got.shape, "x"), "] vs [",
                        absl::StrJoin(want.shape, "x"), "]");
  }
  for (size_t i = 0; i < got.data.size(); ++i) {
    if (!(got.data[i] == want.data[i])) {
      return absl::StrCat(name, ": element ", i, " is ", got.data[i], ", expected ", want.data[i]);
    }
  }
  return "";
}

absl::StatusOr<TensorMap> SimulatePlan(const PlanRequest& req, const Plan& plan,
                                       const TensorMap& inputs) {
  const Mesh& mesh = plan.mesh;
  const int64_t n = NumWorkers(mesh);
  std::vector<Buffers> workers(n);
  // 1. Input shards.
  for (const PlanOperand& op : plan.operands) {
    auto it = inputs.find(op.name);
    if (it == inputs.end()) return absl::InvalidArgumentError(absl::StrCat("no input ", op.name));
    for (int64_t r = 0; r < n; ++r) {
      absl::StatusOr<std::vector<int64_t>> off =
          BlockOffsets(op.name, op.global_shape, op.input_spec, mesh, r);
      if (!off.ok()) return off.status();
      workers[r][op.name] = Extract(it->second, *off, op.input_local_shape);
    }
  }
  // 2. Input collectives; every operand must then be exactly its block
  // under the compute spec.
  absl::Status s = ApplyPhase(mesh, plan, Phase::kBefore, &workers);
  if (!s.ok()) return s;
  for (const PlanOperand& op : plan.operands) {
    for (int64_t r = 0; r < n; ++r) {
      absl::StatusOr<std::vector<int64_t>> off =
          BlockOffsets(op.name, op.global_shape, op.compute_spec, mesh, r);
      if (!off.ok()) return off.status();
      HostTensor want = Extract(inputs.at(op.name), *off, op.local_shape);
      std::string diff = CompareTensors(op.name, workers[r][op.name], want);
      if (!diff.empty()) {
        return absl::InternalError(absl::StrCat("rank ", r, " after input collectives: ", diff));
      }
    }
  }
  // 3. Local ops.
  for (int64_t r = 0; r < n; ++r) {
    const WorkerPlan& wp = plan.workers[r];
    Buffers& b = workers[r];
    std::vector<int64_t> gs = ToInts(b.at("group_sizes"));
    if (static_cast<int64_t>(gs.size()) != wp.local_group_count ||
        wp.group_sizes_end - wp.group_sizes_begin != wp.local_group_count) {
      return absl::InternalError(absl::StrCat("rank ", r, ": local group count mismatch"));
    }
    const std::vector<float>& gdata = inputs.at("group_sizes").data;
    for (int64_t j = 0; j < wp.local_group_count; ++j) {
      if (static_cast<int64_t>(gdata[wp.group_sizes_begin + j]) != gs[j]) {
        return absl::InternalError(absl::StrCat("rank ", r, ": group_sizes range mismatch"));
      }
    }
    if (req.op == OpKind::kGroupedGemmRaggedM) {
      const HostTensor& rhs = b.at("rhs");
      if (rhs.shape[0] != wp.local_group_count) {
        return absl::InternalError(absl::StrCat("rank ", r, ": rhs has ", rhs.shape[0],
                                                " local groups, plan says ", wp.local_group_count));
      }
      auto off = BlockOffsets("rhs", plan.operands[1].global_shape, plan.operands[1].compute_spec,
                              mesh, r);
      if ((*off)[0] != wp.first_group) {
        return absl::InternalError(absl::StrCat("rank ", r, ": first_group mismatch"));
      }
      auto bias = b.find("bias");
      HostTensor l = b.at("lhs"), w = rhs;
      auto ls = b.find("lhs_scale_inv"), rs = b.find("rhs_scale_inv");
      Dequant(req, gs, &l, &w, ls == b.end() ? nullptr : &ls->second,
              rs == b.end() ? nullptr : &rs->second);
      b["out"] = GemmRaggedM(l, w, req.attrs.rhs_transposed, gs, 0,
                             bias == b.end() ? nullptr : &bias->second, wp.apply_bias);
    } else if (req.op == OpKind::kGroupedGemmRaggedK) {
      HostTensor l = b.at("lhs"), w = b.at("rhs");
      auto ls = b.find("lhs_scale_inv"), rs = b.find("rhs_scale_inv");
      Dequant(req, gs, &l, &w, ls == b.end() ? nullptr : &ls->second,
              rs == b.end() ? nullptr : &rs->second);
      b["out"] = GemmRaggedK(l, w, gs);
    } else {
      const HostTensor& x = b.at("x");
      int64_t m = FlatRows(x.shape, FlattenAxis(req, x.shape.size()));
      b["amax"] = HostTensor{{static_cast<int64_t>(gs.size())}, GroupAmax(x, m, gs)};
    }
  }
  if (req.op == OpKind::kGroupedQuantize) {
    s = ApplyPhase(mesh, plan, Phase::kWithin, &workers);
    if (!s.ok()) return s;
    for (int64_t r = 0; r < n; ++r) {
      Buffers& b = workers[r];
      const HostTensor& x = b.at("x");
      int64_t m = FlatRows(x.shape, FlattenAxis(req, x.shape.size()));
      TensorMap outs = QuantizeCast(req, x, m, ToInts(b.at("group_sizes")), b.at("amax").data);
      b.erase("amax");
      for (auto& kv : outs) b[kv.first] = std::move(kv.second);
    }
  }
  // Local-op outputs must have the plan's local-op shapes.
  for (const PlanOutput& o : plan.outputs) {
    for (int64_t r = 0; r < n; ++r) {
      auto it = workers[r].find(o.name);
      if (it == workers[r].end()) {
        return absl::InternalError(absl::StrCat("output ", o.name, " not produced"));
      }
      if (it->second.shape != o.local_op_shape) {
        return absl::InternalError(absl::StrCat("rank ", r, ": ", o.name, " local shape [",
                                                absl::StrJoin(it->second.shape, "x"),
                                                "] vs plan [", absl::StrJoin(o.local_op_shape, "x"),
                                                "]"));
      }
    }
  }
  // 4. Output collectives, then assembly.
  s = ApplyPhase(mesh, plan, Phase::kAfter, &workers);
  if (!s.ok()) return s;
  TensorMap result;
  for (const PlanOutput& o : plan.outputs) {
    HostTensor global = Zeros(o.global_shape);
    std::vector<char> written(global.data.size(), 0);
    for (int64_t r = 0; r < n; ++r) {
      const HostTensor& local = workers[r].at(o.name);
      if (local.shape != o.local_shape) {
        return absl::InternalError(absl::StrCat("rank ", r, ": final ", o.name, " shape [",
                                                absl::StrJoin(local.shape, "x"), "] vs plan [",
                                                absl::StrJoin(o.local_shape, "x"), "]"));
      }
      absl::StatusOr<std::vector<int64_t>> off =
          BlockOffsets(o.name, o.global_shape, o.spec, mesh, r);
      if (!off.ok()) return off.status();
      if (!Insert(&global, &written, local, *off)) {
        return absl::InternalError(absl::StrCat("rank ", r, ": replicas of ", o.name,
                                                " disagree under spec ",
                                                FormatPartitionSpec(o.spec)));
      }
    }
    if (std::find(written.begin(), written.end(), 0) != written.end()) {
      return absl::InternalError(absl::StrCat(o.name, ": not every element written"));
    }
    result[o.name] = std::move(global);
  }
  return result;
}

absl::StatusOr<TensorMap> ReferenceOutputs(const PlanRequest& req, const TensorMap& inputs) {
  const Mesh& mesh = req.mesh;
  const std::string rows_name = req.op == OpKind::kGroupedQuantize ? "x" : "lhs";
  const OperandRequest* rows_op = FindOperand(req, rows_name);
  if (rows_op == nullptr) return absl::InvalidArgumentError("no rows operand");
  const Axes rows = rows_op->spec.dims.empty() ? Axes{} : rows_op->spec.dims[0];
  const int64_t R = AxesProduct(mesh, rows);
  const bool ep_rows = !mesh.roles.ep.empty() &&
                       std::find(rows.begin(), rows.end(), mesh.roles.ep) != rows.end();
  const HostTensor& x = inputs.at(rows_name);
  const std::vector<int64_t> gs_all = ToInts(inputs.at("group_sizes"));
  const int64_t gl = static_cast<int64_t>(gs_all.size()) / R;
  const int64_t ml = x.shape[0] / R;
  auto row_block = [&](const HostTensor& t, int64_t r) {
    std::vector<int64_t> off(t.shape.size(), 0), shape = t.shape;
    off[0] = r * ml;
    shape[0] = ml;
    return Extract(t, off, shape);
  };
  auto local_gs = [&](int64_t r) {
    return std::vector<int64_t>(gs_all.begin() + r * gl, gs_all.begin() + (r + 1) * gl);
  };
  TensorMap out;
  auto ls_it = inputs.find("lhs_scale_inv"), rs_it = inputs.find("rhs_scale_inv");
  const bool scaled = ls_it != inputs.end() && rs_it != inputs.end();
  // Row shard r's scales for its rows: block scales are cut like the rows,
  // per-group scales like group_sizes.
  auto row_scales = [&](const HostTensor& s, int64_t r) {
    if (BlockScaled(req)) {
      std::vector<int64_t> off(s.shape.size(), 0), shape = s.shape;
      shape[0] /= R;
      off[0] = r * shape[0];
      return Extract(s, off, shape);
    }
    return HostTensor{{gl}, std::vector<float>(s.data.begin() + r * gl, s.data.begin() + (r + 1) * gl)};
  };
  if (req.op == OpKind::kGroupedGemmRaggedM) {
    HostTensor rhs = inputs.at("rhs");
    if (scaled) {
      rhs = BlockScaled(req) ? DequantBlocks(rhs, rs_it->second) : DequantExperts(rhs, rs_it->second);
    }
    auto bias = inputs.find("bias");
    const int64_t n = req.attrs.rhs_transposed ? rhs.shape[1] : rhs.shape[2];
    HostTensor o = Zeros({x.shape[0], n});
    std::vector<char> written(o.data.size(), 0);
    for (int64_t r = 0; r < R; ++r) {
      int64_t g0 = ep_rows ? ExpertIndexOfRowShard(mesh, rows, r) * gl : 0;
      HostTensor l = row_block(x, r);
      if (scaled) {
        HostTensor s = row_scales(ls_it->second, r);
        l = BlockScaled(req) ? DequantBlocks(l, s) : DequantRows(l, s, local_gs(r));
      }
      HostTensor part = GemmRaggedM(l, rhs, req.attrs.rhs_transposed, local_gs(r), g0,
                                    bias == inputs.end() ? nullptr : &bias->second, true);
      Insert(&o, &written, part, {r * ml, 0});
    }
    out["out"] = std::move(o);
  } else if (req.op == OpKind::kGroupedGemmRaggedK) {
    const HostTensor& rhs = inputs.at("rhs");
    const int64_t e = ep_rows ? AxisSize(mesh, mesh.roles.ep) : 1;
    HostTensor o = Zeros({gl * e, x.shape[1], rhs.shape[1]});
    for (int64_t r = 0; r < R; ++r) {
      int64_t g0 = ep_rows ? ExpertIndexOfRowShard(mesh, rows, r) * gl : 0;
      HostTensor l = row_block(x, r), w = row_block(rhs, r);
      if (scaled) {
        HostTensor ls = row_scales(ls_it->second, r), rs = row_scales(rs_it->second, r);
        Dequant(req, local_gs(r), &l, &w, &ls, &rs);
      }
      HostTensor part = GemmRaggedK(l, w, local_gs(r));
      for (size_t i = 0; i < part.data.size(); ++i) o.data[g0 * part.shape[1] * part.shape[2] + i] += part.data[i];
    }
    out["out"] = std::move(o);
  } else {
    const int fa = FlattenAxis(req, x.shape.size());
    const int64_t m = FlatRows(x.shape, fa) / R;
    std::vector<std::vector<float>> amax(R);
    for (int64_t r = 0; r < R; ++r) amax[r] = GroupAmax(row_block(x, r), m, local_gs(r));
    if (req.attrs.shared_scales) {
      // One amax per expert: the max over the row shards holding that expert.
      std::vector<std::vector<float>> shared = amax;
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t q = 0; q < R; ++q) {
          bool same_experts = !ep_rows || ExpertIndexOfRowShard(mesh, rows, r) ==
                                              ExpertIndexOfRowShard(mesh, rows, q);
          if (!same_experts) continue;
          for (int64_t j = 0; j < gl; ++j) shared[r][j] = std::max(shared[r][j], amax[q][j]);
        }
      }
      amax = shared;
    }
    std::map<std::string, std::vector<char>> written;
    for (int64_t r = 0; r < R; ++r) {
      TensorMap part = QuantizeCast(req, row_block(x, r), m, local_gs(r), amax[r]);
      for (auto& kv : part) {
        HostTensor& g = out[kv.first];
        if (g.shape.empty()) {
          g = kv.second;
          g.shape[0] *= R;
          g.data.assign(Numel(g.shape), 0.0f);
          written[kv.first].assign(g.data.size(), 0);
        }
        std::vector<int64_t> off(g.shape.size(), 0);
        off[0] = r * kv.second.shape[0];
        Insert(&g, &written[kv.first], kv.second, off);
      }
    }
  }
  return out;
}

}  // namespace planner
}  // namespace shardgemm
