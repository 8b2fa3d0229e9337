// Which grouped-GEMM strategy to run on a Hopper GPU (sm_90), per shape.
// Kept apart from the kernels: a small pure function of the shape, cached by
// the runner per shape. heuristics_sm90.cc explains each rule and the
// measurements behind it (docs/performance/gpu_gemm.md).
#ifndef SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_
#define SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace shardgemm {
namespace cuda {

enum class Strategy : int {
  kAuto = 0,
  kLtLoop = 1,          // one cuBLASLt matmul per group, spread over side streams
  kLtLoopGraph = 2,     // the same, captured once in a CUDA graph and replayed
  kLtBatched = 3,       // one strided-batched cuBLASLt matmul (all groups equal)
  kGroupedBatched = 4,  // cublasGemmGroupedBatchedEx, one call
  kSm90 = 5,            // our persistent TMA + wgmma kernel (ragged M only)
};
constexpr int kNumStrategies = 6;
absl::string_view StrategyName(Strategy s);  // "lt_loop", ...

// What the heuristic looks at.
struct ShapeInfo {
  bool ragged_k = false;
  int64_t num_groups = 0;
  int64_t m = 0, k = 0, n = 0;   // m = rows of lhs (padding included)
  bool rhs_transposed = false;
  bool has_host_sizes = false;
  bool equal_groups = false;     // host sizes known and all equal
  int64_t max_group = 0;         // host sizes known: largest group
  int num_sms = 132;
  // Which strategies can run this shape (bit i = Strategy i).
  unsigned eligible = 0;
};

struct Choice {
  Strategy strategy = Strategy::kLtLoop;
  int sm90_tile_m = 128;  // 64 or 128 when strategy == kSm90
  int sm90_tile_n = 256;  // 256, or 128 with tile_m 128
  int sm90_cluster = 1;   // 2: block pairs share rhs tiles (128x256 tiles only)
  int lt_streams = 0;     // kLtLoop: streams to spread the groups over (0: all side streams)
  // Rule 2b: lt_loop and lt_batched both fit and neither wins by a margin, so
  // the runner times both once (each with its tuned cuBLASLt algorithm) and
  // keeps the faster in its per-shape cache, with what it measured.
  bool time_routes = false;
  float route_loop_ms = 0, route_batched_ms = 0;  // per call, once timed
};

Choice ChooseSm90(const ShapeInfo& s);

// --- FP8 grouped GEMM (fp8_gemm.cc): our sm90 FP8 kernel or one cuBLASLt call per group ---
struct Fp8ShapeInfo {
  int64_t num_groups = 0;
  int64_t m = 0, k = 0, n = 0;  // m = rows of lhs (padding included)
  int64_t max_group = -1;       // largest group when the host sizes are known, else -1
  bool fast_accum = false;      // the caller allows FP8 accumulation without promotion
  bool block_scaling = false;   // 1x128 x 128x128 block scales (always promoted)
  bool kernel_ok = false;       // our kernel can run the params (device sm_90, device sizes given, ...)
  int num_sms = 132;
};
struct Fp8Choice {
  bool ours = false;
  int tile_m = 128, tile_n = 128;  // our kernel's tile: 128x256, 128x128 or 64x256
  bool promote = true;             // FP32 promotion per 128-K block (false: fast accumulation)
  bool tma_store = true;           // epilogue by TMA store where the tile has one (128x256, 128x192)
};
Fp8Choice ChooseSm90Fp8(const Fp8ShapeInfo& s);

// --- cuBLASLt autotuning: how much to time, per problem (rules in the .cc) ---
enum class LtTune : int {
  kNone = 0,    // the heuristic's first pick
  kNarrow = 1,  // time the heuristic's top 8 once
  kWide = 2,    // LtTunePolicy: heuristic top 32 + neighbours + enumerated configs
};
// flops: one cuBLASLt call; repeats: the same problem comes back call after
// call (equal groups, or one batched call), so a longer tuning pays off.
LtTune ChooseLtTune(double flops, bool repeats);

struct LtTunePolicy {
  int heuristic_candidates = 32;  // asked of cublasLtMatmulAlgoGetHeuristic
  int max_heuristic = 16;         // of those, kept
  int seeds = 4;                  // the heuristic's first picks whose neighbours are tried
  int max_with_variants = 40;     // candidates after the neighbours
  int max_candidates = 48;        // after configs built from cublasLtMatmulAlgoGetIds
  int max_checks = 3000;          // cublasLtMatmulAlgoCheck calls (host only, ~us each)
  int max_custom_option = 3;      // custom options 0..this tried (within the algo's range)
  int min_tile_side = 64;         // smaller output tiles are not tried on big problems
  double assumed_tflops = 700;    // to size the timing samples before anything is timed
  double sample_ms = 1.0;         // screening sample: 1..5 calls, about this long
  int max_sample_calls = 5;
  double drop_ratio = 1.25;       // screening: out after one sample this much slower than the best
  int finalists = 4;              // re-timed in alternation
  int final_rounds = 3;           // median of these
  double final_sample_ms = 2.0;   // 1..10 calls
  int max_final_calls = 10;
  double keep_margin = 0.01;      // the heuristic's first pick stays unless beaten by 1%
  double budget_ms = 1500;        // GPU time spent screening, at most (then the rest is skipped)
};
const LtTunePolicy& WideLtTunePolicy();

// Route timing (rule 2b): calls per sample, rounds, and the margin lt_batched
// needs over the loop (the loop, rule 2's measured default, stays on a tie).
constexpr double kRouteSampleMs = 4.0;
constexpr int kRouteRounds = 3;
constexpr double kRouteMargin = 0.01;

// cublasLtClusterShape_t values tried around the heuristic's picks
// (1x1x1, 2x1x1, 1x2x1, 2x2x1), and the order enumerated configs are tried in.
constexpr uint16_t kLtTryClusters[] = {2, 3, 5, 6};
// Output tile of a cublasLtMatmulTile_t value (0 x 0 when undefined/unknown).
void LtTileDims(uint32_t tile, int* rows, int* cols);
// Sort key for configs built from cublasLtMatmulAlgoGetIds (higher first).
double LtEnumRank(uint32_t tile, float waves);
std::string LtTileName(uint32_t tile);        // "128x256"
std::string LtStagesName(uint32_t stages);    // "64xAUTO"
std::string LtClusterName(uint32_t cluster);  // "2x1x1"

}  // namespace cuda
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_HEURISTICS_SM90_H_
