// CPU grouped GEMM: packed, cache-blocked, register-blocked, multithreaded.
//
// Structure (Goto/BLIS style). Every group is one plain GEMM
// C[rows x cols] = sum_p A(i, p) * B(p, j) over a contracting length `depth`:
//   ragged-M: A = lhs rows of g, B = rhs[g] (or its transpose), depth = K.
//   ragged-K: A = (lhs rows of g)^T, B = rhs rows of g, depth = rows of g.
// Work is split into tiles (group, row chunk, column chunk) that threads take
// from an atomic counter. A tile walks the contracting dimension in blocks of
// kKC starting at 0: it packs B[kc, cols] into NR-wide FP32 slivers, then for
// every kMC rows packs A[rows, kc] into MR-high FP32 slivers and runs the
// MR x NR micro-kernel over the block, accumulating into an FP32 scratch tile.
// At the end the scratch tile gets the bias (FP32) and is rounded once to the
// output dtype.
//
// Determinism: the micro-kernel gives each output element its own FP32
// accumulator and updates it once per contracting index, in increasing order
// (acc = fma(a, b, acc), or acc + a * b in the portable kernel). Partial tiles
// are zero-padded in the packed buffers, so edge elements go through exactly
// the same instruction sequence as interior ones. Between kKC blocks the
// accumulator goes through the FP32 scratch tile, which is exact. So the
// result for an element depends only on its own row of A, its own column of B
// and the contracting length.

#include "kernels/cpu/grouped_gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHARDGEMM_X86 1
#endif

#include "absl/strings/str_cat.h"
#include "kernels/cpu/grouped_gemm_internal.h"

