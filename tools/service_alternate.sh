#!/usr/bin/env bash
# Two builds' servers under the same service bench, alternated ROUNDS times
# in one run (a before/after claim needs both in the same run). BASE_BIN
# holds the earlier build's shardgemm-coordinator and shardgemm-worker; the
# bench client and the later servers come from ./bin. Flags go to the bench.
# The servers get --insecure (or --tls_dir with TLS_DIR): an earlier build
# must know the flag.
#   BASE_BIN=.tmp/base_bin MESH='dp=2,fsdp=2,ep=2' WORKERS=8 ROUNDS=3 \
#     bash tools/service_alternate.sh --local=cpu --presets=tools/bench/cpu_presets.json ...
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BASE_BIN:?set BASE_BIN to the folder of the earlier servers}"
for r in $(seq "${ROUNDS:-3}"); do
  for side in base new; do
    bin=./bin
    [ $side = base ] && bin=$BASE_BIN
    echo "== $side round $r"
    SERVER_BIN=$bin bash tools/service_bench.sh "$@" | grep -v '^#'
  done
done
