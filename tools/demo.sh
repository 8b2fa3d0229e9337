#!/usr/bin/env bash
# `make demo`: a local coordinator with its workers (CPU backend when there is
# no GPU), a real sharded grouped GEMM through the CLI, its plan and a checked
# result; then everything shuts down.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./bin
PORT=${SHARDGEMM_DEMO_PORT:-50151}
ADDR=127.0.0.1:$PORT
MESH=${SHARDGEMM_DEMO_MESH:-dp=1}
WORKERS=${SHARDGEMM_DEMO_WORKERS:-1}
LOGS=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

echo "== starting shardgemm-coordinator on $ADDR with mesh $MESH"
$BIN/shardgemm-coordinator --listen="$ADDR" --mesh="$MESH" 2>"$LOGS/coordinator.log" &
pids+=($!)
for ((i = 0; i < WORKERS; i++)); do
  $BIN/shardgemm-worker --coordinator="$ADDR" 2>"$LOGS/worker$i.log" &
  pids+=($!)
done
for _ in $(seq 100); do
  $BIN/shardgemm cluster --coordinator="$ADDR" 2>/dev/null | grep -q "(ready)" && break
  sleep 0.1
done
$BIN/shardgemm cluster --coordinator="$ADDR"
sed 's/^/   /' "$LOGS"/worker*.log

echo
echo "== grouped GEMM: 4 experts of uneven sizes (one empty), 512 rows, K=256, N=128, bf16"
$BIN/shardgemm gemm --coordinator="$ADDR" --lhs=512x256 --rhs=4x256x128 \
  --group-sizes=200,0,96,180 --dtype=bf16 --seed=42 --check

echo
echo "== shutting down"
cleanup
trap - EXIT
echo "done"
