// GPU grouped quantize / dequantize vs the CPU reference, bit for bit, and
// the FP8 grouped GEMM against the dequantized and the BF16 references.
// Without a GPU (cudaGetDeviceCount fails, e.g. "CUDA driver version is
// insufficient") every test skips, so CI builds and runs it harmlessly.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/fp8.h"

namespace shardgemm {
namespace {

bool HaveGpu() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or found none)"

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

// Nonzero bytes among the workspace's fields that every launch leaves zero:
// all but the two-pass path's amax slots, which keep the slot last used
// until the next two-pass call (QuantizeWorkspace).
std::ptrdiff_t NonzeroProtocolBytes(const std::vector<uint8_t>& ws) {
  const size_t n = std::min(ws.size(), offsetof(cuda_internal::QuantizeWorkspace, amax_parity));
  return static_cast<std::ptrdiff_t>(n) - std::count(ws.begin(), ws.begin() + static_cast<std::ptrdiff_t>(n), 0);
}

struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes) : n(bytes) {
    if (bytes) {
      EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    }
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void Upload(const void* h) { EXPECT_EQ(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> h(n);
    if (n) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  void Fill(uint8_t v) {
    if (n) {
      EXPECT_EQ(cudaMemset(p, v, n), cudaSuccess);
    }
  }
};

// Random input of the given dtype, with NaN, +-Inf, zeros, subnormals and
// large values sprinkled in when `specials`.
// count elements of value v in dtype dt.
std::vector<uint8_t> ConstantInput(DType dt, int64_t count, float v) {
  std::vector<uint8_t> r(static_cast<size_t>(count * DTypeSize(dt)));
  for (int64_t i = 0; i < count; ++i) {
    if (dt == DType::kF32) {
      std::memcpy(r.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dt == DType::kBF16 ? FloatToBf16Bits(v) : FloatToF16Bits(v);
      std::memcpy(r.data() + 2 * i, &h, 2);
    }
  }
  return r;
}

std::vector<uint8_t> RandomInput(DType dt, int64_t count, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int es = DTypeSize(dt);
  std::vector<uint8_t> v(static_cast<size_t>(count * es));
  for (int64_t i = 0; i < count; ++i) {
    float f = nd(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 13) - 6));
    if (specials) {
      const uint32_t r = rng() % 4000;
      if (r == 0) f = std::nanf("");
      if (r == 1) f = -std::nanf("");
      if (r == 2) f = INFINITY;
      if (r == 3) f = -INFINITY;
      if (r == 4) f = 0.0f;
      if (r == 5) f = -0.0f;
      if (r == 6) f = 1e-30f;
      if (r == 7) f = 7e4f;
    }
    if (dt == DType::kBF16) {
      uint16_t h = FloatToBf16Bits(f);
      std::memcpy(&v[i * 2], &h, 2);
    } else if (dt == DType::kF16) {
      uint16_t h = FloatToF16Bits(f);
      std::memcpy(&v[i * 2], &h, 2);
    } else {
      std::memcpy(&v[i * 4], &f, 4);
    }
  }
  return v;
}

struct Case {
  ScalingMode mode;
  Fp8Format fmt;
  DType dt;
  bool rowwise, colwise;
  int64_t k;
  std::vector<int64_t> groups;
  int64_t pad_rows;
  bool specials;
  bool software_cvt;
  cuda::GpuQuantizeOptions::CurrentPass current_pass = cuda::GpuQuantizeOptions::CurrentPass::kAuto;
  MxScaleRecipe recipe = MxScaleRecipe::kOcp;
  bool amax_out = true;  // ask for amax (optional for MXFP8 and block scaling)
  int tile_rows = 0;     // GpuQuantizeOptions::tile_rows (0: the default)
  bool workspace = true;  // pass GpuQuantizeOptions::workspace (else current scaling memsets amax first)
  bool own_stream = false;  // a stream of the test's, no workspace: the library's per-stream one
  cuda::GpuQuantizeOptions::Kernel kernel = cuda::GpuQuantizeOptions::Kernel::kAuto;
  int scale_offset = 0;  // scale buffers this many bytes past a 256-byte boundary (MXFP8's are byte arrays)
};

std::string Name(const Case& c) {
  std::string s = std::string(ScalingModeName(c.mode)) + "/" + Fp8FormatName(c.fmt) + "/" +
                  std::string(DTypeName(c.dt)) + (c.rowwise ? "/row" : "") + (c.colwise ? "/col" : "") +
                  "/k=" + std::to_string(c.k) + (c.software_cvt ? "/swcvt" : "/hwcvt") +
                  (c.amax_out ? "" : "/no-amax") + (c.recipe == MxScaleRecipe::kOcp ? "" : "/nv-recipe") +
                  (c.tile_rows ? "/tile_rows=" + std::to_string(c.tile_rows) : "") +
                  (c.workspace ? "" : "/no-workspace") + (c.own_stream ? "/own-stream" : "") +
                  (c.kernel == cuda::GpuQuantizeOptions::Kernel::kTiled     ? "/tiled"
                   : c.kernel == cuda::GpuQuantizeOptions::Kernel::kOneShot ? "/one-shot"
                                                                            : "") +
                  (c.scale_offset ? "/scale_offset=" + std::to_string(c.scale_offset) : "") + " groups=";
  for (int64_t g : c.groups) s += std::to_string(g) + ",";
  return s;
}

void RunCase(const Case& c, uint32_t seed) {
  SCOPED_TRACE(Name(c));
  int64_t m = c.pad_rows;
  for (int64_t g : c.groups) m += g;
  const int64_t k = c.k, G = static_cast<int64_t>(c.groups.size());
  std::vector<uint8_t> x = RandomInput(c.dt, m * k, seed, c.specials);
  std::vector<float> scale(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) scale[g] = std::exp2(static_cast<float>(g % 7) - 2.0f) * 1.5f;

  GroupedQuantizeArgs a;
  a.x_dtype = c.dt, a.m = m, a.k = k, a.group_sizes = c.groups.data(), a.num_groups = G;
  a.mode = c.mode, a.format = c.fmt, a.rowwise = c.rowwise, a.colwise = c.colwise;
  a.mx_recipe = c.recipe;
  absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(a);
  ASSERT_TRUE(l.ok()) << l.status();
  const size_t data_bytes = static_cast<size_t>(m * k);
  const size_t rs_bytes = static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes);
  const size_t cs_bytes = static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes);

  // CPU reference.
  std::vector<uint8_t> hr(data_bytes, 0x5a), hc(data_bytes, 0x5a), hrs(rs_bytes, 0x5a), hcs(cs_bytes, 0x5a);
  std::vector<float> hamax(static_cast<size_t>(G), -1.0f);
  GroupedQuantizeArgs ca = a;
  ca.x = x.data(), ca.scale = scale.data();
  ca.rowwise_data = hr.data(), ca.colwise_data = hc.data();
  ca.rowwise_scale_inv = hrs.data(), ca.colwise_scale_inv = hcs.data();
  ca.amax = c.amax_out ? hamax.data() : nullptr;
  absl::Status cs = cpu::GroupedQuantize(ca);
  ASSERT_TRUE(cs.ok()) << cs;

  // GPU, outputs pre-filled with garbage.
  DevBuf dx(x.size()), dscale(scale.size() * 4), dr(data_bytes), dc(data_bytes), drs(rs_bytes + c.scale_offset),
      dcs(cs_bytes + c.scale_offset),
      damax(static_cast<size_t>(G) * 4);
  dx.Upload(x.data());
  dscale.Upload(scale.data());
  for (DevBuf* b : {&dr, &dc, &drs, &dcs, &damax}) b->Fill(0xa5);
  GroupedQuantizeArgs ga = a;
  ga.x = dx.p, ga.scale = dscale.as<float>();
  ga.rowwise_data = dr.as<uint8_t>(), ga.colwise_data = dc.as<uint8_t>();
  void* const drs_p = drs.as<uint8_t>() + c.scale_offset;
  void* const dcs_p = dcs.as<uint8_t>() + c.scale_offset;
  ga.rowwise_scale_inv = drs_p, ga.colwise_scale_inv = dcs_p;
  ga.amax = c.amax_out ? damax.as<float>() : nullptr;
  cuda::GpuQuantizeOptions opt;
  opt.software_cvt = c.software_cvt;
  opt.current_pass = c.current_pass;
  opt.tile_rows = c.tile_rows;
  opt.kernel = c.kernel;
  // The null stream: the library keeps no workspace of its own for it.
  DevBuf workspace(cuda::QuantizeWorkspaceBytes());
  workspace.Fill(0);
  if (c.workspace && !c.own_stream) opt.workspace = workspace.p;
  cudaStream_t stream = nullptr;
  if (c.own_stream) {
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  // Twice: first on a decoy of larger magnitude, then (outputs filled with
  // garbage again) on x. A workspace the first launch left dirty (amax, the
  // finished-blocks count, the fused pass's counters) shows in the outputs.
  DevBuf decoy(x.size());
  decoy.Upload(ConstantInput(c.dt, m * k, 30000.0f).data());
  for (int rep = 0; rep < 2; ++rep) {
    if (rep == 1) {
      CK(cudaStreamSynchronize(stream));
      for (DevBuf* b : {&dr, &dc, &drs, &dcs, &damax}) b->Fill(0xa5);
      CK(cudaDeviceSynchronize());  // (the fills ran on the legacy stream, which a stream of ours does not wait for)
    }
    ga.x = rep == 0 ? decoy.p : dx.p;
    absl::Status gs = cuda::GroupedQuantize(ga, stream, opt);
    ASSERT_TRUE(gs.ok()) << gs;
  }
  CK(cudaDeviceSynchronize());
  if (opt.workspace != nullptr) {
    const std::vector<uint8_t> ws = workspace.Download();
    EXPECT_EQ(NonzeroProtocolBytes(ws), 0) << "the workspace is not zero after the launch";
  }
  if (stream != nullptr) {
    CK(cudaStreamDestroy(stream));
  }

  auto expect_same = [](const std::vector<uint8_t>& want, const std::vector<uint8_t>& got, const char* what) {
    ASSERT_EQ(want.size(), got.size()) << what;
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] != got[i]) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " bytes differ, first at " << first
                      << " (cpu 0x" << std::hex << (first >= 0 ? int(want[first]) : 0) << ", gpu 0x"
                      << (first >= 0 ? int(got[first]) : 0) << ")";
  };
  // The scales after the offset; the bytes before it untouched.
  auto scales_of = [&](const DevBuf& b, const std::vector<uint8_t>& want, const char* what) {
    std::vector<uint8_t> got = b.Download();
    const std::vector<uint8_t> before(got.begin(), got.begin() + c.scale_offset);
    EXPECT_EQ(before, std::vector<uint8_t>(static_cast<size_t>(c.scale_offset), 0xa5)) << what << ": written before";
    got.erase(got.begin(), got.begin() + c.scale_offset);
    expect_same(want, got, what);
  };
  if (c.rowwise) {
    expect_same(hr, dr.Download(), "rowwise_data");
    scales_of(drs, hrs, "rowwise_scale_inv");
  }
  if (c.colwise) {
    expect_same(hc, dc.Download(), "colwise_data");
    scales_of(dcs, hcs, "colwise_scale_inv");
  }
  if (c.amax_out) {
    std::vector<uint8_t> hamax_bytes(reinterpret_cast<uint8_t*>(hamax.data()),
                                     reinterpret_cast<uint8_t*>(hamax.data()) + G * 4);
    expect_same(hamax_bytes, damax.Download(), "amax");
  }

  // Dequantize on the GPU vs the CPU, every output dtype, rowwise and colwise.
  for (bool colwise : {false, true}) {
    if (colwise ? !c.colwise : !c.rowwise) continue;
    for (DType od : {DType::kF32, DType::kBF16}) {
      GroupedDequantizeArgs d;
      d.colwise = colwise, d.mode = c.mode, d.format = c.fmt, d.m = m, d.k = k;
      d.group_sizes = c.groups.data(), d.num_groups = G, d.out_dtype = od;
      std::vector<uint8_t> hout(static_cast<size_t>(m * k * DTypeSize(od)));
      d.data = colwise ? hc.data() : hr.data();
      d.scale_inv = colwise ? hcs.data() : hrs.data();
      d.out = hout.data();
      ASSERT_TRUE(cpu::GroupedDequantize(d).ok());
      DevBuf dout(hout.size());
      dout.Fill(0x77);
      d.data = colwise ? dc.as<uint8_t>() : dr.as<uint8_t>();
      d.scale_inv = colwise ? dcs_p : drs_p;
      d.out = dout.p;
      absl::Status ds = cuda::GroupedDequantize(d, nullptr);
      ASSERT_TRUE(ds.ok()) << ds;
      CK(cudaDeviceSynchronize());
      expect_same(hout, dout.Download(), colwise ? "dequantize colwise" : "dequantize rowwise");
    }
  }
}

