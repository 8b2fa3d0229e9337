// Hopper grouped GEMM, ragged M: out[rows of g] = lhs[rows of g] @ rhs[g] (+ bias[g]).
//
// One persistent launch (one block per SM) walks all output tiles of all
// groups. Each block first turns the device group sizes into row and tile
// offsets in shared memory (a block-wide scan, so no host copy and no second
// launch), then:
//   warpgroup 0, thread 0: producer. TMA loads of the lhs tile [BM x 64] and
//     the rhs tile [BN x 64] (K-major) or 4 x [64 x 64] (N-major) into a
//     ring of STAGES shared-memory slots, completing on "full" mbarriers.
//   warpgroup 0, warps 1-3: zero the padding rows past sum(group_sizes).
//   warpgroups 1, 2: consumers. wgmma m64nWNk16 from shared memory (128-byte
//     swizzle), FP32 accumulators in registers; each k-block's slot is freed
//     (an "empty" mbarrier arrive) once the next k-block's wgmma is issued and
//     the previous one retired. Epilogue: + bias, convert, store straight from
//     registers with row bounds of the group (rows of the next group that the
//     tile also loaded are discarded).
// BM = 128: each consumer takes 64 rows x BN columns. BM = 64 (small groups):
// each consumer takes all 64 rows x BN/2 columns.
// Rows of lhs past M and K past the end read as zeros (TMA out-of-bounds fill).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "kernels/cuda/sm90_grouped_gemm.h"
#include "kernels/cuda/sm90_wgmma.cuh"

