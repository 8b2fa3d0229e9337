// Device helpers shared by the grouped quantize kernels (quantize.cu: the
// tiled persistent kernels; quantize_oneshot.cu: the register-resident one):
// element decoding, the FP8 and E8M0 conversions, reductions, and the
// workspace protocol. The math is kernels/fp8.h's, so every kernel's bytes
// equal the CPU reference's.
#ifndef SHARDGEMM_KERNELS_CUDA_QUANTIZE_DEVICE_CUH_
#define SHARDGEMM_KERNELS_CUDA_QUANTIZE_DEVICE_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda_internal {
namespace {

// Threads per block of every quantize kernel.
constexpr int kThreads = 256;
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
// The max |x| bits of four words of 16-bit values, pairwise: half-word h of
// the result is the max over the words' half-words h. 16-bit |x| bits order
// like the values (NaN above Inf), so the max is found before any decode.
__device__ __forceinline__ uint32_t AbsMaxPairs(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __vmaxu2(__vmaxu2(a & 0x7fff7fffu, b & 0x7fff7fffu), __vmaxu2(c & 0x7fff7fffu, d & 0x7fff7fffu));
}
// The same over rows rb .. rb + 31 of columns 2 cp and 2 cp + 1 of a tile of
// 16-bit values with kCols columns in shared memory.
template <int kCols, class T>
__device__ __forceinline__ uint32_t ColumnPairAbsMax32(const T* tile, int rb, int cp) {
  static_assert(sizeof(T) == 2, "16-bit input");
  uint32_t m2 = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    m2 = __vmaxu2(m2, *reinterpret_cast<const uint32_t*>(tile + (rb + j) * kCols + 2 * cp) & 0x7fff7fffu);
  }
  return m2;
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
    const uint32_t m2 = AbsMaxPairs(c.w[0], c.w[1], c.w[2], c.w[3]);
    const uint16_t m16 = static_cast<uint16_t>(max(m2 & 0xffffu, m2 >> 16));
    return FloatBits(ToFloat<DT>(m16));
  }
}

// Elements 2j and 2j + 1 of a chunk as floats (f16 through the hardware
// conversion: exact for every non-NaN, but a NaN loses its sign).
template <int DT>
__device__ __forceinline__ float2 Pair(const Chunk<DT>& c, int j) {
  if constexpr (DT == 1) {
    return __half22float2(*reinterpret_cast<const __half2*>(&c.w[j]));
  } else {
    return make_float2(Elem<DT>(c, 2 * j), Elem<DT>(c, 2 * j + 1));
  }
}

// The bytes of elements whose scale is a NaN mark (MXFP8 blocks with a NaN
// code): NaN with each element's sign, as the CPU reference writes them.
template <int FMT, int DT>
__device__ __forceinline__ uint2 NanFix(uint2 out, const Chunk<DT>& v, const float (&s)[8]) {
  static_assert(DT == 0 || DT == 1, "16-bit input: the sign is bit 15 of each half word");
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!IsNanBits(s[j])) continue;
    const uint32_t sign = (v.w[j / 2] >> (16 * (j % 2) + 15)) & 1u;
    const uint32_t nan_byte = static_cast<uint32_t>(Fp8NanWithSignOf(BitsToFloat(sign << 31), fmt)) << (8 * (j % 4));
    uint32_t& word = j < 4 ? out.x : out.y;
    word = (word & ~(0xffu << (8 * (j % 4)))) | nan_byte;
  }
  return out;
}