namespace shardgemm {
namespace cpu {
namespace {

// ----------------------------------------------------------------------------
// Blocking parameters.
constexpr int64_t kKC = 256;     // contracting block
constexpr int64_t kMC = 96;      // rows per packed A block (multiple of every MR)
constexpr int64_t kNCMax = 512;  // columns per tile (multiple of every NR)
constexpr int64_t kTMMax = 480;  // rows per tile (multiple of kMC)

// ----------------------------------------------------------------------------
// Micro-kernels. Each computes a full MR x NR tile:
//   c[i*ldc + j] (=|+=) sum_{p < kc} a[p*MR + i] * b[p*NR + j]
// one accumulator per element, p in increasing order.

using MicroKernelFn = void (*)(int64_t kc, const float* a, const float* b, float* c,
                               int64_t ldc, bool accumulate);

struct KernelSpec {
  internal::GemmKernel id;
  int mr;
  int nr;
  MicroKernelFn fn;
  const char* name;
};

// Portable kernel: GCC/Clang vector extensions (SSE on x86-64-v2). Separate
// multiply and add (the library is built with -ffp-contract=off).
constexpr int kPortMR = 4;
constexpr int kPortNR = 8;
typedef float V4 __attribute__((vector_size(16)));

void MicroKernelPortable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                         bool accumulate) {
  V4 acc[kPortMR][2];
#pragma GCC unroll 8
  for (int i = 0; i < kPortMR; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      if (accumulate) {
        std::memcpy(&acc[i][j], c + i * ldc + 4 * j, sizeof(V4));
      } else {
        acc[i][j] = V4{0.f, 0.f, 0.f, 0.f};
      }
    }
  }
  for (int64_t p = 0; p < kc; ++p) {
    V4 b0, b1;
    std::memcpy(&b0, b + p * kPortNR, sizeof(V4));
    std::memcpy(&b1, b + p * kPortNR + 4, sizeof(V4));
#pragma GCC unroll 8
    for (int i = 0; i < kPortMR; ++i) {
      const float ai = a[p * kPortMR + i];
      const V4 av = V4{ai, ai, ai, ai};
      acc[i][0] = acc[i][0] + av * b0;
      acc[i][1] = acc[i][1] + av * b1;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kPortMR; ++i) {
    std::memcpy(c + i * ldc, &acc[i][0], sizeof(V4));
    std::memcpy(c + i * ldc + 4, &acc[i][1], sizeof(V4));
  }
}

#ifdef SHARDGEMM_X86
constexpr int kAvx2MR = 6;
constexpr int kAvx2NR = 16;

__attribute__((target("avx2,fma"))) void MicroKernelAvx2(int64_t kc, const float* a,
                                                         const float* b, float* c,
                                                         int64_t ldc, bool accumulate) {
  __m256 acc[kAvx2MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < kAvx2MR; ++i) {
    if (accumulate) {
      acc[i][0] = _mm256_loadu_ps(c + i * ldc);
      acc[i][1] = _mm256_loadu_ps(c + i * ldc + 8);
    } else {
      acc[i][0] = _mm256_setzero_ps();
      acc[i][1] = _mm256_setzero_ps();
    }
  }
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * kAvx2NR);
    const __m256 b1 = _mm256_loadu_ps(b + p * kAvx2NR + 8);
#pragma GCC unroll 8
    for (int i = 0; i < kAvx2MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + p * kAvx2MR + i);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kAvx2MR; ++i) {
    _mm256_storeu_ps(c + i * ldc, acc[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
  }
}

constexpr int kAvx512MR = 12;
constexpr int kAvx512NR = 32;

__attribute__((target("avx512f,fma"))) void MicroKernelAvx512(int64_t kc, const float* a,
                                                              const float* b, float* c,
                                                              int64_t ldc, bool accumulate) {
  __m512 acc[kAvx512MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < kAvx512MR; ++i) {
    if (accumulate) {
      acc[i][0] = _mm512_loadu_ps(c + i * ldc);
      acc[i][1] = _mm512_loadu_ps(c + i * ldc + 16);
    } else {
      acc[i][0] = _mm512_setzero_ps();
      acc[i][1] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < kc; ++p) {
    const __m512 b0 = _mm512_loadu_ps(b + p * kAvx512NR);
    const __m512 b1 = _mm512_loadu_ps(b + p * kAvx512NR + 16);
#pragma GCC unroll 16
    for (int i = 0; i < kAvx512MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[p * kAvx512MR + i]);
      acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kAvx512MR; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc[i][0]);
    _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
  }
}
#endif  // SHARDGEMM_X86

constexpr KernelSpec kPortableSpec{internal::GemmKernel::kPortable, kPortMR, kPortNR,
                                   &MicroKernelPortable, "portable"};
#ifdef SHARDGEMM_X86
constexpr KernelSpec kAvx2Spec{internal::GemmKernel::kAvx2, kAvx2MR, kAvx2NR, &MicroKernelAvx2,
                               "avx2"};
constexpr KernelSpec kAvx512Spec{internal::GemmKernel::kAvx512, kAvx512MR, kAvx512NR,
                                 &MicroKernelAvx512, "avx512"};
#endif

static_assert(kMC % kPortMR == 0 && kNCMax % kPortNR == 0, "blocking");
#ifdef SHARDGEMM_X86
static_assert(kMC % kAvx2MR == 0 && kNCMax % kAvx2NR == 0, "blocking");
static_assert(kMC % kAvx512MR == 0 && kNCMax % kAvx512NR == 0, "blocking");
#endif
static_assert(kTMMax % kMC == 0, "blocking");

bool CpuSupports(internal::GemmKernel k) {
  switch (k) {
    case internal::GemmKernel::kAuto:
    case internal::GemmKernel::kPortable:
      return true;
#ifdef SHARDGEMM_X86
    case internal::GemmKernel::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case internal::GemmKernel::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#endif
    default:
      return false;
  }
}

const KernelSpec& SpecFor(internal::GemmKernel k) {
  switch (k) {
#ifdef SHARDGEMM_X86
    case internal::GemmKernel::kAvx2:
      return kAvx2Spec;
    case internal::GemmKernel::kAvx512:
      return kAvx512Spec;
#endif
    default:
      return kPortableSpec;
  }
}

internal::GemmKernel AutoKernel() {
  static const internal::GemmKernel chosen = [] {
    const char* env = std::getenv("SHARDGEMM_CPU_GEMM_KERNEL");
    if (env != nullptr) {
      const std::string s(env);
      internal::GemmKernel k = internal::GemmKernel::kAuto;
      if (s == "portable") k = internal::GemmKernel::kPortable;
      if (s == "avx2") k = internal::GemmKernel::kAvx2;
      if (s == "avx512") k = internal::GemmKernel::kAvx512;
      if (k != internal::GemmKernel::kAuto && CpuSupports(k)) return k;
    }
    if (CpuSupports(internal::GemmKernel::kAvx512)) return internal::GemmKernel::kAvx512;
    if (CpuSupports(internal::GemmKernel::kAvx2)) return internal::GemmKernel::kAvx2;
    return internal::GemmKernel::kPortable;
  }();
  return chosen;
}

std::atomic<int> g_forced_kernel{static_cast<int>(internal::GemmKernel::kAuto)};

const KernelSpec& ActiveSpec() {
  auto k = static_cast<internal::GemmKernel>(g_forced_kernel.load(std::memory_order_relaxed));
  if (k == internal::GemmKernel::kAuto) k = AutoKernel();
  return SpecFor(k);
}

// ----------------------------------------------------------------------------
// Element conversion.

const float* F16Table() {
  static const float* table = [] {
    float* t = new float[65536];
    for (uint32_t h = 0; h < 65536; ++h) t[h] = F16ToFloat(static_cast<uint16_t>(h));
    return t;
  }();
  return table;
}

// dst[i] = float(src[(offset + i * stride)]) for i < n, src of `dtype`.
inline void ConvertRun(DType dtype, const void* src, int64_t offset, int64_t stride, int64_t n,
                       float* dst) {
  switch (dtype) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src) + offset;
      if (stride == 1) {
        std::memcpy(dst, s, n * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = s[i * stride];
      }
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      if (stride == 1) {
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
          std::memcpy(&dst[i], &bits, 4);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(s[i * stride]);
      }
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      const float* t = F16Table();
      for (int64_t i = 0; i < n; ++i) dst[i] = t[s[i * stride]];
      return;
    }
    default:
      std::memset(dst, 0, n * sizeof(float));  // unreachable after validation
  }
}

