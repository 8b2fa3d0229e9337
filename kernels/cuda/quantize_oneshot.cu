// The one-shot grouped quantize kernel: for inputs that are short for the
// tiled kernels of quantize.cu, whose blocks stage 16384-element tiles in
// shared memory and walk them in sequence (load -> scale pass -> convert ->
// store), which costs a single tile about 4 us on the H200 before any
// bandwidth counts (docs/performance/quantize.md, the one-tile row).
//
// Here a block takes one 32-row x 256-column slab of 16-bit x and every
// thread holds its part in registers: 4 rows x 8 columns, loaded as four
// 16-byte vectors at once, so the whole input is in flight from the start.
// Warp w holds rows 4w .. 4w + 3 of the slab, lane l columns 8l .. 8l + 7:
//   - MXFP8 rowwise blocks (32 columns) are 4 adjacent lanes: two shuffles;
//   - MXFP8 colwise blocks (32 rows) are the slab's height: the 8 warps'
//     column maxima meet in shared memory;
//   - tensor scaling's colwise output (per group the transpose [k][m_g]) is
//     transposed through shared memory, so each thread writes one column's
//     32 bytes (one sector) with two 16-byte stores;
//   - current scaling needs every group's amax before any conversion: blocks
//     reduce it into the workspace and meet at a grid barrier (a cooperative
//     launch, so all blocks are resident), then convert what they still hold.
// The math is the same as the tiled kernels' (quantize_device.cuh), so the
// bytes equal the CPU reference's.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/quantize_device.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda_internal {
namespace {

constexpr int kSlabRows = 32, kSlabCols = 256;
static_assert(kThreads == (kSlabRows / 4) * 32, "a warp per 4 slab rows");
static_assert(kSlabCols == 32 * 8, "a lane per 8 slab columns");
// The colwise transpose buffer: a word (4 rows) per column and row group,
// 9 words per column (one of padding) and the row group swizzled by the
// writing lane, so both the writes and the reads are free of bank conflicts.
constexpr int kTransposeStride = 9;
// Blocks per SM the registers are held to: four, the most that 256-thread
// blocks of 64 registers allow (small-decode's 512 slabs in one wave).
constexpr int kOneShotMinBlocks = 4;

// Every block of the (cooperative) launch arrives before any goes on; the
// launch's last block resets the counter (FinishWithWorkspace).
__device__ __forceinline__ void GridBarrier(QuantizeWorkspace* ws) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&ws->grid_barrier, 1);
    while (LoadAcquire(&ws->grid_barrier) < static_cast<int>(gridDim.x * gridDim.y)) __nanosleep(32);
    __threadfence();
  }
  __syncthreads();
}