// An acquire load at GPU scope (a counter another block releases).
__device__ __forceinline__ int LoadAcquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// Four floats to FP8 through the hardware conversion (cvt.rn.satfinite,
// what __nv_cvt_float2_to_fp8x2 with __NV_SATFINITE issues), x0 in the low
// byte, packed by the conversions themselves: the intrinsic's 16-bit result
// took a mask, a shift and an or per word to pack, about a tenth of the
// MXFP8 tile's instructions (ncu on the H200), and those kernels are
// issue-bound. No NaN rule (the callers apply it where a NaN may be).
// cvt's first source lands in the upper byte of its 16-bit result. (One
// string for both formats: inline asm takes a literal, so a macro.)
#define SHARDGEMM_CVT4_ASM(FMT_NAME)                                                           \
  "{\n .reg .b16 lo, hi;\n cvt.rn.satfinite." FMT_NAME "x2.f32 lo, %2, %1;\n cvt.rn.satfinite." \
  FMT_NAME "x2.f32 hi, %4, %3;\n mov.b32 %0, {lo, hi};\n}"
template <int FMT>
__device__ __forceinline__ uint32_t Cvt4(float x0, float x1, float x2, float x3) {
  uint32_t r;
  if constexpr (FMT == 0) {
    asm(SHARDGEMM_CVT4_ASM("e4m3") : "=r"(r) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  } else {
    asm(SHARDGEMM_CVT4_ASM("e5m2") : "=r"(r) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  }
  return r;
}
#undef SHARDGEMM_CVT4_ASM

// An 8-element chunk as floats (Pair's decode) and its FP8 bytes under one
// scale or one per element (MXFP8's rowwise and colwise blocks), by Cvt4.
template <int DT>
__device__ __forceinline__ void ChunkFloats(const Chunk<DT>& v, float (&x)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 e = Pair<DT>(v, j);
    x[2 * j] = e.x, x[2 * j + 1] = e.y;
  }
}
template <int FMT>
__device__ __forceinline__ uint2 Cvt8(const float (&x)[8], float s) {
  return make_uint2(Cvt4<FMT>(x[0] * s, x[1] * s, x[2] * s, x[3] * s), Cvt4<FMT>(x[4] * s, x[5] * s, x[6] * s, x[7] * s));
}
template <int FMT>
__device__ __forceinline__ uint2 Cvt8(const float (&x)[8], const float (&s)[8]) {
  return make_uint2(Cvt4<FMT>(x[0] * s[0], x[1] * s[1], x[2] * s[2], x[3] * s[3]),
                    Cvt4<FMT>(x[4] * s[4], x[5] * s[5], x[6] * s[6], x[7] * s[7]));
}

// Quantizes 8 elements with scale s into 8 bytes (element 0 in the low byte).
// nan_block: the MX block's scale is NaN -> every element is NaN.
// may_nan: an element may be NaN (else the conversion skips the NaN rule).
template <int FMT>
__device__ __forceinline__ uint2 Quant8(const float (&f)[8], float s, bool sw, bool nan_block, bool may_nan = true) {
  const Fp8Format fmt = static_cast<Fp8Format>(FMT);
  uint32_t w[2];
  if (!nan_block && !sw && !may_nan) {
    // No NaN among the inputs: Cvt8 equals HwQuant2 there (the cvt maps
    // only NaN inputs differently) at a fraction of the instructions.
    return Cvt8<FMT>(f, s);
  }
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

// The E8M0 scale code of a block whose max |x| has float bits `abs`: fp8.h's
// MxScaleFromAmax without its branches for the OCP recipe (floor(log2 amax)
// - emax, clamped, is the exponent field minus emax, clamped at 0; subnormal
// and zero amax give 0, Inf and NaN 0xff). Checked equal for every float by
// LaunchExhaustiveCvtCheck.
__device__ __forceinline__ uint32_t MxCode(uint32_t abs, Fp8Format fmt, int recipe) {
  if (recipe != static_cast<int>(MxScaleRecipe::kOcp)) {
    return MxScaleFromAmax(BitsToFloat(abs), fmt, static_cast<MxScaleRecipe>(recipe));
  }
  const int e = static_cast<int>(abs >> 23) - Fp8Emax(fmt);
  return abs >= 0x7f800000u ? 0xffu : static_cast<uint32_t>(max(e, 0));
}
// MxCode for the OCP recipe from a 16-bit input's max |x| bits: for bf16
// the float's exponent field is bits 7..14 (Inf/NaN from 0x7f80 up), with no
// conversion; f16 goes through its float value.
template <int DT>
__device__ __forceinline__ uint32_t MxCodeOcp16(uint32_t m16, Fp8Format fmt) {
  if constexpr (DT == 0) {
    return m16 >= 0x7f80u ? 0xffu : static_cast<uint32_t>(max(static_cast<int>(m16 >> 7) - Fp8Emax(fmt), 0));
  } else {
    return MxCode(FloatBits(ToFloat<DT>(static_cast<uint16_t>(m16))) & 0x7fffffffu, fmt,
                  static_cast<int>(MxScaleRecipe::kOcp));
  }
}
// E8M0ReciprocalToFloat(b) for b != 0xff: 2^(127 - b) as float bits.
__device__ __forceinline__ float MxRecip(uint32_t b) {
  return BitsToFloat(b == 254u ? 0x00400000u : (254u - b) << 23);
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }

// Programmatic dependent launch (PDL). Every quantize launch is its stream
// predecessor's programmatic dependent, so it is launched, and its blocks
// find their first tile, while the kernel before it drains (about 0.3-0.5 us
// a launch on the H200, docs/performance/quantize.md). A call's first
// launch touches no global memory before WaitForPrecedingGrid, which returns
// once the grid before it has finished and its writes are visible (at once
// where the launch is not a dependent), and so, as every block of every
// grid waits before it completes, once all earlier work on the stream has.
// Current scaling's amax pass calls AllowDependentLaunch only after its
// wait, so its quantize pass starts after all earlier work and reads x
// before its own wait, which is then only for the amax. The amax zeroing
// launch allows it first thing (ZeroAmaxKernel); the tiled and one-shot
// kernels only as their blocks finish: dependents launched earlier took the
// SMs' spare block slots and left the blocks that follow unevenly spread
// (small-decode MXFP8 6.5 -> 7.0 us). The exception: delayed scaling's
// launches of at most two items per SM, which hold no spare slots
// (LaunchQuantizeT), allow it right after their wait
// (QuantizeParams::dependents_at_start: small-decode 5.3 -> 4.9 us; MXFP8
// and current scaling measured slower so).
__device__ __forceinline__ void WaitForPrecedingGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void AllowDependentLaunch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

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

// A tile's amax (float bits) max-reduced into group g's (thread 0).
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void ReduceTileAmax(const P& p, int g, uint32_t t) {
  if (t != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax) + g, t);
}

// The tile's amax from the per-warp maxima in red (after a barrier): one
// atomicMax into the group's amax.
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void FlushTileAmax(const P& p, int g, const uint32_t* red) {
  uint32_t t = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) t = max(t, red[i]);
  ReduceTileAmax(p, g, t);
}

