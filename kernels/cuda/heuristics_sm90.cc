// Strategy choice on sm_90. The rules, in order, with the reason for each
// (figures: H200, BF16, TFLOP/s, docs/performance/gpu_gemm.md):
//
// Ragged M
//  1. Without host group sizes the cuBLAS routes need a blocking
//     device-to-host copy of the sizes (a stream sync, ~10-20 us of host
//     stall), so the sm90 kernel (which reads the sizes on the device) is
//     taken whenever it can run the shape, except when the groups are big
//     (rule 2's test on M/G): there one cuBLASLt call per group is 6-20%
//     faster than our kernel even after the sync (mixtral 716-735 vs
//     645-672; deepseek-down 717-739 vs 579-617), so the runner copies the
//     sizes back and loops.
//  2. When one group alone fills the GPU (at least a wave of 128x256 output
//     tiles per group), one cuBLASLt call per group is best: cuBLAS has a
//     tuned kernel for each big shape (mixtral / deepseek: 740-810, against
//     700-770 for the strided-batched call and 580-690 for our kernel). The
//     calls go one after another on one stream: spread over 4 side streams
//     two big GEMMs share the SMs and L2 and averaged 5-8% lower over four
//     runs (mixtral 709 vs 757, deepseek-up 671 vs 732, deepseek-down equal).
// 2b. Big groups that are also equal, with host sizes: the strided-batched
//     call runs them too (one launch, no partial last wave per group, but
//     one cuBLAS kernel for the whole batch). On mixtral the two routes tie
//     within the noise (loop 740, batched 742; dense ceiling 795), and the
//     winner depends on the algorithm each gets, so the runner times both
//     once per shape, each with its widely tuned algorithm (LtTune::kWide),
//     alternating 3 rounds and comparing medians, and caches the faster; the
//     loop stays unless the batched call is at least 1% faster.
//  3. Smaller groups, all equal (host sizes): one strided-batched cuBLASLt
//     call, a single launch whose kernel cuBLAS tuned for the batch (qwen3
//     G16 m512: 717 vs 573 for our kernel; G128 m128: 455 vs 406; G64 m64:
//     197 vs 185).
//  4. Smaller groups of different sizes: a per-group loop leaves most SMs
//     idle (G16 m512: 24 tiles a group for 132 SMs) and pays a launch per
//     group (G128 m128: 108), so our sm90 kernel, one launch for all groups.
//     Its tile: 64 rows when groups average <= 64 rows (half the MMA work of
//     128-row tiles on decode shapes), else 128; 128 columns instead of 256
//     when 256-column tiles would give under ~4 waves on the SMs. The
//     kernel's 2x1-cluster variant (rhs tile shared by TMA multicast) is
//     never chosen: it measured 25-30% slower (mixtral 497 vs 656).
//  5. Failing that: cublasGemmGroupedBatchedEx (the one cuBLAS call that
//     takes groups of different sizes) for small groups, else the loop.
// Ragged K (wgrad: out[g] is K x N, the group is the contracting dim)
//  6. Equal groups: strided-batched cuBLASLt; else one call per group.
//
// FP8 grouped GEMM, tensor x tensor scales (ChooseSm90Fp8, fp8_gemm.cc)
//  F1. Our kernel whenever it can run the params: one launch for all groups,
//      scales read on the device, no per-group host work (the cuBLASLt route
//      is one call per group plus a scale copy to aligned slots).
//  F2. Tile 128x256 with the TMA-store epilogue, except 64x256 (also with
//      the TMA store) when groups average <= 64 rows. 128x256 was the
//      fastest configuration on the five larger presets (H200, one run, TFLOP/s, promoted,
//      128x256 TMA store / 128x192 TMA store / 128x256 direct stores /
//      128x128 / 64x256): mixtral 1288 / 1247 / 1079 / 949 / 903,
//      deepseek-up 1280 / 1231 / 1150 / 962 / 961, deepseek-down 1210 /
//      1180 / 927 / 850 / 812, qwen3-ep8 1070 / 1051 / 787 / 729 / 710,
//      qwen3 (G128 m128) 808 / 806 / 683 / 674 / 682, small-decode (G64 m64)
//      298 / 293 / 272 / 265 / 282, the last two with direct stores). The
//      TMA store lets the consumers go on with the next tile at once (its
//      staging area costs a ring stage: 3 instead of 4); 128x256 moves the
//      fewest operand bytes per FLOP out of L2 (48 KB per 128-K block
//      against 32 KB for 128x128 at half the FLOPs). With the TMA store on
//      64x256 too, small-decode (64-row groups: half of each 128-row tile
//      wasted) ran 328 on 64x256 against 296 on 128x256 (block scales: 290
//      against 270), while qwen3 (128-row groups) stayed on 128x256 (790;
//      64x256 762).
//  F3. FP32 promotion per 128-K block (as cuBLASLt without FAST_ACCUM and
//      torch._scaled_grouped_mm's default; our output is bit-identical to
//      cuBLASLt's there) unless the caller asked for fast accumulation,
//      which runs the same tile unpromoted (mixtral 1497, deepseek-up 1453).
//      Block scales (1x128 x 128x128) are always promoted, with the block's
//      scales: the same tile.
//
// cuBLASLt autotuning (ChooseLtTune; the runner does the timing)
//  T1. Calls under 2 GFLOP run the heuristic's first pick: timing would cost
//      more than it could win back.
//  T2. Narrow: the heuristic's top 8, one warm-up and 3 timed calls each,
//      once per problem. Used when the problem may not come back (unequal
//      groups: every distinct group size is its own problem), so the first
//      call's stall stays short (~30 calls).
//  T3. Wide (>= 20 GFLOP per call, and the problem repeats: equal groups or
//      one batched call): the mixtral groups (240 GFLOP each) sat at parity
//      with torch using the top-8 pick, with the kernel's partial last wave
//      (6.8 waves of 128x256 tiles) the suspected loss, so tile, cluster and
//      raster (swizzle) choices are worth a wider search. Candidates, at
//      most 48, deduplicated by their full configuration, in this order:
//        a. the heuristic's top 32 (at most 16 kept), as ranked;
//        b. neighbours of its first 4 picks, the first pick's all before
//           the second's: split-K off; cluster shape 1x1/2x1/1x2/2x2;
//           swizzle flipped (x those clusters); the algorithm's other output
//           tiles (sides >= 64); custom options 0..3; other stage settings;
//           one knob changed at a time; up to 40 candidates in all;
//        c. algorithms of cublasLtMatmulAlgoGetIds the first 4 picks do not
//           use (tensor-core ones only), each tile (sides >= 64) with the
//           first stage setting cublasLtMatmulAlgoCheck accepts, cluster
//           left to cuBLAS, ordered by LtEnumRank (fullest last wave, then
//           larger tiles); up to 48.
//      Every built config passes cublasLtMatmulAlgoCheck, fits the
//      workspace and needs at most 16-byte alignment. Timing: one warm-up
//      call, then samples of 1-5 calls (~1 ms); a candidate one sample 25%
//      slower than the best so far is out, else its better of two samples
//      counts. The 4 fastest (and the heuristic's first pick) are re-timed
//      in 3 alternating rounds of ~2 ms; the lowest median wins, but the
//      heuristic's pick stays unless beaten by 1% (so noise does not flip
//      the choice from run to run). Screening stops after 1.5 s of GPU time.
//      Mixtral: ~0.2 s per group shape, ~0.5 s for the batched call.
#include "kernels/cuda/heuristics_sm90.h"

