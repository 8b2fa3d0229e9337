#!/usr/bin/env python3
"""torch._grouped_mm (BF16, rhs [G,N,K] transposed as in peer_grouped_mm.py)
on the unbalanced group sizes that grouped_gemm_bench used (its --json
output), timed the same way as the peer script. One JSON line per preset.
  peer_unbalanced.py ours.jsonl
"""
import json, sys
import torch

def bench(fn, iters=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters / 1e3

for line in open(sys.argv[1]):
    o = json.loads(line)
    if o["variant"] != "unbalanced":
        continue
    sizes = o["sizes"]
    G, K, N, M = len(sizes), o["k"], o["n"], sum(sizes)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.tensor(sizes, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    t = bench(lambda: torch._grouped_mm(a, w, offs=offs))
    print(json.dumps({"preset": o["preset"], "torch_unbalanced_tflops": round(2.0 * M * K * N / t / 1e12, 1)}),
          flush=True)
