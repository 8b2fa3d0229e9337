#!/bin/bash
# Nsight Compute on the grouped quantize kernels (mixtral-8x7b-up, the bench's
# first preset): one report per kernel, the stall and memory sections as text,
# the reports themselves for the source view. Bundle as quantize_gpu.sh says.
#   KERNELS="QuantizeKernelILi0ELi2ELi0ELb0E" (mangled names) bash tools/gpu/quantize_profile.sh
# ONLY=small-decode,one-tile: other presets (quantize_bench --only). TABLE=1:
# first, every kernel of one call per bench row of those presets
# (quantize_bench --profile) in a table of duration, traffic and occupancy.
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/quant}
LOG=${OUT:-/tmp/quantize_profile}
mkdir -p "$LOG"
export LD_LIBRARY_PATH=$PWD/$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
ONLY_ARGS=()
[ -n "${ONLY:-}" ] && ONLY_ARGS=(--only "$ONLY")
if [ -n "${TABLE:-}" ]; then
  "$NCU" --clock-control none --profile-from-start off --csv --page raw --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    --log-file "$LOG/table.csv" "$B/bin/quantize_bench" --profile "${ONLY_ARGS[@]}" >"$LOG/table.bench.txt" 2>&1
  echo "table rc=$? ($(( $(grep -c '^"' "$LOG/table.csv") - 2 )) kernels)"
fi
IFS=';' read -ra KS <<<"${KERNELS:-AmaxKernelILi0E;QuantizeKernelILi0ELi0ELi0ELb0E;QuantizeKernelILi0ELi2ELi0ELb0E;QuantizeKernelILi0ELi1ELi0ELb0E}"
i=0
for k in "${KS[@]}"; do
  i=$((i + 1))
  echo "== $k"
  "$NCU" --clock-control none --kernel-name-base mangled -k "regex:${k}" -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters \
    --import-source yes -o "$LOG/k$i" -f "$B/bin/quantize_bench" --iters 3 "${ONLY_ARGS[@]}" >"$LOG/k$i.run.log" 2>&1
  "$NCU" --import "$LOG/k$i.ncu-rep" --print-details all 2>&1 | tee "$LOG/k$i.txt" | \
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|stall|Executed Ipc A|Block Limit" | head -60
done
# Per-line stalls of the quantize kernels (SASS).
for f in "$LOG"/k*.ncu-rep; do
  "$NCU" --import "$f" --page source --csv --print-source sass >"${f%.ncu-rep}.src.csv" 2>&1 || true
done
[ -n "${KEEP_REPORTS:-}" ] || rm -f "$LOG"/*.ncu-rep "$LOG"/*.run.log
ls -la "$LOG"
