// Grouped quantize / dequantize kernels. The math is kernels/fp8.h's, the
// same functions the CPU reference calls, so results match bit for bit; the
// FP8 conversion itself uses the hardware cvt.rn.satfinite (two elements per
// instruction) with fp8.h's NaN rule, checked equal to the software
// conversion for every float by LaunchExhaustiveCvtCheck (and a software path
// is kept behind QuantizeParams::software_cvt).
//
// The tiled kernels live in quantize_tiled.cuh (this file instantiates them
// for the full parameter block, quantize_small.cu for the small one).
// One persistent launch covers all groups: blocks walk tiles of 16384
// elements, 128 x 128, 64 x 256 or 32 x 512 (rows counted from each group's
// first row, so a tile's height is a multiple of its mode's block height;
// see Tile), find a tile's group by binary search in
// the per-group tile prefix sums (__grid_constant__ parameters), stream the
// next tile into shared memory with cp.async while converting the current
// one, and write outputs with 8- and 16-byte vector stores. Whole tiles of
// 16-bit input (nearly all) take a path compiled without bounds checks
// (QuantizeTile's FULL). Current scaling runs AmaxKernel first (the default),
// or fuses its amax pass into the same launch (GpuQuantizeOptions::kFused;
// see "the quantize pass" below).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "kernels/cuda/quantize_device.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/cuda/quantize_tiled.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace cuda_internal {
namespace {

// ---- current scaling, pass 1: per-group amax -------------------------------
// A tile is p.tile_rows whole rows of one group (about 64 KiB): contiguous
// memory, read as 16-byte vectors, four independent loads per thread in flight.
template <int DT>
__device__ __forceinline__ uint32_t AmaxOfVec(uint4 w) {
  if constexpr (DT == 2) {
    uint32_t m = max(max(w.x & 0x7fffffffu, w.y & 0x7fffffffu), max(w.z & 0x7fffffffu, w.w & 0x7fffffffu));
    return m;
  } else {
    const uint32_t m2 = AbsMaxPairs(w.x, w.y, w.z, w.w);  // max first, convert once
    const uint16_t m16 = static_cast<uint16_t>(max(m2 & 0xffffu, m2 >> 16));
    return FloatBits(ToFloat<DT>(m16));
  }
}

template <int DT, class P>  // AmaxParamsT<kCap>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ P p) {
  using T = typename InType<DT>::T;
  __shared__ uint32_t red[kThreads / 32];
  const int t = blockIdx.x;
  const int g = FindGroup(p, t);
  const int64_t off = p.row_off[g];
  const int64_t r0 = off + static_cast<int64_t>(t - p.tile_off[g]) * p.tile_rows;
  const int64_t nrows = min(static_cast<int64_t>(p.tile_rows), p.row_off[g + 1] - r0);
  const uint4* base = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + r0 * p.k);
  const int64_t nvec = nrows * p.k * static_cast<int64_t>(sizeof(T)) / 16;
  // The quantize pass (this grid's programmatic dependent) may start once
  // every block has got here, past its wait, so after all earlier work: it
  // loads its first tiles while these finish, and waits for their amax
  // (WaitForPrecedingGrid there).
  WaitForPrecedingGrid();
  AllowDependentLaunch();
  // With amax_slots: the slot amax_parity names (see QuantizeWorkspace).
  QuantizeWorkspace* ws = reinterpret_cast<QuantizeWorkspace*>(p.workspace);
  const int slot = p.amax_slots && threadIdx.x == 0 ? __ldcg(&ws->amax_parity) : 0;
  if (p.amax_slots && blockIdx.x == 0 && threadIdx.x == 0) ws->amax_slot_in_use = slot;
  uint32_t am = 0;
  for (int64_t i = threadIdx.x; i < nvec; i += 4 * kThreads) {
    uint4 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t idx = i + j * kThreads;
      // Coherent loads (ld.global.cg), not __ldg: the read-only promise of
      // ld.global.nc does not hold for x before this dependent launch's wait,
      // and it is what let ptxas hoist such loads above a wait.
      w[j] = idx < nvec ? __ldcg(base + idx) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) am = max(am, AmaxOfVec<DT>(w[j]));
  }
  am = BlockMax(am, red);
  if (threadIdx.x == 0 && am != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax) + slot * kMaxGpuGroups + g, am);
}

