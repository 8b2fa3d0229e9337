#!/usr/bin/env bash
# What TLS and tokens cost: the service bench against the same servers with
# --insecure and with TLS on every hop (mutual inside the mesh) and the
# bench's bearer token, alternated ROUNDS times in one run. Flags go to the
# bench. Certificates are made in $TLS_DIR (default .tmp/bench-tls).
#   MESH='ep=2,fsdp=2' WORKERS=4 ROUNDS=3 bash tools/security_alternate.sh --local=cpu \
#     --presets=tools/bench/cpu_presets.json --only=cpu-small --dtype=f32 --iters=100 ...
set -euo pipefail
cd "$(dirname "$0")/.."
CERTS=${TLS_DIR:-.tmp/bench-tls}
bash tools/make_certs.sh "$CERTS" 2>/dev/null
for r in $(seq "${ROUNDS:-3}"); do
  for side in insecure tls; do
    echo "== $side, round $r"
    if [ $side = insecure ]; then
      TLS_DIR= WORKER_FLAGS=--backend=cpu bash tools/service_bench.sh "$@" | grep -v '^#'
    else
      TLS_DIR=$CERTS WORKER_FLAGS=--backend=cpu bash tools/service_bench.sh "$@" | grep -v '^#'
    fi
  done
done
