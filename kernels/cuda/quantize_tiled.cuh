// The tiled quantize kernels (the quantize pass, one persistent launch over
// all groups; with p.fuse_amax the amax pass too) and their launch,
// templated on the parameter block (QuantizeParamsT<kCap>). Included by
// quantize.cu, which instantiates them for QuantizeParams (up to
// kMaxGpuGroups groups), and by quantize_small.cu, for
// QuantizeParamsT<kSmallGpuGroups>: two translation units, so nvcc compiles
// the two sets of kernels in parallel. Only those two files include it.
#ifndef SHARDGEMM_KERNELS_CUDA_QUANTIZE_TILED_CUH_
#define SHARDGEMM_KERNELS_CUDA_QUANTIZE_TILED_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels/cuda/quantize_device.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda_internal {
namespace {

// A tile is 16384 elements: TR rows (from the group's first row) x 16384 / TR
// columns, TR = 128 (every mode: a multiple of the MXFP8 and block heights),
// or 64 or 32 (current, delayed, MXFP8: rows of 512 or 1024 contiguous bytes,
// and whole tiles for groups of 64 or 32 rows). quantize.cc picks (see
// QuantizeTileRows).
template <int TR>
struct Tile {
  static_assert(TR == 32 || TR == 64 || TR == 128, "tile heights: 32, 64 or 128 rows");
  static constexpr int kRows = TR;
  static constexpr int kCols = 16384 / TR;
  static constexpr int kChunksPerRow = kCols / 8;            // 8-element chunks
  static constexpr int kChunkRowStep = kThreads / kChunksPerRow;  // rows between a thread's chunks
  static constexpr int kChunksPerThread = TR * kChunksPerRow / kThreads;
};

// Blocks per SM the register budget is sized for: three blocks of 16-bit
// input (kTileBuffers x 32 KiB tiles) fit an SM (80 registers); F32 tiles take
// 128 KiB, one block.
constexpr int MinBlocks(int dt, int /*mode*/) { return dt == 2 ? 1 : 3; }

// ---- the quantize pass -------------------------------------------------------
// Persistent blocks walk the work items. Each block streams its next tile into
// shared memory with cp.async (two buffers) while it converts the current one,
// so loads stay in flight through the conversion, and outputs are written with
// streaming (evict-first) stores. Tile: TR rows (from the group's first row)
// x 16384 / TR columns of x, row-major in shared memory.
//   rowwise: thread tid takes the 8-element chunks ch = tid + i * 256 (row
//            ch / (kCols / 8), columns (ch % (kCols / 8)) * 8 .. + 8): 8-byte
//            stores;
//   colwise: where one scale covers the tile (tensor, 128x128) the rowwise
//            bytes are transposed through shared memory (16-byte stores, a
//            lane pair filling a 32-byte sector in whole tiles); MXFP8's
//            output (not transposed) is written by the rowwise chunk loop
//            once the column scales are known (QuantizeMxTileFull); 1x128
//            tiles of whole columns convert each chunk with its columns'
//            scales and transpose those bytes the same way
//            (QuantizeB1x128TileFull); other partial tiles: a thread takes 4
//            columns x 16 rows.
// Fused current scaling (p.fuse_amax): the items are amax tiles and quantize
// tiles (see QuantizeParams); work is claimed from an atomic counter, so a
// quantize tile only ever waits for amax tiles that running blocks hold.

// Two tile buffers per block. (Three measured no faster on any preset:
// 96 KiB blocks fit two to an SM, not three; docs/performance/quantize.md.)
constexpr int kTileBuffers = 2;

template <int DT>
constexpr int TileBytes() {
  return 16384 * (DT == 2 ? 4 : 2);
}

// 16 bytes global -> shared, L2 only; zero-filled when !valid (nothing is
// read then). (The L2::cache_hint form of cp.async trapped on the H200.)
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


struct Item {
  int t = 0, ct = 0;     // row tile (numbered over all groups), column tile
  bool amax = false;     // fused: an amax tile
  int batch = 0;         // fused: the item's batch
};

// Item i of the launch (see QuantizeParams for the order).
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ Item DecodeItem(const P& p, int i) {
  Item it;
  int local = i, tile_base = 0;
  if (p.fuse_amax) {
    int lo = 0, hi = p.num_batches + 1;  // the phase: last ph with phase_item_off[ph] <= i
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.phase_item_off[mid] <= i) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int ph = lo, j = i - p.phase_item_off[ph];
    const int na = ph < p.num_batches ? (p.batch_tile_off[ph + 1] - p.batch_tile_off[ph]) * p.col_tiles : 0;
    const int nq = ph > 0 ? (p.batch_tile_off[ph] - p.batch_tile_off[ph - 1]) * p.col_tiles : 0;
    const int r = min(nq, na / 2);  // "AAQ" triples first, then the rest of the amax tiles, then quantize
    int a = -1, q = -1;
    if (j < 3 * r) {
      if (j % 3 < 2) {
        a = (j / 3) * 2 + j % 3;
      } else {
        q = j / 3;
      }
    } else {
      const int j2 = j - 3 * r;
      if (j2 < na - 2 * r) {
        a = 2 * r + j2;
      } else {
        q = r + (j2 - (na - 2 * r));
      }
    }
    it.amax = a >= 0;
    it.batch = it.amax ? ph : ph - 1;
    local = it.amax ? a : q;
    tile_base = p.batch_tile_off[it.batch];
  }
  it.t = tile_base + local / p.col_tiles;
  it.ct = local % p.col_tiles;
  return it;
}

// A tile's place, with its group's table entries (read where GeomOf runs:
// for a block's first tile before its wait, for the others a tile ahead, so
// the indexed parameter loads' latency hides; launch_param_bench).
struct TileGeom {
  int t, ct, g;
  int64_t off, mg, r0, c0;
  int nrows, ncols;
  int32_t row_scale_off, col_scale_off;
};
template <int TR, class P>
__device__ __forceinline__ TileGeom GeomOf(const P& p, const Item& it) {
  using TS = Tile<TR>;
  TileGeom tg;
  tg.t = it.t, tg.ct = it.ct;
  tg.g = FindGroupFromGuess(p, it.t);
  tg.off = p.row_off[tg.g];
  tg.mg = p.row_off[tg.g + 1] - tg.off;
  tg.r0 = tg.off + static_cast<int64_t>(it.t - p.tile_off[tg.g]) * TS::kRows;
  tg.nrows = static_cast<int>(min(static_cast<int64_t>(TS::kRows), tg.off + tg.mg - tg.r0));
  tg.c0 = static_cast<int64_t>(it.ct) * TS::kCols;
  tg.ncols = static_cast<int>(min(static_cast<int64_t>(TS::kCols), p.k - tg.c0));
  tg.row_scale_off = p.row_scale_off[tg.g];
  tg.col_scale_off = p.col_scale_off[tg.g];
  return tg;
}