// Its dependent (the quantize pass) may launch at once: it waits for this
// grid before it reads or writes anything, and so for the zeros and for all
// earlier work. (Allowing it only past the wait below, so that the quantize
// pass could read x at its launch and wait for the zeros only at its amax
// atomics, measured 0.3-0.4 us slower on small-decode's MXFP8 and delayed
// row+col: the launch was then on the critical path.)
// Its parameters are the two it uses: a launch's host cost grows with its
// parameter bytes, and QuantizeParams' tables are 25 KB.
struct ZeroAmaxParams {
  float* amax;
  int num_groups;
};
__global__ void __launch_bounds__(kThreads) ZeroAmaxKernel(const __grid_constant__ ZeroAmaxParams p) {
  AllowDependentLaunch();
  WaitForPrecedingGrid();
  for (int g = threadIdx.x; g < p.num_groups; g += kThreads) p.amax[g] = 0.0f;
}

template <class P>
cudaError_t LaunchAmaxP(const P& p, cudaStream_t stream) {
  const int64_t blocks = p.total_tiles;  // whole-row tiles
  if (blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (p.x_dtype) {
    case 0: return LaunchAsDependent(AmaxKernel<0, P>, grid, 0, stream, p);
    case 1: return LaunchAsDependent(AmaxKernel<1, P>, grid, 0, stream, p);
    default: return LaunchAsDependent(AmaxKernel<2, P>, grid, 0, stream, p);
  }
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
    // Cvt4 (no NaN rule: every non-NaN float), each byte position alone.
    if (!IsNanBits(x)) {
      const uint32_t e4 = QuantizeScaled(x, 1.0f, Fp8Format::kE4M3), e5 = QuantizeScaled(x, 1.0f, Fp8Format::kE5M2);
      if (Cvt4<0>(x, 0.0f, 0.0f, 0.0f) != e4 || Cvt4<0>(0.0f, x, 0.0f, 0.0f) != e4 << 8 ||
          Cvt4<0>(0.0f, 0.0f, x, 0.0f) != e4 << 16 || Cvt4<0>(0.0f, 0.0f, 0.0f, x) != e4 << 24) {
        ++bad[0];
      }
      if (Cvt4<1>(x, 0.0f, 0.0f, 0.0f) != e5 || Cvt4<1>(0.0f, x, 0.0f, 0.0f) != e5 << 8 ||
          Cvt4<1>(0.0f, 0.0f, x, 0.0f) != e5 << 16 || Cvt4<1>(0.0f, 0.0f, 0.0f, x) != e5 << 24) {
        ++bad[1];
      }
    }
    // The branch-free E8M0 scale code (amax is non-negative: x's |bits|).
    const uint32_t abs = static_cast<uint32_t>(i) & 0x7fffffffu;
    const int ocp = static_cast<int>(MxScaleRecipe::kOcp);
    if (MxCode(abs, Fp8Format::kE4M3, ocp) != MxScaleFromAmax(BitsToFloat(abs), Fp8Format::kE4M3)) ++bad[0];
    if (MxCode(abs, Fp8Format::kE5M2, ocp) != MxScaleFromAmax(BitsToFloat(abs), Fp8Format::kE5M2)) ++bad[1];
    if (i < 0x8000) {  // every 16-bit |x|
      const uint32_t h = static_cast<uint32_t>(i);
      const float bf = Bf16BitsToFloat(static_cast<uint16_t>(h)), hf = F16BitsToFloat(static_cast<uint16_t>(h));
      if (MxCodeOcp16<0>(h, Fp8Format::kE4M3) != MxScaleFromAmax(bf, Fp8Format::kE4M3)) ++bad[0];
      if (MxCodeOcp16<0>(h, Fp8Format::kE5M2) != MxScaleFromAmax(bf, Fp8Format::kE5M2)) ++bad[1];
      if (MxCodeOcp16<1>(h, Fp8Format::kE4M3) != MxScaleFromAmax(hf, Fp8Format::kE4M3)) ++bad[0];
      if (MxCodeOcp16<1>(h, Fp8Format::kE5M2) != MxScaleFromAmax(hf, Fp8Format::kE5M2)) ++bad[1];
    }
    if (i < 255 && FloatBits(MxRecip(static_cast<uint32_t>(i))) !=
                       FloatBits(E8M0ReciprocalToFloat(static_cast<uint8_t>(i)))) {
      ++bad[0];
    }
  }
  if (bad[0]) atomicAdd(mismatches, bad[0]);
  if (bad[1]) atomicAdd(mismatches + 1, bad[1]);
}

}  // namespace

