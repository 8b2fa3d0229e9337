#!/usr/bin/env python3
"""The service benchmark sweep, in the manner of Triton's perf_analyzer.

Starts one mesh (a coordinator with --shared_memory and WORKERS workers on
loopback, as tools/service_bench.sh does, with its environment variables),
runs bin/shardgemm-service-bench over the presets for each data path and
each concurrency level (or request rate), and beside it, in the same run and
between the same two endpoints, bin/shardgemm-transport-bench moving the
same bytes over a raw gRPC stream (one message each way as the inline
GroupedGemm, and in the stream chunks of PutTensor / GetTensor). On CUDA each
service line also carries the pinned host-to-device and device-to-host
copies of the same bytes (PCIe's floor). Writes one JSON file (every result
line, the floors, what was skipped and why) and PNG plots per preset:
latency p50 / p99 against concurrency, throughput (calls/s and GB/s)
against concurrency, and a phase breakdown bar per path.

    python3 tools/bench/sweep.py --presets=tools/bench/cpu_presets.json --local=cpu \\
        --concurrency=1,2,4,8,16,32,64 --out=/tmp/sweep

Environment, as tools/service_bench.sh: SERVER_BIN (./bin), BENCH,
TRANSPORT_BENCH, MESH (dp=1), WORKERS (1), COORDINATOR_FLAGS, WORKER_FLAGS,
COORDINATOR_CPUS / WORKER_CPUS / BENCH_CPUS (taskset -c lists). Plaintext
(--insecure) only. Exit 1 when a run fails or any checked output is wrong.
Every wait is bounded: each bench run by --run_timeout_s, the mesh's and the
transport server's start by --start_timeout_s.
"""
import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The data paths the service bench offers: its flags for each. `needs` names
# an --activations mode the bench must know (read from its --helpfull), so a
# path another branch adds is run only by a bench that has it.
PATHS = {
    # lhs in every request, through the coordinator; the output back in the response.
    "inline": {"flags": ["--activations=inline", "--returned"]},
    # lhs and output in POSIX shared memory the workers map (coordinator --shared_memory).
    "shared_memory": {"flags": ["--activations=shared_memory", "--returned"]},
    # lhs resident, output kept resident: the service's floor (no tensor bytes move).
    "resident": {"flags": ["--activations=resident"]},
    # lhs resident, output returned through the coordinator.
    "resident_returned": {"flags": ["--activations=resident", "--returned"]},
    # lhs resident, output held on the workers (pinned on CUDA) and fetched
    # from them: the direct path's fetch alone.
    "resident_fetched": {"flags": ["--activations=resident", "--returned", "--output_path=direct"],
                         "needs_flag": "output_path"},
    # Client-direct transfers: the client streams each worker its blocks and
    # reads the outputs from them.
    "direct": {"flags": ["--activations=direct", "--returned"], "needs": "direct"},
    # lhs and output in CUDA allocations of the bench's, which CUDA workers of
    # the same host open (CUDA IPC) and use in place: only with --local=cuda.
    "cuda_ipc": {"flags": ["--activations=cuda_ipc", "--returned"], "needs": "cuda_ipc", "cuda_only": True},
}
DEFAULT_PATHS = "inline,shared_memory,resident,resident_fetched,direct"

# The raw stream's variants: its flags for the messages both ways.
TRANSPORT_VARIANTS = {
    "raw_stream": ["--chunk_bytes=0"],              # one message each way, as the inline GroupedGemm
    "raw_stream_chunked": ["--service_chunks"],     # the stream chunks of PutTensor / GetTensor
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cpus, cmd):
    return (["taskset", "-c", cpus] if cpus else []) + cmd


