#!/usr/bin/env bash
# On a machine with several GPUs: the collective benches (issue 7), NCCL alone
# (--backend=nccl) beside our worker layer (--backend=ours_nccl: host tensors
# in and out, as a worker's step calls it) on the same GPUs and sizes, 1 MiB to
# 1 GiB by 4x, and for all_gather also our layer's device path
# (--backend=ours_nccl_device: AllGatherDevice on device buffers, how a CUDA
# worker gathers an FSDP weight for its GEMM); then the busbw columns side by side. Writes to stdout and,
# when $OUT is set, to $OUT/collective_bench.txt. Exit 1 if any output element
# was wrong or a run failed.
#   bash tools/gpu/run_collective_bench.sh [BUNDLE_DIR=.gpu_bundle/coll] [NGPUS=all]
# dtypes are the service's: the FSDP weight all-gather moves bf16 weights;
# all-reduce and reduce-scatter reduce FP32 partial sums. ITERS / WARMUP override.
set -uo pipefail
B=${1:-.gpu_bundle/coll}
N=${2:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [[ ! -x $B/bin/all_gather_bench ]]; then
  echo "run_collective_bench: no bundle at $B (build it with tools/gpu/build_collective_bundle.sh)" >&2; exit 2
fi
if [[ $N -lt 2 ]]; then
  echo "run_collective_bench: needs 2 or more GPUs, found $N (nvidia-smi -L)" >&2; exit 2
fi
B=$(cd "$B" && pwd)
export LD_LIBRARY_PATH=$B/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
work=$(mktemp -d)
log=$work/all.txt
[[ -n ${OUT:-} ]] && mkdir -p "$OUT" && log=$OUT/collective_bench.txt
: >"$log"
say() { echo "$@" | tee -a "$log"; }

say "# collective benches on $N GPUs, $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi -L 2>&1 | head -n "$N" | sed 's/^/#   /' | tee -a "$log"
nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1 | sed 's/^/#   driver /' | tee -a "$log"
nvidia-smi topo -m 2>&1 | sed 's/^/#   /' | tee -a "$log"
fail=0
backends_for() { [[ $1 == all_gather ]] && echo "nccl ours_nccl ours_nccl_device" || echo "nccl ours_nccl"; }
for run in "all_gather bf16" "all_reduce f32" "reduce_scatter f32"; do
  set -- $run
  for backend in $(backends_for "$1"); do
    say ""
    say "######## $1 --backend=$backend --dtype=$2 --ranks=$N"
    "$B/bin/$1_bench" --backend=$backend --ranks="$N" --dtype="$2" --min_bytes=1048576 \
        --max_bytes=1073741824 --step_factor=4 --iters="${ITERS:-20}" --warmup="${WARMUP:-5}" \
        2>&1 | tee "$work/$1.$backend.txt" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    [[ $rc -ne 0 ]] && { say "######## $1 $backend: exit $rc"; fail=1; }
  done
done

say ""
say "######## busbw (GB/s), NCCL alone beside our layer, $N GPUs"
# Columns: nccl, then each of our backends with its busbw as a percentage of nccl's.
for c in all_gather all_reduce reduce_scatter; do
  say ""
  say "$c"
  files=() j=0  # f=J before each file: an empty file (a failed run) keeps its column
  for backend in $(backends_for "$c"); do files+=("f=$((++j))" "$work/$c.$backend.txt"); done
  awk -v names="$(backends_for "$c")" '
       /^ +[0-9]/ { bw[f, $1] = $6; if (f == 1) order[++n] = $1 }
       END {
         k = split(names, name, " ")
         printf "  %12s %12s", "size(B)", name[1]
         for (j = 2; j <= k; j++) printf " %16s %6s", name[j], "%nccl"
         printf "\n"
         for (i = 1; i <= n; i++) {
           s = order[i]; a = bw[1, s]
           printf "  %12s %12s", s, a
           for (j = 2; j <= k; j++) {
             o = bw[j, s]
             printf " %16s %5s%%", (o == "" ? "-" : o), (a > 0 && o != "" ? sprintf("%.0f", 100 * o / a) : "-")
           }
           printf "\n"
         }
       }' "${files[@]}" | tee -a "$log"
done
say ""
say "collective benches: $([[ $fail -eq 0 ]] && echo PASS || echo FAIL)"
rm -rf "$work"
exit $fail
