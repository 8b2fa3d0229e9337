// Drives the fuzzing entry point with a bounded number of random inputs so
// it runs in CI with g++ (the libFuzzer build is in docs/sharding.md), and
// feeds MakePlan random garbage requests built as structs.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "planner/plan_fuzz_entry.h"
#include "planner/planner.h"

namespace shardgemm {
namespace planner {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g_); }
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(g_); }
  template <typename T>
  const T& Pick(const std::vector<T>& v) { return v[Int(0, static_cast<int64_t>(v.size()) - 1)]; }

 private:
  std::mt19937_64 g_;
};

const std::vector<std::string> kAxes = {"dp", "fsdp", "ep", "tp", "data", "x", "zz"};

std::string RandomSpecText(Rng& r) {
  static const std::vector<std::string> tokens = {
      "(", ")", ",", "None", "'dp'", "fsdp", "\"ep\"", " ", "((", "))", "tp", "x", "1", "'", "data",
      ",)", "(None,", "()"};
  if (r.Coin(0.6)) {  // mostly well-formed
    std::vector<std::string> dims;
    int n = static_cast<int>(r.Int(0, 3));
    for (int i = 0; i < n; ++i) {
      int k = static_cast<int>(r.Int(0, 2));
      if (k == 0) {
        dims.push_back("None");
      } else if (k == 1) {
        dims.push_back(r.Pick(kAxes));
      } else {
        dims.push_back(absl::StrCat("(", r.Pick(kAxes), ",", r.Pick(kAxes), ")"));
      }
    }
    return absl::StrCat("(", absl::StrJoin(dims, ","), n == 1 ? ",)" : ")");
  }
  std::string s;
  int n = static_cast<int>(r.Int(0, 8));
  for (int i = 0; i < n; ++i) s += r.Pick(tokens);
  return s;
}

std::string RandomShapeText(Rng& r, int rank) {
  std::vector<std::string> dims;
  for (int i = 0; i < rank; ++i) {
    int k = static_cast<int>(r.Int(0, 9));
    dims.push_back(k == 0 ? "0" : k == 1 ? "-4" : k == 2 ? "1099511627776" : k == 3 ? "7"
                                                                                  : absl::StrCat(8 * r.Int(1, 4)));
  }
  return absl::StrJoin(dims, "x");
}

std::string Mutate(Rng& r, std::string s) {
  int n = static_cast<int>(r.Int(0, 3));
  for (int i = 0; i < n && !s.empty(); ++i) {
    size_t pos = r.Int(0, static_cast<int64_t>(s.size()) - 1);
    switch (r.Int(0, 2)) {
      case 0: s.erase(pos, 1); break;
      case 1: s.insert(pos, 1, static_cast<char>(r.Int(0, 255))); break;
      default: s[pos] = static_cast<char>(r.Int(32, 126));
    }
  }
  return s;
}