// Issues the cp.async copies of a tile (rows past the group or columns past k
// read as zeros). WHOLE: a whole tile, no bounds to check (see LoadAnyTile).
template <int DT, int TR, bool WHOLE, class P>
__device__ __forceinline__ void LoadTile(const P& p, const TileGeom& tg, unsigned char* buf) {
  using T = typename InType<DT>::T;
  constexpr int kEpv = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
  constexpr int kCpr = Tile<TR>::kCols / kEpv;            // 16-byte chunks per row
  constexpr int kN = TR * kCpr / kThreads;
  constexpr int kRowStep = kThreads / kCpr;  // rows between a thread's chunks
  const T* x = static_cast<const T*>(p.x);
  const int rr0 = static_cast<int>(threadIdx.x) / kCpr, cc = static_cast<int>(threadIdx.x) % kCpr;
  const bool col_valid = WHOLE || cc * kEpv < tg.ncols;
  const T* src = x + (tg.r0 + rr0) * p.k + tg.c0 + cc * kEpv;  // a running pointer: one add per chunk
  unsigned char* dst = buf + threadIdx.x * 16;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const bool valid = WHOLE || (col_valid && rr0 + i * kRowStep < tg.nrows);
    CpAsync16(dst + i * kThreads * 16, valid ? src : x, valid);
    src += kRowStep * p.k;
  }
}
// Nearly every tile is whole: its copies skip the per-chunk bounds (about
// 20 instructions a tile).
template <int DT, int TR, class P>
__device__ __forceinline__ void LoadAnyTile(const P& p, const TileGeom& tg, unsigned char* buf) {
  if (tg.nrows == TR && tg.ncols == Tile<TR>::kCols) {
    LoadTile<DT, TR, true>(p, tg, buf);
  } else {
    LoadTile<DT, TR, false>(p, tg, buf);
  }
}

// max |x| bits over this thread's rowwise chunks of the tile.
template <int DT, int TR>
__device__ __forceinline__ uint32_t TileAbsMaxPart(const typename InType<DT>::T* tile) {
  using TS = Tile<TR>;
  uint32_t am = 0;
#pragma unroll
  for (int i = 0; i < TS::kChunksPerThread; ++i) {
    const int ch = threadIdx.x + i * kThreads;
    am = max(am, ChunkAbsMax<DT>(*reinterpret_cast<const Chunk<DT>*>(tile + (ch / TS::kChunksPerRow) * TS::kCols +
                                                                      (ch % TS::kChunksPerRow) * 8)));
  }
  return am;
}

// Four adjacent columns of one row: 8 bytes (16-bit types) or 16 (f32).
template <int DT>
struct Quad {
  using type = typename std::conditional<DT == 2, uint4, uint2>::type;
};
template <int DT>
__device__ __forceinline__ float QuadElem(const typename Quad<DT>::type& q, int i) {
  if constexpr (DT == 2) {
    return BitsToFloat(i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w);
  } else {
    const uint32_t w = i < 2 ? q.x : q.y;
    const uint16_t h = static_cast<uint16_t>((i & 1) ? (w >> 16) : (w & 0xffffu));
    return ToFloat<DT>(h);
  }
}

// Two elements with their own scales (MXFP8 colwise: one scale per column).
template <int FMT>
__device__ __forceinline__ uint32_t Quant2s(float x0, float s0, bool n0, float x1, float s1, bool n1, bool sw) {
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  if (!sw && !n0 && !n1) {  // a block whose scale is not NaN holds no NaN: no NaN rule needed
    return __nv_cvt_float2_to_fp8x2(make_float2(x0 * s0, x1 * s1), __NV_SATFINITE, FMT == 0 ? __NV_E4M3 : __NV_E5M2);
  }
  uint32_t b0, b1;
  if (sw) {
    b0 = QuantizeScaled(x0, s0, fmt), b1 = QuantizeScaled(x1, s1, fmt);
  } else {
    __nv_fp8x2_storage_t r = __nv_cvt_float2_to_fp8x2(make_float2(x0 * s0, x1 * s1), __NV_SATFINITE,
                                                        FMT == 0 ? __NV_E4M3 : __NV_E5M2);
    b0 = r & 0xffu, b1 = (r >> 8) & 0xffu;
    if (IsNanBits(x0)) b0 = Fp8NanWithSignOf(x0, fmt);
    if (IsNanBits(x1)) b1 = Fp8NanWithSignOf(x1, fmt);
  }
  if (n0) b0 = Fp8NanWithSignOf(x0, fmt);
  if (n1) b1 = Fp8NanWithSignOf(x1, fmt);
  return b0 | (b1 << 8);
}

// The chunk loop of QuantizeMxTileFull: each thread's 8-element chunks,
// decoded once, scaled by the row block's and each column block's 2^-e, and
// converted for both outputs. ROW, COL: the outputs; NAN_CODES: the tile has
// NaN codes (blocks holding Inf or NaN), whose elements get NaN with each
// element's sign. (Runtime flags here cost a chunk about 12 of its 48
// instructions in branches, moves and reloaded column recips.)
template <int DT, int FMT, int TR, bool ROW, bool COL, bool NAN_CODES, class P>
__device__ __forceinline__ void MxTileChunks(const P& p, const TileGeom& tg,
                                             const typename InType<DT>::T* tile, const float* col_recip,
                                             const float* row_recip) {
  using TS = Tile<TR>;
  constexpr int kCols = TS::kCols, kRowBlocks = kCols / 32;
  constexpr int NCH = TS::kChunksPerThread, kStep = TS::kChunkRowStep;
  // Chunk i's row rr0 + kStep i (rr0 < kStep) lies in the 32-row band
  // kStep i / 32, known at compile time: the column recips are read once a band.
  static_assert(32 % kStep == 0, "a thread's chunks do not straddle a 32-row band");
  const int tid = threadIdx.x;
  const int rr0 = tid / TS::kChunksPerRow, cc = tid % TS::kChunksPerRow;
  const int64_t K = p.k;
  uint8_t* row_out = p.row_data + (tg.r0 + rr0) * K + tg.c0 + cc * 8;
  uint8_t* col_out = p.col_data + (tg.r0 + rr0) * K + tg.c0 + cc * 8;
  float sc[8];
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    if (COL && (kStep * i) % 32 == 0) {
      const float* cr = col_recip + ((kStep * i) / 32) * kCols + cc * 8;
      const float4 slo = *reinterpret_cast<const float4*>(cr);
      const float4 shi = *reinterpret_cast<const float4*>(cr + 4);
      sc[0] = slo.x, sc[1] = slo.y, sc[2] = slo.z, sc[3] = slo.w, sc[4] = shi.x, sc[5] = shi.y, sc[6] = shi.z,
      sc[7] = shi.w;
    }
    const int rr = rr0 + kStep * i;
    const Chunk<DT> v = *reinterpret_cast<const Chunk<DT>*>(tile + rr * kCols + cc * 8);
    // Each element decoded once (f16 by the hardware conversion, exact for
    // every non-NaN; NaN only sits in NaN-code blocks, fixed from the sign).
    float x[8];
    ChunkFloats<DT>(v, x);
    if constexpr (ROW) {
      const float rs = row_recip[rr * kRowBlocks + cc / 4];
      uint2 rout = Cvt8<FMT>(x, rs);
      if constexpr (NAN_CODES) {
        const float rsi[8] = {rs, rs, rs, rs, rs, rs, rs, rs};
        rout = NanFix<FMT>(rout, v, rsi);
      }
      __stcs(reinterpret_cast<uint2*>(row_out), rout);
    }
    if constexpr (COL) {
      uint2 cout = Cvt8<FMT>(x, sc);
      if constexpr (NAN_CODES) cout = NanFix<FMT>(cout, v, sc);
      __stcs(reinterpret_cast<uint2*>(col_out), cout);
    }
    row_out += kStep * K;
    col_out += kStep * K;
  }
}
template <int DT, int FMT, int TR, bool NAN_CODES, class P>
__device__ __forceinline__ void MxTileChunksFor(const P& p, const TileGeom& tg,
                                                const typename InType<DT>::T* tile, const float* col_recip,
                                                const float* row_recip) {
  if (p.rowwise && p.colwise) {
    MxTileChunks<DT, FMT, TR, true, true, NAN_CODES>(p, tg, tile, col_recip, row_recip);
  } else if (p.rowwise) {
    MxTileChunks<DT, FMT, TR, true, false, NAN_CODES>(p, tg, tile, col_recip, row_recip);
  } else {
    MxTileChunks<DT, FMT, TR, false, true, NAN_CODES>(p, tg, tile, col_recip, row_recip);
  }
}