inline float ConvertOne(DType dtype, const void* src, int64_t offset) {
  float v;
  ConvertRun(dtype, src, offset, 1, 1, &v);
  return v;
}

inline void StoreRun(DType dtype, const float* src, int64_t n, void* dst, int64_t offset) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(static_cast<float*>(dst) + offset, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBF16(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
    default:
      return;
  }
}

// ----------------------------------------------------------------------------
// Problems, tiles and packing.

// Matrix view: element (i, p) is data[offset + i * rs + p * cs] of `dtype`.
struct MatView {
  const void* data;
  DType dtype;
  int64_t offset;
  int64_t rs;
  int64_t cs;
};

// One group's GEMM: C[rows x cols] = A[rows x depth] * B[depth x cols] (+ bias).
struct Problem {
  MatView a;
  MatView b;
  int64_t rows, cols, depth;
  void* out;
  DType out_dtype;
  int64_t out_offset;  // element offset of C(0, 0) in out
  int64_t ldo;
  const void* bias;  // nullptr: none
  DType bias_dtype;
  int64_t bias_offset;
};

struct Tile {
  int32_t problem;
  int64_t i0, rows, j0, cols;
};

// Element loaders for packing (inlined into the packing loops). Vec4 loads
// four consecutive elements (SSE2 is part of the x86-64 baseline).
struct LoadF32 {
  float At(const void* base, int64_t i) const { return static_cast<const float*>(base)[i]; }
#ifdef SHARDGEMM_X86
  __m128 Vec4(const void* base, int64_t i) const {
    return _mm_loadu_ps(static_cast<const float*>(base) + i);
  }
#endif
};
struct LoadBF16 {
  float At(const void* base, int64_t i) const {
    return BF16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
#ifdef SHARDGEMM_X86
  __m128 Vec4(const void* base, int64_t i) const {
    const __m128i h =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
  }
#endif
};
struct LoadF16 {
  const float* const table = F16Table();
  float At(const void* base, int64_t i) const {
    return table[static_cast<const uint16_t*>(base)[i]];
  }
#ifdef SHARDGEMM_X86
  __m128 Vec4(const void* base, int64_t i) const {
    return _mm_setr_ps(At(base, i), At(base, i + 1), At(base, i + 2), At(base, i + 3));
  }
#endif
};

// Packs A(i0 .. i0+mc, p0 .. p0+kc) into ceil(mc/mr) slivers of kc x mr
// (element (i, p) of a sliver at p*mr + i); missing rows are zero.
template <typename L>
void PackAImpl(const MatView& a, int64_t i0, int64_t mc, int64_t p0, int64_t kc, int mr,
               float* dst) {
  const L ld;
  const void* base = a.data;
  for (int64_t s = 0; s < mc; s += mr) {
    const int64_t rows = std::min<int64_t>(mr, mc - s);
    float* d = dst + (s / mr) * kc * mr;
    const int64_t origin = a.offset + (i0 + s) * a.rs + p0 * a.cs;
    if (a.cs == 1) {
      // Row-major A: read `rows` streams along p.
      int64_t r = 0;
#ifdef SHARDGEMM_X86
      // Four rows at a time: load 4x4, transpose, store.
      for (; r + 4 <= rows; r += 4) {
        const int64_t o = origin + r * a.rs;
        int64_t p = 0;
        for (; p + 4 <= kc; p += 4) {
          __m128 x0 = ld.Vec4(base, o + p);
          __m128 x1 = ld.Vec4(base, o + a.rs + p);
          __m128 x2 = ld.Vec4(base, o + 2 * a.rs + p);
          __m128 x3 = ld.Vec4(base, o + 3 * a.rs + p);
          _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
          _mm_storeu_ps(d + p * mr + r, x0);
          _mm_storeu_ps(d + (p + 1) * mr + r, x1);
          _mm_storeu_ps(d + (p + 2) * mr + r, x2);
          _mm_storeu_ps(d + (p + 3) * mr + r, x3);
        }
        for (; p < kc; ++p) {
          for (int64_t q = 0; q < 4; ++q) d[p * mr + r + q] = ld.At(base, o + q * a.rs + p);
        }
      }
#endif
      for (; r < rows; ++r) {
        const int64_t o = origin + r * a.rs;
        for (int64_t p = 0; p < kc; ++p) d[p * mr + r] = ld.At(base, o + p);
      }
      for (r = rows; r < mr; ++r) {
        for (int64_t p = 0; p < kc; ++p) d[p * mr + r] = 0.f;
      }
    } else {
      // A contiguous along i (ragged-K lhs^T) or general strides.
      for (int64_t p = 0; p < kc; ++p) {
        float* dp = d + p * mr;
        const int64_t o = origin + p * a.cs;
        for (int64_t r = 0; r < rows; ++r) dp[r] = ld.At(base, o + r * a.rs);
        for (int64_t r = rows; r < mr; ++r) dp[r] = 0.f;
      }
    }
  }
}

// Packs B(p0 .. p0+kc, j0 .. j0+nc) into ceil(nc/nr) slivers of kc x nr
// (element (p, j) of a sliver at p*nr + j); missing columns are zero.
template <typename L>
void PackBImpl(const MatView& b, int64_t p0, int64_t kc, int64_t j0, int64_t nc, int nr,
               float* dst) {
  const L ld;
  const void* base = b.data;
  const int64_t origin = b.offset + p0 * b.rs + j0 * b.cs;
  if (b.cs == 1 || b.rs != 1) {
    // Row-major B: walk each row of the panel once, contiguous reads, writes
    // into the slivers in turn.
    const int64_t esize = DTypeSize(b.dtype);
    const char* bytes = static_cast<const char*>(base);
    for (int64_t p = 0; p < kc; ++p) {
      const int64_t o = origin + p * b.rs;
      if (b.cs == 1 && p + 4 < kc) {
        // The rows are far apart in memory: fetch a few rows ahead.
        const char* ahead = bytes + (o + 4 * b.rs) * esize;
        for (int64_t x = 0; x < nc * esize; x += 64) __builtin_prefetch(ahead + x);
      }
      for (int64_t s = 0; s < nc; s += nr) {
        const int64_t cols = std::min<int64_t>(nr, nc - s);
        float* dp = dst + (s / nr) * kc * nr + p * nr;
        for (int64_t c = 0; c < cols; ++c) dp[c] = ld.At(base, o + (s + c) * b.cs);
        for (int64_t c = cols; c < nr; ++c) dp[c] = 0.f;
      }
    }
    return;
  }
  // Transposed B (contiguous along p): read each column's run, write with
  // stride nr (the sliver stays in L1).
  for (int64_t s = 0; s < nc; s += nr) {
    const int64_t cols = std::min<int64_t>(nr, nc - s);
    float* d = dst + (s / nr) * kc * nr;
    int64_t c = 0;
#ifdef SHARDGEMM_X86
    // Four columns at a time: load 4x4, transpose, store.
    for (; c + 4 <= cols; c += 4) {
      const int64_t o = origin + (s + c) * b.cs;
      int64_t p = 0;
      for (; p + 4 <= kc; p += 4) {
        __m128 x0 = ld.Vec4(base, o + p);
        __m128 x1 = ld.Vec4(base, o + b.cs + p);
        __m128 x2 = ld.Vec4(base, o + 2 * b.cs + p);
        __m128 x3 = ld.Vec4(base, o + 3 * b.cs + p);
        _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
        _mm_storeu_ps(d + p * nr + c, x0);
        _mm_storeu_ps(d + (p + 1) * nr + c, x1);
        _mm_storeu_ps(d + (p + 2) * nr + c, x2);
        _mm_storeu_ps(d + (p + 3) * nr + c, x3);
      }
      for (; p < kc; ++p) {
        for (int64_t q = 0; q < 4; ++q) d[p * nr + c + q] = ld.At(base, o + q * b.cs + p);
      }
    }
#endif
    for (; c < cols; ++c) {
      const int64_t o = origin + (s + c) * b.cs;
      for (int64_t p = 0; p < kc; ++p) d[p * nr + c] = ld.At(base, o + p);
    }
    for (c = cols; c < nr; ++c) {
      for (int64_t p = 0; p < kc; ++p) d[p * nr + c] = 0.f;
    }
  }
}

void PackA(const MatView& a, int64_t i0, int64_t mc, int64_t p0, int64_t kc, int mr,
           float* dst) {
  switch (a.dtype) {
    case DType::kBF16:
      return PackAImpl<LoadBF16>(a, i0, mc, p0, kc, mr, dst);
    case DType::kF16:
      return PackAImpl<LoadF16>(a, i0, mc, p0, kc, mr, dst);
    default:
      return PackAImpl<LoadF32>(a, i0, mc, p0, kc, mr, dst);
  }
}

void PackB(const MatView& b, int64_t p0, int64_t kc, int64_t j0, int64_t nc, int nr,
           float* dst) {
  switch (b.dtype) {
    case DType::kBF16:
      return PackBImpl<LoadBF16>(b, p0, kc, j0, nc, nr, dst);
    case DType::kF16:
      return PackBImpl<LoadF16>(b, p0, kc, j0, nc, nr, dst);
    default:
      return PackBImpl<LoadF32>(b, p0, kc, j0, nc, nr, dst);
  }
}

struct FloatBuffer {
  explicit FloatBuffer(int64_t n) {
    const size_t bytes = ((static_cast<size_t>(n) * sizeof(float) + 63) / 64) * 64;
    ptr = static_cast<float*>(std::aligned_alloc(64, bytes > 0 ? bytes : 64));
  }
  ~FloatBuffer() { std::free(ptr); }
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;
  float* ptr;
};

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Workspace {
  Workspace(const KernelSpec& spec, int64_t tm, int64_t nc)
      : ldc(RoundUp(nc, spec.nr)),
        a(kMC * kKC),
        b(kKC * RoundUp(nc, spec.nr)),
        c(RoundUp(tm, spec.mr) * RoundUp(nc, spec.nr)),
        tmp(std::max<int64_t>(kKC, nc)) {}
  int64_t ldc;
  FloatBuffer a, b, c, tmp;
};

// `stop` (may be empty) is asked before each packed block of rows (kMC rows
// by kKC deep, a fraction of a millisecond) after the first: when it says
// so, or `stopped` is already set, the tile is left unfinished (nothing
// stored) and `stopped` is set.
void RunTile(const KernelSpec& spec, const Problem& pr, const Tile& t, Workspace& ws,
             const std::function<bool()>& stop, std::atomic<bool>* stopped) {
  const int mr = spec.mr, nr = spec.nr;
  const int64_t ldc = ws.ldc;
  float* c = ws.c.ptr;
  if (pr.depth == 0) {
    for (int64_t i = 0; i < t.rows; ++i) std::memset(c + i * ldc, 0, t.cols * sizeof(float));
  }
  for (int64_t p0 = 0; p0 < pr.depth; p0 += kKC) {
    const int64_t kc = std::min(kKC, pr.depth - p0);
    const bool accumulate = p0 > 0;
    PackB(pr.b, p0, kc, t.j0, t.cols, nr, ws.b.ptr);
    for (int64_t ii = 0; ii < t.rows; ii += kMC) {
      if ((p0 > 0 || ii > 0) && stop && (stopped->load(std::memory_order_relaxed) || stop())) {
        stopped->store(true, std::memory_order_relaxed);
        return;
      }
      const int64_t mc = std::min(kMC, t.rows - ii);
      PackA(pr.a, t.i0 + ii, mc, p0, kc, mr, ws.a.ptr);
      for (int64_t jr = 0; jr < t.cols; jr += nr) {
        const float* bp = ws.b.ptr + (jr / nr) * kc * nr;
        for (int64_t ir = 0; ir < mc; ir += mr) {
          spec.fn(kc, ws.a.ptr + (ir / mr) * kc * mr, bp, c + (ii + ir) * ldc + jr, ldc,
                  accumulate);
        }
      }
    }
  }
  // Epilogue: bias in FP32, one rounding to the output dtype.
  float* bias = nullptr;
  if (pr.bias != nullptr) {
    bias = ws.tmp.ptr;
    ConvertRun(pr.bias_dtype, pr.bias, pr.bias_offset + t.j0, 1, t.cols, bias);
  }
  for (int64_t i = 0; i < t.rows; ++i) {
    float* row = c + i * ldc;
    if (bias != nullptr) {
      for (int64_t j = 0; j < t.cols; ++j) row[j] = row[j] + bias[j];
    }
    StoreRun(pr.out_dtype, row, t.cols, pr.out, pr.out_offset + (t.i0 + i) * pr.ldo + t.j0);
  }
}

int ResolveThreads(int num_threads) {
  if (num_threads > 0) return num_threads;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// Splits the problems into tiles and runs them on `num_threads` threads;
// CANCELLED once `stop` (asked before each tile and each block of rows of
// one) says so.
absl::Status RunProblems(const std::vector<Problem>& problems, int num_threads,
                         const std::function<bool()>& stop) {
  const KernelSpec& spec = ActiveSpec();
  if (problems.empty()) return absl::OkStatus();
  int64_t max_rows = 0, max_cols = 0;
  for (const Problem& p : problems) {
    max_rows = std::max(max_rows, p.rows);
    max_cols = std::max(max_cols, p.cols);
  }
  if (max_rows == 0 || max_cols == 0) return absl::OkStatus();
  // Small problems: starting a thread costs tens of microseconds, so give
  // each thread at least ~4 MFLOP. (The thread count never changes results.)
  double flops = 0;
  for (const Problem& p : problems) flops += 2.0 * p.rows * p.cols * std::max<int64_t>(p.depth, 1);
  const int threads = static_cast<int>(
      std::max<double>(1.0, std::min<double>(ResolveThreads(num_threads), flops / 4e6)));
  // Tile sizes: as large as possible, smaller when there are too few tiles to
  // keep the threads busy. (Tiling never changes the results.)
  int64_t tm = std::min(kTMMax, RoundUp(max_rows, kMC));
  int64_t nc = std::min(kNCMax, RoundUp(max_cols, spec.nr));
  auto count_tiles = [&](int64_t tm_, int64_t nc_) {
    int64_t n = 0;
    for (const Problem& p : problems) {
      n += ((p.rows + tm_ - 1) / tm_) * ((p.cols + nc_ - 1) / nc_);
    }
    return n;
  };
  while (threads > 1 && count_tiles(tm, nc) < 4 * threads) {
    if (tm > kMC) {
      tm = std::max(kMC, RoundUp(tm / 2, kMC));
    } else if (nc > 4 * spec.nr) {
      nc = std::max<int64_t>(4 * spec.nr, RoundUp(nc / 2, spec.nr));
    } else {
      break;
    }
  }
  std::vector<Tile> tiles;
  for (int32_t pi = 0; pi < static_cast<int32_t>(problems.size()); ++pi) {
    const Problem& p = problems[pi];
    for (int64_t i0 = 0; i0 < p.rows; i0 += tm) {
      for (int64_t j0 = 0; j0 < p.cols; j0 += nc) {
        tiles.push_back(Tile{pi, i0, std::min(tm, p.rows - i0), j0, std::min(nc, p.cols - j0)});
      }
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> stopped{false};
  auto worker = [&] {
    Workspace ws(spec, tm, nc);
    for (size_t t = next.fetch_add(1); t < tiles.size(); t = next.fetch_add(1)) {
      if (stop && (stopped.load(std::memory_order_relaxed) || stop())) {
        stopped.store(true, std::memory_order_relaxed);
        return;
      }
      RunTile(spec, problems[tiles[t].problem], tiles[t], ws, stop, &stopped);
    }
  };
  const int nthreads = static_cast<int>(std::min<size_t>(threads, tiles.size()));
  std::vector<std::thread> pool;
  pool.reserve(nthreads > 0 ? nthreads - 1 : 0);
  for (int i = 1; i < nthreads; ++i) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // cannot start more threads: the started ones share the tiles
    }
  }
  worker();
  for (std::thread& th : pool) th.join();
  if (stopped.load()) {
    return absl::CancelledError("grouped GEMM stopped between tiles: its step was cancelled or expired");
  }
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Validation.

bool IsIoDtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

absl::Status CheckDtype(const char* field, DType d) {
  if (IsIoDtype(d)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": unsupported dtype ", DTypeName(d), " (want f32, bf16 or f16)"));
}

// Sets *bytes = a * b * c * elem_size; error naming `field` on overflow.
absl::Status CheckedBytes(const char* field, int64_t a, int64_t b, int64_t c, int64_t elem,
                          int64_t* elements) {
  int64_t x, y, z;
  if (__builtin_mul_overflow(a, b, &x) || __builtin_mul_overflow(x, c, &y) ||
      __builtin_mul_overflow(y, elem, &z)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": size overflows int64 (", a, " x ", b, " x ", c, ")"));
  }
  *elements = y;
  return absl::OkStatus();
}