template <int DT, int MODE, int FMT, class P>  // P: QuantizeParamsT<kCap>
__global__ void __launch_bounds__(kThreads, kOneShotMinBlocks) OneShotKernel(const __grid_constant__ P p) {
  static_assert(DT == 0 || DT == 1, "16-bit input only");
  constexpr bool kTensor = MODE == kModeCurrent || MODE == kModeDelayed;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  // MXFP8: the threads' column maxima (kThreads uint4); tensor scaling: the
  // colwise transpose (kSlabCols x kTransposeStride words).
  __shared__ __align__(16) uint32_t exchange[kSlabCols * kTransposeStride];
  static_assert(kSlabCols * kTransposeStride >= kThreads * 4, "the exchange holds either");
  __shared__ uint32_t red[kThreads / 32];
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  QuantizeWorkspace* ws = reinterpret_cast<QuantizeWorkspace*>(p.workspace);

  // A block per slab: slab row blockIdx.x, column blockIdx.y (quantize.cc
  // sends calls with no rows to the tiled kernels).
  const int st = static_cast<int>(blockIdx.x), ct = static_cast<int>(blockIdx.y);
  const int g = FindGroupFromGuess(p, st);
  const int64_t off = p.row_off[g], K = p.k;
  const int64_t r0 = off + static_cast<int64_t>(st - p.tile_off[g]) * kSlabRows;  // the slab's first row
  const int64_t c0 = static_cast<int64_t>(ct) * kSlabCols;
  const int64_t my = (r0 + 4 * w) * K + c0 + 8 * lane;  // element offset of this thread's first row

  WaitForPrecedingGrid();
  Chunk<0> v[4];                       // 16-bit input: 8 elements as 4 words
  uint32_t row_m16[4] = {0, 0, 0, 0};  // per row: max |x| bits of the 8 elements
  uint32_t col_m2[4] = {0, 0, 0, 0};   // per column pair: max |x| bits over the 4 rows (two 16-bit halves)
  {
    const uint16_t* src = static_cast<const uint16_t*>(p.x) + my;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 u = __ldcg(reinterpret_cast<const uint4*>(src + i * K));  // coherent: see AmaxKernel
      v[i].w[0] = u.x, v[i].w[1] = u.y, v[i].w[2] = u.z, v[i].w[3] = u.w;
    }
    if constexpr (kTensor) WriteEmptyGroupScales<MODE>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t m2 = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t a = v[i].w[j] & 0x7fff7fffu;
        col_m2[j] = __vmaxu2(col_m2[j], a);
        m2 = __vmaxu2(m2, a);
      }
      row_m16[i] = max(m2 & 0xffffu, m2 >> 16);
    }
  }
  const uint32_t thread_m16 = max(max(row_m16[0], row_m16[1]), max(row_m16[2], row_m16[3]));
  const uint32_t thread_amax = AbsBitsOf<DT>(static_cast<uint16_t>(thread_m16));  // float bits
  if (p.amax != nullptr) {
    const uint32_t wm = WarpMax(thread_amax);
    if (lane == 0) red[w] = wm;
  }

  if constexpr (MODE == kModeMx) {
    // Rowwise blocks: lanes 4q .. 4q + 3, rows two to a word.
    float rs[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    bool nan_code = false;
    if (p.rowwise) {
      uint32_t r01 = row_m16[0] | (row_m16[1] << 16), r23 = row_m16[2] | (row_m16[3] << 16);
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        r01 = __vmaxu2(r01, __shfl_xor_sync(0xffffffffu, r01, o));
        r23 = __vmaxu2(r23, __shfl_xor_sync(0xffffffffu, r23, o));
      }
      const uint32_t bm[4] = {r01 & 0xffffu, r01 >> 16, r23 & 0xffffu, r23 >> 16};
      // Lane 4q + i of the quad writes row i's code (one byte store each).
      const int64_t mx_ld = RoundUp(K / 32, 4);
      uint8_t* rsc = static_cast<uint8_t*>(p.row_scale) + p.row_scale_off[g] + (r0 - off + 4 * w + (lane & 3)) * mx_ld +
                     c0 / 32 + lane / 4;
      uint32_t mine = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t b = MxCodeOcp16<DT>(bm[i], fmt);
        if ((lane & 3) == i) mine = b;
        nan_code = nan_code || b == kE8M0Nan;
        rs[i] = b == kE8M0Nan ? BitsToFloat(0x7fc00000u) : MxRecip(b);
      }
      *rsc = static_cast<uint8_t>(mine);
    }
    if (p.colwise) reinterpret_cast<uint4*>(exchange)[tid] = make_uint4(col_m2[0], col_m2[1], col_m2[2], col_m2[3]);
    __syncthreads();  // the column maxima and red are complete
    if (tid == 0 && p.amax != nullptr) FlushTileAmax(p, g, red);
    float sc[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    if (p.colwise) {
      uint4 m = reinterpret_cast<const uint4*>(exchange)[lane];
#pragma unroll
      for (int ww = 1; ww < kThreads / 32; ++ww) {
        const uint4 o = reinterpret_cast<const uint4*>(exchange)[ww * 32 + lane];
        m.x = __vmaxu2(m.x, o.x), m.y = __vmaxu2(m.y, o.y), m.z = __vmaxu2(m.z, o.z), m.w = __vmaxu2(m.w, o.w);
      }
      const uint32_t cm[4] = {m.x, m.y, m.z, m.w};
      uint8_t* csc =
          static_cast<uint8_t*>(p.col_scale) + p.col_scale_off[g] + ((r0 - off) / 32) * RoundUp(K, 128) + c0 + 8 * lane;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t b = MxCodeOcp16<DT>((j & 1) ? cm[j / 2] >> 16 : cm[j / 2] & 0xffffu, fmt);
        if (w == 0) csc[j] = static_cast<uint8_t>(b);  // (the caller's scales may sit at any address)
        nan_code = nan_code || b == kE8M0Nan;
        sc[j] = b == kE8M0Nan ? BitsToFloat(0x7fc00000u) : MxRecip(b);
      }
    }
    {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float x[8];
        ChunkFloats<DT>(reinterpret_cast<const Chunk<DT>&>(v[i]), x);
        uint2 rout = p.rowwise ? Cvt8<FMT>(x, rs[i]) : make_uint2(0, 0);
        uint2 cout = p.colwise ? Cvt8<FMT>(x, sc) : make_uint2(0, 0);
        if (nan_code) {  // rare: NaN codes (blocks holding Inf or NaN)
          if (p.rowwise) {
            const float rsi[8] = {rs[i], rs[i], rs[i], rs[i], rs[i], rs[i], rs[i], rs[i]};
            rout = NanFix<FMT>(rout, v[i], rsi);
          }
          if (p.colwise) cout = NanFix<FMT>(cout, v[i], sc);
        }
        if (p.rowwise) __stcs(reinterpret_cast<uint2*>(p.row_data + my + i * K), rout);
        if (p.colwise) __stcs(reinterpret_cast<uint2*>(p.col_data + my + i * K), cout);
      }
    }
    // The group's scale padding, shared among its slabs (one block per group
    // made those blocks the launch's slowest).
    const int parts = (p.tile_off[g + 1] - p.tile_off[g]) * p.col_tiles;
    const int part = (st - p.tile_off[g]) * p.col_tiles + ct;
    ZeroMxGroupPadding(p, MxGroupPaddingOf(p, g), int64_t{part} * kThreads, int64_t{parts} * kThreads);
  } else {
    float s;
    bool may_nan;
    if constexpr (MODE == kModeCurrent) {
      // The group's amax from every block that holds its rows.
      __syncthreads();
      if (tid == 0) FlushTileAmax(p, g, red);
      GridBarrier(ws);
      if (blockIdx.x == 0 && blockIdx.y == 0 && p.amax_out != nullptr) PublishAmax(p);
      const float gamax = __ldcg(p.amax + g);
      s = ScaleFromAmax(gamax, Fp8Max(fmt), p.pow2);
      may_nan = (FloatBits(gamax) & 0x7fffffffu) > 0x7f800000u;
    } else {
      s = __ldg(p.scale + g);  // (after the wait: see the tiled kernel)
      may_nan = thread_amax > 0x7f800000u;
      __syncthreads();  // red
      if (tid == 0) FlushTileAmax(p, g, red);
    }
    if (st == p.tile_off[g] && ct == 0 && tid == 0) {  // the group's first slab
      const float sinv = ScaleInv(s);
      if (p.rowwise) static_cast<float*>(p.row_scale)[g] = sinv;
      if (p.colwise) static_cast<float*>(p.col_scale)[g] = sinv;
    }
    uint2 q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // (f16 NaN through the hardware conversion loses its sign, which
        // the NaN rule keeps: the software decode where NaN may be.)
        const Chunk<DT>& c = reinterpret_cast<const Chunk<DT>&>(v[i]);
        const float2 x = may_nan ? make_float2(Elem<DT>(c, 2 * j), Elem<DT>(c, 2 * j + 1)) : Pair<DT>(c, j);
        f[2 * j] = x.x, f[2 * j + 1] = x.y;
      }
      q[i] = Quant8<FMT>(f, s, false, false, may_nan);
      if (p.rowwise) __stcs(reinterpret_cast<uint2*>(p.row_data + my + i * K), q[i]);
    }
    if (p.colwise) {
      // Column j of this thread: its 4 rows' bytes in one word (a 4 x 4 byte
      // transpose per half), at the swizzled slot of row group w.
      const int slot = w ^ ((lane >> 2) & 7);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t a0 = h ? q[0].y : q[0].x, a1 = h ? q[1].y : q[1].x;
        const uint32_t a2 = h ? q[2].y : q[2].x, a3 = h ? q[3].y : q[3].x;
        const uint32_t lo01 = __byte_perm(a0, a1, 0x5140), lo23 = __byte_perm(a2, a3, 0x5140);
        const uint32_t hi01 = __byte_perm(a0, a1, 0x7362), hi23 = __byte_perm(a2, a3, 0x7362);
        const uint32_t col[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                                 __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
        for (int j = 0; j < 4; ++j) exchange[(8 * lane + 4 * h + j) * kTransposeStride + slot] = col[j];
      }
    }
    if (p.colwise) __syncthreads();  // the transpose
    if (p.colwise) {
      // Thread t writes column t's 32 bytes: rows r0 .. r0 + 31 of the group's [k][m_g].
      const int t = tid, wlane_group = ((t / 8) >> 2) & 7;
      uint32_t col[8];
#pragma unroll
      for (int rg = 0; rg < 8; ++rg) col[rg] = exchange[t * kTransposeStride + (rg ^ wlane_group)];
      const int64_t mg = p.row_off[g + 1] - off;
      uint4* dst = reinterpret_cast<uint4*>(p.col_data + off * K + (c0 + t) * mg + (r0 - off));
      __stcs(dst, make_uint4(col[0], col[1], col[2], col[3]));
      __stcs(dst + 1, make_uint4(col[4], col[5], col[6], col[7]));
    }
  }
  AllowDependentLaunch();  // (every thread has waited, above)
  // Current scaling: since arriving at the barrier, every block has only
  // read the workspace (its counter, the group amax, block 0's copy), and
  // used those values before the count's barrier; the relaxed count relies
  // on that.
  if (ws != nullptr) FinishWithWorkspace(p, /*release=*/false);
}