// MXFP8, a whole tile of 16-bit input, OCP recipe (QuantizeAnyTile). Both
// outputs are row-major, so one pass over the tile's 8-element chunks writes
// both once every block's scale is known. Two pre-passes find the scales, then
// one barrier:
//   columns: each thread takes a 32-row block of two columns, finds their
//            amax and E8M0 codes, writes the codes and keeps 2^-e in
//            col_recip ([TR / 32][columns] floats in shared memory);
//   rows:    each thread takes two 32-element row blocks (four 16-byte reads
//            each, in a rotated order that keeps a quarter warp on distinct
//            banks), writes their codes and keeps 2^-e in row_recip
//            ([TR][columns / 32]).
// A NaN in a recip marks a NaN code (a block holding Inf or NaN). The chunk
// loop then only multiplies and converts: no shuffles or scale math per
// chunk (the rowwise scale used to be found per chunk, four lanes a block).
template <int DT, int FMT, int TR, class P>
__device__ __forceinline__ void QuantizeMxTileFull(const P& p, const TileGeom& tg,
                                                   const typename InType<DT>::T* tile, float* recips,
                                                   uint32_t* red) {
  using TS = Tile<TR>;
  constexpr int kCols = TS::kCols;
  constexpr int kRowBlocks = kCols / 32;             // 32-element row blocks per tile row
  constexpr int kWarpsPerRowBlock = kCols / 64;      // column pass: a warp takes 64 columns of 32 rows
  static_assert(TR * kRowBlocks == 2 * kThreads, "row pass: two row blocks per thread");
  static_assert((TR / 32) * kCols + TR * kRowBlocks <= 16384 / 16, "recips fit the block's col_red");
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const int g = tg.g;
  const int64_t off = tg.off, r0 = tg.r0, c0 = tg.c0, K = p.k;
  float* col_recip = recips;                        // [TR / 32][kCols]
  float* row_recip = recips + (TR / 32) * kCols;    // [TR][kRowBlocks]
  const float kNanMark = BitsToFloat(0x7fc00000u);

  bool nan_code = false;  // a NaN code among the tile's blocks
  uint32_t am16 = 0;      // this thread's max |x| bits (16-bit), for the tile amax
  if (p.colwise) {
    // rows rb .. rb + 31, columns 2cp, 2cp + 1
    const int rb = (w / kWarpsPerRowBlock) * 32, cp = (w % kWarpsPerRowBlock) * 32 + lane;
    const uint32_t m2 = ColumnPairAbsMax32<kCols>(tile, rb, cp);
    const uint32_t b0 = MxCodeOcp16<DT>(m2 & 0xffffu, fmt), b1 = MxCodeOcp16<DT>(m2 >> 16, fmt);
    uint8_t* cs = static_cast<uint8_t*>(p.col_scale) + tg.col_scale_off + ((r0 - off + rb) / 32) * RoundUp(K, 128) +
                  c0 + 2 * cp;
    cs[0] = static_cast<uint8_t>(b0);  // (byte stores: the caller's scale buffer may sit at any address)
    cs[1] = static_cast<uint8_t>(b1);
    const bool n0 = b0 == kE8M0Nan, n1 = b1 == kE8M0Nan;
    *reinterpret_cast<float2*>(col_recip + (rb / 32) * kCols + 2 * cp) =
        make_float2(n0 ? kNanMark : MxRecip(b0), n1 ? kNanMark : MxRecip(b1));
    nan_code = n0 || n1;
    am16 = max(m2 & 0xffffu, m2 >> 16);
  }
  if (p.rowwise) {
    const int64_t mx_ld = RoundUp(K / 32, 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int q = tid + i * kThreads;  // row block q: row q / kRowBlocks, 64 bytes at q * 64
      const unsigned char* blk = reinterpret_cast<const unsigned char*>(tile) + q * 64;
      uint32_t m2 = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 u = *reinterpret_cast<const uint4*>(blk + ((j + ((q & 7) >> 1)) & 3) * 16);
        m2 = __vmaxu2(m2, AbsMaxPairs(u.x, u.y, u.z, u.w));
      }
      const uint32_t m = max(m2 & 0xffffu, m2 >> 16);
      const uint32_t b = MxCodeOcp16<DT>(m, fmt);
      const int r = q / kRowBlocks, cb = q % kRowBlocks;
      static_cast<uint8_t*>(p.row_scale)[tg.row_scale_off + (r0 - off + r) * mx_ld + c0 / 32 + cb] =
          static_cast<uint8_t>(b);
      const bool n = b == kE8M0Nan;
      row_recip[q] = n ? kNanMark : MxRecip(b);
      nan_code = nan_code || n;
      am16 = max(am16, m);
    }
  }
  if (p.amax != nullptr) {  // the tile amax from the pre-passes (QuantizeTile skipped its pass)
    const uint32_t wm = WarpMax(AbsBitsOf<DT>(static_cast<uint16_t>(am16)));
    if (lane == 0) red[w] = wm;
  }
  nan_code = __syncthreads_or(nan_code);  // also: the recips and red are complete
  if (p.amax != nullptr && tid == 0) FlushTileAmax(p, g, red);

  // The chunk loop, compiled per output set and apart for tiles with NaN
  // codes, so no chunk branches on them.
  if (nan_code) {
    MxTileChunksFor<DT, FMT, TR, true>(p, tg, tile, col_recip, row_recip);
  } else {
    MxTileChunksFor<DT, FMT, TR, false>(p, tg, tile, col_recip, row_recip);
  }
}

