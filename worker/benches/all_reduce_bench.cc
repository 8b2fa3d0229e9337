// All-reduce (sum) bus bandwidth: NCCL alone beside our worker layer on the
// same GPUs and sizes. Size = the reduced buffer; busbw = algbw * 2(n-1)/n.
// See collective_bench_harness.h.
//   all_reduce_bench --backend=nccl|ours_nccl|gloo [--ranks=N] [--dtype=f32] ...
#include "absl/strings/str_cat.h"
#include "worker/benches/collective_bench_harness.h"

namespace shardgemm {
namespace bench {
namespace {

class AllReduce : public Collective {
 public:
  const char* Name() const override { return "all_reduce"; }
  double BusFactor(int n) const override { return 2.0 * (n - 1) / n; }
  const char* BusFactorText() const override { return "2(n-1)/n"; }
  int PiecesPerBuffer(int) const override { return 1; }
  bool Sums() const override { return true; }
  std::string OursPath(Backend b) const override {
    return absl::StrCat("copy of the host tensor, then Collectives::AllReduce(sum) in place on it: ",
                        b == Backend::kGloo ? "gloo::allreduce (bf16 summed in f32)"
                                            : "H2D copy, ncclAllReduce, wait, D2H copy",
                        " (an after-GEMM all_reduce_sum)");
  }

  std::vector<int64_t> InputShape(const Layout& l) const override { return {l.groups, l.rows, l.cols}; }
  std::vector<int64_t> OutputShape(const Layout& l) const override { return {l.groups, l.rows, l.cols}; }
  double Expected(const Layout& l, int, int64_t o, const InputValues& in) const override {
    double sum = 0;
    for (int s = 0; s < l.ranks; ++s) sum += in(s, o);
    return sum;
  }

  ncclResult_t RunNccl(const void* send, void* recv, const Layout& l, ncclDataType_t type,
                       ncclComm_t comm, cudaStream_t stream) const override {
    return ncclAllReduce(send, recv, l.count, type, ncclSum, comm, stream);
  }
  // As worker/executor.cc's ApplyCollective: the step's tensor is copied,
  // then reduced in place.
  absl::StatusOr<HostTensor> RunOurs(Collectives* c, const HostTensor& in,
                                     const std::vector<std::string>& axes) const override {
    HostTensor out = in;
    if (auto s = c->AllReduce(&out, ReduceOp::kSum, axes); !s.ok()) return s;
    return out;
  }
};

}  // namespace
}  // namespace bench
}  // namespace shardgemm

int main(int argc, char** argv) {
  shardgemm::bench::AllReduce c;
  return shardgemm::bench::BenchMain(argc, argv, c);
}
