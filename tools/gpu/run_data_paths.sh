#!/usr/bin/env bash
# On the H200: how a request's activations reach the workers, one run, one
# CUDA worker: lhs resident with the output kept (the floor), lhs inline in
# every request with the output returned through the coordinator, and lhs
# and output in POSIX shared memory the worker maps (coordinator
# --shared_memory), and the direct path (lhs staged on the worker, the output
# fetched from it). Bundle: bash tools/gpu/bundle_service.sh
#   bash tools/gpu/run_data_paths.sh .gpu_bundle/svc
# PRESETS (default 'small-decode deepseek-v3-up'), ITERS.
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
for preset in ${PRESETS:-small-decode deepseek-v3-up}; do
  for mode in "resident" "inline --returned" "shared_memory --returned" "cuda_ipc --returned" "direct --returned" "resident --returned"; do
    SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench WORKER_FLAGS=--backend=cuda \
      COORDINATOR_FLAGS=--shared_memory PORT=50193 bash tools/service_bench.sh --local=cuda \
      --presets="$B/presets.json" --iters="${ITERS:-10}" --only="$preset" --activations=$mode 2>&1 |
      grep -v "^#" | sed "s/^/${mode// /_} /"
  done
done
