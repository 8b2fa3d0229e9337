// Hopper FP8 grouped GEMM, ragged M, per-group tensor scales:
//   out[rows of g] = (lhs[rows of g] @ rhs[g]^T) * lhs_scale_inv[g] * rhs_scale_inv[g]
//
// The BF16 kernel's structure (sm90_grouped_gemm.cu), with FP8 operands:
// one persistent launch (one block per SM) walks all output tiles of all
// groups. Each block first turns the device group sizes into row and tile
// offsets in shared memory (a block-wide scan, no host copy), then:
//   warpgroup 0, thread 0: producer. TMA loads of the lhs tile [BM x 128] and
//     the rhs tile [BN x 128] (K-major, 128 FP8 = 128 bytes = one 128-byte
//     swizzle row) into a ring of STAGES slots, completing on "full"
//     mbarriers. Warpgroup 0 gives most of its registers back (setmaxnreg).
//   warpgroup 0, warps 1-3: zero the padding rows past sum(group_sizes).
//   warpgroups 1, 2: consumers. wgmma m64nNk32 (E4M3 / E5M2) from shared
//     memory, 4 per 128-wide K block. Epilogue: * lhs_scale_inv[g] *
//     rhs_scale_inv[g], convert, store straight from registers with the
//     group's row bounds (rows of the next group that the tile also loaded
//     are discarded).
// Accumulation (kPromote): each K block goes into a fresh tensor-core
// accumulator (scale-d 0 on its first wgmma), which is waited for and added
// into FP32 registers while the other consumer's wgmmas keep the tensor cores
// busy; the slot is freed once the block's wgmmas retired. With 256 columns
// per consumer the block is done in two halves of 128 columns (one 64-register
// temporary, 128 FP32 registers). Without kPromote (fast accumulation, the
// 128x256 tile only) the wgmmas accumulate all of K, and a slot is freed once
// the next block's wgmmas are issued and the previous ones retired.
// Block scaling (kBlock, 1x128 lhs x 128x128 rhs): the producer bulk-copies
// each K block's scales of the tile into the stage with its tiles, and the
// consumers multiply the temporary by them as they promote it (FFMA).
// BM = 128: each consumer takes 64 rows x BN columns. BM = 64 (small groups):
// each consumer takes all 64 rows x BN/2 columns.
// Rows of lhs past M and K past the end read as zeros (TMA out-of-bounds fill).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/sm90_common.cuh"
#include "kernels/cuda/sm90_fp8_grouped_gemm.h"
#include "kernels/cuda/sm90_wgmma_fp8.cuh"

