#!/usr/bin/env bash
# On the H200 machine, from the repo root, with .gpu_bundle/gemm carried
# (tools/gpu/build_bundle.sh makes it): runs the grouped-GEMM GPU tests.
#   tools/gpu/run_gpu_tests.sh [gtest flags]
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/gemm}
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
"$B/bin/grouped_gemm_gpu_test" "$@"