TEST(QuantizeGpuTest, HardwareConversionMatchesSoftwareForEveryFloat) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<unsigned long long> bad = cuda::ExhaustiveConversionMismatches(nullptr);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(*bad, 0u);
}

TEST(QuantizeGpuTest, BitIdenticalToCpuOnRandomInputs) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  const std::vector<std::vector<int64_t>> shapes = {
      {37, 0, 130, 1, 64, 0, 200},  // uneven, empty, one-row groups
      {0, 0, 5},                    // leading empties
      {256, 128},                   // tile-aligned
  };
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8,
                           ScalingMode::kBlock1x128, ScalingMode::kBlock128x128}) {
    for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
        for (int rc = 0; rc < 3; ++rc) {
          const bool row = rc != 1, col = rc != 0;
          for (size_t si = 0; si < shapes.size(); ++si) {
            // K: a multiple of 128, and one that leaves a partial column tile.
            for (int64_t k : {int64_t{256}, mode == ScalingMode::kMxfp8 ? int64_t{160} : int64_t{200}}) {
              Case c{mode, fmt, dt, row, col, k, shapes[si], si == 0 ? 3 : 0, si != 2, false};
              RunCase(c, seed++);
              if (HasFatalFailure()) return;
              // The tile-aligned shape takes the one-shot kernel by default
              // where it applies: the tiled kernels on it too.
              c.kernel = cuda::GpuQuantizeOptions::Kernel::kTiled;
              if (si == 2) RunCase(c, seed++);
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(QuantizeGpuTest, SoftwareConversionPathIsIdenticalToo) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 1000;
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kMxfp8, ScalingMode::kBlock1x128}) {
    for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      Case c{mode, fmt, DType::kBF16, true, true, 256, {37, 0, 130, 1}, 2, true, true};
      RunCase(c, seed++);
    }
  }
}