class Processes:
    """Processes this sweep started, stopped (SIGTERM, then SIGKILL after 10 s) on exit."""

    def __init__(self, logs):
        self.logs = logs
        self.procs = []

    def start(self, name, cmd):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p, log))
        return p

    def check_alive(self):
        for name, p, _ in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; its log: {self.logs}/{name}.log")

    def stop(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p, log in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            log.close()


def wait_for_port(port, timeout_s, procs):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        procs.check_alive()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


def wait_for_file(path, timeout_s, procs):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        procs.check_alive()
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        time.sleep(0.02)
    raise RuntimeError(f"{path} not written after {timeout_s} s")


def run(cmd, timeout_s, what, failures):
    """Runs a bench, its stdout echoed; a failure or timeout is noted in `failures` with its output
    (the lines it wrote before still count: a wrong output fails its run and is in its lines)."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        failures.append(f"{what}: still running after {timeout_s} s\n{out}")
        print(f"sweep: {failures[-1]}", file=sys.stderr, flush=True)
        return
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        failures.append(f"{what}: exit {r.returncode}\n{r.stderr.strip()}")
        print(f"sweep: {failures[-1]}", file=sys.stderr, flush=True)


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_knows(bench, mode):
    """Whether the service bench's --activations names `mode`."""
    r = subprocess.run([bench, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = r.stdout + r.stderr
    at = text.find("--activations (")
    end = text.find("default:", at)
    return at >= 0 and re.search(rf"\b{re.escape(mode)}\b", text[at:end if end > at else None]) is not None


def bench_has_flag(bench, flag):
    """Whether the service bench takes --`flag`."""
    r = subprocess.run([bench, "--helpfull"], capture_output=True, text=True, timeout=30)
    return f"--{flag} (" in r.stdout + r.stderr


def x_key(rows):
    return "request_rate" if any(r.get("mode") == "rate" for r in rows) else "concurrency"


def floors(results):
    """Per preset: the local op, PCIe's pinned copies (CUDA), and the raw stream at the lowest level.
    Each path's run measures the local op and the copies again: the lowest of those p50s counts (the
    run least disturbed by the rest of the machine)."""
    out = {}
    for r in results:
        if r["kind"] != "service":
            continue
        f = out.setdefault(r["preset"], {})
        f["local_p50_us"] = min(f.get("local_p50_us", float("inf")), r["local_p50_us"])
        if r.get("h2d_p50_us", 0) > 0 or r.get("d2h_p50_us", 0) > 0:
            f["pinned_h2d_p50_us"] = min(f.get("pinned_h2d_p50_us", float("inf")), r["h2d_p50_us"])
            f["pinned_d2h_p50_us"] = min(f.get("pinned_d2h_p50_us", float("inf")), r["d2h_p50_us"])
    for f in out.values():
        if "pinned_h2d_p50_us" in f:
            f["local_plus_pcie_us"] = f["local_p50_us"] + f["pinned_h2d_p50_us"] + f["pinned_d2h_p50_us"]
    for r in results:
        if r["kind"] == "transport" and r["preset"] in out:
            f = out[r["preset"]]
            key = f"{r['path']}_rtt_p50_us"
            if r["concurrency"] == min(x["concurrency"] for x in results
                                       if x["kind"] == "transport" and x["path"] == r["path"]
                                       and x["preset"] == r["preset"]):
                f[key] = r["rtt_p50_us"]
                f[f"local_plus_{r['path']}_us"] = f["local_p50_us"] + r["rtt_p50_us"]
    return out


# GroupedGemmResponse.phases as the service bench writes them (phases_p50_us), in
# the order a request meets them; they add up to the server time.
PHASES = ("plan", "queue", "transfer", "kernel", "collective", "transport", "assemble")


def phase_parts(row):
    """One line's round trip split into parts (µs, p50 each): the server's phases, what of the
    server time no phase holds, and the client hop (round trip - server)."""
    rtt = row["rtt_p50_us"]
    if row["kind"] == "transport":
        return [("raw stream round trip", rtt)]
    server = row["server_p50_us"]
    phases = row.get("phases_p50_us")
    if phases:
        parts = [(name, phases[name]) for name in PHASES if name in phases]
        parts += [(name, us) for name, us in phases.items() if name not in PHASES]
        parts.append(("server, in no phase", max(server - sum(us for _, us in parts), 0.0)))
    else:  # servers older than the phases
        worker = row["worker_p50_us"]
        parts = [("slowest worker", worker), ("coordinator (server - worker)", max(server - worker, 0.0))]
    return parts + [("client hop (round trip - server)", max(rtt - server, 0.0))]


def plot(results, floor, out_dir):
    """PNGs per preset; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    presets = sorted({r["preset"] for r in results})
    for preset in presets:
        rows = [r for r in results if r["preset"] == preset]
        key = x_key([r for r in rows if r["kind"] == "service"])
        paths = list(dict.fromkeys(r["path"] for r in rows))
        by_path = {p: sorted((r for r in rows if r["path"] == p), key=lambda r: r.get(key, r["concurrency"]))
                   for p in paths}
        xlabel = "offered request rate (1/s)" if key == "request_rate" else "concurrency (callers)"

        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (p, rs) in enumerate(by_path.items()):
            xs = [r.get(key, r["concurrency"]) for r in rs]
            color = f"C{i}"
            ax.plot(xs, [r["rtt_p50_us"] / 1e3 for r in rs], "o-", color=color, label=f"{p} p50")
            ax.plot(xs, [r["rtt_p99_us"] / 1e3 for r in rs], "x--", color=color, label=f"{p} p99")
        f = floor.get(preset, {})
        ax.axhline(f.get("local_p50_us", 0) / 1e3, color="k", lw=0.8, label="local op p50")
        if "local_plus_pcie_us" in f:
            ax.axhline(f["local_plus_pcie_us"] / 1e3, color="gray", ls=":", label="local op + pinned H2D + D2H")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("round trip (ms)")
        ax.set_title(f"{preset}: latency")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        made.append(save(fig, os.path.join(out_dir, f"latency_{preset}.png")))

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
        for i, (p, rs) in enumerate(by_path.items()):
            xs = [r.get(key, r["concurrency"]) for r in rs]
            a1.plot(xs, [r["calls_per_s"] for r in rs], "o-", color=f"C{i}", label=p)
            a2.plot(xs, [r["gbps"] for r in rs], "o-", color=f"C{i}", label=p)
        for a, label in ((a1, "calls/s"), (a2, "GB/s (tensor bytes in + out)")):
            a.set_xscale("log", base=2)
            a.set_xlabel(xlabel)
            a.set_ylabel(label)
            a.grid(True, which="both", alpha=0.3)
            a.legend(fontsize=7)
        fig.suptitle(f"{preset}: throughput")
        made.append(save(fig, os.path.join(out_dir, f"throughput_{preset}.png")))

        # The phase breakdown at each path's lowest level (its least queueing).
        service = {p: rs[0] for p, rs in by_path.items() if rs}
        fig, ax = plt.subplots(figsize=(8, 5))
        names = list(service)
        labels_seen = {}
        for i, p in enumerate(names):
            bottom = 0.0
            for j, (part, us) in enumerate(phase_parts(service[p])):
                label = part if part not in labels_seen else None
                color = labels_seen.setdefault(part, f"C{len(labels_seen)}")
                ax.bar(i, us / 1e3, bottom=bottom, color=color, label=label)
                bottom += us / 1e3
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=15)
        ax.set_ylabel("round trip p50 (ms)")
        lowest = {service[p].get(key, service[p]["concurrency"]) for p in names}
        ax.set_title(f"{preset}: where the round trip goes ({key} {', '.join(str(x) for x in sorted(lowest))})")
        ax.legend(fontsize=7)
        made.append(save(fig, os.path.join(out_dir, f"phases_{preset}.png")))
    return made


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def markdown(results):
    lines = ["| preset | path | level | rtt p50 / p90 / p99 (ms) | server p50 (ms) | calls/s | GB/s | wrong / checked |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        level = (f"{r['request_rate']:g}/s" if r.get("mode") == "rate" else str(r["concurrency"]))
        server = f"{r['server_p50_us'] / 1e3:.2f}" if r["kind"] == "service" else "-"
        lines.append(f"| {r['preset']} | {r['path']} | {level} | {r['rtt_p50_us'] / 1e3:.2f} / "
                     f"{r['rtt_p90_us'] / 1e3:.2f} / {r['rtt_p99_us'] / 1e3:.2f} | {server} | "
                     f"{r['calls_per_s']:.0f} | {r['gbps']:.3f} | {r['wrong']} / {r['checked']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=os.path.join(ROOT, "tools", "bench", "cpu_presets.json"))
    ap.add_argument("--only", default="", help="presets whose name contains one of these (comma list)")
    ap.add_argument("--local", default="cpu", choices=["cpu", "cuda"], help="where the bench's local op runs")
    ap.add_argument("--paths", default=DEFAULT_PATHS, help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="closed-loop levels")
    ap.add_argument("--request_rate", default="", help="open loop instead: rates (1/s), comma list")
    ap.add_argument("--arrivals", default="poisson", choices=["poisson", "constant"])
    ap.add_argument("--max_outstanding", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20, help="calls per caller (closed) or per rate (open)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--transport", default="raw_stream,raw_stream_chunked",
                    help=f"raw stream variants beside the paths ({', '.join(TRANSPORT_VARIANTS)}; empty: none)")
    ap.add_argument("--out", required=True, help="folder for sweep.json and the PNGs")
    ap.add_argument("--run_timeout_s", type=float, default=600, help="bound on each bench run")
    ap.add_argument("--start_timeout_s", type=float, default=60, help="bound on the mesh's start")
    ap.add_argument("--markdown", action="store_true", help="print the results as a markdown table")
    ap.add_argument("--logs", default="", help="folder for the servers' logs and the benches' JSON lines "
                    "(default: a new one under --out)")
    ap.add_argument("--replot", default="", help="only draw the plots of this sweep.json (into --out)")
    ap.add_argument("bench_args", nargs="*", help="more service bench flags after --, e.g. --scale_rows=0.5")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            doc = json.load(f)
        os.makedirs(a.out, exist_ok=True)
        made = plot(doc["results"], doc["floors"], a.out)
        print(f"# {len(made)} plots in {a.out}")
        return 0

    server_bin = os.environ.get("SERVER_BIN", os.path.join(ROOT, "bin"))
    bench = os.environ.get("BENCH", os.path.join(ROOT, "bin", "shardgemm-service-bench"))
    transport_bench = os.environ.get("TRANSPORT_BENCH", os.path.join(ROOT, "bin", "shardgemm-transport-bench"))
    mesh, workers = os.environ.get("MESH", "dp=1"), int(os.environ.get("WORKERS", "1"))
    os.makedirs(a.out, exist_ok=True)
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="sweep-logs-", dir=a.logs or a.out)

    paths, skipped = [], []
    for name in filter(None, a.paths.split(",")):
        if name not in PATHS:
            ap.error(f"--paths: '{name}' is not one of {', '.join(PATHS)}")
        needs = PATHS[name].get("needs")
        if needs and not bench_knows(bench, needs):
            skipped.append({"path": name, "why": f"{os.path.basename(bench)} has no --activations={needs} yet"})
            print(f"# {name}: skipped, {skipped[-1]['why']}", flush=True)
            continue
        needs_flag = PATHS[name].get("needs_flag")
        if needs_flag and not bench_has_flag(bench, needs_flag):
            skipped.append({"path": name, "why": f"{os.path.basename(bench)} has no --{needs_flag} yet"})
            print(f"# {name}: skipped, {skipped[-1]['why']}", flush=True)
            continue
        if PATHS[name].get("cuda_only") and a.local != "cuda":
            skipped.append({"path": name, "why": "needs CUDA workers (--local=cuda)"})
            print(f"# {name}: skipped, {skipped[-1]['why']}", flush=True)
            continue
        paths.append(name)
    variants = [v for v in filter(None, a.transport.split(","))]
    for v in variants:
        if v not in TRANSPORT_VARIANTS:
            ap.error(f"--transport: '{v}' is not one of {', '.join(TRANSPORT_VARIANTS)}")

    load = ([f"--request_rate={a.request_rate}", f"--arrivals={a.arrivals}",
             f"--max_outstanding={a.max_outstanding}"] if a.request_rate else [f"--concurrency={a.concurrency}"])
    presets = a.presets
    if a.only:  # a presets file of the chosen ones (the bench's --only takes one name)
        with open(a.presets) as f:
            doc = json.load(f)
        wanted = [w for w in a.only.split(",") if w]
        doc["presets"] = [p for p in doc["presets"] if any(w in p["name"] for w in wanted)]
        if not doc["presets"]:
            ap.error(f"--only: no preset of {a.presets} matches '{a.only}'")
        presets = os.path.join(logs, "presets.json")
        with open(presets, "w") as f:
            json.dump(doc, f)
    common = [f"--presets={presets}", f"--local={a.local}", f"--iters={a.iters}", f"--warmup={a.warmup}",
              "--insecure", *load, *a.bench_args]
    started = time.time()
    load_before = os.getloadavg()
    results = []
    procs = Processes(logs)
    failures = []
    try:
        port = free_port()
        address = f"127.0.0.1:{port}"
        procs.start("coordinator", pinned(os.environ.get("COORDINATOR_CPUS", ""), [
            os.path.join(server_bin, "shardgemm-coordinator"), f"--listen={address}", f"--mesh={mesh}",
            "--insecure", "--shared_memory", *shlex.split(os.environ.get("COORDINATOR_FLAGS", ""))]))
        wait_for_port(port, a.start_timeout_s, procs)
        for i in range(workers):
            procs.start(f"worker{i}", pinned(os.environ.get("WORKER_CPUS", ""), [
                os.path.join(server_bin, "shardgemm-worker"), f"--coordinator={address}", "--insecure",
                *shlex.split(os.environ.get("WORKER_FLAGS", ""))]))
        port_file = os.path.join(logs, "transport.port")
        if variants:
            procs.start("transport_server", pinned(os.environ.get("COORDINATOR_CPUS", ""), [
                transport_bench, "--mode=server", "--listen=127.0.0.1:0", f"--port_file={port_file}"]))
        bench_cpus = os.environ.get("BENCH_CPUS", "")
        for name in paths:
            jsonl = os.path.join(logs, f"{name}.jsonl")
            run(pinned(bench_cpus, [bench, f"--coordinator={address}", *common, *PATHS[name]["flags"],
                                    f"--json={jsonl}"]), a.run_timeout_s, f"service bench, path {name}", failures)
            results += [dict(r, path=name) for r in read_lines(jsonl)]
            procs.check_alive()
        if variants:
            transport_port = wait_for_file(port_file, a.start_timeout_s, procs)
            # The bytes a request moves: the largest a path here sent and got back, per preset.
            moved = {}
            for r in results:
                old = moved.get(r["preset"], (0, 0))
                moved[r["preset"]] = (max(old[0], r["payload_in_bytes"]), max(old[1], r["payload_out_bytes"]))
            levels = str(a.max_outstanding) if a.request_rate else a.concurrency
            for preset, (in_bytes, out_bytes) in moved.items():
                if in_bytes + out_bytes == 0:
                    skipped.append({"path": "raw_stream", "preset": preset,
                                    "why": "no path here moved tensor bytes for this preset"})
                    continue
                for v in variants:
                    jsonl = os.path.join(logs, f"{v}_{preset}.jsonl")
                    run(pinned(bench_cpus, [
                        transport_bench, "--mode=client", f"--target=127.0.0.1:{transport_port}",
                        f"--in_bytes={in_bytes}", f"--out_bytes={out_bytes}",
                        *TRANSPORT_VARIANTS[v], f"--concurrency={levels}",
                        f"--iters={a.iters}", f"--warmup={a.warmup}", f"--label={preset}", f"--json={jsonl}"]),
                        a.run_timeout_s, f"transport bench, {v}, {preset}", failures)
                    results += [dict(r, path=v) for r in read_lines(jsonl)]
    except RuntimeError as e:  # the mesh or the transport server did not start, or one exited
        failures.append(str(e))
        print(f"sweep: {failures[-1]}", file=sys.stderr)
    finally:
        procs.stop()

    floor = floors(results)
    plots = []
    try:
        plots = plot(results, floor, a.out) if results else []
    except ImportError as e:  # a machine without matplotlib: draw them elsewhere with --replot
        skipped.append({"path": "plots", "why": f"{e}; draw them with --replot=sweep.json"})
        print(f"# plots: skipped, {skipped[-1]['why']}", flush=True)
    wrong = sum(r["wrong"] for r in results)
    summary = {
        "about": "tools/bench/sweep.py: service paths and the raw stream per preset and load level; "
                 "times in microseconds, bytes per call, gbps = payload_bytes / wall_s / 1e9",
        "command": " ".join(shlex.quote(c) for c in [sys.executable, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "mesh": mesh, "workers": workers, "local": a.local},
        "wall_s": time.time() - started,
        "paths": paths, "transport": variants, "skipped": skipped,
        "failures": failures, "wrong": wrong,
        "floors": floor, "plots": [os.path.basename(p) for p in plots],
        "results": results,
    }
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if a.markdown:
        print(markdown(results))
    print(f"# sweep: {len(results)} result lines, {wrong} wrong, {len(failures)} failed runs, {len(plots)} plots, "
          f"{summary['wall_s']:.1f} s -> {os.path.join(a.out, 'sweep.json')}", flush=True)
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
