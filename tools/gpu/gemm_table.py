#!/usr/bin/env python3
"""Joins grouped_gemm_bench's JSON lines with peer_grouped_mm.py's and prints
a markdown table: ours, torch._grouped_mm, dense, ours/torch, and the
geometric mean of the ratio over the presets ([G,N,K] rhs, as the peer).
  gemm_table.py ours.jsonl peer.jsonl
"""
import json, math, sys

ours = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peer = {}
for l in open(sys.argv[2]):
    l = l.strip()
    if l.startswith("{"):
        j = json.loads(l)
        peer[j["preset"]] = j

def fmt(x):
    return "-" if x is None or x < 0 else f"{x:.1f}"

print("| preset | ours [G,N,K] | strategy | torch._grouped_mm | dense BF16 | ours/torch | ours [G,K,N] | ours unbalanced (strategy) | ours device sizes (strategy) | per strategy [G,N,K]: lt_loop / lt_graph / lt_batched / grouped_batched / sm90 | check |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
ratios = []
for name in dict.fromkeys(o["preset"] for o in ours):
    v = {o["variant"]: o for o in ours if o["preset"] == name}
    main = v.get("[G,N,K]")
    p = peer.get(name, {})
    t = p.get("torch_grouped_mm_bf16_tflops")
    d = p.get("dense_bf16_tflops")
    r = main["ours_tflops"] / t if main and t else None
    if r:
        ratios.append(r)
    st = main.get("strategies", {}) if main else {}
    per = " / ".join(fmt(st.get(k)) for k in ["lt_loop", "lt_loop_graph", "lt_batched", "grouped_batched", "sm90"])
    def var(key):
        x = v.get(key)
        return f"{fmt(x['ours_tflops'])} ({x['strategy']})" if x else "-"
    ok = all(x.get("ok") for x in v.values())
    print(f"| {name} | {fmt(main['ours_tflops']) if main else '-'} | {main['strategy'] if main else '-'} | {fmt(t)} | {fmt(d)} | "
          f"{r:.2f}x | {fmt(v['[G,K,N]']['ours_tflops']) if '[G,K,N]' in v else '-'} | {var('unbalanced')} | {var('dev-sizes')} | {per} | {'ok' if ok else 'FAIL'} |"
          if r else f"| {name} | missing |")
if ratios:
    g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print(f"\ngeometric mean ours/torch over {len(ratios)} presets: {g:.3f}x; min {min(ratios):.2f}x")