TEST(QuantizeGpuTest, LargeUnevenGroups) {
  SKIP_WITHOUT_GPU();
  // Many tiles, group boundaries inside tiles, a group of 1 and empties.
  std::vector<int64_t> groups = {3000, 1, 0, 2047, 4096, 0, 777, 1500};
  uint32_t seed = 77;
  // f16 too (its own whole-tile kernels).
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8,
                             ScalingMode::kBlock1x128, ScalingMode::kBlock128x128}) {
      Case c{mode, Fp8Format::kE4M3, dt, true, true, 1024, groups, 64, true, false};
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
  // Without the optional amax output (no tile amax pass); one output at a time too.
  for (ScalingMode mode : {ScalingMode::kMxfp8, ScalingMode::kBlock1x128, ScalingMode::kBlock128x128}) {
    for (int rc = 0; rc < 3; ++rc) {
      Case c{mode, Fp8Format::kE5M2, DType::kBF16, rc != 1, rc != 0, 1024, groups, 64, true, false};
      c.amax_out = false;
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
  // Every tile shape of the modes that have three (32 x 512, 64 x 256 and
  // 128 x 128), with k = 1024 (whole column tiles of all) and 384 (partial
  // 256- and 512-column tiles).
  for (int tile_rows : {32, 64, 128}) {
    for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
      for (int64_t k : {int64_t{1024}, int64_t{384}}) {
        Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, k, groups, 64, true, false};
        c.tile_rows = tile_rows;
        RunCase(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
  // 32 x 512 tiles with the other input types (f16's and f32's own loads and
  // decodes), E5M2, and one output at a time.
  for (DType dt : {DType::kF16, DType::kF32}) {
    for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
      for (int rc = 0; rc < 2; ++rc) {
        Case c{mode, Fp8Format::kE5M2, dt, rc == 0, rc == 1, 1024, groups, 64, true, false};
        c.tile_rows = 32;
        RunCase(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
  // Every group empty: amax still comes out zero (zeroed by its own launch,
  // or the workspace's copied out) and the one-block launch writes the tensor
  // scales (MXFP8: no scale entries, null pointers).
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
    Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, 1024, {0, 0, 0}, 5, false, false};
    RunCase(c, seed++);
    if (HasFatalFailure()) return;
  }
  // Without a workspace (current scaling: amax zeroed by a memset before the
  // kernels), and on a stream of ours (the library's own workspace for it).
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
    for (int how = 0; how < 2; ++how) {
      Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, 1024, groups, 64, true, false};
      c.workspace = how == 1;
      c.own_stream = how == 1;
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
  // MXFP8 scales at odd addresses (E8M0 byte arrays may sit anywhere): the
  // codes and the padding's zeros land there, nothing before.
  for (int offset : {1, 7}) {
    Case c{ScalingMode::kMxfp8, Fp8Format::kE4M3, DType::kBF16, true, true, 1024, groups, 64, true, false};
    c.scale_offset = offset;
    RunCase(c, seed++);
    if (HasFatalFailure()) return;
  }
  // MXFP8's other recipe (whole tiles take the general path for it), E5M2 too.
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    Case c{ScalingMode::kMxfp8, fmt, DType::kBF16, true, true, 1024, groups, 64, true, false};
    c.recipe = MxScaleRecipe::kNvidiaRoundUp;
    RunCase(c, seed++);
    if (HasFatalFailure()) return;
  }
}

// Launches of at most kSmallGpuGroups groups take parameter structs sized
// for 64 groups, larger ones the full 1024-group tables (quantize.cu,
// LaunchGroupedQuantize and LaunchGroupedAmax; quantize_oneshot.cu): both
// sides of the boundary, and many uneven groups with empties, for every mode
// on the tiled kernels, both current scaling passes, and the one-shot kernel
// (groups of whole 32-row slabs).
TEST(QuantizeGpuTest, GroupCountsAroundTheSmallParameterTables) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int> rows(0, 150);
  uint32_t seed = 1100;
  for (int G : {cuda_internal::kSmallGpuGroups, cuda_internal::kSmallGpuGroups + 1, 300}) {
    std::vector<int64_t> groups(static_cast<size_t>(G));
    for (int64_t& g : groups) g = rows(rng) < 20 ? 0 : rows(rng);
    for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8,
                             ScalingMode::kBlock1x128, ScalingMode::kBlock128x128}) {
      Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, 256, groups, 7, true, false};
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
    for (auto pass : {cuda::GpuQuantizeOptions::CurrentPass::kTwoPass, cuda::GpuQuantizeOptions::CurrentPass::kFused}) {
      Case c{ScalingMode::kCurrent, Fp8Format::kE5M2, DType::kBF16, true, true, 384, groups, 7, true, false};
      c.current_pass = pass;
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
  std::uniform_int_distribution<int> slabs(0, 3);
  for (int G : {cuda_internal::kSmallGpuGroups, cuda_internal::kSmallGpuGroups + 1, 100}) {
    std::vector<int64_t> groups(static_cast<size_t>(G));
    for (int64_t& g : groups) g = 32 * slabs(rng);
    for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
      Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, 256, groups, 0, true, false};
      c.kernel = cuda::GpuQuantizeOptions::Kernel::kOneShot;
      RunCase(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(QuantizeGpuTest, OneShotKernelIsBitIdenticalToo) {
  SKIP_WITHOUT_GPU();
  using Kernel = cuda::GpuQuantizeOptions::Kernel;
  // Groups of multiples of 32 rows with empties between; padding rows; k of
  // one and of several 256-column slabs; small-decode's shape (64 groups of
  // 64 rows, k = 1024: 512 slabs). Current scaling's launch must fit the GPU
  // at once (4 blocks per SM on the H200): it takes 64 groups of 32 rows
  // (256 slabs, two per SM on a 128-SM GPU).
  std::vector<int64_t> small_decode(64, 64), small_decode_32(64, 32);
  uint32_t seed = 5000;
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
    for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (DType dt : {DType::kBF16, DType::kF16}) {
        for (int rc = 0; rc < 3; ++rc) {
          for (size_t si = 0; si < 3; ++si) {
            const std::vector<std::pair<std::vector<int64_t>, int64_t>> shapes = {
                {{64, 0, 32, 96, 0}, 256},
                {{0, 128}, 768},
                {mode == ScalingMode::kCurrent ? small_decode_32 : small_decode, 1024}};
            Case c{mode, fmt, dt, rc != 1, rc != 0, shapes[si].second, shapes[si].first, si == 0 ? 7 : 0, si != 2,
                   false};
            c.kernel = Kernel::kOneShot;
            RunCase(c, seed++);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
  // Without the optional amax (MXFP8), without a workspace (delayed: amax
  // zeroed by its own launch first, as with one), on a stream of ours.
  for (ScalingMode mode : {ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
    Case c{mode, Fp8Format::kE4M3, DType::kBF16, true, true, 512, {96, 0, 64}, 0, true, false};
    c.kernel = Kernel::kOneShot;
    c.workspace = false;
    c.amax_out = mode == ScalingMode::kDelayed;
    RunCase(c, seed++);
    if (HasFatalFailure()) return;
  }
  Case c{ScalingMode::kCurrent, Fp8Format::kE4M3, DType::kBF16, true, true, 512, {96, 0, 64}, 0, true, false};
  c.kernel = Kernel::kOneShot;
  c.workspace = false, c.own_stream = true;
  RunCase(c, seed++);
  if (HasFatalFailure()) return;
  // MXFP8 scales at an odd address.
  Case m{ScalingMode::kMxfp8, Fp8Format::kE4M3, DType::kBF16, true, true, 512, {96, 0, 64, 32}, 0, true, false};
  m.kernel = Kernel::kOneShot;
  m.scale_offset = 3;
  RunCase(m, seed++);
}

TEST(QuantizeGpuTest, OneShotKernelSaysWhyItCannotTakeACall) {
  SKIP_WITHOUT_GPU();
  std::vector<int64_t> gs = {64, 40};
  GroupedQuantizeArgs a;
  a.m = 104, a.k = 512, a.group_sizes = gs.data(), a.num_groups = 2, a.mode = ScalingMode::kDelayed;
  a.rowwise = true;
  DevBuf x(104 * 512 * 2), d(104 * 512), s(8), am(8);
  a.x = x.p, a.rowwise_data = d.as<uint8_t>(), a.rowwise_scale_inv = s.p, a.amax = am.as<float>(), a.scale = s.as<float>();
  cuda::GpuQuantizeOptions opt;
  opt.kernel = cuda::GpuQuantizeOptions::Kernel::kOneShot;
  auto expect_rejected = [&](const char* why) {
    absl::Status st = cuda::GroupedQuantize(a, nullptr, opt);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(why), std::string::npos) << st;
  };
  expect_rejected("group_sizes[1] is 40");
  gs[1] = 32;
  a.k = 384;
  expect_rejected("k a multiple of 256");
  a.k = 512;
  a.x_dtype = DType::kF32;
  expect_rejected("not f32");
  a.x_dtype = DType::kBF16;
  a.mode = ScalingMode::kCurrent;  // the null stream: no workspace of the library's
  expect_rejected("needs a workspace");
  // A call with no rows takes the tiled kernels' one-block launch (the
  // empty groups' scales and amax), asked for the one-shot kernel or not.
  gs[0] = 0, gs[1] = 0;
  a.mode = ScalingMode::kDelayed;
  EXPECT_TRUE(cuda::GroupedQuantize(a, nullptr, opt).ok());
  gs[0] = 64, gs[1] = 32;
  a.mode = ScalingMode::kCurrent;
  // Auto takes the tiled kernels for all of these, and kOneShot the call that fits.
  opt.kernel = cuda::GpuQuantizeOptions::Kernel::kAuto;
  EXPECT_TRUE(cuda::GroupedQuantize(a, nullptr, opt).ok());
  a.mode = ScalingMode::kDelayed;
  opt.kernel = cuda::GpuQuantizeOptions::Kernel::kOneShot;
  EXPECT_TRUE(cuda::GroupedQuantize(a, nullptr, opt).ok());
  CK(cudaDeviceSynchronize());
}

TEST(QuantizeGpuTest, AutoPicksTheOneShotKernelForShortInputsOnly) {
  SKIP_WITHOUT_GPU();
  using Kernel = cuda::GpuQuantizeOptions::Kernel;
  int device = 0, sms = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Shapes only: nothing is launched (the pointers are never read).
  DevBuf x(16), d(16), s(16), am(16);
  auto chosen = [&](ScalingMode mode, std::vector<int64_t> gs, int64_t k, const cuda::GpuQuantizeOptions& opt) {
    int64_t m = 0;
    for (int64_t g : gs) m += g;
    GroupedQuantizeArgs a;
    a.x = x.p, a.m = m, a.k = k, a.group_sizes = gs.data(), a.num_groups = static_cast<int64_t>(gs.size());
    a.mode = mode, a.rowwise = true, a.colwise = true;
    a.rowwise_data = d.as<uint8_t>(), a.colwise_data = d.as<uint8_t>();
    a.rowwise_scale_inv = s.p, a.colwise_scale_inv = s.p, a.amax = am.as<float>(), a.scale = s.as<float>();
    return cuda::ChosenQuantizeKernel(a, nullptr, opt);
  };
  cuda::GpuQuantizeOptions with_ws;
  with_ws.workspace = am.p;  // (a stand-in: only its presence counts here)
  const cuda::GpuQuantizeOptions none;
  // A decode step of 8 experts x 32 tokens (64 slabs): the one-shot kernel,
  // for current scaling only with a workspace (the null stream has none of
  // the library's).
  const std::vector<int64_t> tiny(8, 32);
  for (ScalingMode mode : {ScalingMode::kDelayed, ScalingMode::kMxfp8}) {
    EXPECT_EQ(*chosen(mode, tiny, 2048, none), Kernel::kOneShot) << ScalingModeName(mode);
  }
  EXPECT_EQ(*chosen(ScalingMode::kCurrent, tiny, 2048, with_ws), Kernel::kOneShot);
  EXPECT_EQ(*chosen(ScalingMode::kCurrent, tiny, 2048, none), Kernel::kTiled);
  // Up to two slabs per SM, then the tiled kernels (small-decode: 512 slabs).
  const int64_t rows_at_limit = (2 * sms / 8) * 32;  // k = 2048: 8 slabs per 32 rows
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, {rows_at_limit}, 2048, none), Kernel::kOneShot);
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, {rows_at_limit + 32}, 2048, none), Kernel::kTiled);
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, std::vector<int64_t>(64, 64), 1024, none), Kernel::kTiled);
  // What the one-shot kernel does not take goes to the tiled kernels.
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, {40}, 2048, none), Kernel::kTiled);
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, {32}, 384, none), Kernel::kTiled);
  EXPECT_EQ(*chosen(ScalingMode::kBlock1x128, {128}, 256, none), Kernel::kTiled);
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, {0, 0}, 256, none), Kernel::kTiled);
  cuda::GpuQuantizeOptions tiled;
  tiled.kernel = Kernel::kTiled;
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, tiny, 2048, tiled), Kernel::kTiled);
  // Asked for where it cannot run: the error GroupedQuantize returns.
  cuda::GpuQuantizeOptions one_shot;
  one_shot.kernel = Kernel::kOneShot;
  absl::StatusOr<Kernel> no = chosen(ScalingMode::kMxfp8, {32}, 384, one_shot);
  EXPECT_EQ(no.status().code(), absl::StatusCode::kInvalidArgument) << no.status();
  EXPECT_EQ(*chosen(ScalingMode::kMxfp8, std::vector<int64_t>(64, 64), 1024, one_shot), Kernel::kOneShot);
}