absl::Status CheckPointer(const char* field, const void* p, int64_t elements) {
  if (p == nullptr && elements > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": null pointer for ", elements, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGroupedGemmArgs(const GroupedGemmArgs& args, bool ragged_k) {
  if (auto s = CheckDtype("lhs_dtype", args.lhs_dtype); !s.ok()) return s;
  if (auto s = CheckDtype("rhs_dtype", args.rhs_dtype); !s.ok()) return s;
  if (auto s = CheckDtype("out_dtype", args.out_dtype); !s.ok()) return s;
  const struct {
    const char* name;
    int64_t value;
  } dims[] = {{"m", args.m}, {"k", args.k}, {"n", args.n}, {"num_groups", args.num_groups}};
  for (const auto& d : dims) {
    if (d.value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(d.name, ": negative (", d.value, ")"));
    }
  }
  if (ragged_k) {
    if (args.bias != nullptr || args.bias_dtype != DType::kInvalid) {
      return absl::InvalidArgumentError("bias: ragged-K grouped GEMM takes no bias");
    }
    if (args.rhs_transposed) {
      return absl::InvalidArgumentError(
          "rhs_transposed: ragged-K grouped GEMM takes rhs as [M, N], not transposed");
    }
  } else {
    if (args.bias_dtype != DType::kInvalid) {
      if (auto s = CheckDtype("bias_dtype", args.bias_dtype); !s.ok()) return s;
    } else if (args.bias != nullptr) {
      return absl::InvalidArgumentError(
          "bias_dtype: bias pointer given but bias_dtype is kInvalid");
    }
  }
  if (args.num_groups > 0 && args.group_sizes == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_sizes: null pointer for ", args.num_groups, " groups"));
  }
  int64_t total = 0;
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t s = args.group_sizes[g];
    if (s < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_sizes[", g, "]: negative (", s, ")"));
    }
    if (s > args.m - total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group_sizes: sum of group sizes exceeds m=", args.m, " (at group ", g, ")"));
    }
    total += s;
  }
  const int64_t one = 1;
  int64_t lhs_el, rhs_el, out_el, bias_el = 0;
  if (auto s = CheckedBytes("lhs (m * k)", args.m, args.k, one, DTypeSize(args.lhs_dtype),
                            &lhs_el);
      !s.ok()) {
    return s;
  }
  if (ragged_k) {
    if (auto s = CheckedBytes("rhs (m * n)", args.m, args.n, one, DTypeSize(args.rhs_dtype),
                              &rhs_el);
        !s.ok()) {
      return s;
    }
    if (auto s = CheckedBytes("out (num_groups * k * n)", args.num_groups, args.k, args.n,
                              DTypeSize(args.out_dtype), &out_el);
        !s.ok()) {
      return s;
    }
  } else {
    if (auto s = CheckedBytes("rhs (num_groups * k * n)", args.num_groups, args.k, args.n,
                              DTypeSize(args.rhs_dtype), &rhs_el);
        !s.ok()) {
      return s;
    }
    if (auto s = CheckedBytes("out (m * n)", args.m, args.n, one, DTypeSize(args.out_dtype),
                              &out_el);
        !s.ok()) {
      return s;
    }
    if (args.bias_dtype != DType::kInvalid) {
      if (auto s = CheckedBytes("bias (num_groups * n)", args.num_groups, args.n, one,
                                DTypeSize(args.bias_dtype), &bias_el);
          !s.ok()) {
        return s;
      }
    }
  }
  if (auto s = CheckPointer("lhs", args.lhs, lhs_el); !s.ok()) return s;
  if (auto s = CheckPointer("rhs", args.rhs, rhs_el); !s.ok()) return s;
  if (auto s = CheckPointer("out", args.out, out_el); !s.ok()) return s;
  if (auto s = CheckPointer("bias", args.bias, bias_el); !s.ok()) return s;
  return absl::OkStatus();
}

