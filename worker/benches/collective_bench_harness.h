// A shared harness for collective benchmarks in the style of nccl-tests: N
// ranks as N threads of one process, a sweep of sizes, one line per size
// (size, count, type, time, algbw, busbw, #wrong). Each collective is a small
// file that says how to run it on each backend and what every output element
// must be:
//   nccl       NCCL alone: ncclAllGather etc. on device buffers, `iters` calls
//              queued on the rank's stream, then one wait (as nccl-tests).
//   ours_nccl  our worker layer (worker/nccl_collectives.cc) called the way a
//              worker's step calls it: host tensors in and out, so the copies
//              to and from the device are in the time, one blocking call at a
//              time.
//   ours_nccl_device
//              our worker layer's device path (all-gather only):
//              Collectives::AllGatherDevice on device buffers, as a CUDA
//              worker gathers an FSDP weight into its GEMM's operand; one
//              blocking call at a time (ncclAllGather, placement along the
//              dim with device-to-device copies, the watched wait).
//   gloo       our worker layer over Gloo (worker/gloo_collectives.cc) on CPU,
//              so the harness and the checks run in CI without a GPU.
// Exit status: 0 all outputs right, 1 some element wrong or a collective
// failed, 2 bad flags or no usable GPU.
#ifndef SHARDGEMM_WORKER_BENCHES_COLLECTIVE_BENCH_HARNESS_H_
#define SHARDGEMM_WORKER_BENCHES_COLLECTIVE_BENCH_HARNESS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/host_tensor.h"
#include "worker/collectives.h"

namespace shardgemm {
namespace bench {

enum class Backend { kNccl, kOursNccl, kOursNcclDevice, kGloo };

// One measured size, the same on every rank. A "piece" is what one rank
// contributes (all-gather) or keeps (reduce-scatter); for all-reduce it is the
// whole buffer. Our layer holds a piece as [groups, rows, cols] and the
// collective runs along dim 1, as the FSDP all-gather of an expert weight
// [E, K/n, N] along K; for NCCL alone the piece is flat (groups = rows = 1).
struct Layout {
  int ranks = 1;
  DType dtype = DType::kF32;
  int64_t bytes = 0;  // the size column: count * element size
  int64_t count = 0;  // elements of the full buffer (gathered / reduced / before scattering)
  int64_t piece = 0;
  int64_t groups = 1, rows = 1, cols = 1;

  // Where element i of rank r's piece sits in the full buffer, and back.
  int64_t FullIndex(int r, int64_t i) const;
  void Split(int64_t full, int* r, int64_t* i) const;
};

// Value of input element i on `rank`: integers in [-bound, bound], so they
// and their sums over the ranks are exact in F32 and BF16.
using InputValues = std::function<double(int rank, int64_t i)>;

class Collective {
 public:
  virtual ~Collective() = default;
  virtual const char* Name() const = 0;
  // nccl-tests: busbw = algbw * BusFactor.
  virtual double BusFactor(int ranks) const = 0;
  virtual const char* BusFactorText() const = 0;  // "(n-1)/n"
  // Pieces in the full buffer (ranks, or 1 for all-reduce) and whether the
  // output sums over ranks (bounds the input values).
  virtual int PiecesPerBuffer(int ranks) const = 0;
  virtual bool Sums() const = 0;
  // What our layer does on `backend` (ours_nccl, ours_nccl_device or gloo), for the header.
  virtual std::string OursPath(Backend backend) const = 0;
  virtual absl::Status Supports(Backend backend, DType dtype) const;

  virtual std::vector<int64_t> InputShape(const Layout& l) const = 0;
  virtual std::vector<int64_t> OutputShape(const Layout& l) const = 0;
  // Output element o on `rank`.
  virtual double Expected(const Layout& l, int rank, int64_t o, const InputValues& in) const = 0;

  // One call. NCCL alone: queue it on `stream` (out of place).
  virtual ncclResult_t RunNccl(const void* send, void* recv, const Layout& l, ncclDataType_t type,
                               ncclComm_t comm, cudaStream_t stream) const = 0;
  // Our layer: what worker/executor.cc's ApplyCollective does for this kind.
  virtual absl::StatusOr<HostTensor> RunOurs(Collectives* c, const HostTensor& in,
                                             const std::vector<std::string>& axes) const = 0;
  // Our layer's device path (ours_nccl_device), where the collective has one:
  // `send` holds the input (InputShape) and `recv` has room for the output
  // (OutputShape), both device memory of the rank's GPU; one blocking call.
  virtual bool HasOursDevice() const { return false; }
  virtual absl::Status RunOursDevice(Collectives* c, const void* send, void* recv, const Layout& l,
                                     const std::vector<std::string>& axes, cudaStream_t stream) const;
};

int64_t NumElements(const std::vector<int64_t>& shape);

// Parses the flags, runs the sweep, prints the table; returns the exit status.
int BenchMain(int argc, char** argv, const Collective& collective);

}  // namespace bench
}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_BENCHES_COLLECTIVE_BENCH_HARNESS_H_