namespace shardgemm {
namespace cuda {
namespace {

constexpr int kBK = 64;  // 64 x 16-bit = 128 bytes: one swizzle row
constexpr int kThreads = 384;

struct KernelArgs {
  void* out;
  const void* bias;
  int bias_dtype;  // CuDType as int
  const int64_t* group_sizes;
  int num_groups;
  int m, n, k;
  uint32_t b_lbo, b_sbo;  // MN-major B descriptor strides (bytes >> 4)
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}
__device__ __forceinline__ void BarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
}
__device__ __forceinline__ void BarWait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(
          SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
}

// The same load, multicast to the CTAs of `mask` in the cluster (same
// shared-memory offset and mbarrier offset in each).
__device__ __forceinline__ void TmaLoad3dMulticast(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                   uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar)), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive on the mbarrier at the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ void BarArriveRemote(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(SmemAddr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t MakeDesc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(lbo & 0x3FFF) << 16;
  d |= static_cast<uint64_t>(sbo & 0x3FFF) << 32;
  d |= 1ull << 62;  // 128B swizzle
  return d;
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int WN, bool kF16, bool kBKMajor>
__device__ __forceinline__ void Wgmma(float (&d)[WN / 2], uint64_t da, uint64_t db, int scale_d) {
  using namespace sm90;
  if constexpr (WN == 256) {
    if constexpr (kF16) {
      if constexpr (kBKMajor) Wgmma_m64n256k16_f16_tb0(d, da, db, scale_d);
      else Wgmma_m64n256k16_f16_tb1(d, da, db, scale_d);
    } else {
      if constexpr (kBKMajor) Wgmma_m64n256k16_bf16_tb0(d, da, db, scale_d);
      else Wgmma_m64n256k16_bf16_tb1(d, da, db, scale_d);
    }
  } else {
    if constexpr (kF16) {
      if constexpr (kBKMajor) Wgmma_m64n128k16_f16_tb0(d, da, db, scale_d);
      else Wgmma_m64n128k16_f16_tb1(d, da, db, scale_d);
    } else {
      if constexpr (kBKMajor) Wgmma_m64n128k16_bf16_tb0(d, da, db, scale_d);
      else Wgmma_m64n128k16_bf16_tb1(d, da, db, scale_d);
    }
  }
}

__device__ __forceinline__ float LoadAsFloat(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case static_cast<int>(CuDType::kF32): return static_cast<const float*>(p)[i];
    case static_cast<int>(CuDType::kBF16): return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case static_cast<int>(CuDType::kF16): return __half2float(static_cast<const __half*>(p)[i]);
    default: return 0.f;
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

// Largest g with tile_start[g] <= t (the non-empty group holding tile t).
__device__ __forceinline__ int FindGroup(const int* tile_start, int num_groups, int t) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <int BM, int BN>
struct Config {
  static constexpr int kWN = BM == 128 ? BN : BN / 2;  // columns per consumer
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = (BM == 128 && BN == 256) ? 4 : (BM == 64 ? 5 : 6);
  static constexpr int kRingBytes = kStages * kStageBytes;
};

template <int BM, int BN>
constexpr int SmemBytes(int num_groups) {
  return 1024 /*align slack*/ + Config<BM, BN>::kRingBytes + 2 * Config<BM, BN>::kStages * 8 +
         2 * (num_groups + 1) * 4;
}

// kCluster = 2: pairs of blocks (a 2x1 cluster) take the same group and
// column tile and adjacent row tiles; each loads its own lhs tile and half of
// the shared rhs tile, multicast to both, which halves the rhs traffic out of
// L2. A slot is refilled only once the consumers of both blocks freed it.
template <int BM, int BN, bool kF16, bool kBKMajor, typename TOut, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedGemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      const KernelArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = Config<BM, BN>;
  constexpr int kStages = C::kStages;
  constexpr int kWN = C::kWN;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kRingBytes);
  uint64_t* empty = full + kStages;
  int* row_start = reinterpret_cast<int*>(empty + kStages);
  int* tile_start = row_start + args.num_groups + 1;
  __shared__ int warp_rows[kThreads / 32], warp_tiles[kThreads / 32];

  const int tid = threadIdx.x;
  const int G = args.num_groups;
  const int n_tiles = (args.n + BN - 1) / BN;

  // --- group offsets: block-wide exclusive scan of rows and tiles ---
  {
    const int chunk = (G + kThreads - 1) / kThreads;
    const int beg = min(G, tid * chunk), end = min(G, beg + chunk);
    int rows = 0, tiles = 0;
    for (int i = beg; i < end; ++i) {
      int64_t s = args.group_sizes[i];
      int r = static_cast<int>(s < 0 ? 0 : (s > args.m ? args.m : s));
      rows += r;
      tiles += ((r + BM - 1) / BM + kCluster - 1) / kCluster * n_tiles;
    }
    const int lane = tid & 31, warp = tid >> 5;
    int inc_r = rows, inc_t = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int vr = __shfl_up_sync(0xffffffffu, inc_r, o);
      int vt = __shfl_up_sync(0xffffffffu, inc_t, o);
      if (lane >= o) { inc_r += vr; inc_t += vt; }
    }
    if (lane == 31) { warp_rows[warp] = inc_r; warp_tiles[warp] = inc_t; }
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) { BarInit(&full[s], 1); BarInit(&empty[s], 8 * kCluster); }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int run_r = inc_r - rows, run_t = inc_t - tiles;
    for (int w = 0; w < warp; ++w) { run_r += warp_rows[w]; run_t += warp_tiles[w]; }
    for (int i = beg; i < end; ++i) {
      row_start[i] = run_r;
      tile_start[i] = run_t;
      int64_t s = args.group_sizes[i];
      int r = static_cast<int>(s < 0 ? 0 : (s > args.m ? args.m : s));
      run_r += r;
      run_t += ((r + BM - 1) / BM + kCluster - 1) / kCluster * n_tiles;
    }
    if (tid == kThreads - 1) {  // totals
      int tr = 0, tt = 0;
      for (int w = 0; w < kThreads / 32; ++w) { tr += warp_rows[w]; tt += warp_tiles[w]; }
      row_start[G] = tr;
      tile_start[G] = tt;
    }
    __syncthreads();
  }
  if constexpr (kCluster > 1) ClusterSync();  // peers' barriers are initialized
  const int total_tiles = tile_start[G];
  const int num_kb = (args.k + kBK - 1) / kBK;
  const int wg = tid / 128;
  const uint32_t rank = kCluster > 1 ? ClusterRank() : 0;
  const int first_tile = blockIdx.x / kCluster, tile_stride = gridDim.x / kCluster;

