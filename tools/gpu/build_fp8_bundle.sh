#!/usr/bin/env bash
# On the build machine: build the FP8 grouped-GEMM GPU test and bench and
# bundle them (with the shared libraries the H200 machine lacks, the peer
# script and the presets) into .gpu_bundle/fp8, to `carry` to the GPU machine.
#   tools/gpu/build_fp8_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OB=${BAZEL_OUTPUT_BASE:-/tmp/bazel_cuda}
bazel --output_base="$OB" build -c opt //kernels/cuda:fp8_grouped_gemm_gpu_test //kernels/cuda:fp8_grouped_gemm_bench
BIN=$(bazel --output_base="$OB" info -c opt bazel-bin 2>/dev/null)
rm -rf .gpu_bundle/fp8
/work/shared/tools/bundle-for-gpu .gpu_bundle/fp8 \
  "$BIN/kernels/cuda/fp8_grouped_gemm_gpu_test" "$BIN/kernels/cuda/fp8_grouped_gemm_bench"
cp /work/shared/anchors/peer_grouped_mm.py /work/shared/anchors/presets.json .gpu_bundle/fp8/