namespace shardgemm {
namespace cuda {
namespace {

using namespace sm90c;

constexpr int kBK = 128;  // 128 x 8-bit = 128 bytes: one swizzle row
constexpr int kThreads = 384;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;  // 128 * 40 + 256 * 232 <= 65536

struct KernelArgs {
  void* out;
  int out_dtype;  // CuDType as int
  int tma_out;    // 1: map_out is valid (16-bit out, 16-byte rows): full sub-tiles leave by TMA store
  // kBlock: lhs_scale / rhs_scale are GroupedQuantize's 1x128 / 128x128 block scales.
  const float* lhs_scale;
  const float* rhs_scale;
  const int64_t* group_sizes;
  int num_groups;
  int m, n, k;
};

// wgmma m64n{WN}k32, A type kFa, B type kFb (0 = E4M3, 1 = E5M2).
template <int WN, int kFa, int kFb>
__device__ __forceinline__ void Wgmma(float (&d)[WN / 2], uint64_t da, uint64_t db, int scale_d) {
  using namespace sm90;
  if constexpr (WN == 256) {
    if constexpr (kFa == 0 && kFb == 0) Wgmma_m64n256k32_e4m3_e4m3(d, da, db, scale_d);
    else if constexpr (kFa == 0 && kFb == 1) Wgmma_m64n256k32_e4m3_e5m2(d, da, db, scale_d);
    else if constexpr (kFa == 1 && kFb == 0) Wgmma_m64n256k32_e5m2_e4m3(d, da, db, scale_d);
    else Wgmma_m64n256k32_e5m2_e5m2(d, da, db, scale_d);
  } else if constexpr (WN == 192) {
    if constexpr (kFa == 0 && kFb == 0) Wgmma_m64n192k32_e4m3_e4m3(d, da, db, scale_d);
    else if constexpr (kFa == 0 && kFb == 1) Wgmma_m64n192k32_e4m3_e5m2(d, da, db, scale_d);
    else if constexpr (kFa == 1 && kFb == 0) Wgmma_m64n192k32_e5m2_e4m3(d, da, db, scale_d);
    else Wgmma_m64n192k32_e5m2_e5m2(d, da, db, scale_d);
  } else {
    static_assert(WN == 128, "wgmma widths: 128, 192, 256");
    if constexpr (kFa == 0 && kFb == 0) Wgmma_m64n128k32_e4m3_e4m3(d, da, db, scale_d);
    else if constexpr (kFa == 0 && kFb == 1) Wgmma_m64n128k32_e4m3_e5m2(d, da, db, scale_d);
    else if constexpr (kFa == 1 && kFb == 0) Wgmma_m64n128k32_e5m2_e4m3(d, da, db, scale_d);
    else Wgmma_m64n128k32_e5m2_e5m2(d, da, db, scale_d);
  }
}

template <typename T>
__device__ __forceinline__ void StorePair(T* p, float a, float b);
template <>
__device__ __forceinline__ void StorePair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void StorePair<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void StorePair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }

// Stores one consumer's 64 x WN tile: fragment (j, h, e) of thread (warp w,
// lane l) is row w*16 + l/4 + 8h, column 8j + 2(l%4) + e.
template <typename TOut, int WN>
__device__ __forceinline__ void StoreTile(const float (&acc)[WN / 2], void* out_v, int n, int row_base, int col_base,
                                          int group_end, float scale) {
  TOut* out = static_cast<TOut*>(out_v);
  const bool pair_ok = (n & 1) == 0;
#pragma unroll
  for (int j = 0; j < WN / 8; ++j) {
    const int col = col_base + 8 * j;
    if (col >= n) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row < group_end) {
        TOut* p = out + static_cast<int64_t>(row) * n + col;
        const float v0 = acc[4 * j + 2 * h] * scale, v1 = acc[4 * j + 2 * h + 1] * scale;
        if (pair_ok && col + 1 < n) {
          StorePair<TOut>(p, v0, v1);
        } else {
          p[0] = FromFloat<TOut>(v0);
          if (col + 1 < n) p[1] = FromFloat<TOut>(v1);
        }
      }
    }
  }
}

// Writes one consumer's 64 x WN tile (scaled, 16-bit) into its staging area
// in shared memory: WN/64 boxes of [64 rows x 64 columns] (8 KB each), each
// row 128 bytes with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8)), as the TMA store of the output map reads them. A warp's
// 4-byte stores then cover all 32 banks.
template <typename TOut, int WN>
__device__ __forceinline__ void StageTile(const float (&acc)[WN / 2], uint32_t staging, int warp_in_wg, int lane,
                                          float scale) {
#pragma unroll
  for (int j = 0; j < WN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_in_wg * 16 + lane / 4 + 8 * h;
      const uint32_t addr = staging + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (lane / 4)) * 16) + 4 * (lane & 3);
      uint32_t v;
      if constexpr (sizeof(TOut) == 2 && std::is_same<TOut, __half>::value) {
        __half2 x = __floats2half2_rn(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
        v = *reinterpret_cast<uint32_t*>(&x);
      } else {
        __nv_bfloat162 x = __floats2bfloat162_rn(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
        v = *reinterpret_cast<uint32_t*>(&x);
      }
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
    }
  }
}

__device__ __forceinline__ void NamedBarrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void TmaStore2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void BulkWaitRead() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void BulkWait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

constexpr int kSmemLimit = 232448;  // per block on sm_90 (227 KB)
// Row, tile and (block scaling) 4-row-rounded row offsets of kSm90Fp8MaxGroups groups.
constexpr int kOffsetBytes = 3 * (kSm90Fp8MaxGroups + 1) * 4;

