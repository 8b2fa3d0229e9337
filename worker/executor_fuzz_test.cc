// Random and hostile steps through the executor: every one must come back
// as a result or a status, never a crash, a hang or an allocation the
// step's claimed sizes would ask for (a crafted step is the worker's input
// too). Deterministic seeds; EXECUTOR_FUZZ_ITERATIONS for longer runs.
#include <cstdlib>
#include <memory>
#include <random>

#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "worker/executor.h"
#include "worker/fake_collectives.h"

namespace shardgemm {
namespace {

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  bool Coin(int percent = 50) { return Int(0, 99) < percent; }
  // Mostly small dims, sometimes hostile ones.
  int64_t Dim() {
    switch (Int(0, 19)) {
      case 0: return -1;
      case 1: return int64_t{1} << 40;
      case 2: return 0;
      default: return Int(1, 6);
    }
  }

 private:
  std::mt19937_64 rng_;
};

v1::DType AnyDtype(Gen& g) {
  static const v1::DType kDtypes[] = {v1::F32, v1::BF16, v1::F16, v1::F8E4M3, v1::I64, v1::DTYPE_UNSPECIFIED,
                                      static_cast<v1::DType>(99)};
  return kDtypes[g.Int(0, 6)];
}

void FillTensor(Gen& g, v1::LocalTensor* t, int rank) {
  t->set_dtype(g.Coin(85) ? v1::F32 : AnyDtype(g));
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    const int64_t dim = g.Dim();
    t->add_shape(dim);
    n = (dim > 0 && n < (1 << 20)) ? n * dim : 0;
  }
  if (g.Coin(10)) {
    t->set_resident(g.Coin(50) ? "w@1" : "missing@7");
    return;
  }
  const int64_t bytes = n > 0 && n < (1 << 16) ? n * 4 : 0;
  t->set_data(std::string(static_cast<size_t>(g.Coin(90) ? bytes : g.Int(0, 64)), '\0'));
}

// An FP8 operand: FP8 bytes (mostly of the right length).
void FillFp8Tensor(Gen& g, v1::LocalTensor* t, int rank) {
  FillTensor(g, t, rank);
  t->set_dtype(g.Coin(70) ? v1::F8E4M3 : g.Coin(50) ? v1::F8E5M2 : AnyDtype(g));
  if (t->source_case() == v1::LocalTensor::kData) {
    int64_t n = 1;
    for (int64_t d : t->shape()) n = (d > 0 && n < (1 << 20)) ? n * d : 0;
    if (g.Coin(90)) t->set_data(std::string(static_cast<size_t>(n > 0 && n < (1 << 16) ? n : 0), '\0'));
  }
}

v1::CollectivePlan AnyCollective(Gen& g) {
  v1::CollectivePlan c;
  c.set_phase(static_cast<v1::CollectivePhase>(g.Int(0, 4)));
  c.set_kind(static_cast<v1::CollectiveKind>(g.Int(0, 6)));
  c.set_tensor(static_cast<v1::TensorRole>(g.Int(0, 12)));
  c.set_dim(static_cast<int32_t>(g.Int(-2, 3)));
  c.add_axes(g.Coin(90) ? "fsdp" : "nope");
  return c;
}

v1::Step AnyStep(Gen& g, uint64_t sequence) {
  v1::Step step;
  step.set_sequence(sequence);
  if (g.Coin(70)) {
    v1::GemmStep* gemm = step.mutable_gemm();
    gemm->set_ragged(static_cast<v1::GroupedGemmRequest::Ragged>(g.Int(0, 2)));
    FillTensor(g, gemm->mutable_lhs(), static_cast<int>(g.Int(1, 3)));
    FillTensor(g, gemm->mutable_rhs(), static_cast<int>(g.Int(1, 4)));
    if (g.Coin(20)) FillTensor(g, gemm->mutable_bias(), 2);
    for (int64_t i = 0, n = g.Int(0, 4); i < n; ++i) gemm->add_group_sizes(g.Coin(90) ? g.Int(0, 4) : g.Dim());
    gemm->set_out_dtype(g.Coin(80) ? v1::F32 : AnyDtype(g));
    gemm->set_rhs_transposed(g.Coin());
    gemm->set_apply_bias(g.Coin());
    gemm->set_agree(g.Coin());
    for (int64_t i = 0, n = g.Int(0, 3); i < n; ++i) *gemm->add_collectives() = AnyCollective(g);
    if (g.Coin(20)) gemm->set_keep_output_as("kept@" + std::to_string(g.Int(1, 3)));
    if (g.Coin(30)) {  // an FP8 step: FP8 operands, their scales, a mode, maybe the fused quantize
      if (g.Coin(70)) FillFp8Tensor(g, gemm->mutable_lhs(), static_cast<int>(g.Int(1, 3)));
      FillFp8Tensor(g, gemm->mutable_rhs(), static_cast<int>(g.Int(1, 4)));
      if (g.Coin(80)) FillTensor(g, gemm->mutable_lhs_scale_inv(), static_cast<int>(g.Int(1, 3)));
      if (g.Coin(80)) FillTensor(g, gemm->mutable_rhs_scale_inv(), static_cast<int>(g.Int(1, 4)));
      gemm->set_scaling(static_cast<v1::ScalingMode>(g.Int(0, 6)));
      if (g.Coin(30)) gemm->set_quantize_lhs_to(g.Coin(70) ? v1::F8E4M3 : AnyDtype(g));
    }
  } else {
    v1::QuantizeStep* q = step.mutable_quantize();
    FillTensor(g, q->mutable_x(), static_cast<int>(g.Int(1, 3)));
    for (int64_t i = 0, n = g.Int(0, 4); i < n; ++i) q->add_group_sizes(g.Coin(90) ? g.Int(0, 4) : g.Dim());
    q->set_out_dtype(g.Coin(80) ? v1::F8E4M3 : AnyDtype(g));
    q->set_scaling(static_cast<v1::ScalingMode>(g.Int(0, 6)));
    q->set_rowwise(g.Coin());
    q->set_colwise(g.Coin());
    q->set_flatten_axis(static_cast<int32_t>(g.Int(-2, 3)));
    q->set_agree(g.Coin());
    if (g.Coin(15)) q->set_keep_rowwise_data_as("q@" + std::to_string(g.Int(1, 3)));
    if (g.Coin(15)) q->set_keep_scale_inv_as("s@" + std::to_string(g.Int(1, 3)));
    for (int64_t i = 0, n = g.Int(0, 2); i < n; ++i) *q->add_collectives() = AnyCollective(g);
  }
  return step;
}

