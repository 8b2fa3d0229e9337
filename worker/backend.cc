#include "worker/backend.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/gemm_scale_layout.h"

namespace shardgemm {

absl::StatusOr<HostTensor> GroupedGemmAfterHostGather(Backend* backend, const LocalGemm& g) {
  if (g.rhs_gather.collectives == nullptr || g.rhs == nullptr) {
    return absl::InvalidArgumentError("rhs_gather without collectives or rhs");
  }
  if (g.rhs_gather.agree) {
    if (auto s = g.rhs_gather.collectives->Agree(absl::OkStatus(), g.rhs_gather.agree_axes); !s.ok()) return s;
  }
  auto gathered = g.rhs_gather.collectives->AllGather(*g.rhs, g.rhs_gather.dim, g.rhs_gather.axes);
  if (!gathered.ok()) return gathered.status();
  if (gathered->shape != g.rhs_gather.gathered_shape) {
    return absl::InternalError(absl::StrCat("gathered rhs is ", ShapeToString(gathered->shape), ", expected ",
                                            ShapeToString(g.rhs_gather.gathered_shape)));
  }
  LocalGemm h = g;
  h.rhs = &*gathered;
  h.resident_rhs = nullptr;
  h.rhs_gather = LocalGemm::RhsGather();
  return backend->GroupedGemm(h);
}

absl::StatusOr<QuantizedLhs> QuantizeLhsForGemm(Backend* backend, const LocalGemm& g) {
  if (g.lhs == nullptr || g.lhs->shape.size() != 2) return absl::InvalidArgumentError("lhs: must be [M, K]");
  LocalQuantize q;
  q.x = g.lhs;
  q.m = g.lhs->shape[0];
  q.k = g.lhs->shape[1];
  q.group_sizes = g.group_sizes;
  q.out_dtype = g.quantize_lhs_to;
  q.rowwise = true;
  q.mode = g.lhs_mode;
  auto outputs = backend->GroupedQuantize(q);
  if (!outputs.ok()) return outputs.status();
  auto scales = GemmScalesFromQuantize(g.lhs_mode, outputs->scale_inv, q.m, q.k, q.group_sizes);
  if (!scales.ok()) return scales.status();
  QuantizedLhs out;
  out.data = std::move(outputs->rowwise_data);
  out.scale_inv = std::move(*scales);
  return out;
}

absl::StatusOr<Shard> Backend::GroupedGemmToShard(const LocalGemm& gemm) {
  auto out = GroupedGemm(gemm);
  if (!out.ok()) return out.status();
  return Shard::OnHost(std::move(*out));
}

namespace {
absl::Status NoDeviceMemory(absl::string_view field, absl::string_view backend) {
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": a CUDA IPC region needs CUDA workers on the client's host; this worker's backend is ", backend));
}
}  // namespace

absl::StatusOr<std::shared_ptr<const DeviceBuffer>> Backend::BlockToDevice(const ClientMemory&,
                                                                           const platform::TensorBlock&,
                                                                           absl::string_view field) {
  return NoDeviceMemory(field, Name());
}

absl::Status Backend::BlockFromDevice(const DeviceBuffer&, const ClientMemory&, const platform::TensorBlock&,
                                      absl::string_view field) {
  return NoDeviceMemory(field, Name());
}

absl::Status Backend::BlockFromHost(const char* source, const ClientMemory& memory, const platform::TensorBlock& block,
                                    absl::string_view field) {
  if (memory.mapping == nullptr) return NoDeviceMemory(field, Name());
  return platform::CopyBlockIn(*memory.mapping, block, source, field);
}

absl::StatusOr<HostTensor> Backend::Download(const Shard& shard) {
  if (shard.host != nullptr) return *shard.host;
  return absl::FailedPreconditionError(absl::StrCat("the ", Name(), " backend holds no device shards"));
}

absl::Status Backend::CopyToHost(const Shard& shard, char* dst) {
  std::shared_ptr<const HostTensor> host = shard.host;
  if (host == nullptr) {
    auto downloaded = Download(shard);
    if (!downloaded.ok()) return downloaded.status();
    host = std::make_shared<const HostTensor>(*std::move(downloaded));
  }
  if (host->NumBytes() != shard.NumBytes()) {
    return absl::InternalError(absl::StrCat("a shard of ", shard.NumBytes(), " bytes holds ", host->NumBytes()));
  }
  if (host->NumBytes() > 0) std::memcpy(dst, host->bytes.data(), static_cast<size_t>(host->NumBytes()));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StagingMemory>> Backend::MakeStagingMemory(int64_t) {
  return MakeHostStagingMemory();
}

GroupedQuantizeArgs QuantizeArgs(const LocalQuantize& q, const void* x) {
  GroupedQuantizeArgs a;
  a.x = x;
  a.x_dtype = q.x->dtype;
  a.m = q.m;
  a.k = q.k;
  a.group_sizes = q.group_sizes.data();
  a.num_groups = static_cast<int64_t>(q.group_sizes.size());
  a.mode = q.block_scaled() ? q.mode : q.scales != nullptr ? ScalingMode::kDelayed : ScalingMode::kCurrent;
  a.format = q.out_dtype == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  a.rowwise = q.rowwise;
  a.colwise = q.colwise;
  return a;
}

absl::StatusOr<QuantizeOutputs> AllocateQuantizeOutputs(const LocalQuantize& q) {
  GroupedQuantizeArgs a = QuantizeArgs(q, nullptr);
  auto layout = GetQuantizeLayout(a);
  if (!layout.ok()) return layout.status();
  QuantizeOutputs out;
  if (q.rowwise) out.rowwise_data = *ZerosTensor(q.out_dtype, {q.m, q.k});
  if (q.colwise) out.colwise_data = *ZerosTensor(q.out_dtype, {q.m, q.k});
  if (q.block_scaled()) {
    const DType sdt = q.mode == ScalingMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
    if (q.rowwise) out.scale_inv = *ZerosTensor(sdt, {layout->rowwise_scale_elems});
    if (q.colwise) out.colwise_scale_inv = *ZerosTensor(sdt, {layout->colwise_scale_elems});
    return out;
  }
  // One scale_inv per group serves both directions; the kernel writes the
  // colwise copy too, which is not returned.
  out.scale_inv = *ZerosTensor(DType::kF32, {a.num_groups});
  out.colwise_scale_inv = *ZerosTensor(DType::kF32, {a.num_groups});
  out.amax = *ZerosTensor(DType::kF32, {a.num_groups});
  return out;
}

void PointQuantizeOutputs(const LocalQuantize& q, const QuantizeBuffers& b, GroupedQuantizeArgs* a) {
  a->rowwise_data = q.rowwise ? static_cast<uint8_t*>(b.rowwise_data) : nullptr;
  a->colwise_data = q.colwise ? static_cast<uint8_t*>(b.colwise_data) : nullptr;
  a->rowwise_scale_inv = q.rowwise ? b.scale_inv : nullptr;
  a->colwise_scale_inv = !q.colwise ? nullptr
                         : q.block_scaled() || q.rowwise ? b.colwise_scale_inv
                                                         : b.scale_inv;
  a->amax = q.block_scaled() ? nullptr : static_cast<float*>(b.amax);
}

}  // namespace shardgemm