template <int DT, int MODE, int FMT, class P>
cudaError_t LaunchT(const P& p, cudaStream_t stream) {
  // (No rows: the tiled kernels' launch.) A slab row per x, column per y.
  if (p.total_tiles <= 0 || p.col_tiles <= 0 || p.col_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 blocks(static_cast<unsigned>(p.total_tiles), static_cast<unsigned>(p.col_tiles));
  // Current scaling's grid barrier needs every block resident: a cooperative launch.
  if constexpr (MODE == kModeCurrent) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
  }
  return LaunchAsDependent(OneShotKernel<DT, MODE, FMT, P>, blocks, 0, stream, p, /*cooperative=*/MODE == kModeCurrent);
}

template <int DT, int MODE, int FMT>
cudaError_t CapacityT(int* blocks, int* sms) {
  int device = 0, per_sm = 0, cooperative = 0;
  *sms = 0, *blocks = 0;
  // Both parameter sizes' kernels (their registers may differ): the fewer.
  int per_sm_small = 0;
  cudaError_t e = KernelResidency(reinterpret_cast<const void*>(OneShotKernel<DT, MODE, FMT, QuantizeParams>), 0, sms,
                                  &per_sm);
  if (e == cudaSuccess) {
    e = KernelResidency(reinterpret_cast<const void*>(OneShotKernel<DT, MODE, FMT, QuantizeParamsT<kSmallGpuGroups>>),
                        0, sms, &per_sm_small);
  }
  per_sm = std::min(per_sm, per_sm_small);
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device);
  // Current scaling's grid barrier needs a cooperative launch.
  if (e == cudaSuccess && (MODE != kModeCurrent || cooperative)) *blocks = *sms * per_sm;
  return e;
}

