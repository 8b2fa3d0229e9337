#!/usr/bin/env bash
# On the H200: the service benchmark sweep (tools/bench/sweep.py) with one
# CUDA worker: every data path (inline, shared memory, resident; direct once
# the bench has it) at each concurrency, the raw gRPC stream moving the same
# bytes, and the pinned H2D / D2H copies of them (the CUDA local op), in one
# run. Bundle (here):
#   bash tools/gpu/bundle_service.sh        # -> .gpu_bundle/svc
# Run there, from the repository root:
#   bash tools/gpu/run_sweep.sh .gpu_bundle/svc
# Writes $OUT/sweep_small (small-decode, concurrency 1-64) and $OUT/sweep_large
# (deepseek-v3-up, concurrency 1-8: an inline call carries 352 MiB, 224 in and
# 128 out, and each level's calls are all in flight at once): sweep.json and the
# PNGs each (where matplotlib is missing there, draw them here with
# python3 tools/bench/sweep.py --replot=sweep.json --out=DIR).
# SMALL_LEVELS, LARGE_LEVELS, SMALL_ITERS (10), LARGE_ITERS (5), PATHS; the
# servers' logs and the benches' JSON lines go to $LOGS (/tmp/sweep_logs).
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
OUTDIR=${OUT:-/tmp/sweep}
mkdir -p "$OUTDIR"
export SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench TRANSPORT_BENCH=$B/bin/shardgemm-transport-bench
export WORKER_FLAGS=--backend=cuda
paths=${PATHS:-inline,shared_memory,cuda_ipc,resident,resident_returned,direct}
rc=0
python3 tools/bench/sweep.py --presets="$B/presets.json" --only=small-decode --local=cuda --paths="$paths" \
  --concurrency="${SMALL_LEVELS:-1,2,4,8,16,32,64}" --iters="${SMALL_ITERS:-10}" --warmup=2 --run_timeout_s=300 \
  --markdown --out="$OUTDIR/sweep_small" --logs="${LOGS:-/tmp/sweep_logs}" || rc=1
python3 tools/bench/sweep.py --presets="$B/presets.json" --only=deepseek-v3-up --local=cuda --paths="$paths" \
  --concurrency="${LARGE_LEVELS:-1,2,4,8}" --iters="${LARGE_ITERS:-5}" --warmup=1 --run_timeout_s=300 \
  --markdown --out="$OUTDIR/sweep_large" --logs="${LOGS:-/tmp/sweep_logs}" || rc=1
exit $rc
