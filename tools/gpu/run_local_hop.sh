#!/usr/bin/env bash
# On the H200 host: what the coordinator -> worker hop over the worker's Unix
# socket buys, against the same build calling it over TCP
# (--worker_local_socket=false), alternated ROUNDS times in one run:
#   1. the service's fixed cost on the GPU presets (one CUDA worker, output
#      kept; each process on a core of its own, and unpinned);
#   2. what TLS and tokens cost in throughput on the service bench's small
#      CPU configuration (tools/security_cost.sh), every process on the same
#      two cores (as on the 2-core development machine, but with nothing
#      else running), for both hops; and with the bench on a core of its own
#      (a remote client's TLS is done on its own machine).
#   bash tools/gpu/run_local_hop.sh .gpu_bundle/svc
# PRESETS (default 'small-decode deepseek-v3-up'), ITERS, ROUNDS, SEC_ROUNDS, SEC_ITERS, PARTS ("gpu sec").
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
hop_flags() { [[ $1 == tcp ]] && echo --worker_local_socket=false || echo ""; }
bench() {  # PRESET LABEL HOP, with the CPUS variables of tools/service_bench.sh
  COORDINATOR_FLAGS="$(hop_flags "$3")" SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench PORT=${PORT:-50191} \
    WORKER_FLAGS=--backend=cuda bash tools/service_bench.sh --local=cuda --presets="$B/presets.json" \
    --iters="${ITERS:-80}" --only="$1" 2>&1 | grep -v "^#" | sed "s/^/$2 /"
}
if [[ " ${PARTS:-gpu sec} " == *" gpu "* ]]; then
  echo "# columns: preset local_us d2h_us server50 server90 worker50 worker90 rtt50 rtt90 ratio added_us h2d d2h check"
  for preset in ${PRESETS:-small-decode deepseek-v3-up}; do
    for ((round = 1; round <= ${ROUNDS:-3}; round++)); do
      for hop in tcp unix; do
        COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 bench "$preset" "split1 $hop r$round" "$hop"
        bench "$preset" "free   $hop r$round" "$hop"
      done
    done
  done
fi
if [[ " ${PARTS:-gpu sec} " == *" sec "* ]]; then
  for hop in tcp unix; do
    echo "## security cost, mesh hop $hop, every process on cores 0-1"
    COORDINATOR_FLAGS="$(hop_flags $hop)" COORDINATOR_CPUS=0-1 WORKER_CPUS=0-1 BENCH_CPUS=0-1 \
      SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench CERTS=$B/tls \
      ROUNDS=${SEC_ROUNDS:-7} ITERS=${SEC_ITERS:-500} bash tools/security_cost.sh 2>&1 | grep -E "median|round|#"
    echo "## security cost, mesh hop $hop, servers on cores 0-1, the bench on core 2"
    COORDINATOR_FLAGS="$(hop_flags $hop)" COORDINATOR_CPUS=0-1 WORKER_CPUS=0-1 BENCH_CPUS=2 \
      SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench CERTS=$B/tls \
      ROUNDS=${SEC_ROUNDS:-7} ITERS=${SEC_ITERS:-500} bash tools/security_cost.sh 2>&1 | grep -E "median|#"
  done
fi
