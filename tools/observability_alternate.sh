#!/usr/bin/env bash
# What metrics and request logs cost: the service bench against the same
# servers with them off (no --metrics_listen, --log_level=warning: no request
# or step lines) and on (metrics served and scraped every second, one JSON
# line per request and per step), alternated ROUNDS times in one run. Flags
# go to the bench.
#   MESH='ep=2,fsdp=2' WORKERS=4 ROUNDS=3 bash tools/observability_alternate.sh --local=cpu \
#     --presets=tools/bench/cpu_presets.json --only=cpu-small --dtype=f32 --iters=100 ...
set -euo pipefail
cd "$(dirname "$0")/.."
METRICS_PORT=${METRICS_PORT:-9471}
for r in $(seq "${ROUNDS:-3}"); do
  for side in off on; do
    echo "== metrics and logs $side, round $r"
    if [ $side = off ]; then
      COORDINATOR_FLAGS="--log_level=warning" WORKER_FLAGS="--backend=cpu --log_level=warning" \
        bash tools/service_bench.sh "$@" | grep -v '^#'
    else
      ( for _ in $(seq 600); do sleep 1; curl -s -o /dev/null "http://127.0.0.1:$METRICS_PORT/metrics" || true; done ) &
      scraper=$!
      COORDINATOR_FLAGS="--metrics_listen=127.0.0.1:$METRICS_PORT --log_format=json" \
        WORKER_FLAGS="--backend=cpu --metrics_listen=127.0.0.1:0 --log_format=json" \
        bash tools/service_bench.sh "$@" | grep -v '^#'
      kill $scraper 2>/dev/null || true
      wait $scraper 2>/dev/null || true
    fi
  done
done
