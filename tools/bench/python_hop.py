#!/usr/bin/env python3
"""The Python client's inline calls on gRPC against the same calls on the
coordinator's --call_socket, alternated ROUNDS times in one run:
GroupedQuantize of x (--op quantize), or GroupedGemm of x against weights
put resident once (--op gemm, [groups, cols, --out_cols]), or PutTensor of x
in its 1 MiB chunks (--op put, always on gRPC: its "frames" line is the
same call again; checked by reading x back after each line).

Starts a coordinator (with --call_socket) and WORKERS CPU workers from
./bin on loopback; x travels inline with each call. Per round it times
ITERS calls on each hop and prints one line per hop and round: p50 / p90
round trip (µs), the server's p50 (the response's server_seconds), and a
count of wrong answers (each answer's bytes against the first gRPC
answer's). --client_path runs another checkout's Python client (its
client/python, protos generated) against the same servers.

  python3 tools/bench/python_hop.py --rows 512 --cols 128 --groups 8 --rounds 3 --iters 200
  python3 tools/bench/python_hop.py --op gemm --rows 16384 --cols 128 --groups 8 --rounds 3 --iters 20
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fields(answer):
    if answer is None:  # a put's: checked by reading it back
        return None
    if isinstance(answer, tuple):  # grouped_gemm's (out, plan)
        return answer[0].tobytes()
    return tuple(getattr(answer, f).data for f in ("rowwise_data", "scale_inv"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("quantize", "gemm", "put"), default="quantize")
    ap.add_argument("--out_cols", type=int, default=16, help="--op gemm: the weights' output columns")
    ap.add_argument("--client_path", default=os.path.join(ROOT, "client", "python"),
                    help="the Python client's directory (default: this checkout's)")
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
    sys.path.insert(0, args.client_path)
    import shardgemm
    d = tempfile.mkdtemp(prefix="sgq.")
    sock = os.path.join(d, "calls.sock")
    addr = f"127.0.0.1:{free_port()}"
    logs = open(os.path.join(d, "servers.log"), "w")
    procs = [subprocess.Popen([os.path.join(ROOT, "bin", "shardgemm-coordinator"), f"--listen={addr}",
                               f"--mesh=dp={args.workers}", "--insecure", f"--call_socket={sock}",
                               "--max_message_mb=256"],
                              stdout=logs, stderr=subprocess.STDOUT)]
    time.sleep(0.5)
    procs += [subprocess.Popen([os.path.join(ROOT, "bin", "shardgemm-worker"), f"--coordinator={addr}",
                                "--backend=cpu", "--insecure"], stdout=logs, stderr=subprocess.STDOUT)
              for _ in range(args.workers)]
    try:
        x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
        sizes = [args.rows // args.groups] * args.groups
        specs = dict(x_spec="(dp, None)" if args.workers > 1 else "", group_sizes_spec="")
        clients = {"grpc": shardgemm.Client(addr, timeout=60, path="inline"),
                   "frames": shardgemm.Client(addr, timeout=60, path="inline", call_socket=sock)}
        deadline = time.time() + 60
        while not clients["grpc"].cluster_info(timeout=5).ready:
            if time.time() > deadline:
                raise SystemExit("the mesh did not become ready")
            time.sleep(0.1)
        if args.op == "gemm":
            w = np.random.default_rng(1).standard_normal((args.groups, args.cols, args.out_cols)).astype(np.float32)
            clients["grpc"].put("w", w, spec="(dp, None, None)" if args.workers > 1 else "")
            specs = dict(lhs_spec=specs["x_spec"], group_sizes_spec="")

            def call(client):
                return client.grouped_gemm(x, "w", sizes, **specs)

            what = f"gemm {args.rows}x{args.cols} f32 by resident [{args.groups}, {args.cols}, {args.out_cols}]"
        elif args.op == "put":
            def call(client):
                client.put("x", x, spec=specs["x_spec"], overwrite=True)
                return None

            what = f"put {args.rows}x{args.cols} f32"
        else:
            def call(client):
                return client.grouped_quantize(x, sizes, **specs)

            what = f"quantize {args.rows}x{args.cols} f32 -> e4m3"
        want = fields(call(clients["grpc"]))
        print(f"# {what}, {args.groups} groups, {args.workers} worker(s), {x.nbytes} bytes in; client "
              f"{args.client_path}; {args.iters} calls per hop and round after {args.warmup}")
        print(f"# {'round':>5} {'hop':>6} {'rtt50_us':>9} {'rtt90_us':>9} {'server50':>9} {'wrong':>5}")
        for r in range(1, args.rounds + 1):
            for hop, client in clients.items():
                rtt, server, wrong = [], [], 0
                for i in range(args.warmup + args.iters):
                    t0 = time.perf_counter()
                    answer = call(client)
                    took = time.perf_counter() - t0
                    if i >= args.warmup:
                        rtt.append(took * 1e6)
                        if answer is not None and not isinstance(answer, tuple):  # a quantize's answer
                            server.append(answer.server_seconds * 1e6)
                        wrong += fields(answer) != want
                if args.op == "put":
                    wrong += client.get("x").tobytes() != x.tobytes()
                q = statistics.quantiles(rtt, n=10)
                server50 = f"{statistics.median(server):9.1f}" if server else f"{'-':>9}"
                print(f"  {r:>5} {hop:>6} {statistics.median(rtt):9.1f} {q[8]:9.1f} {server50} {wrong:>5}", flush=True)
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
