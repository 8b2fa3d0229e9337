#!/usr/bin/env bash
# On the H200 host: how much of the service's added time is the host's cores
# waking from idle while the GPU works. The same bench (one CUDA worker,
# output kept; coordinator, worker and bench each on a core of its own) in
# these states, alternated ROUNDS times:
#   idle   the host as lent (a core with nothing to run halts while a step runs);
#   spin   a SCHED_IDLE busy loop on each of the three cores, from outside
#          (they never halt, and the loop yields to any runnable thread at once);
#   poll   the servers' own --busy_poll=2ms (the same, only while a request is
#          in flight and 2 ms after);
#   free-idle, free-poll   the same two with no process pinned.
# (A PM QoS request on /dev/cpu_dma_latency changed nothing: the guest has no
# cpuidle driver; its idle is the hypervisor's halt.)
#   bash tools/gpu/run_wake_probe.sh .gpu_bundle/svc
# ROUNDS (default 2), ITERS (default 60).
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
echo "# cpuidle driver: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)"
echo "# governor: $(cat /sys/devices/system/cpu/cpu2/cpufreq/scaling_governor 2>/dev/null || echo none)"
bench() {  # LABEL OP PRESET, with CPUS and FLAGS of the state
  COORDINATOR_CPUS=$cpus_c WORKER_CPUS=$cpus_w BENCH_CPUS=$cpus_b COORDINATOR_FLAGS="$flags" SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench \
    WORKER_FLAGS="--backend=cuda $flags" PORT=50191 bash tools/service_bench.sh --local=cuda --op="$2" \
    --presets="$B/presets.json" --iters="${ITERS:-60}" --only="$3" 2>&1 | grep -v "^#" | sed "s/^/$1 $2 /"
}
spin_pids=()
enter() {  # STATE
  cpus_c=2 cpus_w=3 cpus_b=4 flags=
  case $1 in
    poll) flags=--busy_poll=2ms ;;
    free-idle) cpus_c= cpus_w= cpus_b= ;;
    free-poll) cpus_c= cpus_w= cpus_b= flags=--busy_poll=2ms ;;
    spin) for c in 2 3 4; do chrt -i 0 taskset -c "$c" sh -c 'while :; do :; done' & spin_pids+=($!); done ;;
  esac
}
leave() {  # STATE
  case $1 in
    spin) kill "${spin_pids[@]}" 2>/dev/null; wait "${spin_pids[@]}" 2>/dev/null; spin_pids=() ;;
  esac
}
trap 'leave spin' EXIT
echo "# columns: state op preset local_us d2h_us server50 server90 worker50 worker90 rtt50 rtt90 ratio added_us h2d d2h check"
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for state in ${STATES:-idle spin poll free-idle free-poll}; do
    enter $state
    bench "$state r$round" gemm small-decode
    bench "$state r$round" gemm deepseek-v3-up
    bench "$state r$round" fp8 deepseek-v3-up
    leave $state
  done
done
