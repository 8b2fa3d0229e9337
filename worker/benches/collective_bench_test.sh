#!/usr/bin/env bash
# Runs each collective bench through our Gloo layer and checks exit statuses:
# 0 (every element right) on real runs, 1 when an output is corrupted on
# purpose, 2 for a GPU backend asking for more GPUs than any machine has.
#   collective_bench_test.sh ALL_GATHER ALL_REDUCE REDUCE_SCATTER
set -uo pipefail
fail=0
expect() {  # expect STATUS BINARY ARGS...
  local want=$1; shift
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1
  local got=$?
  if [[ $got -ne $want ]]; then
    echo "FAIL (exit $got, expected $want): $*"; cat "$log"; fail=1
  else
    echo "ok   (exit $got): $(basename "$1") ${*:2}"
    [[ $want -eq 0 ]] && grep -E '^ +[0-9]' "$log"
  fi
  rm -f "$log"
}
sizes=(--min_bytes=1024 --max_bytes=1048576 --step_factor=32 --iters=2 --warmup=1 --timeout_s=60)
for bench in "$@"; do
  for ranks in 2 4; do
    for dtype in f32 bf16; do
      expect 0 "$bench" --backend=gloo --ranks=$ranks --dtype=$dtype "${sizes[@]}"
    done
  done
  # Odd sizes and ranks round down to whole pieces; --groups=1 is a flat piece.
  expect 0 "$bench" --backend=gloo --ranks=3 --groups=1 --min_bytes=1000 --max_bytes=100000 --step_factor=10 --iters=1 --warmup=0
  # The check is not vacuous.
  expect 1 "$bench" --backend=gloo --ranks=2 --min_bytes=65536 --max_bytes=65536 --iters=1 --test_corrupt_output=3
  # No machine has 1000 GPUs: a clear error and exit 2, with or without a GPU.
  expect 2 "$bench" --backend=nccl --ranks=1000
  expect 2 "$bench" --backend=ours_nccl --ranks=1000
  expect 2 "$bench" --backend=ours_nccl_device --ranks=1000  # all_gather: GPUs; the others: no device path
  expect 2 "$bench" --backend=gloo --dtype=f16
done
echo "collective_bench_test: $([[ $fail -eq 0 ]] && echo PASS || echo FAIL)"
exit $fail
