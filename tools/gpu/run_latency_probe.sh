#!/usr/bin/env bash
# On the H200: what the service's fixed cost (server time over the local op)
# is made of. The same service bench (one CUDA worker, output kept) runs with
# the processes pinned to cores in several ways, alternated ROUNDS times:
#   free        no pinning
#   split1      coordinator, worker and bench each on a core of its own
#   shared1     coordinator and worker on one core, the bench on another
#   split2      coordinator and worker each on two cores of their own
#   flag        the servers' own --cpus flag (as split1, from inside)
# and the RPC floor (bin/plan_rpc_benchmark --empty_rpc) free and on one core.
#   bash tools/gpu/run_latency_probe.sh .gpu_bundle/svc
# PRESETS (default 'small-decode deepseek-v3-up'), ITERS, ROUNDS, VARIANTS.
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
if [[ -x $B/bin/plan_rpc_benchmark ]]; then
  echo "rpc floor free: $($B/bin/plan_rpc_benchmark --threads=1 --seconds=2 --empty_rpc)"
  echo "rpc floor one core: $(taskset -c 2 $B/bin/plan_rpc_benchmark --threads=1 --seconds=2 --empty_rpc)"
fi
bench() {  # PRESET LABEL, with the CPUS variables of tools/service_bench.sh
  SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench PORT=${PORT:-50191} \
    bash tools/service_bench.sh --local=cuda --presets="$B/presets.json" --iters="${ITERS:-60}" --only="$1" 2>&1 |
    grep -v "^#" | sed "s/^/$2 /"
}
for preset in ${PRESETS:-small-decode deepseek-v3-up}; do
  for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
    for v in ${VARIANTS:-free split1 shared1 split2 flag}; do
      case $v in
        free) WORKER_FLAGS=--backend=cuda bench "$preset" "$v r$round" ;;
        split1) COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 WORKER_FLAGS=--backend=cuda bench "$preset" "$v r$round" ;;
        shared1) COORDINATOR_CPUS=2 WORKER_CPUS=2 BENCH_CPUS=4 WORKER_FLAGS=--backend=cuda bench "$preset" "$v r$round" ;;
        split2) COORDINATOR_CPUS=2-3 WORKER_CPUS=4-5 BENCH_CPUS=6 WORKER_FLAGS=--backend=cuda bench "$preset" "$v r$round" ;;
        flag) COORDINATOR_FLAGS=--cpus=2 WORKER_FLAGS="--backend=cuda ${FLAG_WORKER_CPUS---cpus=3}" WORKER_CPUS=${FLAG_WORKER_TASKSET:-} BENCH_CPUS=4 bench "$preset" "$v r$round" ;;
      esac
    done
  done
done