// A coherent request (mostly plannable) in FuzzPlanOnce's format.
std::string CoherentRequestText(Rng& r) {
  const int64_t dp = r.Int(1, 2), ep = r.Int(1, 2), tp = r.Int(1, 2);
  const char op = "mkq"[r.Int(0, 2)];
  std::vector<std::string> rows_axes;
  if (r.Coin()) rows_axes.push_back("dp");
  if (r.Coin()) rows_axes.push_back("ep");
  if (rows_axes.size() == 2 && r.Coin(0.3)) std::swap(rows_axes[0], rows_axes[1]);
  const int64_t R = (rows_axes.size() > 0 ? (rows_axes[0] == "dp" ? dp : ep) : 1) *
                    (rows_axes.size() > 1 ? (rows_axes[1] == "dp" ? dp : ep) : 1);
  const bool ep_rows = std::find(rows_axes.begin(), rows_axes.end(), "ep") != rows_axes.end();
  const std::string rows = rows_axes.empty() ? "None" : absl::StrCat("(", absl::StrJoin(rows_axes, ","), ",)");
  const std::string k_spec = r.Pick(std::vector<std::string>{"None", "tp", "None"});
  std::vector<std::string> lines = {absl::StrCat("dp=", dp, ",ep=", ep, ",tp=", tp), "",
                                    std::string(1, op), r.Coin() ? "te" : "default",
                                    r.Coin(0.2) ? "T" : ""};
  const int64_t G = 8, gl = ep_rows ? G / ep : G;
  if (op == 'q') {
    lines.push_back(absl::StrCat("x=48x16@(", rows, ",", k_spec, ")"));
    lines.push_back(absl::StrCat("group_sizes=", R * 4, "@(", rows, ",)"));
  } else if (op == 'm' && r.Coin(0.2)) {
    lines[4] = "Fc";
    lines.push_back(absl::StrCat("lhs=48x16@(", rows, ",", k_spec, ")"));
    lines.push_back(absl::StrCat("rhs=8x16x24@(", r.Pick(std::vector<std::string>{"None", "ep"}), ",None,None)"));
    lines.push_back(absl::StrCat("group_sizes=", R * gl, "@(", rows, ",)"));
    lines.push_back(absl::StrCat("lhs_scale_inv=", R * gl, "@(", rows, ",)"));
    lines.push_back("rhs_scale_inv=8@(" + r.Pick(std::vector<std::string>{"None", "ep", "dp"}) + ",)");
  } else if (op == 'm') {
    bool tr = lines[4] == "T";
    lines.push_back(absl::StrCat("lhs=48x16@(", rows, ",", k_spec, ")"));
    lines.push_back(absl::StrCat("rhs=8x", tr ? "24x16" : "16x24", "@(",
                                 r.Pick(std::vector<std::string>{"None", "ep", "dp"}), ",",
                                 r.Pick(std::vector<std::string>{"None", "tp"}), ",None)"));
    lines.push_back(absl::StrCat("group_sizes=", R * gl, "@(", rows, ",)"));
  } else {
    lines.push_back(absl::StrCat("lhs=48x16@(", rows, ",", k_spec, ")"));
    lines.push_back(absl::StrCat("rhs=48x24@(", rows, ",", r.Pick(std::vector<std::string>{"None", "tp"}), ")"));
    lines.push_back(absl::StrCat("group_sizes=", R * gl, "@(", rows, ",)"));
  }
  if (r.Coin(0.3)) lines.push_back("out=" + r.Pick(std::vector<std::string>{"(dp,tp)", "((dp,ep),)", "(None,None,tp)", "(ep,)"}));
  std::string text = absl::StrJoin(lines, "\n");
  return r.Coin(0.2) ? Mutate(r, text) : text;
}

// A structured request text in FuzzPlanOnce's format.
std::string RandomRequestText(Rng& r) {
  if (r.Coin()) return CoherentRequestText(r);
  std::vector<std::string> mesh;
  int axes = static_cast<int>(r.Int(1, 3));
  std::vector<std::string> names = {"dp", "fsdp", "ep", "tp", "data", "x"};
  for (int i = 0; i < axes; ++i) mesh.push_back(absl::StrCat(names[(i * 2 + r.Int(0, 1)) % 6], "=", r.Int(1, 3)));
  std::string roles = r.Coin(0.2) ? "dp=data" : "";
  const char op = "mkq"[r.Int(0, 2)];
  std::string attrs;
  for (char c : std::string("TBSCRcdxbf8F")) {
    if (r.Coin(0.15)) attrs += c;
  }
  if (r.Coin(0.3)) attrs += absl::StrCat(r.Int(-3, 3));
  std::vector<std::string> lines = {absl::StrJoin(mesh, ","), roles, std::string(1, op),
                                    r.Coin() ? "te" : "default", attrs};
  auto operand = [&](const std::string& name, int rank) {
    lines.push_back(absl::StrCat(name, "=", RandomShapeText(r, rank), r.Coin(0.8) ? "@" : "",
                                 RandomSpecText(r)));
  };
  if (op == 'q') {
    operand("x", static_cast<int>(r.Int(1, 3)));
  } else {
    operand("lhs", 2);
    operand("rhs", op == 'k' ? 2 : 3);
  }
  operand("group_sizes", 1);
  if (r.Coin(0.2)) operand("bias", 2);
  if (r.Coin(0.15)) {
    lines[4] += "F";
    operand("lhs_scale_inv", static_cast<int>(r.Int(1, 2)));
    operand("rhs_scale_inv", static_cast<int>(r.Int(1, 3)));
  }
  if (r.Coin(0.1)) operand("extra", 2);
  if (r.Coin(0.3)) lines.push_back("out=" + RandomSpecText(r));
  std::string text = absl::StrJoin(lines, "\n");
  return r.Coin(0.3) ? Mutate(r, text) : text;
}

int Iterations(int fallback) {
  if (const char* env = std::getenv("PLAN_FUZZ_ITERATIONS")) return std::atoi(env);
  return fallback;
}