TEST(QuantizeGpuTest, CurrentScalingFusedAndTwoPassAgree) {
  SKIP_WITHOUT_GPU();
  // Several fused batches (x is ~46 MB), groups inside and across batches,
  // and the separate-amax-pass path on the same inputs.
  std::vector<int64_t> groups = {3000, 0, 1, 2047, 4096, 0, 777, 1500, 128, 129, 5000, 3};
  uint32_t seed = 500;
  using P = cuda::GpuQuantizeOptions::CurrentPass;
  for (P pass : {P::kFused, P::kTwoPass}) {
    for (bool row : {true, false}) {
      Case c{ScalingMode::kCurrent, Fp8Format::kE4M3, DType::kBF16, row, true, 1536, groups, 5, true, false, pass};
      RunCase(c, seed++);
    }
  }
  // Big groups: the fused pass and the default.
  for (P pass : {P::kFused, P::kAuto}) {
    RunCase(Case{ScalingMode::kCurrent, Fp8Format::kE4M3, DType::kBF16, true, true, 8192, {2048, 0, 2100}, 3, true,
                 false, pass},
            seed++);
  }
  Case c{ScalingMode::kCurrent, Fp8Format::kE5M2, DType::kF32, true, true, 512, groups, 0, true, false, P::kFused};
  RunCase(c, seed++);
}

TEST(QuantizeGpuTest, RejectsWhatTheKernelsCannotDo) {
  SKIP_WITHOUT_GPU();
  std::vector<int64_t> gs = {4};
  GroupedQuantizeArgs a;
  a.m = 4, a.k = 12, a.group_sizes = gs.data(), a.num_groups = 1;
  DevBuf x(4 * 16 * 2), d(64), s(4), am(4);
  a.x = x.p, a.rowwise_data = d.as<uint8_t>(), a.rowwise_scale_inv = s.p, a.amax = am.as<float>();
  absl::Status st = cuda::GroupedQuantize(a, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("k:"), std::string::npos) << st;
  a.k = 16;
  cuda::GpuQuantizeOptions opt;
  opt.tile_rows = 96;
  st = cuda::GroupedQuantize(a, nullptr, opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("tile_rows:"), std::string::npos) << st;
}

// Calls queued back to back on one stream, no synchronization between them:
// each launch is the programmatic dependent of the one before (PDL), so a
// launch that ran ahead of the one it follows, or completed before it, shows
// here. Current -> delayed -> MXFP8 -> (every group empty, delayed, amax
// into buffer B) -> MXFP8 into B -> current again, all on one workspace;
// every output checked against the CPU reference. Both kernels: kAuto takes
// the one-shot kernel for these 22 slabs (but for the empty call), kTiled the
// tiled ones (the two-pass current scaling, the amax zeroing's dependents
// reading x before their wait). x has no NaN, so a stale amax would show.
TEST(QuantizeGpuTest, BackToBackCallsOnOneStreamEachMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (cuda::GpuQuantizeOptions::Kernel kernel :
       {cuda::GpuQuantizeOptions::Kernel::kAuto, cuda::GpuQuantizeOptions::Kernel::kTiled}) {
    SCOPED_TRACE(kernel == cuda::GpuQuantizeOptions::Kernel::kTiled ? "tiled" : "auto");
    const int64_t k = 512;
    const std::vector<int64_t> groups = {64, 0, 96, 32, 160};
    const std::vector<int64_t> empty = {0, 0, 0, 0, 0};
    const int64_t G = static_cast<int64_t>(groups.size()), m = 352;
    const std::vector<uint8_t> x1 = RandomInput(DType::kBF16, m * k, 11, false);
    const std::vector<uint8_t> x2 = RandomInput(DType::kBF16, m * k, 12, false);
    const std::vector<float> scale = {1.5f, 3.0f, 0.75f, 6.0f, 0.375f};
    DevBuf dx1(x1.size()), dx2(x2.size()), dscale(G * 4), workspace(cuda::QuantizeWorkspaceBytes()), amax_b(G * 4);
    dx1.Upload(x1.data());
    dx2.Upload(x2.data());
    dscale.Upload(scale.data());
    workspace.Fill(0);
    amax_b.Fill(0xa5);
    struct Call {
      ScalingMode mode;
      const std::vector<uint8_t>* x;
      const DevBuf* dx;
      const std::vector<int64_t>* groups;
      bool shared_amax;  // amax into buffer B, else the call's own
    };
    const std::vector<Call> calls = {
        {ScalingMode::kCurrent, &x1, &dx1, &groups, false}, {ScalingMode::kDelayed, &x2, &dx2, &groups, false},
        {ScalingMode::kMxfp8, &x1, &dx1, &groups, false},   {ScalingMode::kDelayed, &x2, &dx2, &empty, true},
        {ScalingMode::kMxfp8, &x2, &dx2, &groups, true},    {ScalingMode::kCurrent, &x2, &dx2, &groups, false},
    };
    struct Out {
      std::unique_ptr<DevBuf> r, c, rs, cs, amax;
      std::vector<uint8_t> hr, hc, hrs, hcs;
      std::vector<float> hamax;
    };
    std::vector<Out> outs(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      const Call& call = calls[i];
      GroupedQuantizeArgs a;
      a.x_dtype = DType::kBF16, a.m = m, a.k = k, a.group_sizes = call.groups->data(), a.num_groups = G;
      a.mode = call.mode, a.format = Fp8Format::kE4M3, a.rowwise = true, a.colwise = true;
      absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(a);
      ASSERT_TRUE(l.ok()) << l.status();
      Out& o = outs[i];
      const size_t rs = static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes);
      const size_t cs = static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes);
      o.hr.assign(m * k, 0), o.hc.assign(m * k, 0), o.hrs.assign(rs, 0), o.hcs.assign(cs, 0);
      o.hamax.assign(G, -1.0f);
      GroupedQuantizeArgs ca = a;
      ca.x = call.x->data(), ca.scale = scale.data();
      ca.rowwise_data = o.hr.data(), ca.colwise_data = o.hc.data();
      ca.rowwise_scale_inv = o.hrs.data(), ca.colwise_scale_inv = o.hcs.data(), ca.amax = o.hamax.data();
      ASSERT_TRUE(cpu::GroupedQuantize(ca).ok());
      o.r = std::make_unique<DevBuf>(m * k), o.c = std::make_unique<DevBuf>(m * k);
      o.rs = std::make_unique<DevBuf>(rs), o.cs = std::make_unique<DevBuf>(cs);
      o.amax = std::make_unique<DevBuf>(G * 4);
      for (DevBuf* b : {o.r.get(), o.c.get(), o.rs.get(), o.cs.get(), o.amax.get()}) b->Fill(0xa5);
    }
    CK(cudaDeviceSynchronize());
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (size_t i = 0; i < calls.size(); ++i) {  // queued, not waited for
      const Call& call = calls[i];
      Out& o = outs[i];
      GroupedQuantizeArgs a;
      a.x = call.dx->p, a.x_dtype = DType::kBF16, a.m = m, a.k = k;
      a.group_sizes = call.groups->data(), a.num_groups = G;
      a.mode = call.mode, a.format = Fp8Format::kE4M3, a.rowwise = true, a.colwise = true;
      a.scale = dscale.as<float>();
      a.rowwise_data = o.r->as<uint8_t>(), a.colwise_data = o.c->as<uint8_t>();
      a.rowwise_scale_inv = o.rs->p, a.colwise_scale_inv = o.cs->p;
      a.amax = call.shared_amax ? amax_b.as<float>() : o.amax->as<float>();
      cuda::GpuQuantizeOptions opt;
      opt.workspace = workspace.p;
      opt.kernel = kernel;
      absl::Status st = cuda::GroupedQuantize(a, stream, opt);
      EXPECT_TRUE(st.ok()) << "call " << i << ": " << st;
    }
    CK(cudaStreamSynchronize(stream));
    CK(cudaStreamDestroy(stream));
    for (size_t i = 0; i < calls.size(); ++i) {
      SCOPED_TRACE("call " + std::to_string(i));
      const Out& o = outs[i];
      EXPECT_EQ(o.r->Download(), o.hr) << "rowwise_data";
      EXPECT_EQ(o.c->Download(), o.hc) << "colwise_data";
      EXPECT_EQ(o.rs->Download(), o.hrs) << "rowwise_scale_inv";
      EXPECT_EQ(o.cs->Download(), o.hcs) << "colwise_scale_inv";
      if (i == 3) continue;  // its amax buffer (B) is call 4's, checked there
      std::vector<uint8_t> got = (calls[i].shared_amax ? amax_b : *o.amax).Download();
      EXPECT_EQ(0, std::memcmp(got.data(), o.hamax.data(), G * 4)) << "amax";
    }
    const std::vector<uint8_t> ws = workspace.Download();
    EXPECT_EQ(NonzeroProtocolBytes(ws), 0) << "workspace";
    if (HasFailure()) return;
  }
}

