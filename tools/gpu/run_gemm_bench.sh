#!/usr/bin/env bash
# On the H200 machine, from the repo root, with .gpu_bundle/gemm carried:
# runs our grouped-GEMM bench and then the peer script (torch._grouped_mm) in
# the same command, and prints them side by side with the ratio and the
# geometric mean of ours / torch over the presets.
#   tools/gpu/run_gemm_bench.sh [OUT_DIR]
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/gemm}
OUTD=${1:-${OUT:-/tmp}}
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
date -u +"# %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true
# The peer runs before and after ours (the table keeps torch's better figure
# of the two, so clock drift during the run cannot favour us).
export PYTHONUNBUFFERED=1
python3 "$B/peer_grouped_mm.py" --presets "$B/presets.json" | tee "$OUTD/peer.jsonl"
"$B/bin/grouped_gemm_bench" --presets "$B/presets.json" --json "$OUTD/ours.jsonl"
rc=$?
python3 "$B/peer_grouped_mm.py" --presets "$B/presets.json" | tee -a "$OUTD/peer.jsonl"
python3 "$(dirname "$0")/peer_unbalanced.py" "$OUTD/ours.jsonl" | tee -a "$OUTD/peer.jsonl"
python3 "$(dirname "$0")/gemm_table.py" "$OUTD/ours.jsonl" "$OUTD/peer.jsonl" | tee "$OUTD/table.md"
exit $rc
