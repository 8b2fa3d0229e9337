#!/usr/bin/env bash
# On the H200: the service benchmark (bin/shardgemm-service-bench) over the
# presets with one CUDA worker, output kept resident and then returned, after
# the e2e checks. Bundle (here):
#   bash tools/gpu/bundle_service.sh        # -> .gpu_bundle/svc
# Run there, from the repository root:
#   bash tools/gpu/run_service_bench.sh .gpu_bundle/svc
# Result lines go to stdout and, as JSON lines, to $OUT/service_bench.jsonl.
# MODES='kept returned' (default) picks the bench's modes, OPS='gemm fp8 fp8-block' its ops
# (default gemm), ITERS its calls.
set -uo pipefail
B=${1:-.gpu_bundle/svc}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
OUTDIR=${OUT:-/tmp/service_bench}
mkdir -p "$OUTDIR"
rc=0
bash tools/gpu/run_e2e.sh "$B" >"$OUTDIR/e2e.log" 2>&1 || rc=1
grep -E "^==|matches|error|FAIL|e2e:" "$OUTDIR/e2e.log" | tail -40
for op in ${OPS:-gemm}; do
  for mode in ${MODES:-kept returned}; do
    extra=()
    [ $mode = returned ] && extra=(--returned)
    # fp8-block: the 1x128 x 128x128 recipe of --op=fp8.
    bench_op=$op
    [ $op = fp8-block ] && extra+=(--fp8_scaling=block) && bench_op=fp8
    SERVER_BIN=$B/bin BENCH=$B/bin/shardgemm-service-bench WORKER_FLAGS=--backend=cuda PORT=50181 \
      bash tools/service_bench.sh --local=cuda --op=$bench_op --presets="$B/presets.json" --iters="${ITERS:-30}" \
      --json="$OUTDIR/service_bench.jsonl" "${extra[@]}" || rc=1
  done
done
exit $rc
