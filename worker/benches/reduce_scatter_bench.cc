// Reduce-scatter (sum) bus bandwidth: NCCL alone beside our worker layer on
// the same GPUs and sizes. Size = each rank's buffer before scattering;
// busbw = algbw * (n-1)/n. See collective_bench_harness.h.
//   reduce_scatter_bench --backend=nccl|ours_nccl|gloo [--ranks=N] [--dtype=f32] ...
#include "absl/strings/str_cat.h"
#include "worker/benches/collective_bench_harness.h"

namespace shardgemm {
namespace bench {
namespace {

class ReduceScatter : public Collective {
 public:
  const char* Name() const override { return "reduce_scatter"; }
  double BusFactor(int n) const override { return static_cast<double>(n - 1) / n; }
  const char* BusFactorText() const override { return "(n-1)/n"; }
  int PiecesPerBuffer(int ranks) const override { return ranks; }
  bool Sums() const override { return true; }
  std::string OursPath(Backend b) const override {
    return absl::StrCat("Collectives::ReduceScatter(host tensor, dim 1): ",
                        b == Backend::kGloo
                            ? "gloo::allreduce of the whole tensor, then this rank's piece along dim 1 copied out"
                            : "pieces along dim 1 copied out and concatenated, H2D copy, ncclReduceScatter, "
                              "wait, D2H copy",
                        " (an after-GEMM reduce_scatter of FP32 partial sums)");
  }
  // Our NCCL layer reduce-scatters the FP32 partial sums of a step only.
  absl::Status Supports(Backend backend, DType dtype) const override {
    if (backend == Backend::kOursNccl && dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          "--backend=ours_nccl reduce-scatters f32 only (worker/nccl_collectives.cc: steps reduce "
          "FP32 partial sums); use --dtype=f32");
    }
    return absl::OkStatus();
  }

  std::vector<int64_t> InputShape(const Layout& l) const override {
    return {l.groups, l.ranks * l.rows, l.cols};
  }
  std::vector<int64_t> OutputShape(const Layout& l) const override { return {l.groups, l.rows, l.cols}; }
  // Sum over ranks of their element at this rank's piece, index o.
  double Expected(const Layout& l, int rank, int64_t o, const InputValues& in) const override {
    const int64_t full = l.FullIndex(rank, o);
    double sum = 0;
    for (int s = 0; s < l.ranks; ++s) sum += in(s, full);
    return sum;
  }

  ncclResult_t RunNccl(const void* send, void* recv, const Layout& l, ncclDataType_t type,
                       ncclComm_t comm, cudaStream_t stream) const override {
    return ncclReduceScatter(send, recv, l.piece, type, ncclSum, comm, stream);
  }
  absl::StatusOr<HostTensor> RunOurs(Collectives* c, const HostTensor& in,
                                     const std::vector<std::string>& axes) const override {
    return c->ReduceScatter(in, 1, axes);
  }
};

}  // namespace
}  // namespace bench
}  // namespace shardgemm

int main(int argc, char** argv) {
  shardgemm::bench::ReduceScatter c;
  return shardgemm::bench::BenchMain(argc, argv, c);
}