// The colwise output of tensor and block scaling, transposed per group
// ((r, c) at off * K + c * mg + (r - off)): each thread's chunk bytes qv
// (chunk i: row tid / kChunksPerRow + kChunkRowStep i, columns
// (tid % kChunksPerRow) * 8 ..) go through qt, the tile's own shared memory
// (every thread done reading it), and out as 16-row columns. tid: threadIdx.x
// (see OpaqueThreadIdx). FULL: the whole-tile thread mapping, for every
// column of the tile and, unless BOUNDED_ROWS, every row.
template <int TR, bool FULL, class P, bool BOUNDED_ROWS = false>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void StoreColwiseTransposed(const P& p, const TileGeom& tg,
                                                       const uint2 (&qv)[Tile<TR>::kChunksPerThread], uint8_t* qt,
                                                       int tid) {
  using TS = Tile<TR>;
  constexpr int NCH = TS::kChunksPerThread, kCols = TS::kCols, kCpr = TS::kChunksPerRow;
  const int nrows = FULL && !BOUNDED_ROWS ? TR : tg.nrows, ncols = FULL ? kCols : tg.ncols;
  const int64_t off = tg.off, mg = tg.mg, r0 = tg.r0, c0 = tg.c0, K = p.k;
  // FULL: rows whose bit 4 is set are stored with byte offsets XOR 64 (the
  // 64-byte halves of each 128 bytes swapped), so the lanes reading rows r
  // and r + 16 below hit other banks.
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int ch = tid + i * kThreads, row = ch / kCpr;
    const int swz = FULL ? ((row >> 4) & 1) * 64 : 0;
    *reinterpret_cast<uint2*>(qt + row * kCols + (((ch % kCpr) * 8) ^ swz)) = qv[i];
  }
  __syncthreads();
  // A thread takes 4 columns x 16 rows. FULL: lanes 2k and 2k + 1 take the
  // two 16-row halves of the same columns, so each pair's 16-byte stores
  // fill one 32-byte sector (warp: 32 rows x 64 columns). Else kCols / 4
  // threads take rows 16 q .. 16 q + 15 of all columns.
  const int lane = tid % 32, wp = tid / 32;
  constexpr int kWarpsPerBand = kCols / 64;  // FULL: warps per 32-row band
  const int cb = FULL ? 64 * (wp % kWarpsPerBand) + 4 * (lane / 2) : (tid % (kCols / 4)) * 4;
  const int rb = FULL ? 32 * (wp / kWarpsPerBand) + 16 * (lane % 2) : (tid / (kCols / 4)) * 16;
  const int rswz = FULL ? 64 * (lane % 2) : 0;  // rows rb .. rb + 15 share bit 4 = lane % 2
  if (cb < ncols && rb < nrows) {
    uint32_t w[16];  // row rb + j, columns cb .. cb + 3
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = *reinterpret_cast<const uint32_t*>(qt + (rb + j) * kCols + (cb ^ rswz));
    // Transposed per group: (r, c) at off * K + c * mg + (r - off); 16 rows = one 16-byte store.
    const bool aligned = ((off * K) % 16 == 0) && (mg % 16 == 0) && rb + 16 <= nrows;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint8_t* out = p.col_data + off * K + (c0 + cb + i) * mg + (r0 - off) + rb;
      if (aligned) {
        const uint32_t sel = static_cast<uint32_t>(i) | (static_cast<uint32_t>(i + 4) << 4);
        uint32_t col[4];  // byte i of rows 4k .. 4k + 3
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          col[k] = __byte_perm(__byte_perm(w[4 * k], w[4 * k + 1], sel), __byte_perm(w[4 * k + 2], w[4 * k + 3], sel),
                               0x5410);
        }
        __stcs(reinterpret_cast<uint4*>(out), make_uint4(col[0], col[1], col[2], col[3]));
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          if (rb + j < nrows) out[j] = static_cast<uint8_t>(w[j] >> (8 * i));
        }
      }
    }
  }
}

