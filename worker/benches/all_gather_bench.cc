// All-gather bus bandwidth: NCCL alone beside our worker layer on the same
// GPUs and sizes (issue 7: the FSDP weight all-gather). Size = the gathered
// buffer; busbw = algbw * (n-1)/n. See collective_bench_harness.h.
//   all_gather_bench --backend=nccl|ours_nccl|ours_nccl_device|gloo [--ranks=N] [--dtype=bf16] ...
#include "absl/strings/str_cat.h"
#include "worker/benches/collective_bench_harness.h"

namespace shardgemm {
namespace bench {
namespace {

class AllGather : public Collective {
 public:
  const char* Name() const override { return "all_gather"; }
  double BusFactor(int n) const override { return static_cast<double>(n - 1) / n; }
  const char* BusFactorText() const override { return "(n-1)/n"; }
  int PiecesPerBuffer(int ranks) const override { return ranks; }
  bool Sums() const override { return false; }
  std::string OursPath(Backend b) const override {
    if (b == Backend::kOursNcclDevice) {
      return "Collectives::AllGatherDevice(device piece, dim 1, device output): ncclAllGather into a device "
             "scratch buffer, each piece placed along dim 1 of the output with a strided D2D copy, wait (the "
             "FSDP weight gather as a CUDA worker runs it, into the GEMM's operand)";
    }
    return absl::StrCat("Collectives::AllGather(host piece, dim 1): ",
                        b == Backend::kGloo ? "gloo::allgather" : "H2D copy, ncclAllGather, wait, D2H copy",
                        ", each piece placed along dim 1 of a new host tensor (the FSDP weight gather)");
  }

  std::vector<int64_t> InputShape(const Layout& l) const override { return {l.groups, l.rows, l.cols}; }
  std::vector<int64_t> OutputShape(const Layout& l) const override {
    return {l.groups, l.ranks * l.rows, l.cols};
  }
  // Element i of rank s's piece, wherever the layout puts it.
  double Expected(const Layout& l, int, int64_t o, const InputValues& in) const override {
    int s;
    int64_t i;
    l.Split(o, &s, &i);
    return in(s, i);
  }

  ncclResult_t RunNccl(const void* send, void* recv, const Layout& l, ncclDataType_t type,
                       ncclComm_t comm, cudaStream_t stream) const override {
    return ncclAllGather(send, recv, l.piece, type, comm, stream);
  }
  absl::StatusOr<HostTensor> RunOurs(Collectives* c, const HostTensor& in,
                                     const std::vector<std::string>& axes) const override {
    return c->AllGather(in, 1, axes);
  }
  bool HasOursDevice() const override { return true; }
  absl::Status RunOursDevice(Collectives* c, const void* send, void* recv, const Layout& l,
                             const std::vector<std::string>& axes, cudaStream_t stream) const override {
    return c->AllGatherDevice(send, recv, InputShape(l), l.dtype, 1, axes, stream);
  }
};

}  // namespace
}  // namespace bench
}  // namespace shardgemm

int main(int argc, char** argv) {
  shardgemm::bench::AllGather c;
  return shardgemm::bench::BenchMain(argc, argv, c);
}
