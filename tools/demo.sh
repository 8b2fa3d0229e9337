#!/usr/bin/env bash
# `make demo`: a local coordinator with its workers (CPU backend when there is
# no GPU), a real sharded grouped GEMM through the CLI, its plan and a checked
# result; then everything shuts down.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./bin
PORT=${SHARDGEMM_DEMO_PORT:-50151}
ADDR=127.0.0.1:$PORT
MESH=ep=2,fsdp=2
WORKERS=4
LOGS=$(mktemp -d)
# TLS on every hop and a bearer token for the client: a mesh CA and
# certificates made once in .tls/ (tools/make_certs.sh).
TLS_DIR=${SHARDGEMM_DEMO_TLS_DIR:-.tls}
bash tools/make_certs.sh "$TLS_DIR"
SECURITY="--tls_dir=$TLS_DIR"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

echo "== starting shardgemm-coordinator on $ADDR with mesh $MESH (TLS, mutual TLS to the workers, clients need a token)"
$BIN/shardgemm-coordinator --listen="$ADDR" --mesh="$MESH" $SECURITY 2>"$LOGS/coordinator.log" &
pids+=($!)
for ((i = 0; i < WORKERS; i++)); do
  $BIN/shardgemm-worker --coordinator="$ADDR" $SECURITY 2>"$LOGS/worker$i.log" &
  pids+=($!)
done
for _ in $(seq 100); do
  $BIN/shardgemm cluster --coordinator="$ADDR" $SECURITY 2>/dev/null | grep -q "(ready)" && break
  sleep 0.1
done
$BIN/shardgemm cluster --coordinator="$ADDR" $SECURITY
sed 's/^/   /' "$LOGS"/worker*.log

echo
echo "== expert weights resident: 8 experts [8, 256, 128] bf16, experts split over ep, K over fsdp"
$BIN/shardgemm put experts --coordinator="$ADDR" $SECURITY --data=8x256x128 --dtype=bf16 --seed=7 \
  --spec='(ep, fsdp, None)'

echo
echo "== grouped GEMM: 1024 tokens split over (fsdp, ep), each shard's 4 local experts uneven (some empty)"
echo "   the plan gathers each worker's experts along fsdp before its local GEMM"
$BIN/shardgemm gemm --coordinator="$ADDR" $SECURITY --lhs='1024x256@((fsdp, ep), None)' --rhs=resident:experts \
  --group-sizes='100,0,60,96, 30,30,30,30, 256,0,0,0, 1,2,3,200@((fsdp, ep),)' \
  --dtype=bf16 --seed=42 --check

echo
echo "== shutting down"
cleanup
trap - EXIT
echo "done"
