#!/usr/bin/env bash
# On the build machine: build the collective benches (-c opt) and bundle them,
# with the shared libraries the GPU machine lacks, into .gpu_bundle/coll to
# `carry` there; run them with tools/gpu/run_collective_bench.sh.
#   tools/gpu/build_collective_bundle.sh      (BAZEL_OUTPUT_BASE overrides the output base)
set -euo pipefail
cd "$(dirname "$0")/../.."
OB=${BAZEL_OUTPUT_BASE:-/tmp/bazel_helperB}
BENCHES="all_gather_bench all_reduce_bench reduce_scatter_bench"
# --symlink_prefix=/: leave the checkout's bazel-* links to the default build.
bazel --output_base="$OB" build -c opt --symlink_prefix=/ $(printf '//worker/benches:%s ' $BENCHES)
BIN=$(bazel --output_base="$OB" info -c opt bazel-bin 2>/dev/null)/worker/benches
rm -rf .gpu_bundle/coll
../shared/tools/bundle-for-gpu .gpu_bundle/coll $(printf "$BIN/%s " $BENCHES)
echo "on the GPU machine: bash tools/gpu/run_collective_bench.sh .gpu_bundle/coll [NGPUS]"