// Calls captured in a CUDA graph (with an explicit workspace, as capture
// needs) and the graph replayed twice with new inputs in between: every
// replay recomputes each output (the amax zeroing, the workspace's reset and
// the dependent launches are all in the graph). Two of the captured calls
// write the same output buffers, one after the other, on different x and by
// different kernels (one-shot, then tiled): only the second's bytes may be
// left (write after write across a dependent launch).
TEST(QuantizeGpuTest, GraphReplaysAndRewrittenOutputsMatchTheReference) {
  SKIP_WITHOUT_GPU();
  using Kernel = cuda::GpuQuantizeOptions::Kernel;
  const int64_t k = 512;
  const std::vector<int64_t> groups = {64, 0, 96, 32, 160};
  const int64_t G = static_cast<int64_t>(groups.size()), m = 352;
  const std::vector<float> scale = {1.5f, 3.0f, 0.75f, 6.0f, 0.375f};
  DevBuf dx1(m * k * 2), dx2(m * k * 2), dscale(G * 4), workspace(cuda::QuantizeWorkspaceBytes());
  dscale.Upload(scale.data());
  workspace.Fill(0);
  struct Call {
    ScalingMode mode;
    const DevBuf* dx;
    int out;  // which output set
    Kernel kernel;
  };
  const std::vector<Call> calls = {
      {ScalingMode::kCurrent, &dx1, 0, Kernel::kTiled},  // the two passes: the workspace's amax slots
      {ScalingMode::kMxfp8, &dx1, 1, Kernel::kOneShot},
      {ScalingMode::kMxfp8, &dx2, 1, Kernel::kTiled},  // the same outputs, rewritten
      {ScalingMode::kDelayed, &dx2, 2, Kernel::kTiled},
  };
  auto args_for = [&](ScalingMode mode) {
    GroupedQuantizeArgs a;
    a.x_dtype = DType::kBF16, a.m = m, a.k = k, a.group_sizes = groups.data(), a.num_groups = G;
    a.mode = mode, a.format = Fp8Format::kE4M3, a.rowwise = true, a.colwise = true;
    return a;
  };
  struct Out {
    std::unique_ptr<DevBuf> r, c, rs, cs, amax;
  };
  std::vector<Out> outs(3);
  for (int o = 0; o < 3; ++o) {
    absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(args_for(calls[o == 2 ? 3 : o].mode));
    ASSERT_TRUE(l.ok()) << l.status();
    outs[o].r = std::make_unique<DevBuf>(m * k), outs[o].c = std::make_unique<DevBuf>(m * k);
    outs[o].rs = std::make_unique<DevBuf>(static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes));
    outs[o].cs = std::make_unique<DevBuf>(static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes));
    outs[o].amax = std::make_unique<DevBuf>(G * 4);
  }
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (const Call& call : calls) {
    GroupedQuantizeArgs a = args_for(call.mode);
    const Out& o = outs[call.out];
    a.x = call.dx->p, a.scale = dscale.as<float>();
    a.rowwise_data = o.r->as<uint8_t>(), a.colwise_data = o.c->as<uint8_t>();
    a.rowwise_scale_inv = o.rs->p, a.colwise_scale_inv = o.cs->p, a.amax = o.amax->as<float>();
    cuda::GpuQuantizeOptions opt;
    opt.workspace = workspace.p;
    opt.kernel = call.kernel;
    absl::Status st = cuda::GroupedQuantize(a, stream, opt);
    EXPECT_TRUE(st.ok()) << st;
  }
  cudaGraph_t graph = nullptr;
  CK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const std::vector<uint8_t> x1 = RandomInput(DType::kBF16, m * k, 21 + 2 * replay, false);
    const std::vector<uint8_t> x2 = RandomInput(DType::kBF16, m * k, 22 + 2 * replay, false);
    dx1.Upload(x1.data());
    dx2.Upload(x2.data());
    for (const Out& o : outs) {
      for (DevBuf* b : {o.r.get(), o.c.get(), o.rs.get(), o.cs.get(), o.amax.get()}) b->Fill(0xa5);
    }
    CK(cudaDeviceSynchronize());  // (the fills ran on the legacy stream, which ours does not wait for)
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaStreamSynchronize(stream));
    // The last writer of each output set: calls 0, 2 and 3.
    for (size_t i : {size_t{0}, size_t{2}, size_t{3}}) {
      const Call& call = calls[i];
      SCOPED_TRACE("call " + std::to_string(i));
      GroupedQuantizeArgs ca = args_for(call.mode);
      absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(ca);
      ASSERT_TRUE(l.ok()) << l.status();
      std::vector<uint8_t> hr(m * k, 0), hc(m * k, 0);
      std::vector<uint8_t> hrs(static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes));
      std::vector<uint8_t> hcs(static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes));
      std::vector<float> hamax(G, -1.0f);
      ca.x = (call.dx == &dx1 ? x1 : x2).data(), ca.scale = scale.data();
      ca.rowwise_data = hr.data(), ca.colwise_data = hc.data();
      ca.rowwise_scale_inv = hrs.data(), ca.colwise_scale_inv = hcs.data(), ca.amax = hamax.data();
      ASSERT_TRUE(cpu::GroupedQuantize(ca).ok());
      const Out& o = outs[call.out];
      EXPECT_EQ(o.r->Download(), hr) << "rowwise_data";
      EXPECT_EQ(o.c->Download(), hc) << "colwise_data";
      EXPECT_EQ(o.rs->Download(), hrs) << "rowwise_scale_inv";
      EXPECT_EQ(o.cs->Download(), hcs) << "colwise_scale_inv";
      std::vector<uint8_t> got = o.amax->Download();
      EXPECT_EQ(0, std::memcmp(got.data(), hamax.data(), G * 4)) << "amax";
    }
    const std::vector<uint8_t> ws = workspace.Download();
    EXPECT_EQ(NonzeroProtocolBytes(ws), 0) << "workspace";
    if (HasFailure()) break;
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(stream));
}

// A current-scaling row+col call (bf16 x, E4M3) with its CPU reference and
// its device buffers: `args` points at the device ones.
struct CurrentScalingCall {
  std::vector<int64_t> groups;
  int64_t m = 0, G = 0;
  std::vector<uint8_t> hr, hc, hrs, hcs;
  std::vector<float> hamax;
  std::unique_ptr<DevBuf> dx, dr, dc, drs, dcs, damax;
  GroupedQuantizeArgs args;