TEST(ExecutorFuzzTest, HostileStepsGiveAStatusNeverACrash) {
  int iterations = 3000;
  if (const char* env = std::getenv("EXECUTOR_FUZZ_ITERATIONS")) iterations = std::atoi(env);
  auto backend = MakeCpuBackend(1);
  ShardStore store(int64_t{64} << 20);
  HostTensor w = *ZerosTensor(DType::kF32, {2, 3, 4});
  ASSERT_TRUE(store.Put("w@1", w).ok());
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {2};
  p.coords = {1};
  p.rank = 1;
  Executor executor(backend.get(), &store);
  executor.Configure(p, std::make_unique<MirrorCollectives>(p), 1);
  Gen g(20261201);
  int ok = 0;
  for (int i = 0; i < iterations; ++i) {
    auto result = executor.Execute(AnyStep(g, static_cast<uint64_t>(i + 1)));
    if (result.ok()) ++ok;
    // Nothing a step claims may exhaust the worker: the store's budget holds.
    ASSERT_LE(store.used_bytes(), store.budget_bytes()) << "iteration " << i;
  }
  // The generator makes some valid steps (about 1 in 70), so the run is
  // not all refusals.
  EXPECT_GT(ok, iterations / 200);
}

TEST(ExecutorFuzzTest, HugeClaimedShapesOfAFailingWorkerAllocateNothing) {
  // A worker whose input is missing still joins the collective that carries
  // the step's agreement, with a piece of the declared size: a crafted step
  // declaring 2^42 bytes must be refused, not allocated.
  auto backend = MakeCpuBackend(1);
  ShardStore store(int64_t{64} << 20);
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {2};
  p.coords = {0};
  Executor executor(backend.get(), &store);
  executor.Configure(p, std::make_unique<MirrorCollectives>(p), 1);
  for (v1::CollectivePhase phase : {v1::PHASE_BEFORE, v1::PHASE_AFTER}) {
    v1::Step step;
    step.set_sequence(phase == v1::PHASE_BEFORE ? 1 : 2);
    v1::GemmStep* gemm = step.mutable_gemm();
    gemm->mutable_lhs()->set_dtype(v1::F32);
    gemm->mutable_lhs()->add_shape(int64_t{1} << 38);
    gemm->mutable_lhs()->add_shape(4);
    gemm->mutable_lhs()->set_resident("missing@1");
    gemm->mutable_rhs()->set_dtype(v1::F32);
    for (int64_t d : {1, 4, 4}) gemm->mutable_rhs()->add_shape(d);
    gemm->mutable_rhs()->set_resident("missing@2");
    gemm->add_group_sizes(1);
    gemm->set_out_dtype(v1::F32);
    gemm->set_agree(true);
    v1::CollectivePlan* c = gemm->add_collectives();
    c->set_phase(phase);
    c->set_kind(phase == v1::PHASE_BEFORE ? v1::COLLECTIVE_ALL_GATHER : v1::COLLECTIVE_ALL_REDUCE_SUM);
    c->set_tensor(phase == v1::PHASE_BEFORE ? v1::TENSOR_LHS : v1::TENSOR_OUT);
    c->set_dim(phase == v1::PHASE_BEFORE ? 1 : -1);
    c->add_axes("fsdp");
    auto result = executor.Execute(step);
    EXPECT_FALSE(result.ok());
    EXPECT_NE(result.status().code(), absl::StatusCode::kInternal) << result.status();
  }
}

}  // namespace
}  // namespace shardgemm