#include <cmath>

namespace shardgemm {
namespace cuda {

absl::string_view StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kAuto: return "auto";
    case Strategy::kLtLoop: return "lt_loop";
    case Strategy::kLtLoopGraph: return "lt_loop_graph";
    case Strategy::kLtBatched: return "lt_batched";
    case Strategy::kGroupedBatched: return "grouped_batched";
    case Strategy::kSm90: return "sm90";
  }
  return "?";
}

namespace {
bool Eligible(const ShapeInfo& s, Strategy st) { return (s.eligible >> static_cast<int>(st)) & 1u; }
}  // namespace

Choice ChooseSm90(const ShapeInfo& s) {
  Choice c;
  const int64_t g = s.num_groups > 0 ? s.num_groups : 1;
  const int64_t avg_rows = s.m / g;  // padding rows included: an estimate
  if (s.ragged_k) {  // rule 6
    c.strategy = (s.equal_groups && Eligible(s, Strategy::kLtBatched)) ? Strategy::kLtBatched
                                                                        : Strategy::kLtLoop;
    return c;
  }
  c.sm90_tile_m = avg_rows <= 64 ? 64 : 128;
  const int64_t n_tiles = (s.n + 255) / 256;
  const int64_t tiles_256 = (s.m / 128 + g) * n_tiles;  // upper estimate over all groups
  c.sm90_tile_n = (c.sm90_tile_m == 128 && tiles_256 < 4 * s.num_sms) ? 128 : 256;
  c.sm90_cluster = 1;  // 2x1 clusters measured slower, see the header comment
  const bool sm90 = Eligible(s, Strategy::kSm90);
  const int64_t rows = s.has_host_sizes ? s.max_group : avg_rows;
  const int64_t tiles_per_group = ((rows + 127) / 128) * n_tiles;
  const bool big_groups = tiles_per_group >= s.num_sms && Eligible(s, Strategy::kLtLoop);
  if (!s.has_host_sizes && sm90 && !big_groups) {  // rule 1
    c.strategy = Strategy::kSm90;
    return c;
  }
  if (big_groups) {  // rule 2
    c.strategy = Strategy::kLtLoop;
    c.lt_streams = 1;
    c.time_routes = s.equal_groups && Eligible(s, Strategy::kLtBatched);  // rule 2b
  } else if (s.equal_groups && Eligible(s, Strategy::kLtBatched)) {  // rule 3
    c.strategy = Strategy::kLtBatched;
  } else if (sm90) {  // rule 4
    c.strategy = Strategy::kSm90;
  } else if (Eligible(s, Strategy::kGroupedBatched) && avg_rows < 1024) {  // rule 5
    c.strategy = Strategy::kGroupedBatched;
  } else {
    c.strategy = Strategy::kLtLoop;
  }
  return c;
}

