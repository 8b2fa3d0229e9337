#!/usr/bin/env python3
"""Joins grouped_gemm_bench's JSON lines with the peer scripts' and prints a
markdown table: ours, torch._grouped_mm, dense, ours/torch, and the geometric
mean of the ratio over the presets (rhs [G,N,K], as the peer script). Where
the peer ran twice, torch's better figure is kept. A second table gives the
unbalanced-routing variant against torch on the same sizes.
  gemm_table.py ours.jsonl peer.jsonl
"""
import json, math, sys

ours = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peer = {}
for l in open(sys.argv[2]):
    l = l.strip()
    if not l.startswith("{"):
        continue
    j = json.loads(l)
    d = peer.setdefault(j["preset"], {})
    for k, v in j.items():
        if isinstance(v, (int, float)) and k != "flops":
            d[k] = max(d.get(k, v), v)

def fmt(x):
    return "-" if x is None or x < 0 else f"{x:.1f}"

def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")

names = list(dict.fromkeys(o["preset"] for o in ours))
by = {(o["preset"], o["variant"]): o for o in ours}
print("| preset | ours | strategy | torch._grouped_mm | dense BF16 | ours/torch | ours, rhs [G,K,N] | ours, sizes on device only (strategy) | check |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = []
for name in names:
    o = by.get((name, "[G,N,K]"))
    p = peer.get(name, {})
    t, d = p.get("torch_grouped_mm_bf16_tflops"), p.get("dense_bf16_tflops")
    if not o or not t:
        print(f"| {name} | missing | | | | | | | |")
        continue
    r = o["ours_tflops"] / t
    ratios.append(r)
    kn = by.get((name, "[G,K,N]"))
    dv = by.get((name, "dev-sizes"))
    ok = all(x.get("ok") for (n, _), x in by.items() if n == name)
    print(f"| {name} | {fmt(o['ours_tflops'])} | {o['strategy']} | {fmt(t)} | {fmt(d)} | {r:.2f}x | "
          f"{fmt(kn['ours_tflops']) if kn else '-'} | {fmt(dv['ours_tflops']) + ' (' + dv['strategy'] + ')' if dv else '-'} | "
          f"{'ok' if ok else 'FAIL'} |")
if ratios:
    print(f"\ngeometric mean ours/torch over {len(ratios)} presets: {geo(ratios):.3f}x; lowest {min(ratios):.2f}x")

print("\nEvery strategy, rhs [G,N,K], TFLOP/s (- = cannot run the shape):\n")
cols = ["lt_loop", "lt_loop_1stream", "lt_loop_graph", "lt_batched", "grouped_batched", "sm90", "sm90_n128", "sm90_n256",
        "sm90_n256_cluster2"]
print("| preset | " + " | ".join(cols) + " |")
print("|---|" + "---|" * len(cols))
for name in names:
    o = by.get((name, "[G,N,K]"))
    if o:
        st = o.get("strategies", {})
        print(f"| {name} | " + " | ".join(fmt(st.get(c)) for c in cols) + " |")

print("\nUnbalanced routing (same rows, group sizes 0.25x-4x the mean, rhs [G,N,K]):\n")
print("| preset | ours | strategy | torch._grouped_mm, same sizes | ours/torch | sm90 | lt_loop | grouped_batched |")
print("|---|---|---|---|---|---|---|---|")
ur = []
for name in names:
    o = by.get((name, "unbalanced"))
    t = peer.get(name, {}).get("torch_unbalanced_tflops")
    if not o:
        continue
    r = o["ours_tflops"] / t if t else None
    if r:
        ur.append(r)
    st = o.get("strategies", {})
    print(f"| {name} | {fmt(o['ours_tflops'])} | {o['strategy']} | {fmt(t)} | {f'{r:.2f}x' if r else '-'} | "
          f"{fmt(st.get('sm90'))} | {fmt(st.get('lt_loop'))} | {fmt(st.get('grouped_batched'))} |")
if ur:
    print(f"\ngeometric mean ours/torch, unbalanced: {geo(ur):.3f}x; lowest {min(ur):.2f}x")