  if (wg == 0) {
    if (tid == 0) {
      int stage = 0, phase = 0;
      for (int t = first_tile; t < total_tiles; t += tile_stride) {
        const int g = FindGroup(tile_start, G, t);
        const int local = t - tile_start[g];
        const int mt_count = (row_start[g + 1] - row_start[g] + BM - 1) / BM;
        const int pm_count = (mt_count + kCluster - 1) / kCluster;
        const int row0 = row_start[g] + ((local % pm_count) * kCluster + rank) * BM;
        const int n0 = (local / pm_count) * BN;
        for (int kb = 0; kb < num_kb; ++kb) {
          BarWait(&empty[stage], phase ^ 1);
          BarExpectTx(&full[stage], C::kStageBytes);
          uint8_t* sa = ring + stage * C::kStageBytes;
          uint8_t* sb = sa + C::kABytes;
          TmaLoad2d(sa, &map_a, kb * kBK, row0, &full[stage]);
          if constexpr (kCluster > 1) {
            constexpr int kHalf = BN / 2;
            if constexpr (kBKMajor) {
              TmaLoad3dMulticast(sb + rank * kHalf * kBK * 2, &map_b, kb * kBK, n0 + rank * kHalf, g,
                                 &full[stage], 0x3);
            } else {
#pragma unroll
              for (int j = 0; j < kHalf / 64; ++j) {
                const int jj = rank * (kHalf / 64) + j;
                TmaLoad3dMulticast(sb + jj * 64 * kBK * 2, &map_b, n0 + jj * 64, kb * kBK, g, &full[stage], 0x3);
              }
            }
          } else if constexpr (kBKMajor) {
            TmaLoad3d(sb, &map_b, kb * kBK, n0, g, &full[stage]);
          } else {
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)
              TmaLoad3d(sb + j * 64 * kBK * 2, &map_b, n0 + j * 64, kb * kBK, g, &full[stage]);
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
    } else if (tid >= 32) {
      // Zero the padding rows [sum(group_sizes), m).
      const int64_t row_bytes = static_cast<int64_t>(args.n) * sizeof(TOut);
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
    const int c = wg - 1;  // consumer index
    const int warp_in_wg = (tid / 32) & 3, lane = tid & 31;
    // Byte offsets of this consumer's operands inside a stage.
    const uint32_t a_off = BM == 128 ? c * 64 * kBK * 2 : 0;
    const uint32_t b_off = BM == 128 ? 0 : c * kWN * kBK * 2;  // same for both B majors
    const uint32_t ring_addr = SmemAddr(ring);
    float acc[kWN / 2];
    int stage = 0, phase = 0;
    TOut* out = static_cast<TOut*>(args.out);
    auto release = [&](int s) {  // one arrive per warp, on this block's slot and the peer's
      __syncwarp();
      if (lane == 0) {
        BarArrive(&empty[s]);
        if constexpr (kCluster > 1) BarArriveRemote(&empty[s], rank ^ 1);
      }
    };
    for (int t = first_tile; t < total_tiles; t += tile_stride) {
      const int g = FindGroup(tile_start, G, t);
      const int local = t - tile_start[g];
      const int g_rows = row_start[g + 1] - row_start[g];
      const int mt_count = (g_rows + BM - 1) / BM;
      const int pm_count = (mt_count + kCluster - 1) / kCluster;
      const int row0 = row_start[g] + ((local % pm_count) * kCluster + rank) * BM;
      const int n0 = (local / pm_count) * BN;
      int prev_stage = 0;
      for (int kb = 0; kb < num_kb; ++kb) {
        BarWait(&full[stage], phase);
        const uint32_t sa = ring_addr + stage * C::kStageBytes + a_off;
        const uint32_t sb = ring_addr + stage * C::kStageBytes + C::kABytes + b_off;
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = MakeDesc(sa + kk * 32, 1, 64);
          const uint64_t db = kBKMajor ? MakeDesc(sb + kk * 32, 1, 64)
                                       : MakeDesc(sb + kk * 16 * 128, args.b_lbo, args.b_sbo);
          Wgmma<kWN, kF16, kBKMajor>(acc, da, db, (kb > 0 || kk > 0) ? 1 : 0);
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

      // Epilogue: fragment (j, h, e) of thread (warp w, lane l) is row
      // w*16 + l/4 + 8h, column 8j + 2(l%4) + e of this consumer's 64 x WN tile.
      const int group_end = min(row_start[g] + g_rows, args.m);
      const int row_base = row0 + (BM == 128 ? c * 64 : 0) + warp_in_wg * 16 + lane / 4;
      const int col_base = n0 + (BM == 128 ? 0 : c * kWN) + 2 * (lane & 3);
      const bool pair_ok = (args.n & 1) == 0;
#pragma unroll
      for (int j = 0; j < kWN / 8; ++j) {
        const int col = col_base + 8 * j;
        if (col >= args.n) continue;
        float b0 = 0.f, b1 = 0.f;
        if (args.bias != nullptr) {
          b0 = LoadAsFloat(args.bias, args.bias_dtype, static_cast<int64_t>(g) * args.n + col);
          if (col + 1 < args.n) b1 = LoadAsFloat(args.bias, args.bias_dtype, static_cast<int64_t>(g) * args.n + col + 1);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_base + 8 * h;
          if (row < group_end) {
            TOut* p = out + static_cast<int64_t>(row) * args.n + col;
            const float v0 = acc[4 * j + 2 * h] + b0, v1 = acc[4 * j + 2 * h + 1] + b1;
            if (pair_ok && col + 1 < args.n) {
              StorePair<TOut>(p, v0, v1);
            } else {
              p[0] = FromFloat<TOut>(v0);
              if (col + 1 < args.n) p[1] = FromFloat<TOut>(v1);
            }
          }
        }
      }
    }
  }
  if constexpr (kCluster > 1) {  // no block leaves while its peer may still signal it
    __syncwarp();
    ClusterSync();
  }
#endif
}

// --- host side ---

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn GetEncodeTiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiledFn>(nullptr);
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

template <int BM, int BN, bool kF16, bool kBKMajor, typename TOut, int kCluster>
cudaError_t LaunchTyped(const Sm90GroupedGemmParams& p, int num_sms, cudaStream_t stream, const char** detail) {
  EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) {
    *detail = "cuTensorMapEncodeTiled not found in the driver";
    return cudaErrorInvalidValue;
  }
  const CUtensorMapDataType dt = kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  CUtensorMap map_a, map_b;
  {
    cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.m)};
    cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.k) * 2};
    cuuint32_t box[2] = {kBK, BM};
    cuuint32_t estr[2] = {1, 1};
    if (encode(&map_a, dt, 2, const_cast<void*>(p.lhs), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for lhs";
      return cudaErrorInvalidValue;
    }
  }
  {
    cuuint64_t dims[3], strides[2];
    cuuint32_t box[3];
    if (kBKMajor) {  // [G, N, K]
      dims[0] = p.k; dims[1] = p.n; dims[2] = p.num_groups;
      strides[0] = p.k * 2; strides[1] = p.n * p.k * 2;
      box[0] = kBK; box[1] = BN / kCluster; box[2] = 1;
    } else {  // [G, K, N]
      dims[0] = p.n; dims[1] = p.k; dims[2] = p.num_groups;
      strides[0] = p.n * 2; strides[1] = p.n * p.k * 2;
      box[0] = 64; box[1] = kBK; box[2] = 1;
    }
    cuuint32_t estr[3] = {1, 1, 1};
    if (encode(&map_b, dt, 3, const_cast<void*>(p.rhs), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for rhs";
      return cudaErrorInvalidValue;
    }
  }
  KernelArgs a;
  a.out = p.out;
  a.bias = p.bias;
  a.bias_dtype = static_cast<int>(p.bias_dtype);
  a.group_sizes = p.group_sizes;
  a.num_groups = static_cast<int>(p.num_groups);
  a.m = static_cast<int>(p.m);
  a.n = static_cast<int>(p.n);
  a.k = static_cast<int>(p.k);
  // MN-major B, 128B swizzle: atoms of 64 N x 8 K (1 KB); the next 64 N
  // columns are 8 KB on (one [64 K x 64 N] TMA box), the next 8 K rows 1 KB on.
  a.b_lbo = (64 * kBK * 2) >> 4;
  a.b_sbo = 1024 >> 4;
  auto kernel = GroupedGemmKernel<BM, BN, kF16, kBKMajor, TOut, kCluster>;
  const int smem = SmemBytes<BM, BN>(static_cast<int>(p.num_groups));
  static std::once_flag once;
  static cudaError_t attr_err = cudaSuccess;
  std::call_once(once, [&] {
    attr_err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    SmemBytes<BM, BN>(static_cast<int>(kSm90MaxGroups)));
  });
  if (attr_err != cudaSuccess) return attr_err;
  if constexpr (kCluster == 1) {
    kernel<<<num_sms, kThreads, smem, stream>>>(map_a, map_b, a);
    return cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(num_sms / kCluster * kCluster);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    // Not every SM can host a block of a 2-block cluster (clusters live
    // inside one GPC): a persistent grid larger than the co-resident
    // clusters would run its last clusters in a second wave.
    static int max_clusters = -1;
    if (max_clusters < 0) {
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess || n <= 0) {
        cudaGetLastError();
        n = num_sms / kCluster;
      }
      max_clusters = n;
    }
    cfg.gridDim = dim3(std::min(num_sms / kCluster, max_clusters) * kCluster);
    return cudaLaunchKernelEx(&cfg, kernel, map_a, map_b, a);
  }
}