// Dispatch on the input type, mode and format (QuantizeParams' codes).
template <template <int, int, int> class F, typename... A>
cudaError_t Dispatch(int x_dtype, int mode_code, int format, A... args) {
  auto by_fmt = [&](auto dt, auto mode) {
    return format == 0 ? F<decltype(dt)::value, decltype(mode)::value, 0>::Run(args...)
                       : F<decltype(dt)::value, decltype(mode)::value, 1>::Run(args...);
  };
  auto by_mode = [&](auto dt) {
    switch (mode_code) {
      case kModeCurrent:
        return by_fmt(dt, std::integral_constant<int, kModeCurrent>());
      case kModeDelayed:
        return by_fmt(dt, std::integral_constant<int, kModeDelayed>());
      case kModeMx:
        return by_fmt(dt, std::integral_constant<int, kModeMx>());
    }
    return cudaErrorInvalidValue;
  };
  switch (x_dtype) {
    case 0:
      return by_mode(std::integral_constant<int, 0>());
    case 1:
      return by_mode(std::integral_constant<int, 1>());
  }
  return cudaErrorInvalidValue;
}

template <int DT, int MODE, int FMT>
struct LaunchF {
  template <class P>
  static cudaError_t Run(const P* p, cudaStream_t stream) {
    return LaunchT<DT, MODE, FMT>(*p, stream);
  }
};
template <int DT, int MODE, int FMT>
struct CapacityF {
  static cudaError_t Run(int* blocks, int* sms) { return CapacityT<DT, MODE, FMT>(blocks, sms); }
};

}  // namespace

cudaError_t LaunchOneShotQuantize(const QuantizeParams& p, cudaStream_t stream) {
  if (p.tile_rows != kSlabRows || p.k % kSlabCols != 0) return cudaErrorInvalidValue;
  return LaunchWithFittingParams(p, [&](const auto& q) { return Dispatch<LaunchF>(p.x_dtype, p.mode, p.format, &q, stream); });
}

cudaError_t OneShotCapacity(int x_dtype, int mode, int format, int* blocks, int* sms) {
  return Dispatch<CapacityF>(x_dtype, mode, format, blocks, sms);
}

}  // namespace cuda_internal
}  // namespace shardgemm