// A kernel's SM count and resident blocks per SM on the current device, with
// its dynamic shared memory allowed there: set and queried once per kernel
// and device (each is host time on every call otherwise).
cudaError_t KernelResidency(const void* kernel, int smem, int* sms, int* per_sm, int* two_per_sm_smem) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  struct Facts {
    int sms = 0, per_sm = 0, two_per_sm_smem = 0;
  };
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<const void*, int>, Facts>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find({kernel, device});
  if (it == cache->end()) {
    Facts v;
    // The most dynamic shared memory two blocks fit with (their static
    // shared memory and the per-block reservation beside it).
    int sm_smem = 0, reserved = 0, optin = 0;
    cudaFuncAttributes attrs;
    if ((e = cudaFuncGetAttributes(&attrs, kernel)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess) return e;
    const int two = std::max(0, std::min(optin - static_cast<int>(attrs.sharedSizeBytes),
                                         (sm_smem / 2 - reserved - static_cast<int>(attrs.sharedSizeBytes)) / 128 * 128));
    const int allowed = std::max(smem, two);
    if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, allowed)) != cudaSuccess) {
      return e;
    }
    if ((e = cudaDeviceGetAttribute(&v.sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return e;
    if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.per_sm, kernel, kThreads, smem)) != cudaSuccess) return e;
    int per_sm_two = 0;
    if (two > smem &&
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_two, kernel, kThreads, two)) != cudaSuccess) {
      return e;
    }
    v.two_per_sm_smem = per_sm_two == 2 ? two : 0;
    it = cache->emplace(std::make_pair(kernel, device), v).first;
  }
  *sms = it->second.sms, *per_sm = it->second.per_sm;
  if (two_per_sm_smem != nullptr) *two_per_sm_smem = it->second.two_per_sm_smem;
  return cudaSuccess;
}

bool DependentLaunchSupported() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static std::mutex mu;
  static auto* cache = new std::map<int, bool>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(device);
  if (it == cache->end()) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    it = cache->emplace(device, major >= 9).first;
  }
  return it->second;
}

cudaError_t LaunchGroupedAmax(const AmaxParams& p, cudaStream_t stream) {
  return LaunchWithFittingParams(p, [&](const auto& q) { return LaunchAmaxP(q, stream); });
}

cudaError_t LaunchZeroAmax(const QuantizeParams& p, cudaStream_t stream) {
  return LaunchAsDependent(ZeroAmaxKernel, dim3(1), 0, stream, ZeroAmaxParams{p.amax, p.num_groups});
}

cudaError_t LaunchGroupedQuantize(const QuantizeParams& p, cudaStream_t stream) {
  return LaunchWithFittingParams(p, [&](const auto& q) {
    // (The small block's kernels are quantize_small.cu's.)
    if constexpr (std::is_same_v<std::decay_t<decltype(q)>, QuantizeParams>) {
      return LaunchQuantizeP(q, stream);
    } else {
      return LaunchGroupedQuantizeSmall(q, stream);
    }
  });
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