Fp8Choice ChooseSm90Fp8(const Fp8ShapeInfo& s) {
  Fp8Choice c;
  c.ours = s.kernel_ok;  // F1
  const int64_t avg_rows = s.m / (s.num_groups > 0 ? s.num_groups : 1);  // padding rows included
  c.tile_m = 128, c.tile_n = 256, c.tma_store = true;  // F2
  if (avg_rows <= 64) c.tile_m = 64;
  c.promote = !s.fast_accum || s.block_scaling;         // F3
  if (!c.promote) c.tile_m = 128;                       // fast accumulation: 128x256 only
  return c;
}

LtTune ChooseLtTune(double flops, bool repeats) {
  if (flops < 2e9) return LtTune::kNone;                // T1
  if (repeats && flops >= 20e9) return LtTune::kWide;   // T3
  return LtTune::kNarrow;                               // T2
}

const LtTunePolicy& WideLtTunePolicy() {
  static const LtTunePolicy p;
  return p;
}

namespace {
#include "kernels/cuda/cublaslt_names.inc"
}  // namespace

void LtTileDims(uint32_t tile, int* rows, int* cols) {
  *rows = tile < static_cast<uint32_t>(kLtNumTiles) ? kLtTileDims[tile][0] : 0;
  *cols = tile < static_cast<uint32_t>(kLtNumTiles) ? kLtTileDims[tile][1] : 0;
}

double LtEnumRank(uint32_t tile, float waves) {
  // The fuller the last wave the better (a 6.2-wave kernel idles most SMs
  // in its last wave, a 6.9-wave one few); among equals, larger tiles (fewer
  // operand re-reads per FLOP). Unknown wave counts rank as full.
  double fill = 1.0;
  if (waves > 0) fill = waves / std::ceil(waves);
  int r, c;
  LtTileDims(tile, &r, &c);
  return std::round(fill * 20) * 1e6 + static_cast<double>(r) * c;
}

std::string LtTileName(uint32_t tile) {
  int r, c;
  LtTileDims(tile, &r, &c);
  if (r == 0) return tile == 0 ? "undefined" : "tile#" + std::to_string(tile);
  return std::to_string(r) + "x" + std::to_string(c);
}

std::string LtStagesName(uint32_t stages) {
  if (stages < static_cast<uint32_t>(kLtStagesNamesCount) && kLtStagesNames[stages] != nullptr)
    return kLtStagesNames[stages];
  return "stages#" + std::to_string(stages);
}

std::string LtClusterName(uint32_t cluster) {
  if (cluster < static_cast<uint32_t>(kLtClusterNamesCount) && kLtClusterNames[cluster] != nullptr)
    return kLtClusterNames[cluster];
  return "cluster#" + std::to_string(cluster);
}

}  // namespace cuda
}  // namespace shardgemm
