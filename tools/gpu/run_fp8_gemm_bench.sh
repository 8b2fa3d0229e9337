#!/usr/bin/env bash
# On the H200 machine, from the repo root, with .gpu_bundle/fp8 carried
# (tools/gpu/build_fp8_bundle.sh makes it): times torch._scaled_grouped_mm
# (the peer script: FP8 E4M3, rowwise scales, BF16 out, no fast accumulation)
# and our FP8 grouped GEMM (fp8_grouped_gemm_bench: E4M3, per-group scales,
# BF16 out, FP32 promotion) in interleaved rounds, peer first in each (peer,
# ours, peer, ours), so clock drift over the run favours neither side. Round
# 1 of ours also times every tile configuration and the fast-accumulation
# routes; later rounds time ours and the cuBLASLt loop alone. Prints a
# markdown table: each side's median over its rounds (and every round's
# figure), ours / peer, and the cuBLASLt per-group loop beside them.
#   tools/gpu/run_fp8_gemm_bench.sh [OUT_DIR]
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/fp8}
OUTD=${1:-${OUT:-/tmp}}
ROUNDS=${ROUNDS:-2}
HERE=$(dirname "$0")
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
rm -f "$OUTD/fp8_peer.jsonl" "$OUTD"/fp8_ours.*.jsonl
date -u +"# %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
rc=0
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r: torch._scaled_grouped_mm ($(date -u +%H:%M:%S))"
  python3 "$HERE/warm_then_run.py" "$B/peer_grouped_mm.py" --presets "$B/presets.json" | tee -a "$OUTD/fp8_peer.jsonl"
  echo "# round $r: ours ($(date -u +%H:%M:%S))"
  only=""
  [ "$r" -gt 1 ] && only=--main-only
  "$B/bin/fp8_grouped_gemm_bench" --presets "$B/presets.json" --json "$OUTD/fp8_ours.$r.jsonl" --round "$r" $only
  brc=$?
  [ $brc -ne 0 ] && rc=$brc
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader || true
date -u +"# %Y-%m-%dT%H:%M:%SZ"
python3 - "$OUTD/fp8_peer.jsonl" "$OUTD"/fp8_ours.*.jsonl <<'PY' | tee "$OUTD/fp8_table.md"
import json, statistics, sys
peer, ours, block, order = {}, {}, {}, []
for path in sys.argv[1:]:
    for l in open(path):
        l = l.strip()
        if not l.startswith("{"):
            continue
        r = json.loads(l)
        name = r.get("preset")
        if "ours_tflops" in r:
            if r.get("mode", "tensor") == "block":
                block.setdefault(name, []).append(r)
                continue
            ours.setdefault(name, []).append(r)
            if name not in order:
                order.append(name)
        elif "torch_scaled_grouped_mm_fp8_tflops" in r:
            peer.setdefault(name, []).append(r)
med = lambda xs: statistics.median(xs) if xs else float("nan")
f = lambda xs: " / ".join("%.0f" % x for x in xs)
print("| preset | torch._scaled_grouped_mm (rounds) | ours (rounds) | ours / torch (medians) | tile | cuBLASLt loop (rounds) | dense FP8 (torch) | check: max rel err vs cuBLASLt, wrong |")
print("|---|---|---|---|---|---|---|---|")
for name in order:
    pt = [r["torch_scaled_grouped_mm_fp8_tflops"] for r in peer.get(name, [])]
    dn = [r.get("dense_fp8_tflops", float("nan")) for r in peer.get(name, [])]
    ot = [r["ours_tflops"] for r in ours[name]]
    lt = [r["lt_loop_tflops"] for r in ours[name]]
    chk = ", ".join("%.1e, %d" % (r["max_rel_err_vs_lt"], r["wrong_vs_lt"]) for r in ours[name])
    print("| %s | %s | %s | %.3f | %s | %s | %s | %s |" % (name, f(pt), f(ot), med(ot) / med(pt) if pt else float("nan"),
          ours[name][0]["ours_tile"], f(lt), f(dn), chk))
print()
print("Block scaling (1x128 lhs x 128x128 rhs, FP32 scales, promoted per 128-K block):")
print()
print("| preset | ours, block scales (rounds) | ours block / ours per-group (medians) | tile | cuBLASLt block-scaled loop (rounds) | check: max rel err vs cuBLASLt, wrong |")
print("|---|---|---|---|---|---|")
for name in order:
    if name not in block:
        continue
    bt = [r["ours_tflops"] for r in block[name]]
    ot = [r["ours_tflops"] for r in ours[name]]
    lt = [r["lt_loop_tflops"] for r in block[name]]
    chk = ", ".join("%.1e, %d" % (r["max_rel_err_vs_lt"], r["wrong_vs_lt"]) for r in block[name])
    print("| %s | %s | %.3f | %s | %s | %s |" % (name, f(bt), med(bt) / med(ot), block[name][0]["ours_tile"], f(lt), chk))
print()
def variants(title, recs):
    print(title)
    print()
    names = []
    for name in order:
        for v in recs.get(name, [{}])[0].get("variants", {}):
            if v not in names:
                names.append(v)
    print("| preset | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for name in order:
        if name not in recs:
            continue
        vs = recs[name][0].get("variants", {})
        print("| %s | " % name + " | ".join("%.0f (%.1e, %d)" % (vs[v]["tflops"], vs[v]["max_rel_err_vs_lt"], vs[v]["wrong_vs_lt"]) if v in vs else "-" for v in names) + " |")
    print()
variants("Round 1, every configuration of our kernel, per-group scales (TFLOP/s; max rel err vs cuBLASLt, wrong values on sampled rows):", ours)
variants("Round 1, block scales:", block)
PY
exit $rc
