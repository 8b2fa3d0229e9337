#!/usr/bin/env bash
# Builds and bundles what tools/gpu/run_service_bench.sh and
# tools/gpu/run_sweep.sh run on the H200: coordinator, worker, CLI, service
# bench, transport bench and the presets.
set -euo pipefail
cd "$(dirname "$0")/../.."
BAZEL=${BAZEL:-bazel}
B=${1:-.gpu_bundle/svc}
$BAZEL build //server:shardgemm-coordinator //worker:shardgemm-worker //client:shardgemm //client:shardgemm-service-bench \
  //client:shardgemm-transport-bench
bb=$($BAZEL info bazel-bin)
rm -rf "$B"
../shared/tools/bundle-for-gpu "$B" "$bb/server/shardgemm-coordinator" "$bb/worker/shardgemm-worker" \
  "$bb/client/shardgemm" "$bb/client/shardgemm-service-bench" "$bb/client/shardgemm-transport-bench"
cp ../shared/anchors/presets.json "$B/presets.json"