// The libFuzzer seed corpus (testdata/plan_fuzz_seeds) must plan.
TEST(PlanFuzzTest, SeedsPlan) {
  for (const char* name : {"seed1", "seed2", "seed3", "seed4"}) {
    std::ifstream in(std::string("planner/testdata/plan_fuzz_seeds/") + name,
                     std::ios::binary);
    ASSERT_TRUE(in.good()) << name;
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(FuzzPlanOnce(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 1)
        << name;
  }
}

TEST(PlanFuzzTest, RandomBytes) {
  Rng r(1);
  for (int i = 0; i < Iterations(20000); ++i) {
    std::string bytes(r.Int(0, 200), '\0');
    for (char& c : bytes) c = static_cast<char>(r.Int(0, 255));
    FuzzPlanOnce(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

TEST(PlanFuzzTest, StructuredRequests) {
  Rng r(2);
  int planned = 0, total = Iterations(20000);
  for (int i = 0; i < total; ++i) {
    std::string text = RandomRequestText(r);
    planned += FuzzPlanOnce(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }
  // The generator must reach the planner's success paths, not only errors.
  EXPECT_GT(planned, total / 10) << planned << " of " << total;
  std::printf("structured: %d of %d planned\n", planned, total);
}

TEST(PlanFuzzTest, SpecStrings) {
  Rng r(3);
  for (int i = 0; i < Iterations(20000); ++i) FuzzSpecOnce(Mutate(r, RandomSpecText(r)));
}

// Garbage requests built directly as structs (out-of-range enums, negative
// and huge shapes, broken meshes): INVALID_ARGUMENT with a message, or a
// plan; never a crash.
TEST(PlanFuzzTest, GarbageStructs) {
  Rng r(4);
  int errors = 0;
  for (int i = 0; i < Iterations(20000); ++i) {
    PlanRequest req;
    int axes = static_cast<int>(r.Int(0, 4));
    for (int a = 0; a < axes; ++a) {
      req.mesh.axes.push_back({r.Pick(kAxes), r.Coin(0.9) ? r.Int(1, 4) : r.Int(-5, 100000)});
    }
    req.mesh.roles.dp = r.Coin() ? "dp" : r.Pick(kAxes);
    req.mesh.roles.ep = r.Coin() ? "ep" : "";
    req.op = static_cast<OpKind>(r.Int(0, 3));
    req.compat = static_cast<CompatMode>(r.Int(0, 2));
    req.attrs.scaling_mode = static_cast<ScalingMode>(r.Int(0, 4));
    req.attrs.flatten_axis = static_cast<int>(r.Int(-4, 4));
    req.attrs.out_dtype = static_cast<DType>(r.Int(0, 9));
    req.attrs.rhs_transposed = r.Coin(0.2);
    req.attrs.has_bias = r.Coin(0.2);
    req.attrs.shared_scales = r.Coin(0.3);
    req.attrs.colwise = r.Coin(0.3);
    req.attrs.rowwise = r.Coin(0.9);
    const std::vector<std::string> names = {"lhs", "rhs", "group_sizes", "bias", "x", "w"};
    int ops = static_cast<int>(r.Int(0, 5));
    for (int o = 0; o < ops; ++o) {
      OperandRequest op;
      op.name = r.Pick(names);
      int rank = static_cast<int>(r.Int(0, 4));
      for (int d = 0; d < rank; ++d) {
        op.shape.push_back(r.Coin(0.9) ? 8 * r.Int(1, 3) : r.Pick(std::vector<int64_t>{0, -1, INT64_MAX, int64_t{1} << 40}));
      }
      op.dtype = static_cast<DType>(r.Int(0, 9));
      int dims = static_cast<int>(r.Int(0, 4));
      for (int d = 0; d < dims; ++d) {
        std::vector<std::string> entry;
        int n = static_cast<int>(r.Int(0, 2));
        for (int k = 0; k < n; ++k) entry.push_back(r.Pick(kAxes));
        op.spec.dims.push_back(entry);
      }
      req.operands.push_back(op);
    }
    if (r.Coin(0.2)) req.out_spec = PartitionSpec{{{r.Pick(kAxes)}}};
    absl::StatusOr<Plan> plan = MakePlan(req);
    if (!plan.ok()) {
      ++errors;
      ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
      ASSERT_FALSE(plan.status().message().empty());
    } else {
      ASSERT_FALSE(FormatPlanText(*plan).empty());
    }
  }
  EXPECT_GT(errors, 0);
}

}  // namespace
}  // namespace planner
}  // namespace shardgemm
