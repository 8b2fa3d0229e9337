// Launch parameters of the grouped quantize / dequantize kernels: plain data,
// no absl, so nvcc compiles quantize.cu without the host library headers.
// Filled by quantize.cc from a validated GroupedQuantizeArgs.
#ifndef SHARDGEMM_KERNELS_CUDA_QUANTIZE_KERNELS_CUH_
#define SHARDGEMM_KERNELS_CUDA_QUANTIZE_KERNELS_CUH_

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace shardgemm {
namespace cuda_internal {

// Groups per launch: per-group tables travel in the kernel parameters
// (__grid_constant__), 6 x 4 x (kMaxGpuGroups + 1) bytes.
constexpr int kMaxGpuGroups = 1024;
// Launches of at most this many groups take parameters sized for it
// (QuantizeParamsT<kSmallGpuGroups>, about 1.7 KB instead of 25 KB): on the
// H200 the kernels' table reads at runtime indices cost a launch more device
// time the larger the table, and the host more time per parameter byte
// (launch_param_bench; small-decode current scaling 6.9-7.0 -> 6.7-6.8 us,
// qwen3-ep8 25.0-25.2 -> 24.4-24.8: docs/performance/quantize.md).
constexpr int kSmallGpuGroups = 64;

// Everything of a quantize launch but its per-group tables.
struct QuantizeHeader {
  const void* x;
  int x_dtype;  // 0 bf16, 1 f16, 2 f32
  int mode;     // ScalingMode
  int format;   // Fp8Format
  int mx_recipe;
  bool rowwise, colwise, pow2, software_cvt;
  int64_t m, k;
  int num_groups;
  int tile_rows;    // rows per tile of this launch
  int col_tiles;    // ceil(k / (16384 / tile_rows))
  int total_tiles;  // row tiles over all groups
  const float* scale;  // delayed: [G] device
  uint8_t* row_data;
  uint8_t* col_data;
  void* row_scale;
  void* col_scale;
  // [G] device, where tiles max-reduce the per-group amax (atomicMax of float
  // bits): the caller's amax, zeroed first by LaunchZeroAmax (or a memset) or
  // as it stands (GpuQuantizeOptions::amax_accumulate); or, for current
  // scaling with a workspace, the workspace's. May be null (MX / block
  // scaling without the amax output).
  float* amax;
  // Current scaling with a workspace: the caller's amax, which a block
  // writes once the workspace's is final (PublishAmax, PublishSlotAmax).
  // Null otherwise.
  float* amax_out;
  // Current scaling's two passes with a workspace: p.amax is the workspace's
  // amax_slots[0], and the passes take the slot QuantizeWorkspace's
  // amax_parity names (see there), so the quantize pass ends with no count
  // of its finished blocks.
  bool amax_slots;
  // The persistent quantize pass walks `num_items` work items. Without
  // fuse_amax an item is one tile_rows x 16384 / tile_rows tile (row tile
  // item / col_tiles; the fused pass has 128 x 128 tiles only). With
  // fuse_amax (current scaling, one launch) the items are the amax tiles and
  // the quantize tiles of `num_batches` batches of whole groups, in phases:
  // phase b holds batch b's amax tiles and batch b-1's quantize tiles, the
  // amax ones first ("AAQ" interleaved), so a group's amax is done, and its
  // rows still in L2, when its quantize tiles come up.
  bool fuse_amax;
  // The launch lets its programmatic dependent launch as soon as its blocks
  // have waited, not as they finish (LaunchQuantizeT sets it).
  bool dependents_at_start;
  int num_items;
  int num_batches;
  // QuantizeWorkspace (its protocol is there): for fuse_amax, amax_out and
  // amax_slots. Null when none is used.
  int32_t* workspace;
};

// A launch's parameters for at most kCap groups: entries past num_groups + 1
// (phase_item_off: num_batches + 2) are not read.
template <int kCap>
struct QuantizeParamsT : QuantizeHeader {
  int32_t row_off[kCap + 1];
  int32_t tile_off[kCap + 1];  // prefix sum of ceil(m_g / tile_rows)
  int32_t row_scale_off[kCap + 1];
  int32_t col_scale_off[kCap + 1];
  int32_t batch_tile_off[kCap + 1];  // first row tile of each batch
  int32_t phase_item_off[kCap + 2];  // first item of each phase
};
// What quantize.cc fills; the launches shrink it to
// QuantizeParamsT<kSmallGpuGroups> where the groups fit.
using QuantizeParams = QuantizeParamsT<kMaxGpuGroups>;

// Whether p's groups (and the fused pass's batches) fit kCap.
template <int kCap>
inline bool FitsParams(const QuantizeParams& p) {
  return p.num_groups <= kCap && p.num_batches <= kCap;
}
// p's header and its tables' used entries (num_groups + 1; the fused pass's
// num_batches + 1 and + 2, which only it fills and reads) into *out; p fits
// kCap (FitsParams).
template <int kCap>
inline void ShrinkParams(const QuantizeParams& p, QuantizeParamsT<kCap>* out) {
  static_cast<QuantizeHeader&>(*out) = p;
  std::copy_n(p.row_off, p.num_groups + 1, out->row_off);
  std::copy_n(p.tile_off, p.num_groups + 1, out->tile_off);
  std::copy_n(p.row_scale_off, p.num_groups + 1, out->row_scale_off);
  std::copy_n(p.col_scale_off, p.num_groups + 1, out->col_scale_off);
  if (p.fuse_amax) {
    std::copy_n(p.batch_tile_off, p.num_batches + 1, out->batch_tile_off);
    std::copy_n(p.phase_item_off, p.num_batches + 2, out->phase_item_off);
  }
}

// Device scratch of a current-scaling launch: the per-group amax its tiles
// reduce into (so no memset of the caller's amax runs first), the one-shot
// kernel's grid barrier, and the fused pass's work counter and per batch the
// count of amax tiles done. The launch's last block zeroes what it used, so
// the workspace is reused without a memset.
//
// The two-pass path (QuantizeParams::amax_slots) needs no last block: its
// amax pass reduces into amax_slots[amax_parity] and records the slot in
// amax_slot_in_use; its quantize pass reads that slot, and its block 0
// copies it to the caller's amax, zeroes the whole other slot (the previous
// two-pass call's, long finished, which may have had more groups) and sets
// amax_parity to that one, for the next call. Each launch starts after the
// one before it has finished, so plain stores suffice. Invariant between
// launches: amax_slots[amax_parity] and every field above amax_parity are
// zero; the slot just used stays nonzero until the next two-pass call's
// quantize pass.
struct QuantizeWorkspace {
  int32_t next_item;
  int32_t blocks_done;
  int32_t grid_barrier;  // the one-shot kernel's current scaling: blocks arrived
  int32_t amax_tiles_done[kMaxGpuGroups];
  uint32_t amax[kMaxGpuGroups];  // float bits
  int32_t amax_parity;
  int32_t amax_slot_in_use;
  uint32_t amax_slots[2][kMaxGpuGroups];  // float bits
};

// The amax pass's parameters (LaunchGroupedAmax): only its tables, which it
// reads at runtime indices (a cost that grows with the table) and the host
// copies per launch (launch_param_bench); shrunk like QuantizeParams where
// the groups fit.
struct AmaxHeader {
  const void* x;
  int x_dtype;
  int64_t k;
  int num_groups;
  int tile_rows;    // rows per block (whole rows: one column tile)
  int total_tiles;  // blocks
  // Where the blocks max-reduce the per-group amax (float bits): the
  // caller's, or with amax_slots the workspace's amax_slots[0]
  // (QuantizeParams::amax_slots).
  float* amax;
  bool amax_slots;
  int32_t* workspace;
};
template <int kCap>
struct AmaxParamsT : AmaxHeader {
  int32_t row_off[kCap + 1];
  int32_t tile_off[kCap + 1];  // prefix sum of ceil(m_g / tile_rows)
};
using AmaxParams = AmaxParamsT<kMaxGpuGroups>;
template <int kCap>
inline bool FitsParams(const AmaxParams& p) {
  return p.num_groups <= kCap;
}
template <int kCap>
inline void ShrinkParams(const AmaxParams& p, AmaxParamsT<kCap>* out) {
  static_cast<AmaxHeader&>(*out) = p;
  std::copy_n(p.row_off, p.num_groups + 1, out->row_off);
  std::copy_n(p.tile_off, p.num_groups + 1, out->tile_off);
}

// launch(q) with q the smallest parameter block that holds p: where p fits
// kSmallGpuGroups, a value-initialized ParamsT<kSmallGpuGroups> (its unused
// entries zeros) with p's used entries, else p itself. The one place that
// picks a launch's parameter size (QuantizeParamsT, AmaxParamsT).
template <template <int> class ParamsT, class Launch>
cudaError_t LaunchWithFittingParams(const ParamsT<kMaxGpuGroups>& p, Launch launch) {
  if (FitsParams<kSmallGpuGroups>(p)) {
    ParamsT<kSmallGpuGroups> small{};
    ShrinkParams(p, &small);
    return launch(small);
  }
  return launch(p);
}

// p.amax[0 .. p.num_groups) = 0, in a one-block launch that lets its
// dependent (the quantize pass) launch at once, before its own wait: the
// quantize pass's wait then covers the zeros and everything before them,
// and its launch is off the critical path (ZeroAmaxKernel). Replaces a
// memset, which cannot be a programmatic dependent's primary.
cudaError_t LaunchZeroAmax(const QuantizeParams& p, cudaStream_t stream);
// Current scaling's separate first pass (when not fused): per-group amax
// (float bits, atomicMax) into p.amax.
cudaError_t LaunchGroupedAmax(const AmaxParams& p, cudaStream_t stream);
// The quantize pass (all groups, one persistent launch; with p.fuse_amax the
// amax pass too).
cudaError_t LaunchGroupedQuantize(const QuantizeParams& p, cudaStream_t stream);
// The same for a block shrunk to kSmallGpuGroups (quantize_small.cu);
// LaunchGroupedQuantize calls it where the groups fit.
cudaError_t LaunchGroupedQuantizeSmall(const QuantizeParamsT<kSmallGpuGroups>& p, cudaStream_t stream);

// The one-shot kernel (quantize_oneshot.cu): a block per 32-row x 256-column
// slab of 16-bit x (p.tile_rows = 32, p.col_tiles = k / 256, p.tile_off in
// slabs, p.num_items slabs), converted from registers; current, delayed and
// MXFP8 (OCP recipe, hardware conversion) scaling; every group a multiple of
// 32 rows. Current scaling needs p.workspace: its blocks wait for each other
// (every group's amax) at a grid barrier, so it is a cooperative launch of at
// most OneShotCapacity blocks. The grid is 2-D: p.total_tiles slab rows (at
// least one: calls with no rows take the tiled kernels) by p.col_tiles.
cudaError_t LaunchOneShotQuantize(const QuantizeParams& p, cudaStream_t stream);
// A kernel's SM count and resident blocks per SM on the current device, with
// `smem` bytes of dynamic shared memory allowed it there (quantize.cu; set
// and queried once per kernel and device).
// two_per_sm_smem (may be null): dynamic shared memory (allowed too) with
// which exactly two blocks fit an SM, or 0 where none does.
cudaError_t KernelResidency(const void* kernel, int smem, int* sms, int* per_sm, int* two_per_sm_smem = nullptr);
// Whether the current device takes programmatic dependent launches (compute
// capability 9.0 or later; quantize.cu, queried once per device).
bool DependentLaunchSupported();
// How many one-shot blocks of an input type, mode and format (QuantizeParams'
// codes) fit the device at once, and its SM count.
cudaError_t OneShotCapacity(int x_dtype, int mode, int format, int* blocks, int* sms);

struct DequantizeParams {
  const uint8_t* data;
  const void* scale_inv;
  bool colwise;
  int mode, format, out_dtype;  // out_dtype: 0 bf16, 1 f16, 2 f32
  int64_t m, k;
  int num_groups;
  void* out;
  int32_t row_off[kMaxGpuGroups + 1];
  int32_t scale_off[kMaxGpuGroups + 1];
  int32_t scale_ld[kMaxGpuGroups + 1];
};
cudaError_t LaunchGroupedDequantize(const DequantizeParams& p, cudaStream_t stream);

// Test hook: compares the kernels' FP8 conversion (hardware cvt.rn.satfinite
// plus the NaN rule) with the shared software one for every float bit pattern;
// returns the number of mismatches (per format) in mismatches[2] (device).
// It also compares the kernels' branch-free E8M0 scale codes (the OCP
// recipe) with fp8.h's MxScaleFromAmax for every float and 16-bit amax.
cudaError_t LaunchExhaustiveCvtCheck(unsigned long long* mismatches, cudaStream_t stream);

}  // namespace cuda_internal
}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_QUANTIZE_KERNELS_CUH_