// kTmaStore: the epilogue stages each consumer's tile in shared memory and
// sends it out by TMA store (asynchronous: the consumer goes on with the next
// tile at once), which costs the ring stages that the staging area takes.
template <int BM, int BN, bool kPromote, bool kTmaStore>
struct Config {
  static constexpr int kWN = BM == 128 ? BN : BN / 2;  // columns per consumer
  // Promotion works on pieces of at most 192 columns (a temporary of WN/2 registers).
  static constexpr int kHalves = (kPromote && kWN > 192) ? 2 : 1;
  static constexpr int kWNH = kWN / kHalves;
  static constexpr int kABytes = BM * kBK;
  static constexpr int kBBytes = BN * kBK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStagingBytes = kTmaStore ? BM * BN * 2 : 0;  // 16-bit out only
  // Block scaling: each stage's scales, loaded by the producer with its
  // tiles: BM rows' 1x128 lhs scales, then for each 128-column block of the
  // tile the 16 bytes of its 128x128 rhs scale row holding this K block's.
  static constexpr int kNB = (BN + 127) / 128;
  static constexpr int kScaleFloats = BM + 4 * kNB;
  static constexpr int kFit =
      (kSmemLimit - 1024 - kOffsetBytes - 256 - kStagingBytes) / (kStageBytes + kScaleFloats * 4);
  static constexpr int kStages = kFit < 6 ? kFit : 6;
  static constexpr int kRingBytes = kStages * kStageBytes;
  static_assert(kWN % 64 == 0, "staging boxes are 64 columns wide");
};

template <int BM, int BN, bool kPromote, bool kTmaStore>
constexpr int SmemBytes(int num_groups) {
  using C = Config<BM, BN, kPromote, kTmaStore>;
  return 1024 /*align slack*/ + C::kRingBytes + C::kStagingBytes + 2 * C::kStages * 8 +
         C::kStages * C::kScaleFloats * 4 + 3 * (num_groups + 1) * 4;
}

