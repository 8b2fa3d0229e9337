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
// Tile rows: 32 for MXFP8 (the colwise block), 64 for tensor scaling, 128 for
// the FP8 block modes. 256 threads; each loads 16-byte vectors (8 elements),
// rowwise outputs are 8-byte vector stores, colwise outputs go through a
// shared-memory tile (transposed outputs are 16-byte stores when aligned).
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

template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

template <typename T>
__device__ __forceinline__ Vec8<T> LoadVec8(const T* p) {
  Vec8<T> r;
  const uint4* s = reinterpret_cast<const uint4*>(p);
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec8<T>) / 16); ++i) d[i] = __ldg(s + i);
  return r;
}
template <typename T>
__device__ __forceinline__ Vec8<T> ZeroVec8() {
  Vec8<T> r;
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec8<T>) / 16); ++i) d[i] = make_uint4(0, 0, 0, 0);
  return r;
}

constexpr int RowsPerTile(int mode) {
  return mode == kModeMx ? 32 : (mode == kModeCurrent || mode == kModeDelayed) ? 64 : 128;
}

// Blocks per SM the register budget is sized for (memory-bound: occupancy first).
constexpr int MinBlocks(int mode) {
  return (mode == kModeCurrent || mode == kModeMx) ? 4 : mode == kModeDelayed ? 3 : 2;
}

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
template <int DT>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ QuantizeParams p) {
  using T = typename InType<DT>::T;
  constexpr int TR = 64;
  constexpr int NCH = TR * (kTileCols / 8) / kThreads;
  __shared__ uint32_t red[kThreads / 32];
  const int t = blockIdx.x / p.col_tiles, ct = blockIdx.x % p.col_tiles;
  const int g = FindGroup(p, t);
  const int64_t off = p.row_off[g];
  const int64_t r0 = off + static_cast<int64_t>(t - p.tile_off[g]) * TR;
  const int nrows = min(static_cast<int64_t>(TR), p.row_off[g + 1] - r0);
  const int64_t c0 = static_cast<int64_t>(ct) * kTileCols;
  const int ncols = static_cast<int>(min(static_cast<int64_t>(kTileCols), p.k - c0));
  const T* x = static_cast<const T*>(p.x);
  uint32_t am = 0;
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int ch = threadIdx.x + i * kThreads, rr = ch / 16, cc = ch % 16;
    if (rr < nrows && cc * 8 < ncols) {
      Vec8<T> v = LoadVec8(x + (r0 + rr) * p.k + c0 + cc * 8);
      if constexpr (DT == 2) {
#pragma unroll
        for (int j = 0; j < 8; ++j) am = max(am, FloatBits(v.v[j]) & 0x7fffffffu);
      } else {
        // 16-bit |x| bits order like the values (NaN above Inf): max first, convert once.
        const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
        uint32_t m2 = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) m2 = __vmaxu2(m2, w[j] & 0x7fff7fffu);
        const uint16_t m16 = static_cast<uint16_t>(max(m2 & 0xffffu, m2 >> 16));
        am = max(am, FloatBits(ToFloat<DT>(m16)));
      }
    }
  }
  am = BlockMax(am, red);
  if (threadIdx.x == 0 && am != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax) + g, am);
}

