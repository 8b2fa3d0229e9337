#ifndef SHARDGEMM_KERNELS_CUDA_LAUNCH_PARAM_BENCH_H_
#define SHARDGEMM_KERNELS_CUDA_LAUNCH_PARAM_BENCH_H_

namespace shardgemm {

// What a kernel launch's parameter bytes cost on the device and on the
// host: prints one line per (parameter size, grid, dependent launch or not)
// and returns 0, or prints the CUDA error and returns 1.
int RunLaunchParamBench();

}  // namespace shardgemm

#endif  // SHARDGEMM_KERNELS_CUDA_LAUNCH_PARAM_BENCH_H_