template <int BM, int BN, bool kPromote, bool kTmaStore, bool kBlock, int kFa, int kFb>
__global__ void __launch_bounds__(kThreads, 1)
    Fp8GroupedGemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                         const __grid_constant__ CUtensorMap map_out, const KernelArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = Config<BM, BN, kPromote, kTmaStore>;
  static_assert(!kBlock || (kPromote && C::kWNH == 128), "block scales: promoted 128-column pieces");
  constexpr int kStages = C::kStages;
  constexpr int kWN = C::kWN;
  constexpr int kHalves = C::kHalves;
  constexpr int kWNH = C::kWNH;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* ring = smem;
  uint8_t* staging = smem + C::kRingBytes;  // kStagingBytes, 1024-aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + C::kStagingBytes);
  uint64_t* empty = full + kStages;
  float* stage_scales = reinterpret_cast<float*>(empty + kStages);  // 16-byte aligned: 2 * kStages barriers
  int* row_start = reinterpret_cast<int*>(stage_scales + kStages * C::kScaleFloats);
  int* tile_start = row_start + args.num_groups + 1;
  int* row4_start = tile_start + args.num_groups + 1;  // kBlock: sum of roundup(rows, 4) before each group
  __shared__ int warp_rows[kThreads / 32], warp_tiles[kThreads / 32], warp_rows4[kThreads / 32];

  const int tid = threadIdx.x;
  const int G = args.num_groups;
  const int n_tiles = (args.n + BN - 1) / BN;

  // --- group offsets: block-wide exclusive scan of rows and tiles ---
  {
    const int chunk = (G + kThreads - 1) / kThreads;
    const int beg = min(G, tid * chunk), end = min(G, beg + chunk);
    int rows = 0, tiles = 0, rows4 = 0;
    for (int i = beg; i < end; ++i) {
      int64_t s = args.group_sizes[i];
      int r = static_cast<int>(s < 0 ? 0 : (s > args.m ? args.m : s));
      rows += r;
      rows4 += (r + 3) & ~3;
      tiles += (r + BM - 1) / BM * n_tiles;
    }
    const int lane = tid & 31, warp = tid >> 5;
    int inc_r = rows, inc_t = tiles, inc_4 = rows4;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int vr = __shfl_up_sync(0xffffffffu, inc_r, o);
      int vt = __shfl_up_sync(0xffffffffu, inc_t, o);
      int v4 = __shfl_up_sync(0xffffffffu, inc_4, o);
      if (lane >= o) { inc_r += vr; inc_t += vt; inc_4 += v4; }
    }
    if (lane == 31) { warp_rows[warp] = inc_r; warp_tiles[warp] = inc_t; warp_rows4[warp] = inc_4; }
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) { BarInit(&full[s], 1); BarInit(&empty[s], 8); }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int run_r = inc_r - rows, run_t = inc_t - tiles, run_4 = inc_4 - rows4;
    for (int w = 0; w < warp; ++w) { run_r += warp_rows[w]; run_t += warp_tiles[w]; run_4 += warp_rows4[w]; }
    for (int i = beg; i < end; ++i) {
      row_start[i] = run_r;
      tile_start[i] = run_t;
      row4_start[i] = run_4;
      int64_t s = args.group_sizes[i];
      int r = static_cast<int>(s < 0 ? 0 : (s > args.m ? args.m : s));
      run_r += r;
      run_4 += (r + 3) & ~3;
      run_t += (r + BM - 1) / BM * n_tiles;
    }
    if (tid == kThreads - 1) {  // totals
      int tr = 0, tt = 0;
      for (int w = 0; w < kThreads / 32; ++w) { tr += warp_rows[w]; tt += warp_tiles[w]; }
      row_start[G] = tr;
      tile_start[G] = tt;
    }
    __syncthreads();
  }
  const int total_tiles = tile_start[G];
  const int num_kb = (args.k + kBK - 1) / kBK;
  const int wg = tid / 128;

  if (wg == 0) {
    RegDealloc<kProducerRegs>();
    if (tid == 0) {
      int stage = 0, phase = 0;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const int g = FindGroup(tile_start, G, t);
        const int local = t - tile_start[g];
        const int mt_count = (row_start[g + 1] - row_start[g] + BM - 1) / BM;
        const int row0 = row_start[g] + (local % mt_count) * BM;
        const int n0 = (local / mt_count) * BN;
        // kBlock: the tile's rows of the group's [num_kb][roundup(rows, 4)]
        // lhs scales (rows past the group's end are not stored, so their
        // scales need not be loaded), and for each 128-column block the row
        // nb of the group's [ceil(n/128)][roundup(num_kb, 4)] rhs scales.
        const float* a_scales = nullptr;
        int a_scale_ld = 0, a_scale_bytes = 0;
        const float* b_scales[C::kNB];
        if constexpr (kBlock) {
          const int g_rows = row_start[g + 1] - row_start[g];
          const int r0 = (local % mt_count) * BM;
          a_scale_ld = (g_rows + 3) & ~3;
          a_scale_bytes = min(BM, a_scale_ld - r0) * 4;
          a_scales = args.lhs_scale + static_cast<int64_t>(num_kb) * row4_start[g] + r0;
          const int nbc = (args.n + 127) / 128, kb4 = (num_kb + 3) & ~3;
#pragma unroll
          for (int j = 0; j < C::kNB; ++j) {
            b_scales[j] = args.rhs_scale + (static_cast<int64_t>(g) * nbc + min(n0 / 128 + j, nbc - 1)) * kb4;
          }
        }
        for (int kb = 0; kb < num_kb; ++kb) {
          BarWait(&empty[stage], phase ^ 1);
          BarExpectTx(&full[stage], C::kStageBytes + (kBlock ? a_scale_bytes + 16 * C::kNB : 0));
          uint8_t* sa = ring + stage * C::kStageBytes;
          TmaLoad2d(sa, &map_a, kb * kBK, row0, &full[stage]);
          TmaLoad3d(sa + C::kABytes, &map_b, kb * kBK, n0, g, &full[stage]);
          if constexpr (kBlock) {
            float* sc = stage_scales + stage * C::kScaleFloats;
            BulkLoad(sc, a_scales + static_cast<int64_t>(kb) * a_scale_ld, a_scale_bytes, &full[stage]);
#pragma unroll
            for (int j = 0; j < C::kNB; ++j) BulkLoad(sc + BM + 4 * j, b_scales[j] + (kb & ~3), 16, &full[stage]);
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
    } else if (tid >= 32) {
      // Zero the padding rows [sum(group_sizes), m).
      const int out_es = args.out_dtype == static_cast<int>(CuDType::kF32) ? 4 : 2;
      const int64_t row_bytes = static_cast<int64_t>(args.n) * out_es;
      const int64_t pad_rows = args.m - row_start[G];
      if (pad_rows > 0) {
        uint8_t* base = static_cast<uint8_t*>(args.out) + static_cast<int64_t>(row_start[G]) * row_bytes;
        const int64_t bytes = pad_rows * row_bytes;
        const int64_t stride = static_cast<int64_t>(gridDim.x) * 96;  // warps 1-3 of each block
        const int64_t me = static_cast<int64_t>(blockIdx.x) * 96 + (tid - 32);
        if (((reinterpret_cast<uintptr_t>(base) | static_cast<uintptr_t>(bytes)) & 15) == 0) {
          uint4* p = reinterpret_cast<uint4*>(base);
          for (int64_t i = me; i < bytes / 16; i += stride) p[i] = make_uint4(0, 0, 0, 0);
        } else {
          for (int64_t i = me; i < bytes; i += stride) base[i] = 0;
        }
      }
    }
  } else {
    RegAlloc<kConsumerRegs>();
    const int c = wg - 1;  // consumer index
    const int warp_in_wg = (tid / 32) & 3, lane = tid & 31;
    // Byte offsets of this consumer's operands inside a stage.
    const uint32_t a_off = BM == 128 ? c * 64 * kBK : 0;
    const uint32_t b_off = BM == 128 ? 0 : c * kWN * kBK;
    const uint32_t ring_addr = SmemAddr(ring);
    float acc[kWN / 2];  // FP32 result (the tensor cores' accumulator without kPromote)
    float tmp[kPromote ? kWNH / 2 : 1];
    int stage = 0, phase = 0;
    auto release = [&](int s) {  // one arrive per warp
      __syncwarp();
      if (lane == 0) BarArrive(&empty[s]);
    };
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const int g = FindGroup(tile_start, G, t);
      const int local = t - tile_start[g];
      const int g_rows = row_start[g + 1] - row_start[g];
      const int mt_count = (g_rows + BM - 1) / BM;
      const int row0 = row_start[g] + (local % mt_count) * BM;
      const int n0 = (local / mt_count) * BN;
      const float scale = kBlock ? 1.f : __ldg(args.lhs_scale + g) * __ldg(args.rhs_scale + g);
      if constexpr (!kPromote) {
        int prev_stage = 0;
        for (int kb = 0; kb < num_kb; ++kb) {
          BarWait(&full[stage], phase);
          const uint32_t sa = ring_addr + stage * C::kStageBytes + a_off;
          const uint32_t sb = ring_addr + stage * C::kStageBytes + C::kABytes + b_off;
          WgmmaFence();
#pragma unroll
          for (int kk = 0; kk < kBK / 32; ++kk) {
            Wgmma<kWN, kFa, kFb>(acc, MakeDesc(sa + kk * 32, 1, 64), MakeDesc(sb + kk * 32, 1, 64),
                                 (kb > 0 || kk > 0) ? 1 : 0);
          }
          WgmmaCommit();
          if (kb > 0) {
            WgmmaWait<1>();
            release(prev_stage);
          }
          prev_stage = stage;
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
        WgmmaWait<0>();
        release(prev_stage);
      } else {
#pragma unroll
        for (int i = 0; i < kWN / 2; ++i) acc[i] = 0.f;
        // kBlock: this thread's two rows (lane/4 and lane/4 + 8 of its warp's
        // 16) within the tile, whose scales the stage holds.
        const int scale_row = (BM == 128 ? c * 64 : 0) + warp_in_wg * 16 + lane / 4;
        for (int kb = 0; kb < num_kb; ++kb) {
          BarWait(&full[stage], phase);
          float s_a0 = 0.f, s_a1 = 0.f, s_b[kHalves];
          if constexpr (kBlock) {  // read before the stage is released
            const float* sc = stage_scales + stage * C::kScaleFloats;
            s_a0 = sc[scale_row];
            s_a1 = sc[scale_row + 8];
#pragma unroll
            for (int hf = 0; hf < kHalves; ++hf) s_b[hf] = sc[BM + 4 * (BM == 128 ? hf : c) + (kb & 3)];
          }
          const uint32_t sa = ring_addr + stage * C::kStageBytes + a_off;
          const uint32_t sb = ring_addr + stage * C::kStageBytes + C::kABytes + b_off;
#pragma unroll
          for (int hf = 0; hf < kHalves; ++hf) {
            WgmmaFence();
#pragma unroll
            for (int kk = 0; kk < kBK / 32; ++kk) {
              Wgmma<kWNH, kFa, kFb>(tmp, MakeDesc(sa + kk * 32, 1, 64),
                                    MakeDesc(sb + hf * kWNH * kBK + kk * 32, 1, 64), kk > 0 ? 1 : 0);
            }
            WgmmaCommit();
            WgmmaWait<0>();
            if (hf == kHalves - 1) release(stage);
            if constexpr (kBlock) {
              // Fragment i is row half (i >> 1) & 1 (rows lane/4 and lane/4 + 8).
              const float f0 = s_a0 * s_b[hf], f1 = s_a1 * s_b[hf];
#pragma unroll
              for (int i = 0; i < kWNH / 2; ++i)
                acc[hf * (kWNH / 2) + i] = fmaf(tmp[i], ((i >> 1) & 1) ? f1 : f0, acc[hf * (kWNH / 2) + i]);
            } else {
#pragma unroll
              for (int i = 0; i < kWNH / 2; ++i) acc[hf * (kWNH / 2) + i] += tmp[i];
            }
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }

      const int group_end = min(row_start[g] + g_rows, args.m);
      const int sub_row0 = row0 + (BM == 128 ? c * 64 : 0), sub_col0 = n0 + (BM == 128 ? 0 : c * kWN);
      const int row_base = sub_row0 + warp_in_wg * 16 + lane / 4;
      const int col_base = sub_col0 + 2 * (lane & 3);
      // TMA store of the 64 x WN sub-tile when all its rows are the group's
      // (the store clips columns past n and rows past m, not group ends).
      if (kTmaStore && args.tma_out && sub_row0 + 64 <= group_end) {
        const bool leader = warp_in_wg == 0 && lane == 0;
        const uint32_t my_staging = SmemAddr(staging) + c * (64 * kWN * 2);
        if (leader) BulkWaitRead();  // the previous tile's store has read the staging area
        NamedBarrier(1 + c, 128);
        if (args.out_dtype == static_cast<int>(CuDType::kF16)) {
          StageTile<__half, kWN>(acc, my_staging, warp_in_wg, lane, scale);
        } else {
          StageTile<__nv_bfloat16, kWN>(acc, my_staging, warp_in_wg, lane, scale);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        NamedBarrier(1 + c, 128);
        if (leader) {
#pragma unroll
          for (int b = 0; b < kWN / 64; ++b) TmaStore2d(&map_out, my_staging + b * 8192, sub_col0 + b * 64, sub_row0);
          BulkCommit();
        }
        continue;
      }
      if (args.out_dtype == static_cast<int>(CuDType::kBF16)) {
        StoreTile<__nv_bfloat16, kWN>(acc, args.out, args.n, row_base, col_base, group_end, scale);
      } else if (args.out_dtype == static_cast<int>(CuDType::kF16)) {
        StoreTile<__half, kWN>(acc, args.out, args.n, row_base, col_base, group_end, scale);
      } else {
        StoreTile<float, kWN>(acc, args.out, args.n, row_base, col_base, group_end, scale);
      }
    }
    if (kTmaStore && args.tma_out && (tid & 127) == 0) BulkWait();  // stores done before the block exits
  }
#endif
}

// --- host side ---

template <int BM, int BN, bool kPromote, bool kTmaStore, bool kBlock, int kFa, int kFb>
cudaError_t LaunchTyped(const Sm90Fp8GroupedGemmParams& p, int num_sms, cudaStream_t stream, const char** detail) {
  EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) {
    *detail = "cuTensorMapEncodeTiled not found in the driver";
    return cudaErrorInvalidValue;
  }
  CUtensorMap map_a, map_b;
  {
    cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.m)};
    cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.k)};
    cuuint32_t box[2] = {kBK, BM};
    cuuint32_t estr[2] = {1, 1};
    if (encode(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(p.lhs), dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for lhs";
      return cudaErrorInvalidValue;
    }
  }
  {
    cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.n),
                          static_cast<cuuint64_t>(p.num_groups)};
    cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.n * p.k)};
    cuuint32_t box[3] = {kBK, BN, 1};
    cuuint32_t estr[3] = {1, 1, 1};
    if (encode(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(p.rhs), dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for rhs";
      return cudaErrorInvalidValue;
    }
  }
  // Output map for the TMA-store epilogue: 16-bit out, rows of 16-byte multiples, 16-byte aligned.
  CUtensorMap map_out;
  std::memset(&map_out, 0, sizeof(map_out));
  const bool tma_out = kTmaStore && p.out_dtype != CuDType::kF32 && p.n % 8 == 0 &&
                       (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  if (tma_out) {
    cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.n), static_cast<cuuint64_t>(p.m)};
    cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.n) * 2};
    cuuint32_t box[2] = {64, 64};
    cuuint32_t estr[2] = {1, 1};
    if (encode(&map_out, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, p.out, dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for out";
      return cudaErrorInvalidValue;
    }
  }
  KernelArgs a;
  a.out = p.out;
  a.out_dtype = static_cast<int>(p.out_dtype);
  a.tma_out = tma_out ? 1 : 0;
  a.lhs_scale = p.lhs_scale_inv;
  a.rhs_scale = p.rhs_scale_inv;
  a.group_sizes = p.group_sizes;
  a.num_groups = static_cast<int>(p.num_groups);
  a.m = static_cast<int>(p.m);
  a.n = static_cast<int>(p.n);
  a.k = static_cast<int>(p.k);
  auto kernel = Fp8GroupedGemmKernel<BM, BN, kPromote, kTmaStore, kBlock, kFa, kFb>;
  const int smem = SmemBytes<BM, BN, kPromote, kTmaStore>(static_cast<int>(p.num_groups));
  static std::once_flag once;
  static cudaError_t attr_err = cudaSuccess;
  std::call_once(once, [&] {
    attr_err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    SmemBytes<BM, BN, kPromote, kTmaStore>(static_cast<int>(kSm90Fp8MaxGroups)));
  });
  if (attr_err != cudaSuccess) return attr_err;
  kernel<<<num_sms, kThreads, smem, stream>>>(map_a, map_b, map_out, a);
  return cudaGetLastError();
}