template <typename Params>  // QuantizeParams, AmaxParams
__device__ __forceinline__ int FindGroup(const Params& p, int t) {
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

// The group of row tile (or slab row) t: first a guess from equal groups,
// exact for them (the one-shot kernel's binary search cost its warps 66
// instructions of about 870 at small-decode), then the search. The guess is
// taken at the tile's middle, (t + 1/2) G / T, half a tile from either edge
// of an equal group, which the float division's error does not cross while
// t is below about 2^21; past that, or for unequal groups, a wrong guess
// only costs the search.
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ int FindGroupFromGuess(const P& p, int t) {
  const int guess = static_cast<int>(
      __fdividef((static_cast<float>(t) + 0.5f) * static_cast<float>(p.num_groups), static_cast<float>(p.total_tiles)));
  if (guess >= 0 && guess < p.num_groups && p.tile_off[guess] <= t && t < p.tile_off[guess + 1]) return guess;
  return FindGroup(p, t);
}

// MXFP8: the zeros of the scale tensors' padding (the layout of
// kernels/cpu/quantize.h), which no tile writes (so no memset runs first).
// Group g's padding, entries first + threadIdx.x, then every stride of each
// region (so `parts` blocks share it with first = part * kThreads and stride
// = parts * kThreads); empty groups have no scale rows.
//   rowwise [RoundUp(m_g, 128)][RoundUp(k / 32, 4)]: rows m_g.., and the
//           columns past k / 32 of every row;
//   colwise [RoundUp(ceil(m_g / 32), 4)][RoundUp(k, 128)]: rows past
//           ceil(m_g / 32), and the columns past k of every row.
// Group g's table entries ZeroMxGroupPadding needs, read apart so that a
// kernel can load them ahead of its wait (indexed parameter loads are slow
// to come back: launch_param_bench).
struct MxGroupPadding {
  int64_t mg;  // rows
  int32_t row_scale_off, col_scale_off;
};
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ MxGroupPadding MxGroupPaddingOf(const P& p, int g) {
  return MxGroupPadding{p.row_off[g + 1] - p.row_off[g], p.row_scale_off[g], p.col_scale_off[g]};
}
template <class P>  // QuantizeParamsT<kCap>
__device__ void ZeroMxGroupPadding(const P& p, const MxGroupPadding& gp, int64_t first, int64_t stride) {
  const int64_t K = p.k;
  const int64_t mg = gp.mg;
  if (mg == 0) return;
  for (int dir = 0; dir < 2; ++dir) {
    if (dir == 0 ? !p.rowwise : !p.colwise) continue;
    uint8_t* base = static_cast<uint8_t*>(dir == 0 ? p.row_scale : p.col_scale) +
                    (dir == 0 ? gp.row_scale_off : gp.col_scale_off);
    const int64_t rows = dir == 0 ? mg : (mg + 31) / 32;  // rows written by tiles
    const int64_t all_rows = dir == 0 ? RoundUp(mg, 128) : RoundUp(rows, 4);
    const int64_t cols = dir == 0 ? K / 32 : K;  // columns written by tiles
    const int64_t ld = dir == 0 ? RoundUp(K / 32, 4) : RoundUp(K, 128);
    for (int64_t i = rows * ld + first + threadIdx.x; i < all_rows * ld; i += stride) base[i] = 0;
    const int64_t pad = ld - cols;
    for (int64_t i = first + threadIdx.x; pad > 0 && i < rows * pad; i += stride) {
      base[(i / pad) * ld + cols + i % pad] = 0;
    }
  }
}
// The tiled kernels: block b takes groups b, b + gridDim.x, ...; group b's
// entries as the kernel read them before its wait (first).
template <class P>  // QuantizeParamsT<kCap>
__device__ void ZeroMxScalePadding(const P& p, const MxGroupPadding& first) {
  for (int g = blockIdx.x; g < p.num_groups; g += gridDim.x) {
    ZeroMxGroupPadding(p, g == static_cast<int>(blockIdx.x) ? first : MxGroupPaddingOf(p, g), 0, kThreads);
  }
}

// Tensor scaling: the scale_inv of empty groups, which have no tiles or
// slabs to write it (block 0 of the launch does).
template <int MODE, class P>
__device__ __forceinline__ void WriteEmptyGroupScales(const P& p) {
  if (blockIdx.x != 0 || blockIdx.y != 0) return;
  for (int h = threadIdx.x; h < p.num_groups; h += kThreads) {
    if (p.row_off[h + 1] == p.row_off[h]) {
      const float sinv = MODE == kModeCurrent ? 1.0f : ScaleInv(p.scale[h]);
      if (p.rowwise) static_cast<float*>(p.row_scale)[h] = sinv;
      if (p.colwise) static_cast<float*>(p.col_scale)[h] = sinv;
    }
  }
}

// A launch of kThreads-thread blocks as its stream predecessor's programmatic
// dependent where the device takes that (DependentLaunchSupported), and
// cooperative where asked (the one-shot kernel's grid barrier). No retry
// without the attribute on an error: the launch API may report an earlier
// launch's error with this kernel queued, which would then run twice.
template <typename Params>
cudaError_t LaunchAsDependent(void (*kernel)(Params), dim3 grid, int smem, cudaStream_t stream, const Params& p,
                              bool cooperative = false) {
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeCooperative;
  attrs[1].val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  const bool dependent = DependentLaunchSupported();
  config.attrs = dependent ? attrs : attrs + 1;
  config.numAttrs = (dependent ? 1 : 0) + (cooperative ? 1 : 0);
  return cudaLaunchKernelEx(&config, kernel, p);
}

// The workspace protocol (current scaling; the two passes use the amax
// slots instead, PublishSlotAmax). Tiles reduce the amax into the
// workspace's; once it is final (the one-shot kernel: past its grid
// barrier; the fused pass: at its end; a call with no rows, which has no
// amax pass: at once), one block copies it to the caller's (PublishAmax).
// Each block counts itself in once it is done with the workspace; the block
// that counts last zeroes every field the launch used, for the next launch
// on the stream. With release (acq_rel) semantics, the block's earlier
// workspace atomics (the fused pass's claims, amax contributions and
// amax-tile counts) are performed before the count, so before the last
// block's zeroing; the one-shot kernel's blocks only read the workspace
// since their last atomic, which their count need not order.
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void PublishAmax(const P& p) {
  const QuantizeWorkspace* ws = reinterpret_cast<const QuantizeWorkspace*>(p.workspace);
  for (int g = threadIdx.x; g < p.num_groups; g += kThreads) p.amax_out[g] = BitsToFloat(__ldcg(ws->amax + g));
}
// The two-pass path's end (QuantizeParams::amax_slots; block 0 of the
// quantize pass): the slot the amax pass used to the caller's amax, the
// other slot zeroed, and amax_parity pointed at it for the next call. The
// whole other slot: the call that used it may have had more groups than
// this one (a later call with as many would start from its values).
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void PublishSlotAmax(const P& p) {
  QuantizeWorkspace* ws = reinterpret_cast<QuantizeWorkspace*>(p.workspace);
  const int slot = __ldcg(&ws->amax_slot_in_use);
  for (int g = threadIdx.x; g < p.num_groups; g += kThreads) {
    p.amax_out[g] = BitsToFloat(__ldcg(ws->amax_slots[slot] + g));
  }
  for (int g = threadIdx.x; g < kMaxGpuGroups; g += kThreads) ws->amax_slots[1 - slot][g] = 0;
  if (threadIdx.x == 0) ws->amax_parity = 1 - slot;
}
__device__ __forceinline__ bool CountBlockIn(QuantizeWorkspace* ws, bool release) {
  int old;
  if (release) {
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(&ws->blocks_done) : "memory");
  } else {
    old = atomicAdd(&ws->blocks_done, 1);
  }
  return old == static_cast<int>(gridDim.x * gridDim.y) - 1;  // (the one-shot grid is 2-D)
}

// The end of a launch with a workspace (every thread). Only thread 0 touches
// s_last between the barriers (racecheck flagged a read of the word by every
// thread while thread 0 wrote it).
template <class P>  // QuantizeParamsT<kCap>
__device__ __forceinline__ void FinishWithWorkspace(const P& p, bool release) {
  __shared__ int s_last;
  QuantizeWorkspace* ws = reinterpret_cast<QuantizeWorkspace*>(p.workspace);
  __syncthreads();
  if (threadIdx.x == 0) s_last = CountBlockIn(ws, release);
  __syncthreads();
  if (s_last == 0) return;
  if (p.fuse_amax) {
    if (p.amax_out != nullptr) PublishAmax(p);
    for (int b = threadIdx.x; b < p.num_batches; b += kThreads) ws->amax_tiles_done[b] = 0;
  }
  if (p.amax_out != nullptr) {  // (each thread zeroes the groups it published)
    for (int g = threadIdx.x; g < p.num_groups; g += kThreads) ws->amax[g] = 0;
  }
  if (threadIdx.x == 0) ws->next_item = 0, ws->blocks_done = 0, ws->grid_barrier = 0;
}

}  // namespace
}  // namespace cuda_internal
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_QUANTIZE_DEVICE_CUH_