// Converts one tile held in shared memory. tscale: the tensor (per-group) scale.
// FULL: a whole tile of 16-bit input with the hardware conversion
// (and, for MXFP8, the OCP recipe): nearly every tile, compiled without the
// bounds checks, the software path and the recipe choice, and with MXFP8's
// colwise blocks held by single threads.
template <int DT, int MODE, int FMT, bool FULL, int TR, class P>
__device__ __forceinline__ void QuantizeTile(const P& p, const TileGeom& tg,
                                             typename InType<DT>::T* tile, float tscale,
                                             float tscale_amax, uint32_t* red, uint32_t* col_red) {
  using T = typename InType<DT>::T;
  using TS = Tile<TR>;
  static_assert(TR == 128 || (MODE != kModeB1x128 && MODE != kModeB128), "block scaling: 128-row tiles");
  constexpr bool kTensor = MODE == kModeCurrent || MODE == kModeDelayed;
  constexpr int NCH = TS::kChunksPerThread;  // rowwise 8-element chunks per thread
  constexpr int kCols = TS::kCols, kCpr = TS::kChunksPerRow, kStep = TS::kChunkRowStep;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  const int tid = threadIdx.x;
  const int g = tg.g, ct = tg.ct;
  const int nrows = FULL ? TR : tg.nrows, ncols = FULL ? kCols : tg.ncols;
  const int64_t off = tg.off, mg = tg.mg, r0 = tg.r0, c0 = tg.c0, K = p.k;
  const bool sw = FULL ? false : p.software_cvt;
  const float fmax = Fp8Max(fmt);

  if constexpr (kTensor) {
    if (tg.t == p.tile_off[g] && ct == 0 && tid == 0) {
      const float sinv = ScaleInv(tscale);
      if (p.rowwise) static_cast<float*>(p.row_scale)[g] = sinv;
      if (p.colwise) static_cast<float*>(p.col_scale)[g] = sinv;
    }
  }
  // Tile amax: the 128x128 block's scale, the fused per-group amax, and
  // whether the tile holds a NaN (max |x| bits are NaN-propagating); current
  // scaling knows that from the group's amax.
  // Whole delayed and MXFP8 tiles find it in a pass that reads the tile
  // anyway (delayed: the rowwise chunks; MXFP8: its scale pre-passes).
  float bscale = 1.0f;
  bool tile_nan = MODE == kModeCurrent && (FloatBits(tscale_amax) & 0x7fffffffu) > 0x7f800000u;
  const bool amax_in_pass = FULL && (MODE == kModeDelayed || MODE == kModeMx);
  if (!amax_in_pass && (MODE == kModeB128 || MODE == kModeDelayed || (MODE != kModeCurrent && p.amax != nullptr))) {
    const uint32_t tam = BlockMax(TileAbsMaxPart<DT, TR>(tile), red);
    tile_nan = tam > 0x7f800000u;
    if (MODE != kModeCurrent && p.amax != nullptr && tid == 0) ReduceTileAmax(p, g, tam);
    if constexpr (MODE == kModeB128) {
      bscale = ScaleFromAmax(BitsToFloat(tam), fmax, p.pow2);
      if (tid == 0) {
        const int64_t rb = (r0 - off) / 128;
        if (p.rowwise) {
          static_cast<float*>(p.row_scale)[tg.row_scale_off + rb * RoundUp((K + 127) / 128, 4) + ct] =
              ScaleInv(bscale);
        }
        if (p.colwise) {
          static_cast<float*>(p.col_scale)[tg.col_scale_off + ct * RoundUp((mg + 127) / 128, 4) + rb] =
              ScaleInv(bscale);
        }
      }
    }
  }

  if constexpr (FULL && MODE == kModeMx) {
    QuantizeMxTileFull<DT, FMT, TR>(p, tg, tile, reinterpret_cast<float*>(col_red), red);
    return;
  }

  // One scale for the whole tile (tensor and 128x128 scaling): an element's
  // colwise byte is its rowwise byte, so the colwise output is the rowwise
  // bytes transposed through shared memory instead of a second conversion.
  constexpr bool kReuse = kTensor || MODE == kModeB128;
  uint2 qv[NCH];

  // ---- rowwise ----
  if (p.rowwise || (kReuse && p.colwise)) {
    // Chunk i of this thread: row rr0 + kStep i, columns cc * 8 .. + 8. Outputs
    // through running pointers (one 64-bit add per chunk, not a product).
    const int rr0 = tid / kCpr, cc = tid % kCpr;
    uint32_t run_amax = 0;  // FULL delayed: this thread's chunks' max |x| bits
    uint8_t* row_out = p.row_data + (r0 + rr0) * K + c0 + cc * 8;
    const int64_t mx_ld = RoundUp(K / 32, 4);
    uint8_t* mx_scale = MODE == kModeMx && p.rowwise ? static_cast<uint8_t*>(p.row_scale) + tg.row_scale_off +
                                                           (r0 + rr0 - off) * mx_ld + (c0 + cc * 8) / 32
                                                     : nullptr;
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int rr = rr0 + kStep * i;
      const bool valid = FULL || (rr < nrows && cc * 8 < ncols);
      const Chunk<DT> v = *reinterpret_cast<const Chunk<DT>*>(tile + rr * kCols + cc * 8);
      float s = kTensor ? tscale : bscale;
      bool nan_block = false, row_nan = true, chunk_nan = tile_nan;
      if constexpr (FULL && MODE == kModeDelayed) {  // the tile amax, chunk by chunk
        const uint32_t cm = ChunkAbsMax<DT>(v);
        run_amax = max(run_amax, cm);
        chunk_nan = cm > 0x7f800000u;
      }
      if constexpr (MODE == kModeMx) {  // 32-element block = 4 adjacent lanes (whole tiles: QuantizeMxTileFull)
        uint32_t m = ChunkAbsMax<DT>(v);
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const uint32_t b = MxCode(m, fmt, p.mx_recipe);
        if (valid && (cc & 3) == 0) *mx_scale = static_cast<uint8_t>(b);
        mx_scale += kStep * mx_ld;
        nan_block = b == kE8M0Nan;
        s = nan_block ? 1.0f : MxRecip(b);
      }
      if constexpr (MODE == kModeB1x128) {  // 128-element block = 16 lanes
        uint32_t m = ChunkAbsMax<DT>(v);
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        s = ScaleFromAmax(BitsToFloat(m), fmax, p.pow2);
        row_nan = m > 0x7f800000u;
        if (valid && cc == 0) {
          static_cast<float*>(p.row_scale)[tg.row_scale_off + ct * RoundUp(mg, 4) + (r0 + rr - off)] =
              ScaleInv(s);
        }
      }
      if (valid) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = Elem<DT>(v, j);
        const uint2 b =
            Quant8<FMT>(f, s, sw, nan_block, MODE == kModeMx ? false : MODE == kModeB1x128 ? row_nan : chunk_nan);
        if (p.rowwise) __stcs(reinterpret_cast<uint2*>(row_out), b);
        if constexpr (kReuse) qv[i] = b;
      } else if constexpr (kReuse) {
        qv[i] = make_uint2(0, 0);
      }
      row_out += kStep * K;
    }
    if constexpr (FULL && MODE == kModeDelayed) {
      const uint32_t wm = WarpMax(run_amax);
      if (tid % 32 == 0) red[tid / 32] = wm;
      if (!p.colwise) {  // else after the colwise block's first barrier
        __syncthreads();
        if (tid == 0) FlushTileAmax(p, g, red);
      }
    }
  }

  // ---- colwise, from the rowwise bytes ----
  if (kReuse && p.colwise) {
    uint8_t* qt = reinterpret_cast<uint8_t*>(tile);  // [TR][kCols] bytes over this tile's own buffer
    __syncthreads();  // every thread is done reading the input tile
    if constexpr (FULL && MODE == kModeDelayed) {
      if (tid == 0) FlushTileAmax(p, g, red);
    }
    StoreColwiseTransposed<TR, FULL>(p, tg, qv, qt, tid);
  }

  // ---- colwise ----
  if (!kReuse && p.colwise) {  // MXFP8 and 1x128: per-column scales, found below
    using Q = typename Quad<DT>::type;
    const int cg = tid % (kCols / 4), rs = tid / (kCols / 4);  // rs: a 16-row band
    const int cb = cg * 4, rb = rs * 16;  // first column / row of this thread's 16 x 4 block
    const bool cvalid = cb < ncols;       // k % 8 == 0: four columns are valid together
    // Transposed outputs need the 16 rows together; MXFP8 reads each row from
    // shared memory twice (amax, then convert) instead, which keeps it within
    // 128 registers.
    auto row = [&](int j) -> Q { return *reinterpret_cast<const Q*>(tile + (rb + j) * kCols + cb); };
    Q q[MODE == kModeMx ? 1 : 16];
    if constexpr (MODE != kModeMx) {
#pragma unroll
      for (int j = 0; j < 16; ++j) q[j] = row(j);
    }
    auto at = [&](int j) -> Q {
      if constexpr (MODE == kModeMx) {
        return row(j);
      } else {
        return q[j];
      }
    };
    float s[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    bool nanb[4] = {false, false, false, false};
    bool col_nan[4] = {false, false, false, false};
    {  // the columns' amax -> their scales
      uint32_t cam[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) cam[i] = max(cam[i], FloatBits(QuadElem<DT>(at(j), i)) & 0x7fffffffu);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) col_red[rs * kCols + cb + i] = cam[i];
      __syncthreads();
      if constexpr (MODE == kModeMx) {  // 32-row blocks: bands rs and rs ^ 1
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t m = max(cam[i], col_red[(rs ^ 1) * kCols + cb + i]);
          const uint32_t b = MxCode(m, fmt, p.mx_recipe);
          nanb[i] = b == kE8M0Nan;
          s[i] = nanb[i] ? 1.0f : MxRecip(b);
          if ((rs & 1) == 0 && cvalid && rb < nrows) {
            static_cast<uint8_t*>(p.col_scale)[tg.col_scale_off + ((r0 - off + rb) / 32) * RoundUp(K, 128) + c0 +
                                               cb + i] = static_cast<uint8_t>(b);
          }
        }
      } else {  // one 128-row block: all eight bands
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t m = 0;
#pragma unroll
          for (int w = 0; w < TR / 16; ++w) m = max(m, col_red[w * kCols + cb + i]);
          s[i] = ScaleFromAmax(BitsToFloat(m), fmax, p.pow2);
          col_nan[i] = m > 0x7f800000u;
          if (rs == 0 && cvalid) {
            static_cast<float*>(p.col_scale)[tg.col_scale_off + ((r0 - off) / 128) * RoundUp(K, 4) + c0 + cb + i] =
                ScaleInv(s[i]);
          }
        }
      }
    }
    if (cvalid && rb < nrows) {
      if constexpr (MODE == kModeMx) {
        // Not transposed: (r, c) at r * K + c; four columns = one 4-byte store per row.
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          if (rb + j < nrows) {
            const Q v = at(j);
            const uint32_t lo = Quant2s<FMT>(QuadElem<DT>(v, 0), s[0], nanb[0], QuadElem<DT>(v, 1), s[1], nanb[1], sw);
            const uint32_t hi = Quant2s<FMT>(QuadElem<DT>(v, 2), s[2], nanb[2], QuadElem<DT>(v, 3), s[3], nanb[3], sw);
            __stcs(reinterpret_cast<unsigned int*>(p.col_data + (r0 + rb + j) * K + c0 + cb), lo | (hi << 16));
          }
        }
      } else {
        // Transposed per group: (r, c) at off * K + c * mg + (r - off); 16 rows = one 16-byte store.
        const bool aligned = ((off * K) % 16 == 0) && (mg % 16 == 0) && rb + 16 <= nrows;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint8_t* out = p.col_data + off * K + (c0 + cb + i) * mg + (r0 - off) + rb;
          if (aligned) {
            float f[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) f[j] = QuadElem<DT>(at(j), i);
            const uint2 lo = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[0]), s[i], sw, false, col_nan[i]);
            const uint2 hi = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[8]), s[i], sw, false, col_nan[i]);
            __stcs(reinterpret_cast<uint4*>(out), make_uint4(lo.x, lo.y, hi.x, hi.y));
          } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              if (rb + j < nrows) out[j] = Quant1<FMT>(QuadElem<DT>(at(j), i), s[i], sw, false);
            }
          }
        }
      }
    }
  }
}

// threadIdx.x, which the compiler cannot treat as loop-invariant. The 1 x 128
// kernel holds both this path and the general one, and ptxas had hoisted the
// transposed store's 16 shared-memory addresses out of the tile loop and
// spilled them (small-decode's partial tiles, the general path, 18.0 -> 19.7
// us). Recomputing them is 16 instructions a tile.
__device__ __forceinline__ int OpaqueThreadIdx() {
  int tid = static_cast<int>(threadIdx.x);
  asm volatile("" : "+r"(tid));
  return tid;
}