// ---- the quantize pass -------------------------------------------------------
template <int DT, int MODE, int FMT>
__global__ void __launch_bounds__(kThreads, MinBlocks(MODE)) QuantizeKernel(const __grid_constant__ QuantizeParams p) {
  using T = typename InType<DT>::T;
  constexpr int TR = RowsPerTile(MODE);
  constexpr int NCH = TR * (kTileCols / 8) / kThreads;  // 8-element chunks per thread
  constexpr int HR = TR / 2;                              // colwise rows per thread
  constexpr bool kTensor = MODE == kModeCurrent || MODE == kModeDelayed;
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);  // [TR][128], colwise only
  __shared__ uint32_t red[kThreads / 32];
  __shared__ uint32_t red2[kThreads / 32];
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
  Vec8<T> v[NCH];
  uint32_t am = 0;
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int ch = tid + i * kThreads, rr = ch / 16, cc = ch % 16;
    const bool valid = rr < nrows && cc * 8 < ncols;
    v[i] = valid ? LoadVec8(x + (r0 + rr) * K + c0 + cc * 8) : ZeroVec8<T>();
    if (p.colwise) *reinterpret_cast<Vec8<T>*>(tile + rr * kTileCols + cc * 8) = v[i];
    if (MODE != kModeCurrent) {
#pragma unroll
      for (int j = 0; j < 8; ++j) am = max(am, AbsBitsOf<DT>(v[i].v[j]));
    }
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
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int ch = tid + i * kThreads, rr = ch / 16, cc = ch % 16;
      const bool valid = rr < nrows && cc * 8 < ncols;
      float f[8];
      uint32_t cam = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        f[j] = ToFloat<DT>(v[i].v[j]);
        cam = max(cam, FloatBits(f[j]) & 0x7fffffffu);
      }
      float s = kTensor ? tscale : bscale;
      bool nan_block = false;
      if constexpr (MODE == kModeMx) {  // 32-element block = 4 adjacent lanes
        cam = max(cam, __shfl_xor_sync(0xffffffffu, cam, 1));
        cam = max(cam, __shfl_xor_sync(0xffffffffu, cam, 2));
        const uint8_t b = MxScaleFromAmax(BitsToFloat(cam), fmt, static_cast<MxScaleRecipe>(p.mx_recipe));
        if (valid && (cc & 3) == 0) {
          static_cast<uint8_t*>(p.row_scale)[p.row_scale_off[g] + (r0 + rr - off) * RoundUp(K / 32, 4) +
                                             (c0 + cc * 8) / 32] = b;
        }
        nan_block = b == kE8M0Nan;
        s = nan_block ? 1.0f : E8M0ReciprocalToFloat(b);
      }
      if constexpr (MODE == kModeB1x128) {  // 128-element block = 16 lanes
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) cam = max(cam, __shfl_xor_sync(0xffffffffu, cam, o));
        s = ScaleFromAmax(BitsToFloat(cam), fmax, p.pow2);
        if (valid && cc == 0) {
          static_cast<float*>(p.row_scale)[p.row_scale_off[g] + ct * RoundUp(mg, 4) + (r0 + rr - off)] =
              ScaleInv(s);
        }
      }
      if (valid) {
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
    const int rend = min(rbeg + HR, nrows);
    float s = kTensor ? tscale : bscale;
    bool nan_block = false;
    if constexpr (MODE == kModeMx || MODE == kModeB1x128) {
      uint32_t cam = 0;
      for (int r = rbeg; r < rend; ++r) cam = max(cam, AbsBitsOf<DT>(tile[r * kTileCols + c]));
      if (part == 1) col_red[c] = cam;
      __syncthreads();
      if (part == 0) col_red[c] = max(cam, col_red[c]);
      __syncthreads();
      cam = col_red[c];
      if constexpr (MODE == kModeMx) {
        const uint8_t b = MxScaleFromAmax(BitsToFloat(cam), fmt, static_cast<MxScaleRecipe>(p.mx_recipe));
        if (part == 0 && cvalid) {
          static_cast<uint8_t*>(p.col_scale)[p.col_scale_off[g] + ((r0 - off) / 32) * RoundUp(K, 128) + c0 + c] = b;
        }
        nan_block = b == kE8M0Nan;
        s = nan_block ? 1.0f : E8M0ReciprocalToFloat(b);
      } else {
        s = ScaleFromAmax(BitsToFloat(cam), fmax, p.pow2);
        if (part == 0 && cvalid) {
          static_cast<float*>(p.col_scale)[p.col_scale_off[g] + ((r0 - off) / 128) * RoundUp(K, 4) + c0 + c] =
              ScaleInv(s);
        }
      }
    }
    if (cvalid) {
      if constexpr (MODE == kModeMx) {
        // Not transposed: (r, c) at r * K + c; a warp stores 32 contiguous bytes per row.
        for (int r = rbeg; r < rend; ++r) {
          p.col_data[(r0 + r) * K + c0 + c] = Quant1<FMT>(ToFloat<DT>(tile[r * kTileCols + c]), s, sw, nan_block);
        }
      } else {
        // Transposed per group: (r, c) at off*K + c*mg + (r - off).
        uint8_t* out = p.col_data + off * K + (c0 + c) * mg + (r0 - off);
        const bool aligned = ((off * K) % 16 == 0) && (mg % 16 == 0);
        for (int r = rbeg; r < rend; r += 16) {
          if (aligned && r + 16 <= rend) {
            float f[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) f[j] = ToFloat<DT>(tile[(r + j) * kTileCols + c]);
            const uint2 lo = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[0]), s, sw, false);
            const uint2 hi = Quant8<FMT>(*reinterpret_cast<const float(*)[8]>(&f[8]), s, sw, false);
            *reinterpret_cast<uint4*>(out + r) = make_uint4(lo.x, lo.y, hi.x, hi.y);
          } else {
            for (int j = r; j < min(r + 16, rend); ++j) {
              out[j] = Quant1<FMT>(ToFloat<DT>(tile[j * kTileCols + c]), s, sw, false);
            }
          }
        }
      }
    }
  }
  (void)red2;
}

template <int DT, int MODE, int FMT>
cudaError_t LaunchQuantizeT(const QuantizeParams& p, cudaStream_t stream) {
  constexpr int TR = RowsPerTile(MODE);
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
  const int64_t blocks = static_cast<int64_t>(p.total_tiles) * p.col_tiles;
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
