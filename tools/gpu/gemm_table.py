#!/usr/bin/env python3
"""Joins grouped_gemm_bench's JSON lines (one file per round) with the peer
scripts' and prints markdown tables: per preset each side's median over its
rounds (the headline ratio is median / median), each side's best, every
round's figure, the strategy and cuBLASLt algorithm auto ran, and the
geometric mean of the ratio over the presets (rhs [G,N,K], as the peer
script); then every strategy (round 1, the full round), the unbalanced-routing
variant against torch on the same sizes, and the algorithm each round picked.
  gemm_table.py peer.jsonl ours.1.jsonl [ours.2.jsonl ...]
Files are told apart by content (our lines have a "variant"), so the order of
the arguments does not matter beyond the rounds' order among our files.
"""
import json, math, statistics, sys

ours_rounds = []   # one list of records per file of ours
peer = {}          # preset -> key -> [values in file order]
for path in sys.argv[1:]:
    recs = []
    for l in open(path):
        l = l.strip()
        if not l.startswith("{"):
            continue
        j = json.loads(l)
        if "variant" in j:
            recs.append(j)
            continue
        d = peer.setdefault(j.get("preset", "?"), {})
        for k, v in j.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "flops":
                d.setdefault(k, []).append(v)
    if recs:
        ours_rounds.append(recs)


def fmt(x):
    return "-" if x is None or x < 0 else f"{x:.1f}"


def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def med(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return statistics.median(xs) if xs else None


def best(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return max(xs) if xs else None


def rounds_str(xs):
    return " / ".join(fmt(x) for x in xs)


# (preset, variant) -> [record per round]
by = {}
names = []
for recs in ours_rounds:
    for o in recs:
        by.setdefault((o["preset"], o["variant"]), []).append(o)
        if o["preset"] not in names:
            names.append(o["preset"])


def ours_vals(name, variant):
    return [o["ours_tflops"] for o in by.get((name, variant), [])]


def full(name, variant):
    """The round that timed every strategy (round 1), else the first."""
    rs = by.get((name, variant), [])
    for o in rs:
        if not o.get("only_auto"):
            return o
    return rs[0] if rs else None


nr = len(ours_rounds)
print(f"{nr} round(s) of ours; each side's figure is the median over its rounds (best in brackets)\n")
print("| preset | ours | torch._grouped_mm | ours/torch | best/best | ours per round | torch per round | dense BF16 "
      "| strategy | ours, rhs [G,K,N] | ours, sizes on device only (strategy) | check |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
ratios, best_ratios = [], []
for name in names:
    ov = ours_vals(name, "[G,N,K]")
    p = peer.get(name, {})
    tv = p.get("torch_grouped_mm_bf16_tflops", [])
    om, tm = med(ov), med(tv)
    if not om or not tm:
        print(f"| {name} | {fmt(om)} | missing | | | | | | | | | |")
        continue
    r, rb = om / tm, best(ov) / best(tv)
    ratios.append(r)
    best_ratios.append(rb)
    strategies = sorted({o["strategy"] for o in by[(name, "[G,N,K]")]})
    kn = med(ours_vals(name, "[G,K,N]"))
    dvr = by.get((name, "dev-sizes"), [])
    dv = med([o["ours_tflops"] for o in dvr])
    dvs = "/".join(sorted({o["strategy"] for o in dvr}))
    ok = all(o.get("ok") for (n, _), rs in by.items() if n == name for o in rs)
    print(f"| {name} | {fmt(om)} ({fmt(best(ov))}) | {fmt(tm)} ({fmt(best(tv))}) | **{r:.2f}x** | {rb:.2f}x | "
          f"{rounds_str(ov)} | {rounds_str(tv)} | {fmt(med(p.get('dense_bf16_tflops', [])))} | "
          f"{'/'.join(strategies)} | {fmt(kn)} | {fmt(dv) + ' (' + dvs + ')' if dvr else '-'} | "
          f"{'ok' if ok else 'FAIL'} |")
if ratios:
    print(f"\ngeometric mean ours/torch (medians) over {len(ratios)} presets: {geo(ratios):.3f}x; "
          f"lowest {min(ratios):.3f}x; every preset >= 1.0x: {'yes' if min(ratios) >= 1.0 else 'no'}")
    print(f"geometric mean, best against best: {geo(best_ratios):.3f}x; lowest {min(best_ratios):.3f}x")

print("\nEvery strategy, rhs [G,N,K], TFLOP/s (round 1; - = cannot run the shape):\n")
cols = ["lt_loop", "lt_loop_1stream", "lt_loop_graph", "lt_batched", "grouped_batched", "sm90", "sm90_n128", "sm90_n256",
        "sm90_n256_cluster2", "auto_first", "auto_last"]
print("| preset | " + " | ".join(cols) + " |")
print("|---|" + "---|" * len(cols))
for name in names:
    o = full(name, "[G,N,K]")
    if o:
        st = o.get("strategies", {})
        print(f"| {name} | " + " | ".join(fmt(st.get(c)) for c in cols) + " |")

print("\nUnbalanced routing (same rows, group sizes 0.25x-4x the mean, rhs [G,N,K]; medians over rounds):\n")
print("| preset | ours | strategy | torch._grouped_mm, same sizes | ours/torch | ours per round | torch per round "
      "| sm90 | lt_loop | grouped_batched |")
print("|---|---|---|---|---|---|---|---|---|---|")
ur = []
for name in names:
    rs = by.get((name, "unbalanced"))
    if not rs:
        continue
    ov = [o["ours_tflops"] for o in rs]
    tv = peer.get(name, {}).get("torch_unbalanced_tflops", [])
    om, tm = med(ov), med(tv)
    r = om / tm if om and tm else None
    if r:
        ur.append(r)
    st = (full(name, "unbalanced") or {}).get("strategies", {})
    strategies = "/".join(sorted({o["strategy"] for o in rs}))
    print(f"| {name} | {fmt(om)} | {strategies} | {fmt(tm)} | {f'{r:.2f}x' if r else '-'} | {rounds_str(ov)} | "
          f"{rounds_str(tv)} | {fmt(st.get('sm90'))} | {fmt(st.get('lt_loop'))} | {fmt(st.get('grouped_batched'))} |")
if ur:
    print(f"\ngeometric mean ours/torch, unbalanced: {geo(ur):.3f}x; lowest {min(ur):.2f}x")

print("\nWhat auto ran (cuBLASLt algorithm of the largest group's call and how it was tuned), per round:\n")
for name in names:
    for variant in ("[G,N,K]", "[G,K,N]", "dev-sizes"):
        for o in by.get((name, variant), []):
            algo = o.get("algo", "")
            if algo:
                print(f"- {name} {variant} round {o.get('round', '?')}: {o['strategy']} "
                      f"{fmt(o['ours_tflops'])} TFLOP/s: {algo}")
print("\nRound 1, the algorithm each strategy ran on rhs [G,N,K]:\n")
for name in names:
    o = full(name, "[G,N,K]")
    if o and o.get("algos"):
        for k, v in sorted(o["algos"].items()):
            if not k.startswith("sm90"):
                print(f"- {name} {k}: {v}")