// 1 x 128 block scaling, a 128 x 128 tile of 16-bit input with the hardware
// conversion, whole columns (QuantizeAnyTile): the tile holds one row block
// per row and one column block (all the tile's rows) per column. Rows past
// the group read as zeros, which change no amax, and are not stored. Two
// pre-passes find every scale once, as MXFP8's do (the general path found a
// row's scale per chunk, with shuffles and an IEEE division each, and read
// the tile again for the columns: twice the instructions of MXFP8's tile):
//   columns: each thread takes 32 rows of two columns (a warp: 32 rows x 64
//            columns); the four bands meet in shared memory, where 64
//            threads find the 128 column scales;
//   rows:    two threads a row, 128 bytes each (eight 16-byte reads in a
//            rotated order, a quarter warp on distinct banks), meet by a
//            shuffle.
// Then one pass converts each chunk with its row's scale (stored at once)
// and its columns' scales (kept for the transposed store, as tensor
// scaling's). A tile with a NaN is left to the general path (its NaN rule;
// false returned, the scales written are the ones it writes again): one copy
// of that path in the kernel, not a second one inlined here, which measured
// 2.4 us slower on small-decode's partial tiles.
template <int DT, int FMT, bool ROW, bool COL, class P>
__device__ __forceinline__ void B1x128TileChunks(const P& p, const TileGeom& tg, typename InType<DT>::T* tile,
                                                 const float* col_scale_s, const float* row_scale_s) {
  using TS = Tile<128>;
  constexpr int NCH = TS::kChunksPerThread, kStep = TS::kChunkRowStep, kCols = TS::kCols;
  const int tid = threadIdx.x;
  const int rr0 = tid / TS::kChunksPerRow, cc = tid % TS::kChunksPerRow;
  const int64_t K = p.k;
  uint8_t* row_out = ROW ? p.row_data + (tg.r0 + rr0) * K + tg.c0 + cc * 8 : nullptr;
  float sc[8];
  if constexpr (COL) {
    const float4 slo = *reinterpret_cast<const float4*>(col_scale_s + cc * 8);
    const float4 shi = *reinterpret_cast<const float4*>(col_scale_s + cc * 8 + 4);
    sc[0] = slo.x, sc[1] = slo.y, sc[2] = slo.z, sc[3] = slo.w, sc[4] = shi.x, sc[5] = shi.y, sc[6] = shi.z,
    sc[7] = shi.w;
  }
  uint2 qv[NCH];
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int rr = rr0 + kStep * i;
    const Chunk<DT> v = *reinterpret_cast<const Chunk<DT>*>(tile + rr * kCols + cc * 8);
    float x[8];
    ChunkFloats<DT>(v, x);
    if constexpr (ROW) {
      if (rr < tg.nrows) __stcs(reinterpret_cast<uint2*>(row_out), Cvt8<FMT>(x, row_scale_s[rr]));
      row_out += kStep * K;
    }
    if constexpr (COL) qv[i] = Cvt8<FMT>(x, sc);
  }
  if constexpr (COL) {
    __syncthreads();  // every thread is done reading the input tile
    StoreColwiseTransposed<128, true, P, /*BOUNDED_ROWS=*/true>(p, tg, qv,
                                                               reinterpret_cast<uint8_t*>(tile),  // (over its bytes)
                                                               OpaqueThreadIdx());
  }
}

template <int DT, int FMT, class P>
__device__ __forceinline__ bool QuantizeB1x128TileFull(const P& p, const TileGeom& tg, typename InType<DT>::T* tile,
                                                       uint32_t* red, uint32_t* col_red) {
  static_assert(DT == 0 || DT == 1, "16-bit input");
  constexpr int kCols = Tile<128>::kCols;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  const float fmax = Fp8Max(fmt);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const int64_t off = tg.off, mg = tg.mg, r0 = tg.r0, c0 = tg.c0, K = p.k;
  uint32_t* col_part = col_red;                                  // [4 bands][64 column pairs], 16-bit |x| bits
  float* col_scale_s = reinterpret_cast<float*>(col_red) + 256;  // [128]
  float* row_scale_s = reinterpret_cast<float*>(col_red) + 384;  // [128]
  bool nan = false;
  if (p.colwise) {
    const int band = w / 2, cp = (w % 2) * 32 + lane;
    col_part[band * 64 + cp] = ColumnPairAbsMax32<kCols>(tile, band * 32, cp);
  }
  uint32_t am16;  // this row's max |x| bits (16-bit)
  {
    const int r = tid / 2, h = tid % 2;
    const unsigned char* half = reinterpret_cast<const unsigned char*>(tile) + r * (kCols * 2) + h * kCols;
    uint32_t m2 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 u = *reinterpret_cast<const uint4*>(half + ((j + r) & 7) * 16);
      m2 = __vmaxu2(m2, AbsMaxPairs(u.x, u.y, u.z, u.w));
    }
    am16 = max(m2 & 0xffffu, m2 >> 16);
    am16 = max(am16, __shfl_xor_sync(0xffffffffu, am16, 1));
    const uint32_t a = AbsBitsOf<DT>(static_cast<uint16_t>(am16));
    nan = a > 0x7f800000u;
    if (p.rowwise) {
      const float sr = ScaleFromAmax(BitsToFloat(a), fmax, p.pow2);
      if (h == 0) {
        row_scale_s[r] = sr;
        if (r < tg.nrows) static_cast<float*>(p.row_scale)[tg.row_scale_off + tg.ct * RoundUp(mg, 4) + (r0 - off + r)] = ScaleInv(sr);
      }
    }
  }
  if (p.amax != nullptr) {  // the tile amax from the row pre-pass
    const uint32_t wm = WarpMax(AbsBitsOf<DT>(static_cast<uint16_t>(am16)));
    if (lane == 0) red[w] = wm;
  }
  __syncthreads();  // col_part complete
  if (p.colwise && tid < 64) {
    uint32_t m2 = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) m2 = __vmaxu2(m2, col_part[b * 64 + tid]);
    float* cs = static_cast<float*>(p.col_scale) + tg.col_scale_off + ((r0 - off) / 128) * RoundUp(K, 4) + c0 + 2 * tid;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint32_t a = AbsBitsOf<DT>(static_cast<uint16_t>(e == 0 ? m2 & 0xffffu : m2 >> 16));
      nan = nan || a > 0x7f800000u;
      const float sc = ScaleFromAmax(BitsToFloat(a), fmax, p.pow2);
      col_scale_s[2 * tid + e] = sc;
      cs[e] = ScaleInv(sc);
    }
  }
  nan = __syncthreads_or(nan);  // also: the scales and red are complete
  if (nan) return false;  // (rare; before the flush: the general path writes red at once, and flushes itself)
  if (p.amax != nullptr && tid == 0) FlushTileAmax(p, tg.g, red);
  if (p.rowwise && p.colwise) {
    B1x128TileChunks<DT, FMT, true, true>(p, tg, tile, col_scale_s, row_scale_s);
  } else if (p.rowwise) {
    B1x128TileChunks<DT, FMT, true, false>(p, tg, tile, col_scale_s, row_scale_s);
  } else {
    B1x128TileChunks<DT, FMT, false, true>(p, tg, tile, col_scale_s, row_scale_s);
  }
  return true;
}

