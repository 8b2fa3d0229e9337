#include "kernels/cuda/quantize.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/quantize_kernels.cuh"

namespace shardgemm {
namespace cuda {
namespace {

using cuda_internal::kMaxGpuGroups;

int DTypeCode(DType d) { return d == DType::kBF16 ? 0 : d == DType::kF16 ? 1 : 2; }

bool Aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

absl::Status CheckGpuShape(int64_t m, int64_t k, int64_t num_groups) {
  if (k % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("k: ", k, " is not a multiple of 8 (GPU kernels)"));
  if (num_groups > kMaxGpuGroups) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_groups: ", num_groups, " is over the GPU kernels' ", kMaxGpuGroups));
  }
  if (m >= (int64_t{1} << 31)) return absl::InvalidArgumentError("m: must be below 2^31 on the GPU");
  return absl::OkStatus();
}

// Rows of x per batch of the fused current-scaling pass: a batch's amax tiles
// run one phase ahead of its quantize tiles, so about two batches of x must
// stay in L2 (50 MB on the H100/H200) between the two reads.
constexpr int64_t kFusedBatchBytes = int64_t{8} << 20;

// Blocks of current scaling's amax pass where its 64 KiB cap allows fewer,
// bigger ones (small inputs): about two per SM of an H200, so that the
// quantize pass, launched as the amax pass starts, finds SM room (threads,
// registers) for its first blocks, which stream their first tiles in while
// the amax pass runs. With 1024 (eight 256-thread blocks filled each SM)
// the quantize pass waited for the SMs to empty: small-decode row+col
// 8.6 -> 7.9 us, qwen3-ep8 26.4 -> 25.9; 128 measured the same as 256
// (docs/performance/quantize.md).
constexpr int64_t kAmaxPassBlocks = 256;

// The launch's workspace (QuantizeWorkspace): the caller's
// (options.workspace), or one of ours per stream, keyed by the stream's
// process-unique id: launches on one stream run in order, and each launch
// leaves the workspace fit for the next (QuantizeWorkspace). Ours only for
// streams the caller created, outside capture: the default streams can be
// shared between threads, and a captured graph may be replayed on another
// stream, where two launches would share one workspace. Otherwise nullptr
// (current scaling: a memset of amax before the launch, and the two-pass
// path). Allocated on first use, kept until ReleaseQuantizeWorkspace(stream).
// Whether a launch on `stream` with `options` has a workspace (before ours is
// allocated).
// The default streams, which threads may share: the library keeps no
// workspace for them.
bool IsDefaultStream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

absl::StatusOr<bool> HasWorkspace(cudaStream_t stream, const GpuQuantizeOptions& options) {
  if (options.workspace != nullptr) return true;
  if (IsDefaultStream(stream)) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return CudaStatus(e, "cudaStreamIsCapturing");
  return capture == cudaStreamCaptureStatusNone;
}

// The library's workspaces, by stream id.
struct StreamWorkspaces {
  std::mutex mu;
  std::map<unsigned long long, int32_t*> by_stream;
};
StreamWorkspaces& OurWorkspaces() {
  static auto* w = new StreamWorkspaces();
  return *w;
}

absl::StatusOr<int32_t*> LaunchWorkspace(cudaStream_t stream, const GpuQuantizeOptions& options) {
  if (options.workspace != nullptr) return static_cast<int32_t*>(options.workspace);
  absl::StatusOr<bool> has = HasWorkspace(stream, options);
  if (!has.ok()) return has.status();
  if (!*has) return nullptr;
  cudaError_t e = cudaSuccess;
  unsigned long long id = 0;
  if ((e = cudaStreamGetId(stream, &id)) != cudaSuccess) return CudaStatus(e, "cudaStreamGetId");
  StreamWorkspaces& ours = OurWorkspaces();
  std::lock_guard<std::mutex> lock(ours.mu);
  auto it = ours.by_stream.find(id);
  if (it != ours.by_stream.end()) return it->second;
  void* w = nullptr;
  const size_t bytes = QuantizeWorkspaceBytes();
  if ((e = cudaMalloc(&w, bytes)) != cudaSuccess) return CudaStatus(e, "cudaMalloc (quantize workspace)");
  // On the stream itself: a plain cudaMemset runs on the legacy stream, which
  // does not order against a non-blocking stream's first launch.
  if ((e = cudaMemsetAsync(w, 0, bytes, stream)) != cudaSuccess) {
    cudaFree(w);
    return CudaStatus(e, "cudaMemsetAsync (quantize workspace)");
  }
  ours.by_stream[id] = static_cast<int32_t*>(w);
  return static_cast<int32_t*>(w);
}

// The quantize pass's tile height (quantize.cu: tiles of 16384 elements,
// rows x 16384 / rows). Block scaling needs 128 rows (its blocks are 128
// tall), and so does the fused pass (its batches count 128-row tiles).
// Otherwise, unless the caller asks, from the H200 runs of quantize_bench
// (docs/performance/quantize.md): MXFP8 takes 32 x 512 where k fills whole
// 512-column tiles (even or up to 3 points ahead of 64 x 256, 5-8 ahead of
// 128 x 128), else 64 x 256 (twice as fast as 128 x 128 on 64-row groups);
// current and delayed scaling keep 128 x 128 (2-5 points ahead of 64 x 256 on
// big groups, more ahead of 32 x 512) unless 128-row tiles would be under 7/8
// full, as with 64-row groups.
int QuantizeTileRows(const GroupedQuantizeArgs& a, bool fused, const GpuQuantizeOptions& options) {
  const bool short_ok =
      !fused && (a.mode == ScalingMode::kCurrent || a.mode == ScalingMode::kDelayed || a.mode == ScalingMode::kMxfp8);
  if (!short_ok) return 128;
  if (options.tile_rows != 0) return options.tile_rows;
  if (a.mode == ScalingMode::kMxfp8) return a.k % 512 == 0 ? 32 : 64;
  int64_t used = 0, tile_rows_128 = 0;
  for (int64_t g = 0; g < a.num_groups; ++g) {
    used += a.group_sizes[g];
    tile_rows_128 += (a.group_sizes[g] + 127) / 128 * 128;
  }
  return used * 8 < tile_rows_128 * 7 ? 64 : 128;
}

// Why the one-shot kernel (quantize_oneshot.cu) cannot take the call, or OK
// (GpuQuantizeOptions::Kernel lists what it takes). A request for it that
// fails here is the caller's INVALID_ARGUMENT; kAuto takes the tiled kernels.
absl::Status OneShotFits(const GroupedQuantizeArgs& a, const GpuQuantizeOptions& options, bool have_workspace) {
  auto no = [](auto... why) { return absl::InvalidArgumentError(absl::StrCat("kernel: one-shot ", why...)); };
  if (options.tile_rows != 0) return no("has no tile_rows (", options.tile_rows, ")");
  if (options.software_cvt) return no("has no software conversion");
  if (a.x_dtype != DType::kBF16 && a.x_dtype != DType::kF16) {
    return no("takes bf16 or f16 x, not ", DTypeName(a.x_dtype));
  }
  if (a.mode == ScalingMode::kCurrent) {
    if (options.current_pass != GpuQuantizeOptions::CurrentPass::kAuto) return no("has its own current_pass");
    if (!have_workspace) return no("current scaling needs a workspace (its blocks meet at a grid barrier)");
  } else if (a.mode == ScalingMode::kMxfp8) {
    if (a.mx_recipe != MxScaleRecipe::kOcp) return no("takes the OCP MX recipe only");
  } else if (a.mode != ScalingMode::kDelayed) {
    return no("takes current, delayed or MXFP8 scaling, not ", ScalingModeName(a.mode));
  }
  if (a.k % 256 != 0) return no("needs k a multiple of 256, not ", a.k);
  int64_t slabs = 0;
  for (int64_t g = 0; g < a.num_groups; ++g) {
    if (a.group_sizes[g] % 32 != 0) {
      return no("needs groups of a multiple of 32 rows: group_sizes[", g, "] is ", a.group_sizes[g]);
    }
    slabs += a.group_sizes[g] / 32 * (a.k / 256);
  }
  if (a.mode == ScalingMode::kCurrent || options.kernel == GpuQuantizeOptions::Kernel::kAuto) {
    int capacity = 0, sms = 0;
    cudaError_t e = cuda_internal::OneShotCapacity(DTypeCode(a.x_dtype), static_cast<int>(a.mode),
                                                   static_cast<int>(a.format), &capacity, &sms);
    if (e != cudaSuccess) return CudaStatus(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor (one-shot quantize)");
    if (slabs > capacity) return no("holds ", capacity, " 32 x 256 slabs at once on this GPU; the call has ", slabs);
    // kAuto: only where the tiled kernels would give each SM at most one
    // 16384-element tile (two slabs), whose latency then is the whole launch
    // (one tile: 3.6 us against 5.2 for MXFP8); at small-decode's 512 slabs
    // on 132 SMs the tiled kernels measured as fast or faster
    // (docs/performance/quantize.md).
    if (options.kernel == GpuQuantizeOptions::Kernel::kAuto && slabs > 2 * int64_t{sms}) {
      return no("is picked for at most ", 2 * int64_t{sms}, " slabs; the call has ", slabs);
    }
  }
  return absl::OkStatus();
}

// Whether the call takes the one-shot kernel (GpuQuantizeOptions::Kernel).
// A call with no rows takes the tiled kernels' one-block launch, which writes
// the empty groups' scales and amax.
absl::StatusOr<bool> UseOneShot(const GroupedQuantizeArgs& a, const GpuQuantizeOptions& options, bool have_workspace) {
  if (options.kernel == GpuQuantizeOptions::Kernel::kTiled) return false;
  int64_t rows = 0;
  for (int64_t g = 0; g < a.num_groups; ++g) rows += a.group_sizes[g];
  if (rows == 0) return false;
  absl::Status fits = OneShotFits(a, options, have_workspace);
  if (!fits.ok() && (options.kernel == GpuQuantizeOptions::Kernel::kOneShot || !absl::IsInvalidArgument(fits))) {
    return fits;
  }
  return fits.ok();
}

absl::Status CheckGpuArgs(const GroupedQuantizeArgs& a, const GpuQuantizeOptions& options) {
  if (absl::Status s = ValidateGroupedQuantizeArgs(a); !s.ok()) return s;
  if (absl::Status s = CheckGpuShape(a.m, a.k, a.num_groups); !s.ok()) return s;
  if (options.tile_rows != 0 && options.tile_rows != 32 && options.tile_rows != 64 && options.tile_rows != 128) {
    return absl::InvalidArgumentError(absl::StrCat("tile_rows: ", options.tile_rows, " is not 0, 32, 64 or 128"));
  }
  if (options.amax_accumulate && a.mode == ScalingMode::kCurrent) {
    return absl::InvalidArgumentError(
        "amax_accumulate: current scaling's scales come from this call's amax, which it cannot accumulate into");
  }
  if (options.amax_accumulate && a.amax == nullptr) {
    return absl::InvalidArgumentError("amax_accumulate: amax is null (nothing to accumulate into)");
  }
  if (!Aligned(a.x, 16)) return absl::InvalidArgumentError("x: not 16-byte aligned");
  if (a.rowwise && !Aligned(a.rowwise_data, 16)) return absl::InvalidArgumentError("rowwise_data: not 16-byte aligned");
  if (a.colwise && !Aligned(a.colwise_data, 16)) return absl::InvalidArgumentError("colwise_data: not 16-byte aligned");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GpuQuantizeOptions::Kernel> ChosenQuantizeKernel(const GroupedQuantizeArgs& args, cudaStream_t stream,
                                                                const GpuQuantizeOptions& options) {
  if (absl::Status s = CheckGpuArgs(args, options); !s.ok()) return s;
  absl::StatusOr<bool> has_workspace = HasWorkspace(stream, options);
  if (!has_workspace.ok()) return has_workspace.status();
  absl::StatusOr<bool> one_shot = UseOneShot(args, options, *has_workspace);
  if (!one_shot.ok()) return one_shot.status();
  return *one_shot ? GpuQuantizeOptions::Kernel::kOneShot : GpuQuantizeOptions::Kernel::kTiled;
}

size_t QuantizeWorkspaceBytes() { return sizeof(cuda_internal::QuantizeWorkspace); }

absl::Status ReleaseQuantizeWorkspace(cudaStream_t stream) {
  if (IsDefaultStream(stream)) return absl::OkStatus();
  unsigned long long id = 0;
  cudaError_t e = cudaStreamGetId(stream, &id);
  if (e != cudaSuccess) return CudaStatus(e, "cudaStreamGetId");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if ((e = cudaStreamIsCapturing(stream, &capture)) != cudaSuccess) return CudaStatus(e, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError("stream: capturing a graph (release its quantize workspace outside capture)");
  }
  int32_t* workspace = nullptr;
  {
    StreamWorkspaces& ours = OurWorkspaces();
    std::lock_guard<std::mutex> lock(ours.mu);
    auto it = ours.by_stream.find(id);
    if (it == ours.by_stream.end()) return absl::OkStatus();
    workspace = it->second;
    ours.by_stream.erase(it);
  }
  // Outside the lock (calls on other streams go on): the launches queued on
  // this stream may still use it. Should the wait fail, it is left allocated
  // (the next call on the stream makes a new one).
  if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return CudaStatus(e, "cudaStreamSynchronize");
  if ((e = cudaFree(workspace)) != cudaSuccess) return CudaStatus(e, "cudaFree (quantize workspace)");
  return absl::OkStatus();
}

namespace {

// A launch's parameter block on the heap (its tables are up to 25 KB), its
// header zeroed. Its tables too where the launch passes them whole, over
// kSmallGpuGroups groups; else the launch copies just their used entries
// into a zeroed small block (LaunchWithFittingParams; the fused pass's
// batches never outnumber the groups), so no per-call 25 KB memset.
template <class Params, class Header>
std::unique_ptr<Params> NewParams(int64_t num_groups) {
  std::unique_ptr<Params> p(new Params);
  if (num_groups > cuda_internal::kSmallGpuGroups) {
    std::memset(p.get(), 0, sizeof(Params));
  } else {
    static_cast<Header&>(*p) = Header{};
  }
  return p;
}

}  // namespace

absl::Status GroupedQuantize(const GroupedQuantizeArgs& a, cudaStream_t stream, const GpuQuantizeOptions& options) {
  if (absl::Status s = CheckGpuArgs(a, options); !s.ok()) return s;
  absl::StatusOr<QuantizeLayout> layout = GetQuantizeLayout(a);
  if (!layout.ok()) return layout.status();
  const QuantizeLayout& l = *layout;
  if (l.rowwise_scale_elems >= (int64_t{1} << 31) || l.colwise_scale_elems >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("scale_inv: over 2^31 entries");
  }
  auto p = NewParams<cuda_internal::QuantizeParams, cuda_internal::QuantizeHeader>(a.num_groups);
  p->x = a.x;
  p->x_dtype = DTypeCode(a.x_dtype);
  p->mode = static_cast<int>(a.mode);
  p->format = static_cast<int>(a.format);
  p->mx_recipe = static_cast<int>(a.mx_recipe);
  p->rowwise = a.rowwise, p->colwise = a.colwise, p->pow2 = a.pow2_scales;
  p->software_cvt = options.software_cvt;
  p->fuse_amax = false;
  p->m = a.m, p->k = a.k;
  p->num_groups = static_cast<int>(a.num_groups);
  const bool fused = a.mode == ScalingMode::kCurrent && options.current_pass == GpuQuantizeOptions::CurrentPass::kFused;
  absl::StatusOr<int32_t*> ws = LaunchWorkspace(stream, options);
  if (!ws.ok()) return ws.status();
  // The one-shot kernel's slabs are 32 x 256 (its tiles, in p's tables).
  absl::StatusOr<bool> use_one_shot = UseOneShot(a, options, *ws != nullptr);
  if (!use_one_shot.ok()) return use_one_shot.status();
  const bool one_shot = *use_one_shot;
  p->tile_rows = one_shot ? 32 : QuantizeTileRows(a, fused, options);
  const int64_t tile_cols = one_shot ? 256 : 16384 / p->tile_rows;
  p->col_tiles = static_cast<int>((a.k + tile_cols - 1) / tile_cols);
  p->scale = a.scale;
  p->row_data = a.rowwise ? a.rowwise_data : nullptr;
  p->col_data = a.colwise ? a.colwise_data : nullptr;
  p->row_scale = a.rowwise ? a.rowwise_scale_inv : nullptr;
  p->col_scale = a.colwise ? a.colwise_scale_inv : nullptr;
  // Where the tiles max-reduce amax:
  //   current scaling with a workspace: into the workspace's, which a block
  //     copies to a.amax once final (no launch or memset first: the amax
  //     zeroing launch below, in front of the amax pass, measured 0.5-1 us
  //     slower on small-decode, qwen3-ep8, one-tile and tiny-decode; since
  //     it lets its dependent launch at once, 0.2-0.3 us faster on
  //     small-decode and one-tile, 0.6 slower on qwen3-30b-up:
  //     docs/performance/quantize.md);
  //   else into a.amax itself: as it stands when accumulating; else zeroed
  //     first by a one-block launch (LaunchZeroAmax), which lets the
  //     quantize launch start at once (current scaling without a
  //     workspace: a memset).
  const bool current = a.mode == ScalingMode::kCurrent;
  const bool wants_amax = a.amax != nullptr && a.num_groups > 0 && !options.amax_accumulate;
  const bool amax_in_workspace = current && wants_amax && *ws != nullptr;
  const bool zero_amax = !current && wants_amax;
  if (amax_in_workspace) {
    p->workspace = *ws;
    p->amax = reinterpret_cast<float*>(reinterpret_cast<cuda_internal::QuantizeWorkspace*>(*ws)->amax);
    p->amax_out = a.amax;
  } else {
    p->amax = a.amax;
  }
  int64_t tiles = 0;
  for (int64_t g = 0; g <= a.num_groups; ++g) {
    p->row_off[g] = static_cast<int32_t>(l.row_offset[g]);
    p->tile_off[g] = static_cast<int32_t>(tiles);
    p->row_scale_off[g] = static_cast<int32_t>(l.rowwise_scale_offset[g]);
    p->col_scale_off[g] = static_cast<int32_t>(l.colwise_scale_offset[g]);
    if (g < a.num_groups) tiles += (a.group_sizes[g] + p->tile_rows - 1) / p->tile_rows;
  }
  p->total_tiles = static_cast<int>(tiles);
  if (2 * tiles * p->col_tiles >= (int64_t{1} << 31)) return absl::InvalidArgumentError("m, k: too many tiles");
  // Which passes run: the fused pass where asked and a workspace allows it,
  // else (tiled current scaling with rows) an amax pass before the quantize
  // pass. The two passes take the workspace's amax slots (no count of
  // finished blocks at the quantize pass's end: QuantizeWorkspace); the
  // one-shot kernel, the fused pass and calls with no rows keep its amax.
  const bool fused_pass = fused && tiles > 0 && *ws != nullptr;
  const bool amax_pass = current && tiles > 0 && !one_shot && !fused_pass;
  if (amax_in_workspace && amax_pass) {
    p->amax_slots = true;
    p->amax = reinterpret_cast<float*>(reinterpret_cast<cuda_internal::QuantizeWorkspace*>(*ws)->amax_slots[0]);
  }

  const int64_t used = l.row_offset[a.num_groups];
  const size_t tail = static_cast<size_t>((a.m - used) * a.k);
  cudaError_t e = cudaSuccess;
  if (current && wants_amax && !amax_in_workspace) e = cudaMemsetAsync(a.amax, 0, sizeof(float) * a.num_groups, stream);
  // Scales no kernel writes: 128 x 128 block scaling's padding. MXFP8's and
  // 1 x 128's kernels zero their own (the two memsets had cost 1 x 128
  // row+col 3-8 us a call on the H200, in a graph: small-decode 18.1 ->
  // 10.2 us, qwen3-ep8 25.5 -> 22.0; docs/performance/quantize.md).
  const bool scales_need_zeroing = a.mode == ScalingMode::kBlock128x128;
  if (e == cudaSuccess && a.rowwise && tail) e = cudaMemsetAsync(a.rowwise_data + used * a.k, 0, tail, stream);
  if (e == cudaSuccess && a.colwise && tail) e = cudaMemsetAsync(a.colwise_data + used * a.k, 0, tail, stream);
  if (e == cudaSuccess && scales_need_zeroing && a.rowwise && l.rowwise_scale_elems) {
    e = cudaMemsetAsync(a.rowwise_scale_inv, 0, static_cast<size_t>(l.rowwise_scale_elems * l.scale_bytes), stream);
  }
  if (e == cudaSuccess && scales_need_zeroing && a.colwise && l.colwise_scale_elems) {
    e = cudaMemsetAsync(a.colwise_scale_inv, 0, static_cast<size_t>(l.colwise_scale_elems * l.scale_bytes), stream);
  }
  if (e != cudaSuccess) return CudaStatus(e, "cudaMemsetAsync");
  if (zero_amax && (e = cuda_internal::LaunchZeroAmax(*p, stream)) != cudaSuccess) {
    return CudaStatus(e, "amax zeroing kernel");
  }
  p->num_items = static_cast<int>(tiles * p->col_tiles);
  // A failed launch may follow one that reduced into the workspace (or the
  // error may be an earlier call's, reported by cudaGetLastError with the
  // kernel having run): zero the workspace for the next launch on the stream
  // (best effort; the launch error is what the caller gets).
  auto fail_launch = [&](cudaError_t err, const char* what) {
    if (p->workspace != nullptr) (void)cudaMemsetAsync(p->workspace, 0, QuantizeWorkspaceBytes(), stream);
    return CudaStatus(err, what);
  };
  if (one_shot) {
    e = cuda_internal::LaunchOneShotQuantize(*p, stream);
    // Current scaling's cooperative launch can be refused where fewer blocks
    // fit than the device's SM count promised (an MPS client's share of the
    // SMs): kAuto then takes the tiled kernels, which need no residency. The
    // refusal is a launch-configuration error (not sticky) and nothing of
    // this launch ran; what was queued before it (zeroing, memsets) only
    // runs again.
    const bool refused = e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported;
    if (refused && a.mode == ScalingMode::kCurrent && options.kernel == GpuQuantizeOptions::Kernel::kAuto) {
      (void)cudaGetLastError();
      GpuQuantizeOptions tiled = options;
      tiled.kernel = GpuQuantizeOptions::Kernel::kTiled;
      return GroupedQuantize(a, stream, tiled);
    }
    if (e != cudaSuccess) return fail_launch(e, "one-shot grouped quantize kernel");
    return absl::OkStatus();
  }
  if (fused_pass) {
    // Batches of whole groups of about kFusedBatchBytes of x (none empty).
    const int64_t row_bytes = a.k * DTypeSize(a.x_dtype);
    int nb = 0;
    int64_t bytes = 0, t = 0;
    p->batch_tile_off[0] = 0;
    for (int64_t g = 0; g < a.num_groups; ++g) {
      t += (a.group_sizes[g] + p->tile_rows - 1) / p->tile_rows;
      bytes += a.group_sizes[g] * row_bytes;
      if (t > p->batch_tile_off[nb] && (bytes >= kFusedBatchBytes || t == tiles)) {
        p->batch_tile_off[++nb] = static_cast<int32_t>(t);
        bytes = 0;
      }
    }
    p->num_batches = nb;
    // Phase b: batch b's amax tiles and batch b-1's quantize tiles.
    int64_t item = 0;
    for (int b = 0; b <= nb; ++b) {
      p->phase_item_off[b] = static_cast<int32_t>(item);
      if (b < nb) item += int64_t{p->batch_tile_off[b + 1] - p->batch_tile_off[b]} * p->col_tiles;
      if (b > 0) item += int64_t{p->batch_tile_off[b] - p->batch_tile_off[b - 1]} * p->col_tiles;
    }
    p->phase_item_off[nb + 1] = static_cast<int32_t>(item);
    p->num_items = static_cast<int>(item);
    p->fuse_amax = true;
    p->workspace = *ws;
  }
  if (amax_pass) {
    // The amax pass tiles whole rows: at most 64 KiB per block, and about
    // kAmaxPassBlocks blocks where the rows allow.
    auto pa = NewParams<cuda_internal::AmaxParams, cuda_internal::AmaxHeader>(a.num_groups);
    pa->x = p->x, pa->x_dtype = p->x_dtype, pa->k = p->k, pa->num_groups = p->num_groups;
    pa->amax = p->amax, pa->amax_slots = p->amax_slots, pa->workspace = p->workspace;
    const int64_t row_bytes = a.k * DTypeSize(a.x_dtype);
    const int64_t cap = std::max<int64_t>(1, (int64_t{64} << 10) / row_bytes);
    pa->tile_rows = static_cast<int>(std::min<int64_t>(cap, std::max<int64_t>(1, used / kAmaxPassBlocks)));
    int64_t at = 0;
    for (int64_t g = 0; g <= a.num_groups; ++g) {
      pa->row_off[g] = p->row_off[g];
      pa->tile_off[g] = static_cast<int32_t>(at);
      if (g < a.num_groups) at += (a.group_sizes[g] + pa->tile_rows - 1) / pa->tile_rows;
    }
    pa->total_tiles = static_cast<int>(at);
    e = cuda_internal::LaunchGroupedAmax(*pa, stream);
    if (e != cudaSuccess) return fail_launch(e, "grouped amax kernel");
  }
  e = cuda_internal::LaunchGroupedQuantize(*p, stream);
  if (e != cudaSuccess) return fail_launch(e, "grouped quantize kernel");
  return absl::OkStatus();
}

absl::Status GroupedDequantize(const GroupedDequantizeArgs& d, cudaStream_t stream) {
  GroupedQuantizeArgs a;
  a.x_dtype = DType::kF32;
  a.m = d.m, a.k = d.k, a.group_sizes = d.group_sizes, a.num_groups = d.num_groups;
  a.mode = d.mode, a.format = d.format, a.rowwise = !d.colwise, a.colwise = d.colwise;
  absl::StatusOr<QuantizeLayout> layout = GetQuantizeLayout(a);
  if (!layout.ok()) return layout.status();
  if (absl::Status s = CheckGpuShape(d.m, d.k, d.num_groups); !s.ok()) return s;
  if (d.data == nullptr && d.m > 0) return absl::InvalidArgumentError("data: null");
  const int64_t scale_elems = d.colwise ? layout->colwise_scale_elems : layout->rowwise_scale_elems;
  if (d.scale_inv == nullptr && scale_elems > 0) return absl::InvalidArgumentError("scale_inv: null");
  if (d.out == nullptr && d.m > 0) return absl::InvalidArgumentError("out: null");
  if (d.out_dtype != DType::kBF16 && d.out_dtype != DType::kF16 && d.out_dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("out_dtype: ", DTypeName(d.out_dtype), " is not bf16, f16 or f32"));
  }
  const QuantizeLayout& l = *layout;
  auto p = std::make_unique<cuda_internal::DequantizeParams>();
  std::memset(p.get(), 0, sizeof(*p));
  p->data = d.data, p->scale_inv = d.scale_inv, p->colwise = d.colwise;
  p->mode = static_cast<int>(d.mode), p->format = static_cast<int>(d.format), p->out_dtype = DTypeCode(d.out_dtype);
  p->m = d.m, p->k = d.k, p->num_groups = static_cast<int>(d.num_groups), p->out = d.out;
  for (int64_t g = 0; g <= d.num_groups; ++g) {
    p->row_off[g] = static_cast<int32_t>(l.row_offset[g]);
    p->scale_off[g] = static_cast<int32_t>(d.colwise ? l.colwise_scale_offset[g] : l.rowwise_scale_offset[g]);
    if (g < d.num_groups) {
      p->scale_ld[g] = static_cast<int32_t>(d.colwise ? l.colwise_scale_cols[g] : l.rowwise_scale_cols[g]);
    }
  }
  cudaError_t e = cuda_internal::LaunchGroupedDequantize(*p, stream);
  if (e != cudaSuccess) return CudaStatus(e, "grouped dequantize kernel");
  return absl::OkStatus();
}

absl::StatusOr<unsigned long long> ExhaustiveConversionMismatches(cudaStream_t stream) {
  unsigned long long* d = nullptr;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&d), 2 * sizeof(unsigned long long));
  if (e != cudaSuccess) return CudaStatus(e, "cudaMalloc");
  unsigned long long h[2] = {0, 0};
  e = cudaMemsetAsync(d, 0, sizeof(h), stream);
  if (e == cudaSuccess) e = cuda_internal::LaunchExhaustiveCvtCheck(d, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(h, d, sizeof(h), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  cudaFree(d);
  if (e != cudaSuccess) return CudaStatus(e, "conversion check");
  return h[0] + h[1];
}

}  // namespace cuda
}  // namespace shardgemm