template <int BM, int BN, bool kF16, bool kBKMajor, int kCluster>
cudaError_t DispatchOut(const Sm90GroupedGemmParams& p, int num_sms, cudaStream_t s, const char** d) {
  switch (p.out_dtype) {
    case CuDType::kBF16: return LaunchTyped<BM, BN, kF16, kBKMajor, __nv_bfloat16, kCluster>(p, num_sms, s, d);
    case CuDType::kF16: return LaunchTyped<BM, BN, kF16, kBKMajor, __half, kCluster>(p, num_sms, s, d);
    case CuDType::kF32: return LaunchTyped<BM, BN, kF16, kBKMajor, float, kCluster>(p, num_sms, s, d);
    default: *d = "unsupported output dtype"; return cudaErrorInvalidValue;
  }
}

template <int BM, int BN, int kCluster = 1>
cudaError_t DispatchIn(const Sm90GroupedGemmParams& p, int num_sms, cudaStream_t s, const char** d) {
  const bool f16 = p.in_dtype == CuDType::kF16;
  if (p.rhs_transposed) {
    return f16 ? DispatchOut<BM, BN, true, true, kCluster>(p, num_sms, s, d)
               : DispatchOut<BM, BN, false, true, kCluster>(p, num_sms, s, d);
  }
  return f16 ? DispatchOut<BM, BN, true, false, kCluster>(p, num_sms, s, d)
             : DispatchOut<BM, BN, false, false, kCluster>(p, num_sms, s, d);
}

}  // namespace