  // The reference on x (m x k bf16 bytes), x uploaded. (ASSERTs: a void function.)
  void Init(std::vector<int64_t> group_sizes, int64_t k, const std::vector<uint8_t>& x) {
    groups = std::move(group_sizes);
    G = static_cast<int64_t>(groups.size());
    m = static_cast<int64_t>(x.size()) / (2 * k);
    args.x_dtype = DType::kBF16, args.m = m, args.k = k, args.group_sizes = groups.data(), args.num_groups = G;
    args.mode = ScalingMode::kCurrent, args.format = Fp8Format::kE4M3, args.rowwise = true, args.colwise = true;
    hr.assign(m * k, 0), hc.assign(m * k, 0), hrs.assign(G * 4, 0), hcs.assign(G * 4, 0), hamax.assign(G, 0.0f);
    GroupedQuantizeArgs ca = args;
    ca.x = x.data(), ca.rowwise_data = hr.data(), ca.colwise_data = hc.data();
    ca.rowwise_scale_inv = hrs.data(), ca.colwise_scale_inv = hcs.data(), ca.amax = hamax.data();
    ASSERT_TRUE(cpu::GroupedQuantize(ca).ok());
    dx = std::make_unique<DevBuf>(x.size()), dr = std::make_unique<DevBuf>(m * k), dc = std::make_unique<DevBuf>(m * k);
    drs = std::make_unique<DevBuf>(G * 4), dcs = std::make_unique<DevBuf>(G * 4);
    damax = std::make_unique<DevBuf>(G * 4);
    dx->Upload(x.data());
    args.x = dx->p, args.rowwise_data = dr->as<uint8_t>(), args.colwise_data = dc->as<uint8_t>();
    args.rowwise_scale_inv = drs->p, args.colwise_scale_inv = dcs->p, args.amax = damax->as<float>();
  }
  // Garbage in every output, the fills done (they run on the legacy stream,
  // which a stream of the caller's does not wait for).
  void FillOutputs() const {
    for (DevBuf* b : {dr.get(), dc.get(), drs.get(), dcs.get(), damax.get()}) b->Fill(0xa5);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // After the call's work has finished.
  void ExpectOutputsMatchTheReference() const {
    EXPECT_EQ(dr->Download(), hr) << "rowwise_data";
    EXPECT_EQ(dc->Download(), hc) << "colwise_data";
    EXPECT_EQ(drs->Download(), hrs) << "rowwise_scale_inv";
    EXPECT_EQ(dcs->Download(), hcs) << "colwise_scale_inv";
    const std::vector<uint8_t> got = damax->Download();
    EXPECT_EQ(0, std::memcmp(got.data(), hamax.data(), G * 4)) << "amax";
  }
};

// Current scaling's two passes on one workspace take its amax slots in
// turn (QuantizeWorkspace): a call with fewer groups than the call before
// the last must still find its slot zero in every group. Calls of 8, 1 and 8
// groups (the first on large values, so a leftover shows in the third's
// amax and scales; the third with an empty group, whose amax must be 0),
// then the workspace's invariant: the slot named next is all zero.
TEST(QuantizeGpuTest, TwoPassAmaxSlotsStartFromZeroWhateverTheCallsBefore) {
  SKIP_WITHOUT_GPU();
  const int64_t k = 256;
  DevBuf workspace(cuda::QuantizeWorkspaceBytes());
  workspace.Fill(0);
  struct Call {
    std::vector<int64_t> groups;
    bool large;
  };
  const std::vector<Call> calls = {
      {{64, 32, 96, 32, 64, 32, 32, 64}, true},
      {{128}, false},
      {{64, 32, 0, 32, 64, 32, 32, 64}, false},
      {{64, 32, 96, 32, 64, 32, 32, 64}, false},
  };
  uint32_t seed = 900;
  for (size_t i = 0; i < calls.size(); ++i) {
    SCOPED_TRACE("call " + std::to_string(i));
    int64_t m = 0;
    for (int64_t g : calls[i].groups) m += g;
    CurrentScalingCall call;
    call.Init(calls[i].groups, k,
              calls[i].large ? ConstantInput(DType::kBF16, m * k, 30000.0f)
                             : RandomInput(DType::kBF16, m * k, seed++, false));
    if (HasFatalFailure()) return;
    call.FillOutputs();
    cuda::GpuQuantizeOptions opt;
    opt.workspace = workspace.p;
    opt.kernel = cuda::GpuQuantizeOptions::Kernel::kTiled;
    absl::Status st = cuda::GroupedQuantize(call.args, nullptr, opt);
    ASSERT_TRUE(st.ok()) << st;
    CK(cudaDeviceSynchronize());
    call.ExpectOutputsMatchTheReference();
    const std::vector<uint8_t> ws = workspace.Download();
    EXPECT_EQ(NonzeroProtocolBytes(ws), 0) << "workspace";
    cuda_internal::QuantizeWorkspace w;
    ASSERT_EQ(ws.size(), sizeof(w));
    std::memcpy(&w, ws.data(), sizeof(w));
    ASSERT_TRUE(w.amax_parity == 0 || w.amax_parity == 1) << w.amax_parity;
    EXPECT_EQ(w.amax_parity, 1 - w.amax_slot_in_use) << "the parity names the slot this call did not use";
    EXPECT_EQ(std::count(std::begin(w.amax_slots[w.amax_parity]), std::end(w.amax_slots[w.amax_parity]), 0u),
              cuda_internal::kMaxGpuGroups)
        << "the slot the next call takes is not zero";
  }
}

// The library's own workspace of a stream (no options.workspace) is freed on
// request, the stream's queued work finished first; the next call on the
// stream gets a new one and is still right. Releasing where there is none
// (a stream never used, the null stream) does nothing.
TEST(QuantizeGpuTest, ReleasedStreamWorkspaceIsMadeAgainOnTheNextCall) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EXPECT_TRUE(cuda::ReleaseQuantizeWorkspace(stream).ok());  // none yet
  EXPECT_TRUE(cuda::ReleaseQuantizeWorkspace(nullptr).ok());
  const int64_t k = 256, m = 96;
  CurrentScalingCall call;
  call.Init({32, 0, 64}, k, RandomInput(DType::kBF16, m * k, 31, true));
  if (HasFatalFailure()) return;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    call.FillOutputs();
    for (cuda::GpuQuantizeOptions::Kernel kernel :
         {cuda::GpuQuantizeOptions::Kernel::kOneShot, cuda::GpuQuantizeOptions::Kernel::kTiled}) {
      cuda::GpuQuantizeOptions opt;  // no workspace: the library's own for the stream
      opt.kernel = kernel;
      absl::Status st = cuda::GroupedQuantize(call.args, stream, opt);
      ASSERT_TRUE(st.ok()) << st;
    }
    absl::Status released = cuda::ReleaseQuantizeWorkspace(stream);  // waits for the calls above
    ASSERT_TRUE(released.ok()) << released;
    call.ExpectOutputsMatchTheReference();
  }
  EXPECT_TRUE(cuda::ReleaseQuantizeWorkspace(stream).ok());  // released already: nothing to do
  CK(cudaStreamDestroy(stream));
}

