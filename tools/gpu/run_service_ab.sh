#!/usr/bin/env bash
# On the H200: an earlier build's servers against today's under the same
# service bench, alternated ROUNDS times in one run (tools/service_alternate.sh),
# one CUDA worker, output kept; then today's FP8 ops. Bundle (here):
#   bash tools/gpu/bundle_service.sh            # today's -> .gpu_bundle/svc
#   ../shared/tools/bundle-for-gpu .gpu_bundle/base OLD/shardgemm-coordinator OLD/shardgemm-worker
#   tar cf - -C .gpu_bundle svc base/bin | xz -T2 > .gpu_bundle/ab.tar.xz   # carry this
# Run there, from the repository root:
#   tar xJf .gpu_bundle/ab.tar.xz -C .gpu_bundle && bash tools/gpu/run_service_ab.sh
# PRESETS (substrings, default 'deepseek-v3-up small-decode'), ROUNDS, ITERS.
# BASE_BIN (default .gpu_bundle/base/bin) may be today's servers too, with
# BASE_COORDINATOR_FLAGS / BASE_WORKER_FLAGS turning a feature off, e.g.
#   BASE_BIN=.gpu_bundle/svc/bin BASE_COORDINATOR_FLAGS=--worker_step_socket=false
# FP8=0 skips the FP8 ops.
set -uo pipefail
S=.gpu_bundle/svc
export LD_LIBRARY_PATH=$PWD/$S/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
mkdir -p bin && cp $S/bin/* bin/
rc=0
for p in ${PRESETS:-deepseek-v3-up small-decode}; do
  BASE_BIN=${BASE_BIN:-.gpu_bundle/base/bin} WORKER_FLAGS=--backend=cuda \
    BASE_WORKER_FLAGS=${BASE_WORKER_FLAGS:---backend=cuda} PORT=50181 \
    ROUNDS=${ROUNDS:-3} bash tools/service_alternate.sh --local=cuda --presets=$S/presets.json --only=$p \
    --iters=${ITERS:-100} || rc=1
done
[ "${FP8:-1}" = 0 ] && exit $rc
for extra in "" --fp8_scaling=block; do
  SERVER_BIN=bin WORKER_FLAGS=--backend=cuda PORT=50182 bash tools/service_bench.sh --local=cuda --op=fp8 $extra \
    --presets=$S/presets.json --iters=${ITERS:-100} || rc=1
done
exit $rc
