// launch_param_bench: what a kernel launch's parameter bytes cost
// (kernels/cuda/launch_param_bench.cu). No flags.
#include "kernels/cuda/launch_param_bench.h"

int main() { return shardgemm::RunLaunchParamBench(); }
