#!/usr/bin/env bash
# On the H200 host: what the worker's step socket buys, against the same
# build sending steps as gRPC calls (--worker_step_socket=false), alternated
# ROUNDS times in one run, one CUDA worker, everything resident, output kept:
# each process on a core of its own with both servers' --busy_poll=2ms
# ("split"), and unpinned on idle cores ("free"); then one traced run of
# each hop (tools/trace_timeline.py). Bundle (here):
#   bash tools/gpu/bundle_service.sh && tar cf - -C .gpu_bundle svc | xz -T2 > .gpu_bundle/svc.tar.xz
# Run there, from the repository root:
#   tar xJf .gpu_bundle/svc.tar.xz -C .gpu_bundle && bash tools/gpu/run_step_socket_probe.sh
# PRESETS (default 'small-decode deepseek-v3-up'), OPS (default 'gemm fp8'), ITERS, ROUNDS.
set -uo pipefail
B=${B:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
hop_flags() { [[ $1 == grpc ]] && echo --worker_step_socket=false || echo ""; }
bench() {  # PRESET OP LABEL HOP SERVER_FLAGS [COORDINATOR_FLAGS WORKER_FLAGS], with the CPUS variables of tools/service_bench.sh
  COORDINATOR_FLAGS="$(hop_flags "$4") $5 ${6:-}" WORKER_FLAGS="--backend=cuda $5 ${7:-}" SERVER_BIN=$B/bin \
    BENCH=$B/bin/shardgemm-service-bench PORT=${PORT:-50191} bash tools/service_bench.sh --local=cuda \
    --presets="$B/presets.json" --iters="${ITERS:-80}" --only="$1" --op="$2" 2>&1 | grep -v "^#" | grep -v concurrency |
    sed "s/^/$3 /"
}
echo "# columns: label hop round preset local_us d2h_us server50 server90 worker50 worker90 rtt50 rtt90 ratio added_us h2d d2h check"
for op in ${OPS:-gemm fp8}; do
  for preset in ${PRESETS:-small-decode deepseek-v3-up}; do
    [[ $op == fp8 && $preset == small-decode ]] && continue
    for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
      for hop in grpc socket; do
        COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 bench "$preset" $op "split $op $hop r$round" $hop --busy_poll=2ms
        bench "$preset" $op "free  $op $hop r$round" $hop ""
      done
    done
  done
done
for hop in grpc socket; do
  echo "## traced, small-decode, split, $hop"
  logs=$(mktemp -d)
  LOGS=$logs COORDINATOR_CPUS=2 WORKER_CPUS=3 BENCH_CPUS=4 bench small-decode gemm "traced $hop" $hop \
    "--busy_poll=2ms --log_format=json" --trace_requests --trace_steps >/dev/null
  python3 tools/trace_timeline.py --skip=20 --coordinator="$logs/coordinator.log" "$logs/worker0.log" 2>&1 | tail -30
done
