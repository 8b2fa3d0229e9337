// Property test: for thousands of random meshes, specs and shapes, the plan
// executed by the simulator equals the per-shard reference, bit for bit.
// Data are small integers so every FP32 sum is exact in any order, which
// makes partial-sum plans bit-identical to the reference too.
#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/simulator.h"

namespace shardgemm {
namespace planner {
namespace {

using Axes = std::vector<std::string>;

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  template <typename T>
  void Shuffle(std::vector<T>* v) { std::shuffle(v->begin(), v->end(), rng_); }

 private:
  std::mt19937_64 rng_;
};

Mesh RandomMesh(Gen& g) {
  std::vector<std::string> pool = {"dp", "fsdp", "ep", "tp", "data", "expert", "x"};
  g.Shuffle(&pool);
  const int n = static_cast<int>(g.Int(1, 4));
  std::vector<std::string> items;
  int64_t product = 1;
  for (int i = 0; i < n; ++i) {
    int64_t max = std::min<int64_t>(4, 8 / product);
    int64_t size = g.Int(1, max);
    product *= size;
    items.push_back(absl::StrCat(pool[i], "=", size));
  }
  // Sometimes bind roles to freely named axes.
  std::vector<std::string> roles;
  for (int i = 0; i < n; ++i) {
    if (pool[i] == "data" && g.Coin(0.7)) roles.push_back("dp=data");
    if (pool[i] == "expert" && g.Coin(0.7)) roles.push_back("ep=expert");
    if (pool[i] == "x" && g.Coin(0.5)) roles.push_back("fsdp=x");
  }
  absl::StatusOr<Mesh> mesh = ParseMesh(absl::StrJoin(items, ","), absl::StrJoin(roles, ","));
  if (!mesh.ok()) {  // e.g. fsdp=x while an axis is also called fsdp: drop roles
    mesh = ParseMesh(absl::StrJoin(items, ","), "");
  }
  return *mesh;
}

bool IsDataAxis(const Mesh& m, const std::string& a) {
  Role r = RoleOf(m, a);
  return r == Role::kDp || r == Role::kFsdp || r == Role::kEp;
}

// Picks 0-2 axes from `free` (removing them); `only_data` limits to dp/fsdp/ep.
Axes PickAxes(Gen& g, const Mesh& m, Axes* free, bool only_data = false, double p_none = 0.4) {
  Axes out;
  if (g.Coin(p_none)) return out;
  int want = static_cast<int>(g.Int(1, 2));
  Axes candidates;
  for (const std::string& a : *free) {
    if (!only_data || IsDataAxis(m, a)) candidates.push_back(a);
  }
  g.Shuffle(&candidates);
  for (int i = 0; i < want && i < static_cast<int>(candidates.size()); ++i) {
    out.push_back(candidates[i]);
    free->erase(std::find(free->begin(), free->end(), candidates[i]));
  }
  return out;
}

Axes AllAxes(const Mesh& m) {
  Axes a;
  for (const MeshAxis& x : m.axes) a.push_back(x.name);
  return a;
}

PartitionSpec RandomSpec(Gen& g, const Mesh& m, size_t rank, double p_none = 0.4) {
  Axes free = AllAxes(m);
  PartitionSpec s;
  for (size_t d = 0; d < rank; ++d) s.dims.push_back(PickAxes(g, m, &free, false, p_none));
  // Sometimes give the spec shorter (padded with None) when trailing dims are None.
  while (!s.dims.empty() && s.dims.back().empty() && g.Coin()) s.dims.pop_back();
  return s;
}

HostTensor RandomTensor(Gen& g, std::vector<int64_t> shape, int64_t lo = -2, int64_t hi = 2) {
  HostTensor t;
  t.shape = shape;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.data.resize(n);
  for (float& v : t.data) v = static_cast<float>(g.Int(lo, hi));
  return t;
}

// Powers of two: every product with the small-integer data stays exact.
HostTensor RandomScales(Gen& g, std::vector<int64_t> shape) {
  HostTensor t = RandomTensor(g, shape, 0, 2);
  for (float& v : t.data) v = v == 0 ? 0.5f : v == 1 ? 1.0f : 2.0f;
  return t;
}

// Group sizes for R row shards of `rows` rows each with `gl` groups: uneven,
// some empty, some padding at the end of a shard.
HostTensor RandomGroupSizes(Gen& g, int64_t shards, int64_t gl, int64_t rows) {
  HostTensor t;
  t.shape = {shards * gl};
  for (int64_t r = 0; r < shards; ++r) {
    int64_t left = g.Coin(0.6) ? rows : g.Int(0, rows);
    for (int64_t j = 0; j < gl; ++j) {
      int64_t v = (j + 1 == gl) ? (g.Coin(0.7) ? left : g.Int(0, left))
                                : (g.Coin(0.25) ? 0 : g.Int(0, left));
      t.data.push_back(static_cast<float>(v));
      left -= v;
    }
  }
  return t;
}

struct Case {
  PlanRequest req;
  TensorMap inputs;
};

void AddOperand(Case* c, const std::string& name, DType dtype, const PartitionSpec& spec,
                HostTensor t) {
  c->req.operands.push_back({name, t.shape, dtype, spec});
  c->inputs[name] = std::move(t);
}

Case RandomCase(Gen& g) {
  Case c;
  PlanRequest& req = c.req;
  req.mesh = RandomMesh(g);
  const Mesh& m = req.mesh;
  const int64_t W = NumWorkers(m);
  req.compat = g.Coin() ? CompatMode::kTe : CompatMode::kDefault;
  const bool te = req.compat == CompatMode::kTe;
  int op = static_cast<int>(g.Int(0, 2));
  req.op = op == 0 ? OpKind::kGroupedGemmRaggedM
                   : op == 1 ? OpKind::kGroupedGemmRaggedK : OpKind::kGroupedQuantize;
  Axes free = AllAxes(m);
  Axes rows = PickAxes(g, m, &free, /*only_data=*/te, 0.25);
  const int64_t R = AxesProduct(m, rows);
  const bool ep_rows = !m.roles.ep.empty() && std::find(rows.begin(), rows.end(), m.roles.ep) != rows.end();
  const int64_t E = ep_rows ? AxisSize(m, m.roles.ep) : 1;
  if (req.op == OpKind::kGroupedQuantize) {
    OpAttrs& a = req.attrs;
    int sm = static_cast<int>(g.Int(0, 9));
    a.scaling_mode = sm < 4 ? ScalingMode::kCurrent : sm < 7 ? ScalingMode::kDelayed
                   : sm < 9 ? ScalingMode::kMxfp8 : ScalingMode::kBlock;
    const bool block = a.scaling_mode == ScalingMode::kMxfp8 || a.scaling_mode == ScalingMode::kBlock;
    const int64_t bs = a.scaling_mode == ScalingMode::kMxfp8 ? 32 : 128;
    a.rowwise = g.Coin(0.8);
    a.colwise = !a.rowwise || g.Coin(0.4);
    a.shared_scales = !block && g.Coin(0.5);
    a.out_dtype = g.Coin() ? DType::kF8E4M3 : DType::kF8E5M2;
    std::vector<int64_t> shape;
    PartitionSpec spec;
    const int64_t M = block ? W * bs : W * g.Int(1, 3);
    if (!block && g.Coin(0.4)) {
      shape = {M, 2, W * g.Int(1, 2)};
      const int fas[] = {1, 2, -1, -2};
      a.flatten_axis = fas[g.Int(0, 3)];
    } else {
      shape = {M, block ? bs : W * g.Int(1, 2)};
      a.flatten_axis = g.Coin() ? 1 : -1;
    }
    spec.dims.push_back(rows);
    for (size_t d = 1; d < shape.size(); ++d) {
      int fa = a.flatten_axis < 0 ? a.flatten_axis + static_cast<int>(shape.size()) : a.flatten_axis;
      bool row_dim = static_cast<int>(d) < fa;
      spec.dims.push_back(row_dim || block || shape[d] % W != 0 ? Axes{} : PickAxes(g, m, &free));
    }
    const int64_t gl = g.Int(1, 3);
    const int fa_norm = a.flatten_axis < 0 ? a.flatten_axis + static_cast<int>(shape.size())
                                           : a.flatten_axis;
    int64_t flat_rows = M / R * (shape.size() == 3 && fa_norm == 2 ? 2 : 1);
    AddOperand(&c, "x", g.Coin() ? DType::kBF16 : DType::kF32, spec,
               RandomTensor(g, shape, -9, 9));
    AddOperand(&c, "group_sizes", DType::kI32, PartitionSpec{{rows}},
               RandomGroupSizes(g, R, gl, flat_rows));
    if (g.Coin(0.2)) {
      PartitionSpec out = RandomSpec(g, m, shape.size());
      for (size_t d = 0; d < out.dims.size(); ++d) {
        if (shape[d] % W != 0) out.dims[d].clear();
      }
      req.out_spec = out;
    }
    (void)E;
    return c;
  }
  // FP8 inputs with scale_inv operands: tensor scaling (per group / per
  // expert) or block scales (MXFP8 32, block 128 with 128x128 weights).
  const bool fp8 = g.Coin(0.25);
  ScalingMode mode = static_cast<ScalingMode>(g.Int(0, 3));
  if (mode == ScalingMode::kBlock && W > 2) mode = ScalingMode::kMxfp8;
  const bool blocks = fp8 && (mode == ScalingMode::kMxfp8 || mode == ScalingMode::kBlock);
  const int64_t b = mode == ScalingMode::kMxfp8 ? 32 : 128;
  req.attrs.scaling_mode = mode;
  const DType dt = fp8 ? (g.Coin() ? DType::kF8E4M3 : DType::kF8E5M2) : DType::kBF16;
  const DType dt2 = dt == DType::kF8E5M2 ? DType::kF8E4M3 : dt;
  const DType sdt = mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
  const bool ragged_m = req.op == OpKind::kGroupedGemmRaggedM;
  const int64_t M = (blocks && !ragged_m) ? W * b : W * g.Int(1, 2);
  const int64_t K = (blocks && ragged_m) ? W * b : W * g.Int(1, 2);
  const int64_t N = (blocks && ragged_m && mode == ScalingMode::kBlock) ? W * 128 : W * g.Int(1, 2);
  const int64_t G = W * g.Int(1, 2);  // divisible by every axis subset
  const int64_t gl = G / E;
  Axes lk = PickAxes(g, m, &free);
  if (ragged_m) {
    req.attrs.rhs_transposed = g.Coin();
    req.attrs.has_bias = g.Coin(0.3);
    AddOperand(&c, "lhs", dt, PartitionSpec{{rows, lk}}, RandomTensor(g, {M, K}));
    std::vector<int64_t> rshape = req.attrs.rhs_transposed ? std::vector<int64_t>{G, N, K}
                                                           : std::vector<int64_t>{G, K, N};
    AddOperand(&c, "rhs", dt2, RandomSpec(g, m, 3), RandomTensor(g, rshape));
    AddOperand(&c, "group_sizes", DType::kI32, PartitionSpec{{rows}},
               RandomGroupSizes(g, R, gl, M / R));
    if (req.attrs.has_bias) {
      AddOperand(&c, "bias", DType::kF32, RandomSpec(g, m, 2), RandomTensor(g, {G, N}));
    }
    if (fp8 && !blocks) {
      AddOperand(&c, "lhs_scale_inv", DType::kF32, PartitionSpec{{rows}},
                 RandomScales(g, {R * gl}));
      AddOperand(&c, "rhs_scale_inv", DType::kF32, RandomSpec(g, m, 1), RandomScales(g, {G}));
    } else if (fp8) {
      const int64_t bn = mode == ScalingMode::kBlock ? 128 : 1;
      Axes lfree = AllAxes(m);
      lfree.erase(std::remove_if(lfree.begin(), lfree.end(), [&](const std::string& a) {
                    return std::find(rows.begin(), rows.end(), a) != rows.end();
                  }), lfree.end());
      AddOperand(&c, "lhs_scale_inv", sdt, PartitionSpec{{rows, PickAxes(g, m, &lfree)}},
                 RandomScales(g, {M, K / b}));
      std::vector<int64_t> sshape = req.attrs.rhs_transposed
                                        ? std::vector<int64_t>{G, N / bn, K / b}
                                        : std::vector<int64_t>{G, K / b, N / bn};
      AddOperand(&c, "rhs_scale_inv", sdt, RandomSpec(g, m, 3), RandomScales(g, sshape));
    }
    if (g.Coin(0.35)) req.out_spec = RandomSpec(g, m, 2, 0.3);
  } else {
    Axes rn = PickAxes(g, m, &free);
    AddOperand(&c, "lhs", dt, PartitionSpec{{rows, lk}}, RandomTensor(g, {M, K}));
    AddOperand(&c, "rhs", dt2, PartitionSpec{{rows, rn}}, RandomTensor(g, {M, N}));
    AddOperand(&c, "group_sizes", DType::kI64, PartitionSpec{{rows}},
               RandomGroupSizes(g, R, gl, M / R));
    if (fp8 && !blocks) {
      AddOperand(&c, "lhs_scale_inv", DType::kF32, PartitionSpec{{rows}}, RandomScales(g, {R * gl}));
      AddOperand(&c, "rhs_scale_inv", DType::kF32, PartitionSpec{{rows}}, RandomScales(g, {R * gl}));
    } else if (fp8) {
      Axes f1 = free, f2 = free;
      AddOperand(&c, "lhs_scale_inv", sdt, PartitionSpec{{rows, PickAxes(g, m, &f1)}},
                 RandomScales(g, {M / b, K}));
      AddOperand(&c, "rhs_scale_inv", sdt, PartitionSpec{{rows, PickAxes(g, m, &f2)}},
                 RandomScales(g, {M / b, N}));
    }
    if (g.Coin(0.4)) req.out_spec = RandomSpec(g, m, 3, 0.3);
  }
  if (g.Coin(0.3)) req.attrs.out_dtype = DType::kF32;
  return c;
}

std::string Describe(const PlanRequest& req) {
  std::string s = absl::StrCat("mesh ", FormatMesh(req.mesh), " roles ", FormatRoles(req.mesh.roles),
                               " op ", OpKindName(req.op), " compat ", CompatModeName(req.compat));
  for (const OperandRequest& op : req.operands) {
    absl::StrAppend(&s, "\n  ", op.name, " [", absl::StrJoin(op.shape, "x"), "] @ ",
                    FormatPartitionSpec(op.spec));
  }
  if (req.out_spec) absl::StrAppend(&s, "\n  out @ ", FormatPartitionSpec(*req.out_spec));
  absl::StrAppend(&s, "\n  attrs: transposed=", req.attrs.rhs_transposed, " bias=", req.attrs.has_bias,
                  " flatten_axis=", req.attrs.flatten_axis, " scaling=",
                  ScalingModeName(req.attrs.scaling_mode), " shared=", req.attrs.shared_scales,
                  " rowwise=", req.attrs.rowwise, " colwise=", req.attrs.colwise);
  return s;
}

TEST(PlanPropertyTest, SimulatedPlanEqualsPerShardReference) {
  int iterations = 6000;
  if (const char* env = std::getenv("PLAN_PROPERTY_ITERATIONS")) iterations = std::atoi(env);
  uint64_t base = 20260101;
  if (const char* env = std::getenv("PLAN_PROPERTY_SEED")) base = std::strtoull(env, nullptr, 10);
  int by_op[3] = {0, 0, 0}, with_reduce = 0, with_scatter = 0, fp8 = 0;
  for (int i = 0; i < iterations; ++i) {
    const uint64_t seed = base + i;
    Gen g(seed);
    Case c = RandomCase(g);
    absl::StatusOr<Plan> plan = MakePlan(c.req);
    ASSERT_TRUE(plan.ok()) << "seed " << seed << " (PLAN_PROPERTY_SEED=" << seed
                           << " PLAN_PROPERTY_ITERATIONS=1): " << plan.status() << "\n"
                           << Describe(c.req);
    absl::StatusOr<TensorMap> got = SimulatePlan(c.req, *plan, c.inputs);
    ASSERT_TRUE(got.ok()) << "seed " << seed << ": " << got.status() << "\n"
                          << Describe(c.req) << "\n" << FormatPlanText(*plan);
    absl::StatusOr<TensorMap> want = ReferenceOutputs(c.req, c.inputs);
    ASSERT_TRUE(want.ok()) << "seed " << seed << ": " << want.status();
    ASSERT_EQ(got->size(), want->size()) << "seed " << seed;
    for (const auto& kv : *want) {
      auto it = got->find(kv.first);
      ASSERT_NE(it, got->end()) << "seed " << seed << ": missing output " << kv.first;
      std::string diff = CompareTensors(kv.first, it->second, kv.second);
      ASSERT_TRUE(diff.empty()) << "seed " << seed << " (PLAN_PROPERTY_SEED=" << seed
                                << " PLAN_PROPERTY_ITERATIONS=1): " << diff << "\n"
                                << Describe(c.req) << "\n" << FormatPlanText(*plan);
    }
    by_op[static_cast<int>(c.req.op)]++;
    fp8 += c.inputs.count("lhs_scale_inv") > 0;
    for (const Collective& col : plan->collectives) {
      with_reduce += col.kind == CollectiveKind::kAllReduceSum;
      with_scatter += col.kind == CollectiveKind::kReduceScatter;
    }
  }
  std::printf("cases: ragged_m %d, ragged_k %d, quantize %d (fp8 gemm %d); all_reduce_sum %d, "
              "reduce_scatter %d\n",
              by_op[0], by_op[1], by_op[2], fp8, with_reduce, with_scatter);
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm
