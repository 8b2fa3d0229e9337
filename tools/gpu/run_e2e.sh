#!/usr/bin/env bash
# On the GPU machine: a coordinator and one CUDA worker through gRPC, grouped
# GEMMs checked against the CPU reference. Run from the repository root with
# the bundle made by tools/gpu/bundle_e2e.sh:
#   bash tools/gpu/run_e2e.sh .gpu_bundle/e2e
set -uo pipefail
B=${1:-.gpu_bundle/e2e}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
ADDR=127.0.0.1:50061
CLI="$B/bin/shardgemm --coordinator=$ADDR --insecure"  # loopback on a lent machine
$B/bin/shardgemm-coordinator --listen=$ADDR --mesh=dp=1 --insecure 2>/tmp/coordinator.log &
C=$!
$B/bin/shardgemm-worker --coordinator=$ADDR --backend=cuda --insecure 2>/tmp/worker.log &
W=$!
for _ in $(seq 100); do $CLI cluster 2>/dev/null | grep -q "(ready)" && break; sleep 0.2; done
$CLI cluster; cat /tmp/worker.log
fail=0
run() { echo "== shardgemm gemm $*"; $CLI gemm --show_plan=false "$@" || fail=1; }
run --lhs=4096x1024 --rhs=8x1024x512 --dtype=bf16 --groups=8 --check
run --lhs=4096x1024 --rhs=8x512x1024 --rhs_transposed --bias=8x512 --dtype=bf16 --groups=8 --check
run --lhs=1000x200 --rhs=3x200x136 --dtype=f16 --groups=3 --out_dtype=f32 --check
run --lhs=2048x256 --rhs=2048x128 --wgrad --dtype=bf16 --groups=8 --check
$CLI put experts --data=8x1024x512 --dtype=bf16 --seed=3 || fail=1
run --lhs=8192x1024 --rhs=resident:experts --dtype=bf16 --groups=8 --check
echo "== outputs kept in device memory, then read as an operand and through GetTensor"
$CLI put x --data=8192x1024 --dtype=bf16 --seed=5 || fail=1
$CLI put experts2 --data=8x512x256 --dtype=bf16 --seed=6 || fail=1
sizes8=1024,1024,1024,1024,1024,1024,1024,1024
$CLI gemm --show_plan=false --lhs=resident:x --rhs=resident:experts --group-sizes=$sizes8 --keep_as=y || fail=1
run --lhs=resident:y --rhs=resident:experts2 --group-sizes=$sizes8 --check
$CLI get y --out=/tmp/y.npy || fail=1
echo "== deepseek-v3-up shape through the service (timing; weights resident on the worker)"
$CLI put w --data=8x7168x4096 --dtype=bf16 || fail=1
for i in 1 2 3; do run --lhs=16384x7168 --rhs=resident:w --dtype=bf16 --group-sizes=2048,2048,2048,2048,2048,2048,2048,2048; done
echo "== small-decode shape through the service (G64 m64 K1024 N1024; weights resident)"
$CLI put wd --data=64x1024x1024 --dtype=bf16 || fail=1
sizes=$(printf '64,%.0s' $(seq 64)); sizes=${sizes%,}
for i in 1 2 3 4 5; do run --lhs=4096x1024 --rhs=resident:wd --dtype=bf16 --group-sizes=$sizes; done
kill $W $C; wait
echo "e2e: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