template <int BM, int BN, bool kPromote, bool kTmaStore, bool kBlock = false>
cudaError_t DispatchFormats(const Sm90Fp8GroupedGemmParams& p, int num_sms, cudaStream_t s, const char** d) {
  const bool a5 = p.lhs_format == Sm90Fp8Format::kE5M2, b5 = p.rhs_format == Sm90Fp8Format::kE5M2;
  if (!a5 && !b5) return LaunchTyped<BM, BN, kPromote, kTmaStore, kBlock, 0, 0>(p, num_sms, s, d);
  if (!a5 && b5) return LaunchTyped<BM, BN, kPromote, kTmaStore, kBlock, 0, 1>(p, num_sms, s, d);
  if (a5 && !b5) return LaunchTyped<BM, BN, kPromote, kTmaStore, kBlock, 1, 0>(p, num_sms, s, d);
  *d = "e5m2 x e5m2 has no FP8 GEMM";
  return cudaErrorInvalidValue;
}

}  // namespace

const char* Sm90Fp8GroupedGemmUnsupportedReason(const Sm90Fp8GroupedGemmParams& p) {
  if (p.lhs_format != Sm90Fp8Format::kE4M3 && p.lhs_format != Sm90Fp8Format::kE5M2) return "lhs format: not FP8";
  if (p.rhs_format != Sm90Fp8Format::kE4M3 && p.rhs_format != Sm90Fp8Format::kE5M2) return "rhs format: not FP8";
  if (p.lhs_format == Sm90Fp8Format::kE5M2 && p.rhs_format == Sm90Fp8Format::kE5M2)
    return "e5m2 x e5m2 has no FP8 GEMM";
  if (p.out_dtype != CuDType::kBF16 && p.out_dtype != CuDType::kF16 && p.out_dtype != CuDType::kF32)
    return "output must be bf16, f16 or f32";
  const bool tile_ok = (p.tile_m == 128 && p.tile_n == 256) || (p.tile_m == 128 && p.tile_n == 192) ||
                       (p.tile_m == 128 && p.tile_n == 128) || (p.tile_m == 64 && p.tile_n == 256);
  if (!tile_ok) return "tile must be 128x256, 128x192, 128x128 or 64x256";
  if (!p.promote && !(p.tile_m == 128 && p.tile_n == 256)) return "fast accumulation (no promotion) needs the 128x256 tile";
  if (p.block_scaling && !p.promote) return "block scaling promotes every 128-K block (promote must be set)";
  if (p.block_scaling && p.tile_n == 192) return "block scaling: tile 128x256, 128x128 or 64x256";
  if (p.block_scaling &&
      ((reinterpret_cast<uintptr_t>(p.lhs_scale_inv) | reinterpret_cast<uintptr_t>(p.rhs_scale_inv)) & 15))
    return "block scaling: the scales must be 16-byte aligned (the kernel copies them in bulk)";
  if (p.num_groups < 1 || p.num_groups > kSm90Fp8MaxGroups) return "num_groups out of range for the sm90 FP8 kernel";
  if (p.k < 1 || p.k % 16 != 0) return "k must be a positive multiple of 16 (16-byte TMA strides)";
  if (p.m < 0 || p.n < 1) return "m must be >= 0 and n >= 1";
  if (p.m >= (int64_t{1} << 31) || p.n >= (int64_t{1} << 31) || p.k >= (int64_t{1} << 31))
    return "dimensions must fit in 31 bits";
  if (p.m * p.n >= (int64_t{1} << 40)) return "output too large";
  if (p.group_sizes == nullptr || p.lhs_scale_inv == nullptr || p.rhs_scale_inv == nullptr)
    return "group sizes and scales must be given (device pointers)";
  if ((p.m > 0 && p.lhs == nullptr) || p.rhs == nullptr || (p.m > 0 && p.out == nullptr))
    return "lhs, rhs and out must be given";
  if ((reinterpret_cast<uintptr_t>(p.lhs) | reinterpret_cast<uintptr_t>(p.rhs)) & 15)
    return "lhs and rhs must be 16-byte aligned";
  if (p.out_dtype != CuDType::kF32 ? (reinterpret_cast<uintptr_t>(p.out) & 3) : (reinterpret_cast<uintptr_t>(p.out) & 7))
    return "out must be aligned to two elements";
  return nullptr;
}

