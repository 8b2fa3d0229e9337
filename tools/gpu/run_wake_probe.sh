#!/usr/bin/env bash
# On the H200 host: how much of the service's added time is the host's cores
# waking from idle while the GPU works. The same bench (one CUDA worker,
# output kept; coordinator, worker and bench each on a core of its own) in
# three host states, alternated ROUNDS times:
#   idle   the host as lent (the cores may enter deep C-states while a step runs);
#   qos    a PM QoS request of 0 us held on /dev/cpu_dma_latency (no deep C-states);
#   spin   a SCHED_IDLE busy loop on each of the three cores (they never idle,
#          and the loop yields to any runnable thread at once).
#   bash tools/gpu/run_wake_probe.sh .gpu_bundle/svc
# ROUNDS (default 2), ITERS (default 60).
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
echo "# cpuidle states of cpu2 (name, exit latency in us, disabled)"
for d in /sys/devices/system/cpu/cpu2/cpuidle/state*; do
  echo "#   $(cat "$d/name") $(cat "$d/latency") $(cat "$d/disable" 2>/dev/null)"
done
echo "# governor: $(cat /sys/devices/system/cpu/cpu2/cpufreq/scaling_governor 2>/dev/null || echo none)"
bench() {  # LABEL OP PRESET
  COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench \
    WORKER_FLAGS=--backend=cuda PORT=50191 bash tools/service_bench.sh --local=cuda --op="$2" \
    --presets="$B/presets.json" --iters="${ITERS:-60}" --only="$3" 2>&1 | grep -v "^#" | sed "s/^/$1 $2 /"
}
spin_pids=()
enter() {  # STATE
  case $1 in
    qos) exec 3>/dev/cpu_dma_latency && printf '\x00\x00\x00\x00' >&3 || echo "# qos: /dev/cpu_dma_latency not writable" ;;
    spin) for c in 2 3 4; do chrt -i 0 taskset -c "$c" sh -c 'while :; do :; done' & spin_pids+=($!); done ;;
  esac
}
leave() {  # STATE
  case $1 in
    qos) exec 3>&- ;;
    spin) kill "${spin_pids[@]}" 2>/dev/null; wait "${spin_pids[@]}" 2>/dev/null; spin_pids=() ;;
  esac
}
trap 'leave spin' EXIT
echo "# columns: state op preset local_us d2h_us server50 server90 worker50 worker90 rtt50 rtt90 ratio added_us h2d d2h check"
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for state in idle qos spin; do
    enter $state
    bench "$state r$round" gemm small-decode
    bench "$state r$round" gemm deepseek-v3-up
    bench "$state r$round" fp8 deepseek-v3-up
    leave $state
  done
done
