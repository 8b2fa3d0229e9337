// Grouped quantize / dequantize kernels. The math is kernels/fp8.h's, the
// same functions the CPU reference calls, so results match bit for bit; the
// FP8 conversion itself uses the hardware cvt.rn.satfinite (two elements per
// instruction) with fp8.h's NaN rule, checked equal to the software
// conversion for every float by LaunchExhaustiveCvtCheck (and a software path
// is kept behind QuantizeParams::software_cvt).
//
// One launch covers all groups: the grid is (row tiles of every group) x
// (128-column tiles); a block finds its group by binary search in the
// per-group tile prefix sums passed as __grid_constant__ parameters.
// Tiles are 128 rows x 128 columns in every mode (a multiple of the MXFP8 and
// FP8-block heights, rows counted from each group's first row). 256 threads;
// each loads eight 16-byte vectors up front, rowwise outputs are 8-byte vector
// stores, colwise outputs read the tile from shared memory (transposed outputs
// are 16-byte stores when aligned). Current scaling's amax pass reads whole-row
// tiles of about 64 KiB with four 16-byte loads per thread in flight.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda_internal {
namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = 128;
constexpr int kModeCurrent = 0, kModeDelayed = 1, kModeMx = 2, kModeB1x128 = 3, kModeB128 = 4;

template <int DT> struct InType;
template <> struct InType<0> { using T = uint16_t; };
template <> struct InType<1> { using T = uint16_t; };
template <> struct InType<2> { using T = float; };

template <int DT, typename T>
__device__ __forceinline__ float ToFloat(T v) {
  if constexpr (DT == 0) {
    return Bf16BitsToFloat(v);
  } else if constexpr (DT == 1) {
    return F16BitsToFloat(v);
  } else {
    return v;
  }
}

// Eight elements as raw 32-bit words (16-bit types stay packed two to a word,
// which keeps register use down).
template <int DT>
struct alignas(16) Chunk {
  uint32_t w[DT == 2 ? 8 : 4];
};

template <int DT>
__device__ __forceinline__ Chunk<DT> LoadChunk(const void* p) {
  Chunk<DT> r;
  const uint4* s = static_cast<const uint4*>(p);
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Chunk<DT>) / 16); ++i) d[i] = __ldg(s + i);
  return r;
}
template <int DT>
__device__ __forceinline__ Chunk<DT> ZeroChunk() {
  Chunk<DT> r;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Chunk<DT>) / 4); ++i) r.w[i] = 0;
  return r;
}
// Element j as float.
template <int DT>
__device__ __forceinline__ float Elem(const Chunk<DT>& c, int j) {
  if constexpr (DT == 0) {
    return BitsToFloat((j & 1) ? (c.w[j / 2] & 0xffff0000u) : (c.w[j / 2] << 16));
  } else if constexpr (DT == 1) {
    return F16BitsToFloat(static_cast<uint16_t>((j & 1) ? (c.w[j / 2] >> 16) : (c.w[j / 2] & 0xffffu)));
  } else {
    return BitsToFloat(c.w[j]);
  }
}
// max |x| over the chunk, as float bits (NaN-propagating).
template <int DT>
__device__ __forceinline__ uint32_t ChunkAbsMax(const Chunk<DT>& c) {
  if constexpr (DT == 2) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, c.w[j] & 0x7fffffffu);
    return m;
  } else {
    uint32_t m2 = __vmaxu2(__vmaxu2(c.w[0] & 0x7fff7fffu, c.w[1] & 0x7fff7fffu),
                           __vmaxu2(c.w[2] & 0x7fff7fffu, c.w[3] & 0x7fff7fffu));
    const uint16_t m16 = static_cast<uint16_t>(max(m2 & 0xffffu, m2 >> 16));
    return FloatBits(ToFloat<DT>(m16));
  }
}

constexpr int kTileRows = 128;  // every mode: a multiple of the MXFP8 (32) and block (128) heights

// Blocks per SM the register budget is sized for (memory-bound: occupancy first).
constexpr int MinBlocks(int dt) { return dt == 2 ? 2 : 3; }