cudaError_t LaunchSm90Fp8GroupedGemm(const Sm90Fp8GroupedGemmParams& p, int num_sms, cudaStream_t stream,
                                     const char** detail) {
  static const char* none = "";
  *detail = none;
  if (const char* why = Sm90Fp8GroupedGemmUnsupportedReason(p)) {
    *detail = why;
    return cudaErrorInvalidValue;
  }
  if (p.m == 0) return cudaSuccess;  // nothing to compute or zero
  const bool tma = p.tma_store;
  if (p.block_scaling) {
    if (p.tile_m == 64) {
      return tma ? DispatchFormats<64, 256, true, true, true>(p, num_sms, stream, detail)
                 : DispatchFormats<64, 256, true, false, true>(p, num_sms, stream, detail);
    }
    if (p.tile_n == 128) return DispatchFormats<128, 128, true, true, true>(p, num_sms, stream, detail);
    return tma ? DispatchFormats<128, 256, true, true, true>(p, num_sms, stream, detail)
               : DispatchFormats<128, 256, true, false, true>(p, num_sms, stream, detail);
  }
  if (p.tile_m == 64) {
    return tma ? DispatchFormats<64, 256, true, true>(p, num_sms, stream, detail)
               : DispatchFormats<64, 256, true, false>(p, num_sms, stream, detail);
  }
  if (p.tile_n == 128) {
    return tma ? DispatchFormats<128, 128, true, true>(p, num_sms, stream, detail)
               : DispatchFormats<128, 128, true, false>(p, num_sms, stream, detail);
  }
  if (p.tile_n == 192) {
    return tma ? DispatchFormats<128, 192, true, true>(p, num_sms, stream, detail)
               : DispatchFormats<128, 192, true, false>(p, num_sms, stream, detail);
  }
  if (p.promote) {
    return tma ? DispatchFormats<128, 256, true, true>(p, num_sms, stream, detail)
               : DispatchFormats<128, 256, true, false>(p, num_sms, stream, detail);
  }
  return tma ? DispatchFormats<128, 256, false, true>(p, num_sms, stream, detail)
             : DispatchFormats<128, 256, false, false>(p, num_sms, stream, detail);
}

}  // namespace cuda
}  // namespace shardgemm
