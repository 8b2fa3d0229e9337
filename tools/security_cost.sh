#!/usr/bin/env bash
# What TLS and tokens cost in throughput, in one run: the service bench's
# small CPU configuration (cpu-small of tools/bench/cpu_presets.json, F32,
# weights and activations resident, output kept) against a fresh mesh per
# side and round, plaintext (--insecure everywhere) and TLS (--tls_dir on
# every server: server TLS for the bench, mutual TLS coordinator <-> workers,
# the bench's bearer token), alternated ROUNDS times (the side that goes
# first alternates too). Each side: CONCURRENCY callers at once, ITERS calls
# each, after their warm-up. Prints, per mesh and round, both sides' calls/s
# and server p50, and the ratio TLS / insecure of the throughput; then the
# median ratio per mesh (target: >= 0.90, i.e. TLS costs <= 10%).
#   ROUNDS=5 CONCURRENCY=4 ITERS=300 bash tools/security_cost.sh
# MESHES: "1" (dp=1, one worker) and/or "4" (ep=2,fsdp=2, four workers);
# default "1 4". Certificates in $CERTS (default .tmp/bench-tls, made by
# tools/make_certs.sh). SERVER_BIN (default ./bin) and BENCH as
# tools/service_bench.sh; every mesh on a port the OS picks.
set -euo pipefail
cd "$(dirname "$0")/.."
CERTS=${CERTS:-.tmp/bench-tls}
ROUNDS=${ROUNDS:-5}
CONCURRENCY=${CONCURRENCY:-4}
ITERS=${ITERS:-300}
MESHES=${MESHES:-1 4}
[[ -s $CERTS/ca.crt ]] || bash tools/make_certs.sh "$CERTS" >/dev/null 2>&1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
common=(--local=cpu --threads=1 --presets=tools/bench/cpu_presets.json --only=cpu-small --dtype=f32
        --iters="$ITERS" --concurrency="$CONCURRENCY")
side() {  # MESH SIDE ROUND: one bench run, its JSON line appended to $out/MESH-SIDE.jsonl
  local mesh=$1 side=$2 round=$3 flags=()
  local env=(PORT="$(free_port)" WORKER_FLAGS=--backend=cpu)
  [[ $side == tls ]] && env+=(TLS_DIR="$CERTS") || env+=(TLS_DIR=)
  if [[ $mesh == 4 ]]; then
    env+=(MESH='ep=2,fsdp=2' WORKERS=4)
    flags=(--lhs_spec='((fsdp,ep),None)' --rhs_spec='(ep,fsdp,None)' --group_sizes_spec='((fsdp,ep),)'
           --row_shards=4 --expert_shards=2)
  else
    env+=(MESH='dp=1' WORKERS=1)
  fi
  env "${env[@]}" bash tools/service_bench.sh "${common[@]}" "${flags[@]}" --json="$out/$mesh-$side.jsonl" \
    >"$out/last.txt" 2>&1 || { cat "$out/last.txt" >&2; exit 1; }
}
echo "# security cost: cpu-small, F32, output kept, $CONCURRENCY callers x $ITERS calls a side, $ROUNDS rounds," \
     "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- security server worker || echo '+changes')"
for r in $(seq "$ROUNDS"); do
  for mesh in $MESHES; do
    if ((r % 2)); then order=(insecure tls); else order=(tls insecure); fi
    for s in "${order[@]}"; do side "$mesh" "$s" "$r"; done
    python3 - "$out" "$mesh" "$r" <<'EOF'
import json, sys
out, mesh, r = sys.argv[1:]
last = {s: [json.loads(l) for l in open(f"{out}/{mesh}-{s}.jsonl")][-1] for s in ("insecure", "tls")}
i, t = last["insecure"], last["tls"]
print(f"  round {r}  {mesh} worker(s)  insecure {i['calls_per_s']:8.1f} calls/s (server p50 {i['server_p50_us']:7.1f} us)"
      f"  tls {t['calls_per_s']:8.1f} calls/s (server p50 {t['server_p50_us']:7.1f} us)"
      f"  tls/insecure {t['calls_per_s'] / i['calls_per_s']:.3f}  checks {i['check'].split()[0]}/{t['check'].split()[0]}",
      flush=True)
EOF
  done
done
python3 - "$out" $MESHES <<'EOF'
import json, statistics, sys
out, meshes = sys.argv[1], sys.argv[2:]
for mesh in meshes:
    rows = {s: [json.loads(l) for l in open(f"{out}/{mesh}-{s}.jsonl")] for s in ("insecure", "tls")}
    ratios = [t["calls_per_s"] / i["calls_per_s"] for i, t in zip(rows["insecure"], rows["tls"])]
    print(f"median {mesh} worker(s): tls/insecure throughput {statistics.median(ratios):.3f}"
          f" (rounds {', '.join(f'{x:.3f}' for x in ratios)}); insecure"
          f" {statistics.median(x['calls_per_s'] for x in rows['insecure']):.1f} calls/s, tls"
          f" {statistics.median(x['calls_per_s'] for x in rows['tls']):.1f} calls/s")
EOF
