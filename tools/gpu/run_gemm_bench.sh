#!/usr/bin/env bash
# On the H200 machine, from the repo root, with .gpu_bundle/gemm carried:
# times torch._grouped_mm (the peer script) and our grouped GEMM in three
# interleaved rounds, peer first in each (peer, ours, peer, ours, peer, ours),
# so clock drift over the run favours neither side; the table takes each
# side's median over its three figures (and shows the best). Round 1 of ours
# times every strategy; rounds 2 and 3 time auto alone. torch on our
# unbalanced group sizes (peer_unbalanced.py, which needs round 1's sizes)
# runs after each of our rounds. About 3-4 minutes on an H200.
#   tools/gpu/run_gemm_bench.sh [OUT_DIR]
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/gemm}
OUTD=${1:-${OUT:-/tmp}}
ROUNDS=${ROUNDS:-3}
HERE=$(dirname "$0")
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
rm -f "$OUTD/peer.jsonl" "$OUTD"/ours.*.jsonl
date -u +"# %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
rc=0
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r: torch._grouped_mm ($(date -u +%H:%M:%S))"
  python3 "$HERE/warm_then_run.py" "$B/peer_grouped_mm.py" --presets "$B/presets.json" | tee -a "$OUTD/peer.jsonl"
  if [ "$r" -gt 1 ]; then
    python3 "$HERE/warm_then_run.py" "$HERE/peer_unbalanced.py" "$OUTD/ours.1.jsonl" | tee -a "$OUTD/peer.jsonl"
  fi
  echo "# round $r: ours ($(date -u +%H:%M:%S))"
  only=""
  [ "$r" -gt 1 ] && only=--only-auto
  "$B/bin/grouped_gemm_bench" --presets "$B/presets.json" --json "$OUTD/ours.$r.jsonl" --round "$r" $only
  brc=$?
  [ $brc -ne 0 ] && rc=$brc
done
echo "# torch on our unbalanced sizes, after our last round ($(date -u +%H:%M:%S))"
python3 "$HERE/warm_then_run.py" "$HERE/peer_unbalanced.py" "$OUTD/ours.1.jsonl" | tee -a "$OUTD/peer.jsonl"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader || true
date -u +"# %Y-%m-%dT%H:%M:%SZ"
python3 "$HERE/gemm_table.py" "$OUTD/peer.jsonl" "$OUTD"/ours.*.jsonl | tee "$OUTD/table.md"
exit $rc
