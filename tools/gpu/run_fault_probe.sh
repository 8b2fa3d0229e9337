#!/usr/bin/env bash
# On the H200 (world size 1): a kernel launch failure or an NCCL error fails
# its request with the CUDA / NCCL message and the worker serves the next
# request; a sticky CUDA error (an illegal address) makes the worker report
# itself unhealthy and exit (status 3), the coordinator marks it down, and a
# restarted worker serves again. One coordinator and one CUDA worker on the
# mesh fsdp=1, the worker with --fault_injection (docs/reliability.md):
#   launch 2: an empty grid, which the runtime refuses (CUDA 13 names it
#   cudaErrorInvalidValue, older runtimes cudaErrorInvalidConfiguration);
#   collective 1: an NCCL all-reduce with
#   an invalid datatype (the all-reduce of a plan that splits K over fsdp,
#   which a mesh of one still runs); launch 7: a write through an invalid address.
# Bundle: bash tools/gpu/bundle_service.sh BUNDLE, then from the repository root
#   bash tools/gpu/run_fault_probe.sh BUNDLE
# FAULTS= BACKEND=cpu runs the same requests with no faults (all right; the
# worker is killed instead of exiting): a dry run on a machine without a GPU.
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$(cd "$B" && pwd)/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BACKEND=${BACKEND:-cuda}
FAULTS=${FAULTS-kernel_launch:2,nccl:1,illegal_address:7}
LOGS=${LOGS:-/tmp/fault_probe}
PORT=${PORT:-50071}
ADDR=127.0.0.1:$PORT
CLI="timeout 120 $B/bin/shardgemm --coordinator=$ADDR --insecure"
rm -rf "$LOGS" && mkdir -p "$LOGS"
fail=0
say() { echo "$*" | tee -a "$LOGS/summary.txt"; }
# The message a faulted request must carry, or "right" in a dry run.
expect() { if [[ -z $FAULTS ]]; then echo right; else echo "$1"; fi; }

$B/bin/shardgemm-coordinator --listen=$ADDR --mesh=fsdp=1 --insecure --heartbeat_interval_s=0.2 \
  --heartbeat_misses=2 --step_timeout_s=60 2>"$LOGS/coordinator.log" &
C=$!
HEALTH=127.0.0.1:$((PORT + 1))
start_worker() {  # extra worker flags
  $B/bin/shardgemm-worker --coordinator=$ADDR --backend=$BACKEND --insecure --collective_timeout_s=20 \
    --health_listen=$HEALTH "$@" 2>>"$LOGS/worker.log" &
  W=$!
}
wait_ready() {
  for _ in $(seq 300); do $CLI cluster 2>/dev/null | grep -q "(ready)" && return 0; sleep 0.1; done
  say "FAIL: the mesh was not ready in 30 s"; fail=1; return 1
}
# request NAME WANT ARGS...: a GEMM checked against the CLI's reference;
# WANT "right", or a text its error must contain.
request() {
  local name=$1 want=$2; shift 2
  local t0 out rc ms
  t0=$(date +%s%N)
  out=$($CLI gemm --show_plan=false --dtype=bf16 --groups=8 --check "$@" 2>&1); rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  local verdict=PASS
  if [[ $want == right ]]; then
    [[ $rc == 0 && $out == *"result matches reference"* ]] || verdict=FAIL
  else
    [[ $rc != 0 && $out == *"$want"* ]] || verdict=FAIL
  fi
  [[ $verdict == PASS ]] || fail=1
  say "== $name [$verdict] (rc $rc, ${ms} ms; want: $want)"
  say "$(echo "$out" | grep -E "shardgemm:|result" | sed 's/^/   /')"
}
resident="--lhs=2048x512 --rhs=resident:experts"
reduced="--lhs=2048x512@(None,fsdp) --rhs=8x512x256@(None,fsdp,None)"

start_worker ${FAULTS:+--fault_injection=$FAULTS}
wait_ready
$CLI cluster | tee -a "$LOGS/summary.txt"
$CLI put experts --data=8x512x256 --dtype=bf16 --seed=3 >/dev/null || { say "FAIL: put experts"; fail=1; }
request "1 good (launch 1)" right $resident
request "2 kernel launch failure (launch 2)" "$(expect 'grouped GEMM kernel launch [--fault_injection kernel_launch:2]: CUDA error cudaErrorInvalid')" $resident
request "3 good (launch 3; the resident weight's device copy kept)" right $resident
request "4 NCCL error (collective 1: the plan's all-reduce over fsdp)" "$(expect 'ncclAllReduce: NCCL invalid argument')" $reduced
request "5 good all-reduce (collective 2)" right $reduced
request "6 good (launch 6)" right $resident
# The health-only port's answers while the worker goes (a probe every ~20 ms).
(while kill -0 $W 2>/dev/null; do
  timeout 2 $B/bin/shardgemm-health-probe --addr=$HEALTH --timeout_s=0.5 2>&1 | head -1; sleep 0.01
done) >"$LOGS/health.txt" &
PROBE=$!
request "7 illegal address (launch 7: sticky)" "$(expect 'cudaErrorIllegalAddress')" $resident

# The worker with the lost context exits by itself (status 3); in a dry run it is killed.
[[ -z $FAULTS ]] && kill -KILL $W
exited=""
for _ in $(seq 150); do kill -0 $W 2>/dev/null || { exited=1; break; }; sleep 0.1; done
if [[ -n $exited ]]; then
  wait $W; rc=$?
  want_rc=$([[ -z $FAULTS ]] && echo 137 || echo 3)
  v=$([[ $rc == "$want_rc" ]] && echo PASS || echo FAIL)
  [[ $v == PASS ]] || fail=1
  say "== worker exited with status $rc [$v] (want $want_rc)"
else
  say "== worker still running 15 s after the sticky error [FAIL]"; fail=1; kill -KILL $W
fi
kill $PROBE 2>/dev/null; wait $PROBE 2>/dev/null
say "   health answers meanwhile, in order (repeats folded): $(uniq "$LOGS/health.txt" | sed 's/shardgemm-health-probe: //' | cut -c1-60 | paste -sd';')"
[[ -n $FAULTS ]] && say "$(grep -E "device_lost|fault_injection" "$LOGS/worker.log" | sed 's/^/   worker log: /')"
down=""
for _ in $(seq 100); do
  if $CLI cluster 2>/dev/null | grep -q "DOWN"; then down=1; break; fi
  sleep 0.1
done
say "== coordinator marks rank 0 down [$([[ -n $down ]] && echo PASS || echo FAIL)]"
[[ -n $down ]] || fail=1
$CLI cluster | tee -a "$LOGS/summary.txt"

# The supervisor's restart: a fresh worker, no faults; the lost weight is put again.
start_worker
wait_ready
$CLI ls 2>&1 | sed 's/^/   ls: /' | tee -a "$LOGS/summary.txt"
$CLI delete experts >/dev/null 2>&1
$CLI put experts --data=8x512x256 --dtype=bf16 --seed=3 >/dev/null || { say "FAIL: put experts again"; fail=1; }
request "8 good after the restart" right $resident
request "9 good all-reduce after the restart" right $reduced

kill $W $C 2>/dev/null; wait
say "fault probe: $([[ $fail == 0 ]] && echo PASS || echo FAIL)"
exit $fail