// amax_accumulate: the tiles max-reduce into the caller's amax as it stands
// (a running max over calls), on both kernels, with and without a workspace
// (which must then not publish over the caller's values), row+col; the data
// are the same bytes; a second call leaves the running max where it is.
TEST(QuantizeGpuTest, AmaxAccumulateMaxReducesIntoTheCallersAmax) {
  SKIP_WITHOUT_GPU();
  using Kernel = cuda::GpuQuantizeOptions::Kernel;
  std::vector<int64_t> gs = {64, 0, 96, 32};
  const int64_t G = static_cast<int64_t>(gs.size()), m = 192, k = 512;
  const std::vector<uint8_t> x = RandomInput(DType::kBF16, m * k, 91, false);
  const std::vector<float> scale(static_cast<size_t>(G), 2.0f);
  // Per group: zero, on the empty group, above the group's amax, below it.
  const std::vector<float> before = {0.0f, 7.0f, 1e30f, 1e-30f};
  DevBuf dx(x.size()), ds(scale.size() * 4), dd(static_cast<size_t>(m * k)), dcd(static_cast<size_t>(m * k)),
      dam(static_cast<size_t>(G) * 4), workspace(cuda::QuantizeWorkspaceBytes());
  dx.Upload(x.data());
  ds.Upload(scale.data());
  workspace.Fill(0);
  for (ScalingMode mode : {ScalingMode::kDelayed, ScalingMode::kMxfp8, ScalingMode::kBlock1x128}) {
    for (Kernel kernel : {Kernel::kTiled, Kernel::kOneShot}) {
      for (bool with_workspace : {false, true}) {
        if (mode == ScalingMode::kBlock1x128 && kernel == Kernel::kOneShot) continue;
        SCOPED_TRACE(std::string(ScalingModeName(mode)) + (kernel == Kernel::kTiled ? " tiled" : " one-shot") +
                     (with_workspace ? " workspace" : ""));
        GroupedQuantizeArgs a;
        a.x_dtype = DType::kBF16, a.m = m, a.k = k, a.group_sizes = gs.data(), a.num_groups = G;
        a.mode = mode, a.format = Fp8Format::kE4M3, a.rowwise = true, a.colwise = true;
        absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(a);
        ASSERT_TRUE(l.ok()) << l.status();
        const size_t rsb = static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes);
        const size_t csb = static_cast<size_t>(l->colwise_scale_elems * l->scale_bytes);
        std::vector<uint8_t> hd(static_cast<size_t>(m * k)), hcd(static_cast<size_t>(m * k)), hs(rsb), hcs(csb);
        std::vector<float> hamax(static_cast<size_t>(G));
        GroupedQuantizeArgs ca = a;
        ca.x = x.data(), ca.scale = scale.data(), ca.rowwise_data = hd.data(), ca.rowwise_scale_inv = hs.data();
        ca.colwise_data = hcd.data(), ca.colwise_scale_inv = hcs.data(), ca.amax = hamax.data();
        ASSERT_TRUE(cpu::GroupedQuantize(ca).ok());

        DevBuf dsc(rsb), dcsc(csb);
        GroupedQuantizeArgs ga = a;
        ga.x = dx.p, ga.scale = ds.as<float>(), ga.rowwise_data = dd.as<uint8_t>(), ga.rowwise_scale_inv = dsc.p;
        ga.colwise_data = dcd.as<uint8_t>(), ga.colwise_scale_inv = dcsc.p, ga.amax = dam.as<float>();
        cuda::GpuQuantizeOptions opt;
        opt.kernel = kernel;
        opt.amax_accumulate = true;
        if (with_workspace) opt.workspace = workspace.p;
        CK(cudaMemcpy(dam.p, before.data(), before.size() * 4, cudaMemcpyHostToDevice));
        for (int call = 0; call < 2; ++call) {  // the second: the running max stays
          absl::Status st = cuda::GroupedQuantize(ga, nullptr, opt);
          ASSERT_TRUE(st.ok()) << st;
          CK(cudaDeviceSynchronize());
          std::vector<float> got(static_cast<size_t>(G));
          CK(cudaMemcpy(got.data(), dam.p, got.size() * 4, cudaMemcpyDeviceToHost));
          for (int64_t g = 0; g < G; ++g) {
            const float want = gs[g] == 0 ? before[g] : std::max(before[g], hamax[g]);
            EXPECT_EQ(got[g], want) << "call " << call << ", group " << g << ": before " << before[g]
                                    << ", the group's amax " << hamax[g];
          }
        }
        EXPECT_EQ(dd.Download(), hd) << "rowwise_data";
        EXPECT_EQ(dsc.Download(), hs) << "rowwise_scale_inv";
        EXPECT_EQ(dcd.Download(), hcd) << "colwise_data";
        EXPECT_EQ(dcsc.Download(), hcs) << "colwise_scale_inv";
        const std::vector<uint8_t> ws = workspace.Download();
        EXPECT_EQ(NonzeroProtocolBytes(ws), 0) << "workspace";
      }
    }
  }
  // Current scaling's scales come from this call's amax: refused, by name.
  GroupedQuantizeArgs a;
  a.x_dtype = DType::kBF16, a.m = m, a.k = k, a.group_sizes = gs.data(), a.num_groups = G;
  a.mode = ScalingMode::kCurrent, a.rowwise = true, a.x = dx.p, a.rowwise_data = dd.as<uint8_t>();
  DevBuf dsc(static_cast<size_t>(G) * 4);
  a.rowwise_scale_inv = dsc.p, a.amax = dam.as<float>();
  cuda::GpuQuantizeOptions opt;
  opt.amax_accumulate = true;
  absl::Status st = cuda::GroupedQuantize(a, nullptr, opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("amax_accumulate:"), std::string::npos) << st;
  // Nothing to accumulate into: refused too.
  a.mode = ScalingMode::kMxfp8, a.amax = nullptr;
  DevBuf dmx(static_cast<size_t>(m * k / 32 + 4096));
  a.rowwise_scale_inv = dmx.p;
  st = cuda::GroupedQuantize(a, nullptr, opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("amax_accumulate:"), std::string::npos) << st;
}

// ---- FP8 grouped GEMM ---------------------------------------------------------

struct GemmResult {
  double rel_err_vs_dequant = 0;
  double rel_err_vs_bf16 = 0;
  cuda::Fp8GemmStats stats;
};

// Quantizes bf16 x [M, K] (groups) and w [G, N, K] on the GPU, runs the FP8
// GEMM, and compares against (a) the CPU dequantize-then-FP32 reference and
// (b) the FP32 product of the BF16 inputs.
// Diagnostic scale re-layouts for block scaling (variant 0 = as GroupedQuantize writes them):
// lhs variant 1: per group [m_g][ceil(K/128)] (K-blocks innermost) instead of [ceil(K/128)][roundup(m_g, 4)];
// rhs variant 1: per group [ceil(K/128)][roundup(ceil(N/128), 4)] instead of [ceil(N/128)][roundup(ceil(K/128), 4)].
void Relayout(std::vector<uint8_t>& bytes, const QuantizeLayout& l, const std::vector<int64_t>& gs, int64_t k,
              bool lhs) {
  std::vector<float> f(bytes.size() / 4), o(bytes.size() / 4, 0.0f);
  std::memcpy(f.data(), bytes.data(), bytes.size());
  const int64_t kb = (k + 127) / 128;
  for (size_t g = 0; g < gs.size(); ++g) {
    const int64_t base = l.rowwise_scale_offset[g];
    const int64_t rows = l.rowwise_scale_rows[g], cols = l.rowwise_scale_cols[g];
    if (lhs) {  // [kb][cols=roundup(m,4)] -> [m][kb]
      for (int64_t b = 0; b < kb; ++b) {
        for (int64_t r = 0; r < gs[g]; ++r) o[base + r * kb + b] = f[base + b * cols + r];
      }
    } else {  // [rows=nb][cols] -> [kb][roundup(nb,4)]
      const int64_t ld = (rows + 3) / 4 * 4;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < kb; ++b) o[base + b * ld + r] = f[base + r * cols + b];
      }
    }
  }
  std::memcpy(bytes.data(), o.data(), bytes.size());
}