// The 1 x 128 scale entries no tile's rows own, zeroed by the tile next to
// them (no memset of the scales runs first): rowwise, rows mg ..
// RoundUp(mg, 4) of each column block, by the group's last row tile there.
// (The colwise scales' rows are RoundUp(k, 4) long, and the GPU takes only
// k % 8 == 0, CheckGpuShape: no colwise padding.)
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void ZeroB1x128ScalePadding(const P& p, const TileGeom& tg) {
  const int j = static_cast<int>(threadIdx.x);
  const int64_t mg = tg.mg;
  if (j < 3 && p.rowwise && tg.r0 + tg.nrows == tg.off + mg && mg + j < RoundUp(mg, 4)) {
    static_cast<float*>(p.row_scale)[tg.row_scale_off + tg.ct * RoundUp(mg, 4) + mg + j] = 0.0f;
  }
}

// The whole-tile path where it applies, else the general one. ALLOW_FULL is
// off in the fused kernel, whose claim and wait state would spill with it.
template <int DT, int MODE, int FMT, int TR, bool ALLOW_FULL = true, class P>
__device__ __forceinline__ void QuantizeAnyTile(const P& p, const TileGeom& tg,
                                                typename InType<DT>::T* tile, float tscale, float tscale_amax,
                                                uint32_t* red, uint32_t* col_red) {
  if constexpr (MODE == kModeB1x128) ZeroB1x128ScalePadding(p, tg);
  if constexpr (ALLOW_FULL && MODE == kModeB1x128 && (DT == 0 || DT == 1)) {
    static_assert(TR == 128, "block scaling: 128-row tiles");
    if (tg.ncols == Tile<TR>::kCols && !p.software_cvt && QuantizeB1x128TileFull<DT, FMT>(p, tg, tile, red, col_red)) {
      return;
    }
  } else if constexpr (ALLOW_FULL && (DT == 0 || DT == 1)) {
    if (tg.nrows == TR && tg.ncols == Tile<TR>::kCols && !p.software_cvt &&
        (MODE != kModeMx || p.mx_recipe == static_cast<int>(MxScaleRecipe::kOcp))) {
      QuantizeTile<DT, MODE, FMT, true, TR>(p, tg, tile, tscale, tscale_amax, red, col_red);
      return;
    }
  }
  QuantizeTile<DT, MODE, FMT, false, TR>(p, tg, tile, tscale, tscale_amax, red, col_red);
}

// FUSED (current scaling only): the amax tiles, the claim counter and the
// waits are compiled in only where they run, which keeps the plain kernels'
// registers free of them.
template <int DT, int MODE, int FMT, bool FUSED, int TR, class P>  // P: QuantizeParamsT<kCap>
__global__ void __launch_bounds__(kThreads, MinBlocks(DT, MODE)) QuantizeKernel(const __grid_constant__ P p) {
  using T = typename InType<DT>::T;
  constexpr bool kTensor = MODE == kModeCurrent || MODE == kModeDelayed;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ uint32_t red[kThreads / 32];
  // A word per column per 16-row band; read as float4 (MXFP8's recips).
  __shared__ __align__(16) uint32_t col_red[16384 / 16];
  __shared__ int s_claim, s_next;  // the fused pass's claims
  const int tid = threadIdx.x;

  constexpr bool fused = MODE == kModeCurrent && FUSED;
  QuantizeWorkspace* ws = reinterpret_cast<QuantizeWorkspace*>(p.workspace);

  if constexpr (!fused) {
    // Item i + k * gridDim.x is this block's k-th; the next one streams into
    // the other buffer while this one is converted. Its geometry, found when
    // its load is issued, is carried to its own iteration.
    static_assert(kTileBuffers == 2, "the loop alternates two buffers");
    const int stride = static_cast<int>(gridDim.x);
    int i = static_cast<int>(blockIdx.x);
    // Item (row tile t, column tile ct) = (i / col_tiles, i % col_tiles), the
    // next one's kept by adding the stride's quotient and remainder (a
    // division per tile was 30 of its instructions).
    Item it;
    it.t = i / p.col_tiles, it.ct = i % p.col_tiles;
    const int stride_t = stride / p.col_tiles, stride_ct = stride % p.col_tiles;
    TileGeom tg{};
    if (i < p.num_items) tg = GeomOf<TR>(p, it);
    MxGroupPadding first_padding{};  // (MXFP8: this block's first group's scale padding)
    if (MODE == kModeMx && static_cast<int>(blockIdx.x) < p.num_groups) {
      first_padding = MxGroupPaddingOf(p, static_cast<int>(blockIdx.x));
    }
    // Current scaling's quantize pass always follows its amax pass, which
    // started after all earlier work: it reads x at once, and waits only for
    // the amax (final and visible past the wait below, while the first tile
    // streams in). The other modes wait first.
    constexpr bool kAfterAmaxPass = MODE == kModeCurrent;
    if (!kAfterAmaxPass) WaitForPrecedingGrid();
    if (i < p.num_items) LoadAnyTile<DT, TR>(p, tg, smem_raw);
    CpAsyncCommit();
    if (kAfterAmaxPass) WaitForPrecedingGrid();
    if (p.dependents_at_start) AllowDependentLaunch();
    // The amax pass's slot (p.amax_slots), final past the wait.
    const int amax_slot_off =
        kAfterAmaxPass && p.amax_slots ? __ldcg(&ws->amax_slot_in_use) * kMaxGpuGroups : 0;
    if constexpr (kTensor) WriteEmptyGroupScales<MODE>(p);
    if constexpr (MODE == kModeMx) ZeroMxScalePadding(p, first_padding);  // while the first tile streams in
    int buf = 0;
#pragma unroll 1
    for (; i < p.num_items; i += stride) {
      TileGeom next{};
      it.t += stride_t, it.ct += stride_ct;
      if (it.ct >= p.col_tiles) it.t += 1, it.ct -= p.col_tiles;
      if (i + stride < p.num_items) {
        next = GeomOf<TR>(p, it);
        LoadAnyTile<DT, TR>(p, next, smem_raw + (buf ^ 1) * TileBytes<DT>());
      }
      CpAsyncCommit();
      // The tile's scale is read before the wait, so its latency hides there.
      float tscale = 1.0f, gamax = 0.0f;
      // (Current scaling: final, the amax pass ran before.)
      if constexpr (MODE == kModeCurrent) gamax = __ldcg(p.amax + amax_slot_off + tg.g);
      // (__ldg: read after the wait, through L1, where the other tiles of the
      // group find it; __ldcg measured 0.1 us slower on delayed row+col.)
      if constexpr (MODE == kModeDelayed) tscale = __ldg(p.scale + tg.g);
      CpAsyncWait<1>();  // this tile's group is in
      __syncthreads();
      if constexpr (MODE == kModeCurrent) tscale = ScaleFromAmax(gamax, Fp8Max(static_cast<Fp8Format>(FMT)), p.pow2);
      QuantizeAnyTile<DT, MODE, FMT, TR>(p, tg, reinterpret_cast<T*>(smem_raw + buf * TileBytes<DT>()), tscale, gamax, red,
                                         col_red);
      __syncthreads();  // this buffer is free again
      tg = next;
      buf ^= 1;
    }
    CpAsyncWait<0>();
    AllowDependentLaunch();  // (every thread has waited)
    if constexpr (kAfterAmaxPass) {
      // The amax to the caller's. With slots (the two passes): block 0
      // alone, no count. Else (a call with no rows, so no amax pass): the
      // workspace's zeros, then the workspace reset by the last block; its
      // reads here have been used before the count's barrier, which the
      // relaxed count relies on.
      if (p.amax_slots) {
        if (blockIdx.x == 0) PublishSlotAmax(p);
      } else if (p.workspace != nullptr) {
        if (blockIdx.x == 0) PublishAmax(p);
        FinishWithWorkspace(p, /*release=*/false);
      }
    }
  } else {
    // The fused pass: items are claimed from the workspace's counter, two
    // ahead, so a block only waits on amax tiles that running blocks hold.
    WaitForPrecedingGrid();
    WriteEmptyGroupScales<MODE>(p);
    if (tid == 0) {
      s_claim = atomicAdd(&ws->next_item, 1);
      s_next = atomicAdd(&ws->next_item, 1);
    }
    __syncthreads();
    int cur = s_claim, nxt = s_next;
    Item it_cur, it_nxt;
    int buf = 0;
    if (cur < p.num_items) {
      it_cur = DecodeItem(p, cur);
      LoadAnyTile<DT, TR>(p, GeomOf<TR>(p, it_cur), smem_raw);
    }
    CpAsyncCommit();
    while (cur < p.num_items) {
      if (nxt < p.num_items) {
        it_nxt = DecodeItem(p, nxt);
        LoadAnyTile<DT, TR>(p, GeomOf<TR>(p, it_nxt), smem_raw + (buf ^ 1) * TileBytes<DT>());
      }
      CpAsyncCommit();
      int claimed = 0;
      if (tid == 0) claimed = atomicAdd(&ws->next_item, 1);  // two ahead: its latency hides here
      CpAsyncWait<1>();  // every group but the newest: the current tile is in
      __syncthreads();
      T* tile = reinterpret_cast<T*>(smem_raw + buf * TileBytes<DT>());
      const TileGeom tg = GeomOf<TR>(p, it_cur);
      if (it_cur.amax) {
        const uint32_t tam = BlockMax(TileAbsMaxPart<DT, TR>(tile), red);
        if (tid == 0) {
          if (tam != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax) + tg.g, tam);
          __threadfence();
          atomicAdd(&ws->amax_tiles_done[it_cur.batch], 1);
        }
      } else {
        if (tid == 0) {
          const int need = (p.batch_tile_off[it_cur.batch + 1] - p.batch_tile_off[it_cur.batch]) * p.col_tiles;
          while (LoadAcquire(&ws->amax_tiles_done[it_cur.batch]) < need) __nanosleep(64);
        }
        __syncthreads();
        const float gamax = __ldcg(p.amax + tg.g);
        const float tscale = ScaleFromAmax(gamax, Fp8Max(static_cast<Fp8Format>(FMT)), p.pow2);
        QuantizeAnyTile<DT, MODE, FMT, TR, false>(p, tg, tile, tscale, gamax, red, col_red);
      }
      if (tid == 0) s_claim = claimed;
      __syncthreads();  // this buffer is free again; s_claim is visible
      cur = nxt, it_cur = it_nxt;
      nxt = s_claim;
      buf ^= 1;
    }
    CpAsyncWait<0>();
    AllowDependentLaunch();
    FinishWithWorkspace(p, /*release=*/true);  // the fused pass always has a workspace
  }
}

