#!/usr/bin/env bash
# Two builds' servers under the same service bench, alternated ROUNDS times
# in one run (a before/after claim needs both in the same run). BASE_BIN
# holds the earlier build's shardgemm-coordinator and shardgemm-worker; the
# bench client and the later servers come from ./bin. Flags go to the bench.
# The servers get --insecure (or --tls_dir with TLS_DIR). An earlier build
# that predates those flags (plaintext only, e.g. 32b82c9) gets none of them
# (TLS_DIR is then refused); the bench keeps --insecure. BASE_COORDINATOR_FLAGS
# and BASE_WORKER_FLAGS, when set, replace COORDINATOR_FLAGS / WORKER_FLAGS
# for the earlier build (flags it does not know).
#   BASE_BIN=.tmp/base_bin MESH='dp=2,fsdp=2,ep=2' WORKERS=8 ROUNDS=3 \
#     bash tools/service_alternate.sh --local=cpu --presets=tools/bench/cpu_presets.json ...
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BASE_BIN:?set BASE_BIN to the folder of the earlier servers}"
base_env=()
base_help=$("$BASE_BIN/shardgemm-coordinator" --helpfull 2>&1 || true)
if [[ $base_help != *--insecure* ]]; then
  if [[ -n ${TLS_DIR:-} ]]; then
    echo "service_alternate.sh: $BASE_BIN's servers know no --tls_dir; run without TLS_DIR" >&2
    exit 2
  fi
  base_env+=(SERVER_SECURITY=)
fi
[[ -n ${BASE_COORDINATOR_FLAGS+x} ]] && base_env+=("COORDINATOR_FLAGS=$BASE_COORDINATOR_FLAGS")
[[ -n ${BASE_WORKER_FLAGS+x} ]] && base_env+=("WORKER_FLAGS=$BASE_WORKER_FLAGS")
for r in $(seq "${ROUNDS:-3}"); do
  for side in base new; do
    echo "== $side round $r"
    if [ $side = base ]; then
      env "${base_env[@]}" SERVER_BIN="$BASE_BIN" bash tools/service_bench.sh "$@" | grep -v '^#'
    else
      SERVER_BIN=./bin bash tools/service_bench.sh "$@" | grep -v '^#'
    fi
  done
done