absl::StatusOr<GemmResult> RunGemm(ScalingMode lmode, ScalingMode rmode, Fp8Format lfmt, Fp8Format rfmt,
                                   const std::vector<int64_t>& groups, int64_t pad, int64_t n, int64_t k,
                                   int lhs_variant = 0, int rhs_variant = 0) {
  const int64_t G = static_cast<int64_t>(groups.size());
  int64_t m = pad;
  for (int64_t g : groups) m += g;
  std::vector<uint8_t> xb = RandomInput(DType::kBF16, m * k, 5, false);
  std::vector<uint8_t> wb = RandomInput(DType::kBF16, G * n * k, 6, false);
  std::vector<int64_t> wgs(static_cast<size_t>(G), n);
  DevBuf dx(xb.size()), dw(wb.size());
  dx.Upload(xb.data());
  dw.Upload(wb.data());
  struct Q {
    GroupedQuantizeArgs a;
    std::unique_ptr<DevBuf> data, scale, amax;
    std::vector<uint8_t> hdata, hscale;
  };
  auto quantize = [](Q& q, const DevBuf& x, int64_t rows, int64_t k, const int64_t* gs, int64_t G, ScalingMode mode,
                     Fp8Format fmt) -> absl::Status {
    q.a.x = x.p, q.a.x_dtype = DType::kBF16, q.a.m = rows, q.a.k = k, q.a.group_sizes = gs, q.a.num_groups = G;
    q.a.mode = mode, q.a.format = fmt, q.a.rowwise = true;
    absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(q.a);
    if (!l.ok()) return l.status();
    q.data = std::make_unique<DevBuf>(static_cast<size_t>(rows * k));
    q.scale = std::make_unique<DevBuf>(static_cast<size_t>(l->rowwise_scale_elems * l->scale_bytes));
    q.amax = std::make_unique<DevBuf>(static_cast<size_t>(G * 4));
    q.a.rowwise_data = q.data->as<uint8_t>(), q.a.rowwise_scale_inv = q.scale->p, q.a.amax = q.amax->as<float>();
    std::vector<float> ones(static_cast<size_t>(G), 1.0f);
    if (mode == ScalingMode::kDelayed) return absl::InvalidArgumentError("not used");
    if (absl::Status s = cuda::GroupedQuantize(q.a, nullptr); !s.ok()) return s;
    cudaDeviceSynchronize();
    q.hdata = q.data->Download();
    q.hscale = q.scale->Download();
    return absl::OkStatus();
  };
  Q lq, rq;
  if (absl::Status s = quantize(lq, dx, m, k, groups.data(), G, lmode, lfmt); !s.ok()) return s;
  if (absl::Status s = quantize(rq, dw, G * n, k, wgs.data(), G, rmode, rfmt); !s.ok()) return s;

  if (lhs_variant || rhs_variant) {
    for (int side = 0; side < 2; ++side) {
      if (!(side == 0 ? lhs_variant : rhs_variant)) continue;
      Q& q = side == 0 ? lq : rq;
      absl::StatusOr<QuantizeLayout> l = GetQuantizeLayout(q.a);
      std::vector<int64_t> gsv(q.a.group_sizes, q.a.group_sizes + G);
      std::vector<uint8_t> b = q.hscale;
      Relayout(b, *l, gsv, k, side == 0);
      q.scale->Upload(b.data());
    }
  }
  cublasLtHandle_t handle;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return absl::InternalError("cublasLtCreate");
  DevBuf ws(32 << 20), dout(static_cast<size_t>(m * n * 2));
  dout.Fill(0x7f);
  cuda::Fp8GroupedGemmArgs ga;
  ga.lhs = lq.data->as<uint8_t>(), ga.lhs_scale_inv = lq.scale->p, ga.lhs_mode = lmode, ga.lhs_format = lfmt;
  ga.rhs = rq.data->as<uint8_t>(), ga.rhs_scale_inv = rq.scale->p, ga.rhs_mode = rmode, ga.rhs_format = rfmt;
  ga.m = m, ga.n = n, ga.k = k, ga.group_sizes = groups.data(), ga.num_groups = G;
  ga.out = dout.p, ga.out_dtype = DType::kBF16, ga.workspace = ws.p, ga.workspace_bytes = ws.n;
  cuda::Fp8GemmStats stats;
  ga.stats = &stats;
  absl::Status s = cuda::Fp8GroupedGemm(ga, handle, nullptr);
  cudaDeviceSynchronize();
  cublasLtDestroy(handle);
  if (!s.ok()) return s;
  std::vector<uint8_t> out_bytes = dout.Download();

  auto deq = [&](const Q& q) {
    GroupedDequantizeArgs d;
    d.data = q.hdata.data(), d.scale_inv = q.hscale.data(), d.mode = q.a.mode, d.format = q.a.format;
    d.m = q.a.m, d.k = q.a.k, d.group_sizes = q.a.group_sizes, d.num_groups = q.a.num_groups;
    return d;
  };
  absl::StatusOr<std::vector<float>> ref = cpu::DequantizeGroupedGemmReference(deq(lq), deq(rq), n);
  if (!ref.ok()) return ref.status();
  GemmResult r;
  double e1 = 0, n1 = 0, e2 = 0, n2 = 0;
  int64_t off = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t row = off; row < off + groups[g]; ++row) {
      for (int64_t j = 0; j < n; ++j) {
        uint16_t h;
        std::memcpy(&h, &out_bytes[(row * n + j) * 2], 2);
        const double got = Bf16BitsToFloat(h);
        const double want1 = (*ref)[row * n + j];
        double want2 = 0;
        for (int64_t c = 0; c < k; ++c) {
          uint16_t xv, wv;
          std::memcpy(&xv, &xb[(row * k + c) * 2], 2);
          std::memcpy(&wv, &wb[((g * n + j) * k + c) * 2], 2);
          want2 += static_cast<double>(Bf16BitsToFloat(xv)) * Bf16BitsToFloat(wv);
        }
        e1 += (got - want1) * (got - want1), n1 += want1 * want1;
        e2 += (got - want2) * (got - want2), n2 += want2 * want2;
      }
    }
    off += groups[g];
  }
  for (int64_t i = off * n; i < m * n; ++i) {
    if (out_bytes[i * 2] != 0 || out_bytes[i * 2 + 1] != 0) return absl::InternalError("padding row not zero");
  }
  r.stats = stats;
  r.rel_err_vs_dequant = std::sqrt(e1 / n1);
  r.rel_err_vs_bf16 = std::sqrt(e2 / n2);
  return r;
}

const std::vector<int64_t> kGemmGroups = {100, 0, 257, 31, 128};

TEST(Fp8GemmGpuTest, TensorScalingE4M3) {
  SKIP_WITHOUT_GPU();
  auto r = RunGemm(ScalingMode::kCurrent, ScalingMode::kCurrent, Fp8Format::kE4M3, Fp8Format::kE4M3, kGemmGroups, 5,
                   384, 512);
  ASSERT_TRUE(r.ok()) << r.status();
  std::printf("tensor e4m3 x e4m3: rel err vs dequant ref %.2e, vs bf16 ref %.2e (groups direct %lld, padded %lld)\n",
              r->rel_err_vs_dequant, r->rel_err_vs_bf16, static_cast<long long>(r->stats.direct_groups),
              static_cast<long long>(r->stats.padded_groups));
  EXPECT_LT(r->rel_err_vs_dequant, 5e-3);  // bf16 output rounding + accumulation order
  EXPECT_LT(r->rel_err_vs_bf16, 0.06);     // E4M3's 3 mantissa bits on both operands
}

TEST(Fp8GemmGpuTest, TensorScalingE5M2Lhs) {
  SKIP_WITHOUT_GPU();
  auto r = RunGemm(ScalingMode::kCurrent, ScalingMode::kCurrent, Fp8Format::kE5M2, Fp8Format::kE4M3, kGemmGroups, 0,
                   256, 256);
  ASSERT_TRUE(r.ok()) << r.status();
  std::printf("tensor e5m2 x e4m3: rel err vs dequant ref %.2e, vs bf16 ref %.2e (groups direct %lld, padded %lld)\n",
              r->rel_err_vs_dequant, r->rel_err_vs_bf16, static_cast<long long>(r->stats.direct_groups),
              static_cast<long long>(r->stats.padded_groups));
  EXPECT_LT(r->rel_err_vs_dequant, 5e-3);
  EXPECT_LT(r->rel_err_vs_bf16, 0.10);
}

TEST(Fp8GemmGpuTest, BlockScaling) {
  SKIP_WITHOUT_GPU();
  auto r = RunGemm(ScalingMode::kBlock1x128, ScalingMode::kBlock128x128, Fp8Format::kE4M3, Fp8Format::kE4M3,
                   kGemmGroups, 5, 384, 512);
  if (!r.ok() && r.status().code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << r.status();
  }
  ASSERT_TRUE(r.ok()) << r.status();
  std::printf("block 1x128 x 128x128: rel err vs dequant ref %.2e, vs bf16 ref %.2e (groups direct %lld, padded %lld)\n",
              r->rel_err_vs_dequant, r->rel_err_vs_bf16, static_cast<long long>(r->stats.direct_groups),
              static_cast<long long>(r->stats.padded_groups));
  if (r->rel_err_vs_dequant >= 5e-3) {
    // Diagnose which scale layout cuBLASLt reads (n = k so both rhs layouts have the same size).
    for (int lv = 0; lv < 2; ++lv) {
      for (int rv = 0; rv < 2; ++rv) {
        auto d = RunGemm(ScalingMode::kBlock1x128, ScalingMode::kBlock128x128, Fp8Format::kE4M3, Fp8Format::kE4M3,
                         kGemmGroups, 5, 512, 512, lv, rv);
        std::printf("  layout variant lhs=%d rhs=%d: %s rel err vs dequant ref %.2e\n", lv, rv,
                    d.ok() ? "ok" : d.status().ToString().c_str(), d.ok() ? d->rel_err_vs_dequant : -1.0);
      }
    }
  }
  EXPECT_LT(r->rel_err_vs_dequant, 5e-3);
  EXPECT_LT(r->rel_err_vs_bf16, 0.06);
}

// Which group sizes cuBLASLt takes directly (the rest run padded).
TEST(Fp8GemmGpuTest, GroupSizeProbe) {
  SKIP_WITHOUT_GPU();
  for (int64_t mg : {int64_t{1}, int64_t{16}, int64_t{31}, int64_t{64}, int64_t{100}, int64_t{257}}) {
    for (bool block : {false, true}) {
      auto r = RunGemm(block ? ScalingMode::kBlock1x128 : ScalingMode::kCurrent,
                       block ? ScalingMode::kBlock128x128 : ScalingMode::kCurrent, Fp8Format::kE4M3,
                       Fp8Format::kE4M3, {mg}, 0, 256, 256);
      std::printf("probe %-6s m_g=%-4lld: %s", block ? "block" : "tensor", static_cast<long long>(mg),
                  r.ok() ? "ok" : r.status().ToString().c_str());
      if (r.ok()) {
        std::printf(" direct=%lld padded=%lld err=%.2e", static_cast<long long>(r->stats.direct_groups),
                    static_cast<long long>(r->stats.padded_groups), r->rel_err_vs_dequant);
        EXPECT_LT(r->rel_err_vs_dequant, 5e-3);
      }
      std::printf("\n");
      if (!block) {
        EXPECT_TRUE(r.ok()) << r.status();
      }
    }
  }
}

TEST(Fp8GemmGpuTest, Mxfp8IsUnimplementedOnHopper) {
  SKIP_WITHOUT_GPU();
  auto r = RunGemm(ScalingMode::kMxfp8, ScalingMode::kMxfp8, Fp8Format::kE4M3, Fp8Format::kE4M3, {64, 32}, 0, 128,
                   256);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("mxfp8"), std::string::npos);
}

}  // namespace
}  // namespace shardgemm