const char* Sm90GroupedGemmUnsupportedReason(const Sm90GroupedGemmParams& p) {
  if (p.in_dtype != CuDType::kBF16 && p.in_dtype != CuDType::kF16) return "inputs must be bf16 or f16";
  if (p.out_dtype != CuDType::kBF16 && p.out_dtype != CuDType::kF16 && p.out_dtype != CuDType::kF32)
    return "output must be bf16, f16 or f32";
  if (p.num_groups < 1 || p.num_groups > kSm90MaxGroups) return "num_groups out of range for the sm90 kernel";
  if (p.k < 1 || p.k % 8 != 0) return "k must be a positive multiple of 8 (16-byte TMA strides)";
  if (!p.rhs_transposed && p.n % 8 != 0) return "n must be a multiple of 8 for [G,K,N] rhs (16-byte TMA strides)";
  if (p.m >= (int64_t{1} << 31) || p.n >= (int64_t{1} << 31) || p.k >= (int64_t{1} << 31))
    return "dimensions must fit in 31 bits";
  if (p.m * p.n >= (int64_t{1} << 40)) return "output too large";
  if ((reinterpret_cast<uintptr_t>(p.lhs) | reinterpret_cast<uintptr_t>(p.rhs)) & 15)
    return "lhs and rhs must be 16-byte aligned";
  if (p.out_dtype != CuDType::kF32 ? (reinterpret_cast<uintptr_t>(p.out) & 3) : (reinterpret_cast<uintptr_t>(p.out) & 7))
    return "out must be aligned to two elements";
  return nullptr;
}

cudaError_t LaunchSm90GroupedGemm(const Sm90GroupedGemmParams& p, int num_sms, cudaStream_t stream,
                                  const char** detail) {
  static const char* none = "";
  *detail = none;
  if (const char* why = Sm90GroupedGemmUnsupportedReason(p)) {
    *detail = why;
    return cudaErrorInvalidValue;
  }
  if (p.tile_m == Sm90TileM::k64) return DispatchIn<64, 256>(p, num_sms, stream, detail);
  if (p.tile_n == 128) return DispatchIn<128, 128>(p, num_sms, stream, detail);
  if (p.cluster == 2) return DispatchIn<128, 256, 2>(p, num_sms, stream, detail);
  return DispatchIn<128, 256>(p, num_sms, stream, detail);
}

}  // namespace cuda
}  // namespace shardgemm