template <int DT, int MODE, int FMT, class P>
cudaError_t LaunchQuantizeT(const P& p, cudaStream_t stream) {
  // quantize.cc picks the tile height (QuantizeTileRows): 32 or 64 rows only
  // for the modes whose blocks are at most 32 rows tall, outside the fused
  // pass.
  constexpr bool kShort = MODE == kModeCurrent || MODE == kModeDelayed || MODE == kModeMx;
  if (p.tile_rows != 128 && !(kShort && (p.tile_rows == 64 || p.tile_rows == 32) && !p.fuse_amax)) {
    return cudaErrorInvalidValue;
  }
  auto kernel = QuantizeKernel<DT, MODE, FMT, false, 128, P>;
  if constexpr (kShort) {
    if (p.tile_rows == 64) kernel = QuantizeKernel<DT, MODE, FMT, false, 64, P>;
    if (p.tile_rows == 32) kernel = QuantizeKernel<DT, MODE, FMT, false, 32, P>;
  }
  if constexpr (MODE == kModeCurrent) {
    if (p.fuse_amax) kernel = QuantizeKernel<DT, MODE, FMT, true, 128, P>;
  }
  const int smem = kTileBuffers * TileBytes<DT>();
  int sms = 0, per_sm = 0, two_per_sm_smem = 0;
  cudaError_t e = KernelResidency(reinterpret_cast<const void*>(kernel), smem, &sms, &per_sm, &two_per_sm_smem);
  if (e != cudaSuccess) return e;
  // A launch of at most two items per SM asks for so much shared memory that
  // no third block fits beside two, so its blocks spread two to an SM
  // whatever else is resident. Current scaling's quantize pass launches
  // while its amax pass runs: allowed three an SM, its blocks filled the SMs
  // unevenly (small-decode row+col 7.7 -> 7.1 us, three runs; MXFP8 and
  // delayed unchanged: docs/performance/quantize.md).
  const bool cap_two = per_sm > 2 && p.num_items <= 2 * int64_t{sms} && two_per_sm_smem > smem;
  const int launch_smem = cap_two ? two_per_sm_smem : smem;
  // Delayed scaling's capped launches let their dependent launch once their
  // blocks have waited, not as they finish: small-decode row+col 5.3 -> 4.9
  // us. The same for MXFP8 (5.5 -> 5.8-6.0, on 64 x 256 tiles no faster)
  // and current scaling's quantize pass (7.1 -> 8.5) measured slower
  // (docs/performance/quantize.md).
  const P* launch_p = &p;
  std::unique_ptr<P> early;  // (on the heap: up to 25 KB of tables)
  if (MODE == kModeDelayed && cap_two) {
    early = std::make_unique<P>(p);
    early->dependents_at_start = true;
    launch_p = early.get();
  }
  // Enough blocks to fill the GPU once; an empty launch still writes empty groups' scales.
  // (Two blocks per SM, or the fewest blocks for the same number of waves,
  // measured no faster on any preset: docs/performance/quantize.md.)
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(p.num_items, static_cast<int64_t>(sms) * std::max(1, per_sm)));
  return LaunchAsDependent(kernel, dim3(static_cast<unsigned>(blocks)), launch_smem, stream, *launch_p);
}

template <int DT, int MODE, class P>
cudaError_t LaunchQuantizeF(const P& p, cudaStream_t stream) {
  return p.format == 0 ? LaunchQuantizeT<DT, MODE, 0>(p, stream) : LaunchQuantizeT<DT, MODE, 1>(p, stream);
}
template <int DT, class P>
cudaError_t LaunchQuantizeM(const P& p, cudaStream_t stream) {
  switch (p.mode) {
    case kModeCurrent: return LaunchQuantizeF<DT, kModeCurrent>(p, stream);
    case kModeDelayed: return LaunchQuantizeF<DT, kModeDelayed>(p, stream);
    case kModeMx: return LaunchQuantizeF<DT, kModeMx>(p, stream);
    case kModeB1x128: return LaunchQuantizeF<DT, kModeB1x128>(p, stream);
    case kModeB128: return LaunchQuantizeF<DT, kModeB128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <class P>
cudaError_t LaunchQuantizeP(const P& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case 0: return LaunchQuantizeM<0>(p, stream);
    case 1: return LaunchQuantizeM<1>(p, stream);
    default: return LaunchQuantizeM<2>(p, stream);
  }
}

}  // namespace
}  // namespace cuda_internal
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_QUANTIZE_TILED_CUH_