// Two elements through the hardware conversion (x0 in the low byte), with the
// shared NaN rule applied on the unscaled inputs.
template <int FMT>
__device__ __forceinline__ uint32_t HwQuant2(float x0, float x1, float s) {
  __nv_fp8x2_storage_t r = __nv_cvt_float2_to_fp8x2(make_float2(x0 * s, x1 * s), __NV_SATFINITE,
                                                      FMT == 0 ? __NV_E4M3 : __NV_E5M2);
  uint32_t b0 = r & 0xffu, b1 = (r >> 8) & 0xffu;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  if (IsNanBits(x0)) b0 = Fp8NanWithSignOf(x0, fmt);
  if (IsNanBits(x1)) b1 = Fp8NanWithSignOf(x1, fmt);
  return b0 | (b1 << 8);
}

// Quantizes 8 elements with scale s into 8 bytes (element 0 in the low byte).
// nan_block: the MX block's scale is NaN -> every element is NaN.
template <int FMT>
__device__ __forceinline__ uint2 Quant8(const float (&f)[8], float s, bool sw, bool nan_block) {
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  uint32_t w[2];
  if (nan_block) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[h] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w[h] |= static_cast<uint32_t>(Fp8NanWithSignOf(f[h * 4 + j], fmt)) << (8 * j);
    }
  } else if (sw) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[h] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w[h] |= static_cast<uint32_t>(QuantizeScaled(f[h * 4 + j], s, fmt)) << (8 * j);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[h] = HwQuant2<FMT>(f[h * 4], f[h * 4 + 1], s) | (HwQuant2<FMT>(f[h * 4 + 2], f[h * 4 + 3], s) << 16);
    }
  }
  return make_uint2(w[0], w[1]);
}

template <int FMT>
__device__ __forceinline__ uint8_t Quant1(float x, float s, bool sw, bool nan_block) {
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  if (nan_block) return Fp8NanWithSignOf(x, fmt);
  if (sw) return QuantizeScaled(x, s, fmt);
  return static_cast<uint8_t>(HwQuant2<FMT>(x, 0.0f, s) & 0xffu);
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }

// Block-wide max; `red` holds kThreads / 32 words; all threads get the result.
__device__ __forceinline__ uint32_t BlockMax(uint32_t v, uint32_t* red) {
  v = WarpMax(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) r = max(r, red[i]);
  return r;
}

__device__ __forceinline__ int FindGroup(const QuantizeParams& p, int t) {
  int lo = 0, hi = p.num_groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.tile_off[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

template <int DT, typename T>
__device__ __forceinline__ uint32_t AbsBitsOf(T v) {
  return FloatBits(ToFloat<DT>(v)) & 0x7fffffffu;
}

// ---- current scaling, pass 1: per-group amax -------------------------------
// A tile is p.tile_rows whole rows of one group (about 64 KiB): contiguous
// memory, read as 16-byte vectors, four independent loads per thread in flight.
template <int DT>
__device__ __forceinline__ uint32_t AmaxOfVec(uint4 w) {
  if constexpr (DT == 2) {
    uint32_t m = max(max(w.x & 0x7fffffffu, w.y & 0x7fffffffu), max(w.z & 0x7fffffffu, w.w & 0x7fffffffu));
    return m;
  } else {
    // 16-bit |x| bits order like the values (NaN above Inf): max first, convert once.
    uint32_t m2 = __vmaxu2(__vmaxu2(w.x & 0x7fff7fffu, w.y & 0x7fff7fffu), __vmaxu2(w.z & 0x7fff7fffu, w.w & 0x7fff7fffu));
    const uint16_t m16 = static_cast<uint16_t>(max(m2 & 0xffffu, m2 >> 16));
    return FloatBits(ToFloat<DT>(m16));
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ QuantizeParams p) {
  using T = typename InType<DT>::T;
  __shared__ uint32_t red[kThreads / 32];
  const int t = blockIdx.x;
  const int g = FindGroup(p, t);
  const int64_t off = p.row_off[g];
  const int64_t r0 = off + static_cast<int64_t>(t - p.tile_off[g]) * p.tile_rows;
  const int64_t nrows = min(static_cast<int64_t>(p.tile_rows), p.row_off[g + 1] - r0);
  const uint4* base = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + r0 * p.k);
  const int64_t nvec = nrows * p.k * static_cast<int64_t>(sizeof(T)) / 16;
  uint32_t am = 0;
  for (int64_t i = threadIdx.x; i < nvec; i += 4 * kThreads) {
    uint4 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t idx = i + j * kThreads;
      w[j] = idx < nvec ? __ldg(base + idx) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) am = max(am, AmaxOfVec<DT>(w[j]));
  }
  am = BlockMax(am, red);
  if (threadIdx.x == 0 && am != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax) + g, am);
}

