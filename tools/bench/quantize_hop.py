#!/usr/bin/env python3
"""GroupedQuantize through the Python client on gRPC against the same calls
on the coordinator's --call_socket, alternated ROUNDS times in one run.

Starts a coordinator (with --call_socket) and WORKERS CPU workers from
./bin on loopback, puts nothing (x travels inline: the call is small), then
per round times ITERS calls on each hop and prints one line per hop and
round: rows, bytes in, p50 / p90 round trip (µs), the server's p50 (the
response's server_seconds), and a count of wrong answers (each answer's
bytes against the first gRPC answer's).

  python3 tools/bench/quantize_hop.py --rows 512 --cols 128 --groups 8 --rounds 3 --iters 200
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import shardgemm  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fields(resp):
    return tuple(getattr(resp, f).data for f in ("rowwise_data", "scale_inv"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    if args.rows % args.groups:
        ap.error("--rows must be a multiple of --groups")
    d = tempfile.mkdtemp(prefix="sgq.")
    sock = os.path.join(d, "calls.sock")
    addr = f"127.0.0.1:{free_port()}"
    logs = open(os.path.join(d, "servers.log"), "w")
    procs = [subprocess.Popen([os.path.join(ROOT, "bin", "shardgemm-coordinator"), f"--listen={addr}",
                               f"--mesh=dp={args.workers}", "--insecure", f"--call_socket={sock}"],
                              stdout=logs, stderr=subprocess.STDOUT)]
    time.sleep(0.5)
    procs += [subprocess.Popen([os.path.join(ROOT, "bin", "shardgemm-worker"), f"--coordinator={addr}",
                                "--backend=cpu", "--insecure"], stdout=logs, stderr=subprocess.STDOUT)
              for _ in range(args.workers)]
    try:
        x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
        sizes = [args.rows // args.groups] * args.groups
        specs = dict(x_spec="(dp, None)" if args.workers > 1 else "", group_sizes_spec="")
        clients = {"grpc": shardgemm.Client(addr, timeout=30, path="inline"),
                   "frames": shardgemm.Client(addr, timeout=30, path="inline", call_socket=sock)}
        deadline = time.time() + 60
        while not clients["grpc"].cluster_info(timeout=5).ready:
            if time.time() > deadline:
                raise SystemExit("the mesh did not become ready")
            time.sleep(0.1)
        want = fields(clients["grpc"].grouped_quantize(x, sizes, **specs))
        print(f"# quantize {args.rows}x{args.cols} f32 -> e4m3, {args.groups} groups, {args.workers} worker(s), "
              f"{x.nbytes} bytes in; {args.iters} calls per hop and round after {args.warmup}")
        print(f"# {'round':>5} {'hop':>6} {'rtt50_us':>9} {'rtt90_us':>9} {'server50':>9} {'wrong':>5}")
        for r in range(1, args.rounds + 1):
            for hop, client in clients.items():
                rtt, server, wrong = [], [], 0
                for i in range(args.warmup + args.iters):
                    t0 = time.perf_counter()
                    resp = client.grouped_quantize(x, sizes, **specs)
                    took = time.perf_counter() - t0
                    if i >= args.warmup:
                        rtt.append(took * 1e6)
                        server.append(resp.server_seconds * 1e6)
                        wrong += fields(resp) != want
                q = statistics.quantiles(rtt, n=10)
                print(f"  {r:>5} {hop:>6} {statistics.median(rtt):9.1f} {q[8]:9.1f} "
                      f"{statistics.median(server):9.1f} {wrong:>5}", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
        logs.close()


if __name__ == "__main__":
    main()
