#!/usr/bin/env bash
# On the H200 host: the coordinator's --call_socket (the bench's GroupedGemm
# calls as frames on a Unix socket) against the same build's gRPC hop over
# loopback TCP, alternated ROUNDS times in one run, one CUDA worker on its
# step socket: CUDA IPC (lhs and the output in the bench's own CUDA
# allocations), small-decode all resident with the output kept, and quantize
# + FP8 GEMM with the weights resident. Each process on a core of its own
# with both servers' --busy_poll=2ms ("split"), the same with the bench's
# --busy_poll=2ms too ("split+bench"); the last round also unpinned on idle
# cores ("free"). Bundle (here):
#   bash tools/gpu/bundle_service.sh && tar cf - -C .gpu_bundle svc | xz -T2 > .gpu_bundle/svc.tar.xz
# Run there, from the repository root:
#   tar xJf .gpu_bundle/svc.tar.xz -C .gpu_bundle && bash tools/gpu/run_call_socket_probe.sh
# ROUNDS (default 3), ITERS (default 60); CASES ("NAME FLAGS...;...") and HOPS
# ("grpc frames") replace the cases and hops; SETTINGS (default "split
# split+bench", every round) and LAST_SETTINGS (default "free", the last
# round too) name the placements, of split, split+bench, free and free+poll
# (unpinned, both servers --busy_poll=2ms).
set -uo pipefail
B=${B:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
sockets=$(mktemp -d)  # private (0700): the coordinator refuses a directory others may write
trap 'rm -rf "$sockets"' EXIT
bench() {  # LABEL HOP SERVER_FLAGS BENCH_FLAGS..., with the CPUS variables of tools/service_bench.sh
  local label=$1 hop=$2 server_flags=$3
  shift 3
  local call_socket=""
  [[ $hop == frames ]] && call_socket=$sockets/calls.sock
  CALL_SOCKET=$call_socket COORDINATOR_FLAGS="--shared_memory $server_flags" WORKER_FLAGS="--backend=cuda $server_flags" \
    SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench PORT=${PORT:-50197} bash tools/service_bench.sh \
    --local=cuda --presets="$B/presets.json" --check=last --iters="${ITERS:-60}" "$@" 2>&1 |
    grep -v "^#" | grep -v concurrency | sed "s/^/$label $hop /"
}
cases=("cuda_ipc --only=deepseek-v3-up --activations=cuda_ipc --returned"
       "kept --only=small-decode --activations=resident"
       "fp8 --only=deepseek-v3-up --activations=resident --op=fp8")
if [[ -n ${CASES:-} ]]; then  # "NAME FLAGS...;NAME FLAGS...": these cases instead
  IFS=';' read -r -a cases <<<"$CASES"
fi
HOPS=${HOPS:-grpc frames}
echo "# columns: place case hop round preset local_us d2h_us server50 server90 worker50 worker90 rtt50 rtt90 ratio added_us h2d d2h check"
for ((round = 1; round <= ${ROUNDS:-3}; round++)); do
  for c in "${cases[@]}"; do
    read -r name flags <<<"$c"
    for hop in $HOPS; do
      settings=${SETTINGS:-split split+bench}
      [[ $round == "${ROUNDS:-3}" ]] && settings="$settings ${LAST_SETTINGS:-free}"
      for place in $settings; do
        # shellcheck disable=SC2086
        case $place in
          split) COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 bench "split $name r$round" $hop --busy_poll=2ms $flags ;;
          split+bench) COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 bench "split+bench $name r$round" $hop \
                         --busy_poll=2ms $flags --busy_poll=2ms ;;
          free) bench "free $name r$round" $hop "" $flags ;;
          free+poll) bench "free+poll $name r$round" $hop --busy_poll=2ms $flags ;;
          *) echo "unknown setting $place (split, split+bench, free, free+poll)" >&2; exit 2 ;;
        esac
      done
    done
  done
done