// ---- the quantize pass -------------------------------------------------------
// Tile: 128 rows (from the group's first row) x 128 columns; 256 threads, each
// loading eight 16-byte chunks up front. Rowwise from registers; colwise from
// the tile in shared memory, thread (c = tid % 128, part = tid / 128) taking
// column c over rows part*64 .. +64 (two MXFP8 column blocks, half a 1x128
// column block), in fully unrolled loops.
template <int DT, int MODE, int FMT>
__global__ void __launch_bounds__(kThreads, MinBlocks(DT)) QuantizeKernel(const __grid_constant__ QuantizeParams p) {
  using T = typename InType<DT>::T;
  constexpr int TR = kTileRows;
  constexpr int NCH = TR * (kTileCols / 8) / kThreads;  // 8-element chunks per thread
  constexpr int HR = TR / 2;                              // colwise rows per thread
  constexpr bool kTensor = MODE == kModeCurrent || MODE == kModeDelayed;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);  // [TR][128], colwise only
  __shared__ uint32_t red[kThreads / 32];
  __shared__ uint32_t col_red[kTileCols];

  const int tid = threadIdx.x;
  const int t = blockIdx.x / p.col_tiles, ct = blockIdx.x % p.col_tiles;
  const int g = FindGroup(p, t);
  const int64_t off = p.row_off[g];
  const int64_t mg = p.row_off[g + 1] - off;
  const int64_t r0 = off + static_cast<int64_t>(t - p.tile_off[g]) * TR;
  const int nrows = static_cast<int>(min(static_cast<int64_t>(TR), off + mg - r0));
  const int64_t K = p.k;
  const int64_t c0 = static_cast<int64_t>(ct) * kTileCols;
  const int ncols = static_cast<int>(min(static_cast<int64_t>(kTileCols), K - c0));
  const T* x = static_cast<const T*>(p.x);
  const bool sw = p.software_cvt;
  const float fmax = Fp8Max(fmt);

  float tscale = 1.0f;
  if constexpr (MODE == kModeCurrent) tscale = ScaleFromAmax(p.amax[g], fmax, p.pow2);
  if constexpr (MODE == kModeDelayed) tscale = p.scale[g];
  if constexpr (kTensor) {
    if (t == p.tile_off[g] && ct == 0 && tid == 0) {
      const float sinv = ScaleInv(tscale);
      if (p.rowwise) static_cast<float*>(p.row_scale)[g] = sinv;
      if (p.colwise) static_cast<float*>(p.col_scale)[g] = sinv;
    }
    if (blockIdx.x == 0) {  // empty groups have no tiles: their scale_inv here
      for (int h = tid; h < p.num_groups; h += kThreads) {
        if (p.row_off[h + 1] == p.row_off[h]) {
          const float sinv = MODE == kModeCurrent ? 1.0f : ScaleInv(p.scale[h]);
          if (p.rowwise) static_cast<float*>(p.row_scale)[h] = sinv;
          if (p.colwise) static_cast<float*>(p.col_scale)[h] = sinv;
        }
      }
    }
  }

  // Load the tile: chunk ch covers row ch / 16, columns (ch % 16) * 8 .. + 8.
  Chunk<DT> v[NCH];
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int ch = tid + i * kThreads, rr = ch / 16, cc = ch % 16;
    const bool valid = rr < nrows && cc * 8 < ncols;
    v[i] = valid ? LoadChunk<DT>(x + (r0 + rr) * K + c0 + cc * 8) : ZeroChunk<DT>();
  }
  uint32_t am = 0;
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int ch = tid + i * kThreads, rr = ch / 16, cc = ch % 16;
    if (p.colwise) *reinterpret_cast<Chunk<DT>*>(tile + rr * kTileCols + cc * 8) = v[i];
    if (MODE != kModeCurrent) am = max(am, ChunkAbsMax<DT>(v[i]));
  }
  // Tile amax: the 128x128 block's scale, and the fused per-group amax.
  float bscale = 1.0f;
  if (MODE == kModeB128 || (MODE != kModeCurrent && p.amax != nullptr)) {
    const uint32_t tam = BlockMax(am, red);
    if (MODE != kModeCurrent && p.amax != nullptr && tid == 0 && tam != 0) {
      atomicMax(reinterpret_cast<unsigned int*>(p.amax) + g, tam);
    }
    if constexpr (MODE == kModeB128) {
      bscale = ScaleFromAmax(BitsToFloat(tam), fmax, p.pow2);
      if (tid == 0) {
        const int64_t rb = (r0 - off) / 128;
        if (p.rowwise) {
          static_cast<float*>(p.row_scale)[p.row_scale_off[g] + rb * RoundUp((K + 127) / 128, 4) + ct] =
              ScaleInv(bscale);
        }
        if (p.colwise) {
          static_cast<float*>(p.col_scale)[p.col_scale_off[g] + ct * RoundUp((mg + 127) / 128, 4) + rb] =
              ScaleInv(bscale);
        }
      }
    }
  }

  // ---- rowwise ----
  if (p.rowwise) {
    // Per-chunk |x| maxima first (short live ranges), then scales, then quantize.
    uint32_t cam[NCH];
#pragma unroll
    for (int i = 0; i < NCH; ++i) cam[i] = ChunkAbsMax<DT>(v[i]);
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int ch = tid + i * kThreads, rr = ch / 16, cc = ch % 16;
      const bool valid = rr < nrows && cc * 8 < ncols;
      float s = kTensor ? tscale : bscale;
      bool nan_block = false;
      if constexpr (MODE == kModeMx) {  // 32-element block = 4 adjacent lanes
        uint32_t m = cam[i];
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const uint8_t b = MxScaleFromAmax(BitsToFloat(m), fmt, static_cast<MxScaleRecipe>(p.mx_recipe));
        if (valid && (cc & 3) == 0) {
          static_cast<uint8_t*>(p.row_scale)[p.row_scale_off[g] + (r0 + rr - off) * RoundUp(K / 32, 4) +
                                             (c0 + cc * 8) / 32] = b;
        }
        nan_block = b == kE8M0Nan;
        s = nan_block ? 1.0f : E8M0ReciprocalToFloat(b);
      }
      if constexpr (MODE == kModeB1x128) {  // 128-element block = 16 lanes
        uint32_t m = cam[i];
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        s = ScaleFromAmax(BitsToFloat(m), fmax, p.pow2);
        if (valid && cc == 0) {
          static_cast<float*>(p.row_scale)[p.row_scale_off[g] + ct * RoundUp(mg, 4) + (r0 + rr - off)] =
              ScaleInv(s);
        }
      }
      if (valid) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = Elem<DT>(v[i], j);
        *reinterpret_cast<uint2*>(p.row_data + (r0 + rr) * K + c0 + cc * 8) = Quant8<FMT>(f, s, sw, nan_block);
      }
    }
  }

  // ---- colwise ----
  if (p.colwise) {
    __syncthreads();
    const int c = tid % kTileCols, part = tid / kTileCols;
    const bool cvalid = c < ncols;
    const int rbeg = part * HR;
    const T* col = tile + c;  // rows beyond nrows hold zeros
    if constexpr (MODE == kModeMx) {
      // Two 32-row MXFP8 blocks; not transposed: (r, c) at r * K + c (a warp stores 32 contiguous bytes).
#pragma unroll
      for (int sb = 0; sb < 2; ++sb) {
        const int rb0 = rbeg + sb * 32;
        uint32_t cam = 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) cam = max(cam, AbsBitsOf<DT>(col[(rb0 + j) * kTileCols]));
        if (cvalid && rb0 < nrows) {
          const uint8_t b = MxScaleFromAmax(BitsToFloat(cam), fmt, static_cast<MxScaleRecipe>(p.mx_recipe));
          static_cast<uint8_t*>(p.col_scale)[p.col_scale_off[g] + ((r0 - off + rb0) / 32) * RoundUp(K, 128) + c0 + c] =
              b;
          const bool nan_block = b == kE8M0Nan;
          const float s = nan_block ? 1.0f : E8M0ReciprocalToFloat(b);
          uint8_t* out = p.col_data + (r0 + rb0) * K + c0 + c;
          const int nv = min(32, nrows - rb0);
          if (nv == 32 && !nan_block) {
#pragma unroll
            for (int j = 0; j < 32; j += 2) {
              const float f0 = ToFloat<DT>(col[(rb0 + j) * kTileCols]);
              const float f1 = ToFloat<DT>(col[(rb0 + j + 1) * kTileCols]);
              const uint32_t q = sw ? (QuantizeScaled(f0, s, fmt) | (QuantizeScaled(f1, s, fmt) << 8))
                                    : HwQuant2<FMT>(f0, f1, s);
              out[j * K] = static_cast<uint8_t>(q & 0xffu);
              out[(j + 1) * K] = static_cast<uint8_t>(q >> 8);
            }
          } else {
            for (int j = 0; j < nv; ++j) out[j * K] = Quant1<FMT>(ToFloat<DT>(col[(rb0 + j) * kTileCols]), s, sw, nan_block);
          }
        }
      }
    } else {
      float s = kTensor ? tscale : bscale;
      if constexpr (MODE == kModeB1x128) {  // one 128-row block: both halves' amax
        uint32_t cam = 0;
#pragma unroll
        for (int j = 0; j < HR; ++j) cam = max(cam, AbsBitsOf<DT>(col[(rbeg + j) * kTileCols]));
        if (part == 1) col_red[c] = cam;
        __syncthreads();
        if (part == 0) col_red[c] = max(cam, col_red[c]);
        __syncthreads();
        cam = col_red[c];
        s = ScaleFromAmax(BitsToFloat(cam), fmax, p.pow2);
        if (part == 0 && cvalid) {
          static_cast<float*>(p.col_scale)[p.col_scale_off[g] + ((r0 - off) / 128) * RoundUp(K, 4) + c0 + c] =
              ScaleInv(s);
        }
      }
      if (cvalid) {
        // Transposed per group: (r, c) at off*K + c*mg + (r - off); 16-byte stores when aligned.
        uint8_t* out = p.col_data + off * K + (c0 + c) * mg + (r0 - off);
        const bool aligned = ((off * K) % 16 == 0) && (mg % 16 == 0);
#pragma unroll
        for (int seg = 0; seg < HR / 16; ++seg) {
          const int r = rbeg + seg * 16;
          if (r >= nrows) break;
          if (aligned && r + 16 <= nrows) {
            float f[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) f[j] = ToFloat<DT>(col[(r + j) * kTileCols]);
            const uint2 lo = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[0]), s, sw, false);
            const uint2 hi = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[8]), s, sw, false);
            *reinterpret_cast<uint4*>(out + r) = make_uint4(lo.x, lo.y, hi.x, hi.y);
          } else {
            for (int j = r; j < min(r + 16, nrows); ++j) out[j] = Quant1<FMT>(ToFloat<DT>(col[j * kTileCols]), s, sw, false);
          }
        }
      }
    }
  }
}