absl::Status GroupedGemmRaggedM(const GroupedGemmArgs& args, int num_threads) {
  if (auto s = ValidateGroupedGemmArgs(args, /*ragged_k=*/false); !s.ok()) return s;
  const int64_t K = args.k, N = args.n;
  const int64_t out_size = DTypeSize(args.out_dtype);
  std::vector<Problem> problems;
  problems.reserve(args.num_groups);
  int64_t row = 0;
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t mg = args.group_sizes[g];
    if (mg > 0 && N > 0) {
      Problem p;
      p.a = MatView{args.lhs, args.lhs_dtype, row * K, K, 1};
      p.b = args.rhs_transposed ? MatView{args.rhs, args.rhs_dtype, g * K * N, 1, K}
                                : MatView{args.rhs, args.rhs_dtype, g * K * N, N, 1};
      p.rows = mg;
      p.cols = N;
      p.depth = K;
      p.out = args.out;
      p.out_dtype = args.out_dtype;
      p.out_offset = row * N;
      p.ldo = N;
      p.bias = args.bias;
      p.bias_dtype = args.bias_dtype;
      p.bias_offset = g * N;
      problems.push_back(p);
    }
    row += mg;
  }
  // Padding rows are zero (all-zero bits is +0 in every output dtype).
  if (row < args.m && N > 0) {
    std::memset(static_cast<char*>(args.out) + row * N * out_size, 0,
                static_cast<size_t>((args.m - row) * N * out_size));
  }
  return RunProblems(problems, num_threads, args.stop);
}

