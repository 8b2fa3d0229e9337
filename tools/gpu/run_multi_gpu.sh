#!/usr/bin/env bash
# On a machine with several GPUs: the sharded plans on CUDA workers with NCCL
# (one worker per GPU), each checked against the CPU reference, and EP weak
# scaling through the service.   bash tools/gpu/run_multi_gpu.sh .gpu_bundle/e2e [NGPUS]
set -uo pipefail
B=${1:-.gpu_bundle/e2e}
N=${2:-$(nvidia-smi -L | wc -l)}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
ADDR=127.0.0.1:50071
CLI="$B/bin/shardgemm --coordinator=$ADDR --insecure"  # loopback on a lent machine
fail=0
pids=()
start() {  # start MESH WORKERS
  $B/bin/shardgemm-coordinator --listen=$ADDR --mesh="$1" --insecure 2>/tmp/coordinator.log &
  pids=($!)
  for ((i = 0; i < $2; i++)); do
    $B/bin/shardgemm-worker --coordinator=$ADDR --backend=${BACKEND:-cuda} --device=$i --collective_timeout_s=60 --insecure 2>/tmp/worker$i.log &
    pids+=($!)
  done
  for _ in $(seq 150); do $CLI cluster 2>/dev/null | grep -q "(ready)" && break; sleep 0.2; done
  echo; echo "######## mesh $1 on $2 CUDA workers"; $CLI cluster | tail -n +3
}
stop() { kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; }
run() { echo "== gemm $*"; $CLI gemm --show_plan=false "$@" || { fail=1; tail -3 /tmp/worker*.log; }; }
plan_kinds() { $CLI gemm --show_plan=true "$@" | grep -E "^ +[0-9]+\. " || true; }

start dp=$N $N
echo "== quantize, rows over dp, shared per-group scales (amax all-reduce-max over NCCL)"
$CLI quantize --x="4096x1024@(dp,None)" --group-sizes="$(printf '500,0,300,1000,%.0s' $(seq $N) | sed 's/,$//')@(dp,)" --dtype=bf16 --shared_scales --check --show_plan=false || fail=1
$CLI quantize --x="4096x1024@(dp,None)" --group-sizes="$(printf '500,0,300,1000,%.0s' $(seq $N) | sed 's/,$//')@(dp,)" --dtype=bf16 --format=e5m2 --check --show_plan=false || fail=1
run --lhs="2048x512@(dp,None)" --rhs=8x512x256 --group-sizes="$(printf '30,20,0,78,%.0s' $(seq $((2*N))) | sed 's/,$//')@(dp,)" --dtype=bf16 --check
stop
start fsdp=$N $N
plan_kinds --lhs="2048x512@(fsdp,None)" --rhs="8x512x256@(None,fsdp,None)" --groups=8 --group-sizes="$(printf '64,64,0,0,32,32,32,32,%.0s' $(seq $N) | sed 's/,$//')@(fsdp,)" --dtype=bf16 --check
run --lhs="2048x512@(None,fsdp)" --rhs="8x512x256@(None,fsdp,None)" --group-sizes=500,0,700,800,10,10,10,10 --dtype=bf16 --check
run --lhs="2048x512@(fsdp,None)" --rhs="2048x128@(fsdp,None)" --wgrad --group-sizes="$(printf '100,0,300,%.0s' $(seq $N) | sed 's/,$//')@(fsdp,)" --dtype=bf16 --check
run --lhs="2048x512@(fsdp,None)" --rhs="2048x128@(fsdp,None)" --wgrad --out_spec="(None,fsdp,None)" --group-sizes="$(printf '100,0,300,%.0s' $(seq $N) | sed 's/,$//')@(fsdp,)" --dtype=bf16 --check
stop
start ep=$N $N
run --lhs="2048x512@(ep,None)" --rhs="$((4*N))x512x256@(ep,None,None)" --group-sizes="$(printf '100,0,300,50,%.0s' $(seq $N) | sed 's/,$//')@(ep,)" --dtype=bf16 --check
stop
start tp=$N $N
run --lhs="2048x512@(None,tp)" --rhs="4x512x256@(None,tp,None)" --group-sizes=500,0,700,800 --dtype=bf16 --check
run --lhs="2048x512@(None,tp)" --rhs="4x512x256@(None,tp,None)" --out_spec="(None,tp)" --group-sizes=500,0,700,800 --dtype=bf16 --check
run --lhs=2048x512 --rhs="4x512x256@(None,None,tp)" --group-sizes=500,0,700,800 --dtype=bf16 --check
stop

echo; echo "######## EP weak scaling: deepseek-v3-up per GPU (G8 m2048 K7168 N4096), weights resident"
# Two ways in: activations sent with the request through the coordinator (x
# and out cross the coordinator), and activations resident on the workers with
# the output kept there (what a pipeline stage does); the slowest worker's
# step time is printed beside the server time.
for n in ${SCALING_SIZES-1 $N}; do
  start ep=$n $n
  $CLI put w --data=$((8*n))x7168x4096 --dtype=bf16 --spec="(ep,None,None)" >/dev/null || fail=1
  sizes=$(printf '2048,%.0s' $(seq $((8*n)))); sizes=${sizes%,}
  echo "== $n GPU(s), activations through the coordinator"
  for i in 1 2 3; do $CLI gemm --show_plan=false --lhs="$((16384*n))x7168@(ep,None)" --rhs=resident:w --group-sizes="$sizes@(ep,)" --dtype=bf16 | grep result; done
  $CLI put x --data=$((16384*n))x7168 --dtype=bf16 --spec="(ep,None)" >/dev/null || fail=1
  echo "== $n GPU(s), activations resident, output kept resident"
  for i in 1 2 3 4 5 6; do
    $CLI gemm --show_plan=false --lhs=resident:x --rhs=resident:w --group-sizes="$sizes@(ep,)" --keep_as=y$i | grep result || fail=1
    $CLI delete y$i >/dev/null
  done
  stop
done
echo "multi-gpu: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