template <int DT, int MODE, int FMT>
cudaError_t LaunchQuantizeT(const QuantizeParams& p, cudaStream_t stream) {
  constexpr int TR = kTileRows;
  const size_t smem = p.colwise ? static_cast<size_t>(TR) * kTileCols * sizeof(typename InType<DT>::T) : 0;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(QuantizeKernel<DT, MODE, FMT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  const int64_t blocks = static_cast<int64_t>(p.total_tiles) * p.col_tiles;
  if (blocks == 0) return cudaSuccess;
  QuantizeKernel<DT, MODE, FMT><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int DT, int MODE>
cudaError_t LaunchQuantizeF(const QuantizeParams& p, cudaStream_t stream) {
  return p.format == 0 ? LaunchQuantizeT<DT, MODE, 0>(p, stream) : LaunchQuantizeT<DT, MODE, 1>(p, stream);
}
template <int DT>
cudaError_t LaunchQuantizeM(const QuantizeParams& p, cudaStream_t stream) {
  switch (p.mode) {
    case kModeCurrent: return LaunchQuantizeF<DT, kModeCurrent>(p, stream);
    case kModeDelayed: return LaunchQuantizeF<DT, kModeDelayed>(p, stream);
    case kModeMx: return LaunchQuantizeF<DT, kModeMx>(p, stream);
    case kModeB1x128: return LaunchQuantizeF<DT, kModeB1x128>(p, stream);
    case kModeB128: return LaunchQuantizeF<DT, kModeB128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// ---- dequantize ---------------------------------------------------------------
__global__ void DequantizeKernel(const __grid_constant__ DequantizeParams p) {
  const int64_t total = p.m * p.k;
  const int64_t used = static_cast<int64_t>(p.row_off[p.num_groups]) * p.k;
  const Fp8Format fmt = static_cast<Fp8Format>(p.format);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = 0.0f;
    if (i < used) {
      const int64_t r = i / p.k, c = i % p.k;
      int lo = 0, hi = p.num_groups;
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (p.row_off[mid] <= r) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      // Skip empty groups that share the start row.
      while (lo + 1 < p.num_groups && p.row_off[lo + 1] <= r) ++lo;
      const int g = lo;
      const int64_t off = p.row_off[g], mg = p.row_off[g + 1] - off, rl = r - off;
      const bool transposed = p.colwise && p.mode != kModeMx;
      const uint8_t q = transposed ? p.data[off * p.k + c * mg + rl] : p.data[i];
      const float* sf = static_cast<const float*>(p.scale_inv);
      const uint8_t* s8 = static_cast<const uint8_t*>(p.scale_inv);
      const int64_t so = p.scale_off[g], ld = p.scale_ld[g];
      float s = 1.0f;
      switch (p.mode) {
        case kModeCurrent:
        case kModeDelayed: s = sf[g]; break;
        case kModeMx: s = E8M0ToFloat(p.colwise ? s8[so + (rl / 32) * ld + c] : s8[so + rl * ld + c / 32]); break;
        case kModeB1x128: s = p.colwise ? sf[so + (rl / 128) * ld + c] : sf[so + (c / 128) * ld + rl]; break;
        case kModeB128: s = p.colwise ? sf[so + (c / 128) * ld + rl / 128] : sf[so + (rl / 128) * ld + c / 128]; break;
      }
      v = DequantizeValue(q, fmt, s);
    }
    switch (p.out_dtype) {
      case 0: static_cast<uint16_t*>(p.out)[i] = FloatToBf16Bits(v); break;
      case 1: static_cast<uint16_t*>(p.out)[i] = FloatToF16Bits(v); break;
      default: static_cast<float*>(p.out)[i] = v; break;
    }
  }
}

// ---- exhaustive conversion check ------------------------------------------------
__global__ void CvtCheckKernel(unsigned long long* mismatches) {
  unsigned long long bad[2] = {0, 0};
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float x = BitsToFloat(static_cast<uint32_t>(i));
    if ((HwQuant2<0>(x, 0.0f, 1.0f) & 0xffu) != QuantizeScaled(x, 1.0f, Fp8Format::kE4M3)) ++bad[0];
    if ((HwQuant2<1>(x, 0.0f, 1.0f) & 0xffu) != QuantizeScaled(x, 1.0f, Fp8Format::kE5M2)) ++bad[1];
    // The high byte of the pair too.
    if (((HwQuant2<0>(0.0f, x, 1.0f) >> 8) & 0xffu) != QuantizeScaled(x, 1.0f, Fp8Format::kE4M3)) ++bad[0];
  }
  if (bad[0]) atomicAdd(mismatches, bad[0]);
  if (bad[1]) atomicAdd(mismatches + 1, bad[1]);
}

}  // namespace

cudaError_t LaunchGroupedAmax(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t blocks = p.total_tiles;  // whole-row tiles
  if (blocks == 0) return cudaSuccess;
  switch (p.x_dtype) {
    case 0: AmaxKernel<0><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p); break;
    case 1: AmaxKernel<1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p); break;
    default: AmaxKernel<2><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchGroupedQuantize(const QuantizeParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case 0: return LaunchQuantizeM<0>(p, stream);
    case 1: return LaunchQuantizeM<1>(p, stream);
    default: return LaunchQuantizeM<2>(p, stream);
  }
}

cudaError_t LaunchGroupedDequantize(const DequantizeParams& p, cudaStream_t stream) {
  const int64_t total = p.m * p.k;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = (total + 255) / 256;
  DequantizeKernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchExhaustiveCvtCheck(unsigned long long* mismatches, cudaStream_t stream) {
  CvtCheckKernel<<<132 * 16, 256, 0, stream>>>(mismatches);
  return cudaGetLastError();
}

}  // namespace cuda_internal
}  // namespace shardgemm