absl::Status GroupedGemmRaggedK(const GroupedGemmArgs& args, int num_threads) {
  if (auto s = ValidateGroupedGemmArgs(args, /*ragged_k=*/true); !s.ok()) return s;
  const int64_t K = args.k, N = args.n;
  std::vector<Problem> problems;
  problems.reserve(args.num_groups);
  int64_t row = 0;
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t mg = args.group_sizes[g];
    if (K > 0 && N > 0) {
      Problem p;
      p.a = MatView{args.lhs, args.lhs_dtype, row * K, 1, K};  // A(i, p) = lhs[row + p, i]
      p.b = MatView{args.rhs, args.rhs_dtype, row * N, N, 1};  // B(p, j) = rhs[row + p, j]
      p.rows = K;
      p.cols = N;
      p.depth = mg;  // 0 for an empty group: the tile writes zeros
      p.out = args.out;
      p.out_dtype = args.out_dtype;
      p.out_offset = g * K * N;
      p.ldo = N;
      p.bias = nullptr;
      p.bias_dtype = DType::kInvalid;
      p.bias_offset = 0;
      problems.push_back(p);
    }
    row += mg;
  }
  return RunProblems(problems, num_threads, args.stop);
}

namespace internal {

bool SetGemmKernelForTesting(GemmKernel kernel) {
  if (!CpuSupports(kernel)) return false;
  g_forced_kernel.store(static_cast<int>(kernel), std::memory_order_relaxed);
  return true;
}

const char* ActiveGemmKernelName() { return ActiveSpec().name; }

}  // namespace internal

}  // namespace cpu
}  // namespace shardgemm
