#!/usr/bin/env python3
"""Fault-injection soak: a CPU mesh under checked load while workers are killed.

    python3 tools/fault_soak.py                      # 10 minutes, a kill every 30 s, 8 clients
    python3 tools/fault_soak.py --duration_s=60 --period_s=10 --clients=4 --json=soak.json

Starts a coordinator and one CPU worker per rank of `--mesh` (axes `ep` and
`fsdp`; default `ep=2,fsdp=2`) on loopback (`--insecure`), with short
heartbeats and step and collective timeouts. N client threads send checked
requests against NumPy references (tests/reference.py):

- gemm:     a ragged-M grouped GEMM, rows over (ep, fsdp), experts over ep and
            K over fsdp (the plan all-gathers the weight over fsdp);
- wgrad:    a ragged-K grouped GEMM (per-expert partial sums all-reduced over fsdp);
- resident: each client puts weights of its own (an acknowledged put is
            recorded), runs GEMMs on them and reads them back bit-exact;
            a tensor whose shard died with a worker must be DATA_LOSS, and is
            deleted and put again. With --replicas=2 (the coordinator's) no
            tensor may be lost: the replacement gets its copies back, and a
            read meanwhile is UNAVAILABLE (being restored).

Every `--period_s` one worker (in turn) is SIGKILLed and at once started
again on a new port; it takes the dead rank once the heartbeat has marked
it down. Every answer must be right or a clear error (UNAVAILABLE, ABORTED,
DEADLINE_EXCEEDED with a message; DATA_LOSS naming a lost tensor). Counted:
ok, clear errors by code, wrong (a result off its reference, a read not
bit-exact, a lost tensor served, an acknowledged tensor missing), unclear
(any other status), stuck (a call that took longer than its bound:
min(client deadline, step timeout) + --stuck_slack_s). At the end the mesh
must serve every kind of request again, and every acknowledged tensor (two put
before the soak, and each client's last ones) is listed and read back
bit-exact, or listed lost and DATA_LOSS on read: never served wrong.

A NOT_FOUND naming a resident tensor right after a rejoin (a race
docs/reliability.md says is closed) is counted apart and fails nothing. A client pauses
--backoff_s after an error, as a client would before trying again.

Prints the figures (requests, ok, errors by code, wrong, stuck, p50/p99
latency, per restart the time to down, to ready and to the first right GEMM)
and exits 1 on any wrong, stuck or unclear answer, a problem with an
acknowledged tensor, or a restart the mesh did not recover from (no right
GEMM before the next kill, or not every kind of request right after the soak).
--events writes every call, one JSON a line.
"""
import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from shardgemm_client import Client, from_tensor, pb  # noqa: E402
import reference  # noqa: E402  (tests/reference.py: pure NumPy)

try:  # a progress bar only where tqdm is installed already, and on a terminal
    import tqdm  # noqa: F401
    HAVE_TQDM = sys.stderr.isatty()
except ImportError:
    HAVE_TQDM = False

CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}
RESIDENT_USES = ("gemm_resident", "get")
COLLECTIVE_KINDS = ("gemm", "wgrad", "gemm_resident")


def free_port():
    """An OS-chosen free port on loopback (as tests/conftest.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.02)
    return False


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


# --- the mesh -------------------------------------------------------------------------------

class Mesh:
    """A coordinator and one CPU worker per rank on loopback; each worker
    listens on a port chosen here, so a restarted one gets a new port."""

    def __init__(self, args, logs):
        self.args = args
        self.logs = logs
        os.makedirs(logs, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.axes = dict(kv.split("=") for kv in args.mesh.split(","))
        self.axes = {k: int(v) for k, v in self.axes.items()}
        if set(self.axes) != {"ep", "fsdp"}:
            raise SystemExit("--mesh must have exactly the axes ep and fsdp, e.g. ep=2,fsdp=2")
        self.num_workers = self.axes["ep"] * self.axes["fsdp"]
        self.procs = []  # every process started: (name, Popen)
        self.workers = []  # per slot: {"proc", "address", "name"}
        self.starts = collections.Counter()
        self.coordinator = self._start("coordinator", [
            os.path.join(ROOT, "bin", "shardgemm-coordinator"), f"--listen={self.address}", f"--mesh={args.mesh}",
            "--insecure", f"--heartbeat_interval_s={args.heartbeat_interval_s}",
            f"--heartbeat_misses={args.heartbeat_misses}", f"--step_timeout_s={args.step_timeout_s}",
            f"--replicas={args.replicas}"])
        if not wait_for_port(self.port, 30):
            self.stop()
            raise RuntimeError("the coordinator does not listen:\n" + self.log_tail())
        for slot in range(self.num_workers):
            self.workers.append(self.start_worker(slot))
        self.client = Client(self.address, timeout=5)

    def _start(self, name, cmd):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append((name, p))
        return p

    def start_worker(self, slot):
        self.starts[slot] += 1
        name = f"worker{slot}" + (f"-restart{self.starts[slot] - 1}" if self.starts[slot] > 1 else "")
        address = f"127.0.0.1:{free_port()}"
        a = self.args
        p = self._start(name, [os.path.join(ROOT, "bin", "shardgemm-worker"), f"--coordinator={self.address}",
                               f"--listen={address}", "--backend=cpu", "--insecure", f"--threads={a.worker_threads}",
                               f"--collective_timeout_s={a.collective_timeout_s}"])
        return {"proc": p, "address": address, "name": name}

    def kill(self, slot):
        p = self.workers[slot]["proc"]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)

    def info(self):
        try:
            return self.client.cluster_info()
        except grpc.RpcError:
            return None

    def wait_ready(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.info()
            if info is not None and info.ready:
                return True
            time.sleep(0.05)
        return False

    def log_tail(self, lines=20):
        out = []
        for name, _ in self.procs:
            try:
                with open(os.path.join(self.logs, f"{name}.log")) as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
            except OSError:
                pass
        return "\n".join(out)

    def stop(self):
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - not made yet
            pass
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


# --- checked requests ------------------------------------------------------------------------

class Workload:
    """Request shapes and their references for a mesh ep=E, fsdp=F: row shard
    s = e * F + f (rows split over (ep, fsdp), ep major), 2 experts per ep
    shard, so row shard s's groups are experts e * 2 .. e * 2 + 1."""

    def __init__(self, ep, fsdp, rows_per_shard=16, k=32, n=16):
        self.ep, self.fsdp = ep, fsdp
        self.shards = ep * fsdp
        self.gpe = 2  # experts per ep shard, = groups per row shard
        self.groups = ep * self.gpe
        self.rows = rows_per_shard
        self.m, self.k, self.n = rows_per_shard * self.shards, k, n
        self.lhs_spec = "((ep, fsdp), None)"
        self.gs_spec = "((ep, fsdp),)"
        self.rhs_spec = "(ep, fsdp, None)"

    def sizes(self, rng):
        out = []
        for _ in range(self.shards):
            cut = np.sort(rng.integers(0, self.rows + 1, size=self.gpe))
            out += [int(x) for x in np.diff(np.concatenate([[0], cut]))]
        return out

    def first_group(self, shard):
        return (shard // self.fsdp) * self.gpe

    def gemm_reference(self, lhs, rhs, sizes):
        out = np.zeros((self.m, self.n))
        for s in range(self.shards):
            row = s * self.rows
            for j in range(self.gpe):
                size = sizes[s * self.gpe + j]
                out[row:row + size] = lhs[row:row + size].astype(np.float64) @ rhs[self.first_group(s) + j]
                row += size
        return out

    def wgrad_reference(self, lhs, rhs, sizes):
        out = np.zeros((self.groups, self.k, self.n))
        for s in range(self.shards):
            row = s * self.rows
            for j in range(self.gpe):
                size = sizes[s * self.gpe + j]
                a = lhs[row:row + size].astype(np.float64)
                out[self.first_group(s) + j] += a.T @ rhs[row:row + size].astype(np.float64)
                row += size
        return out

    def rand(self, rng, *shape):
        return rng.uniform(-1, 1, size=shape).astype(np.float32)


def off_reference(got, ref, contracting):
    """None when `got` is within tolerance of `ref`, else why not."""
    if got is None or got.shape != ref.shape:
        return f"shape {None if got is None else got.shape}, want {ref.shape}"
    if not np.all(np.isfinite(got)):
        return "non-finite values"
    tol = reference.tolerance(got.dtype, contracting, ref)
    err = float(np.abs(np.asarray(got, np.float64) - ref).max(initial=0))
    return None if err <= tol else f"max error {err:.3g} > tolerance {tol:.3g}"


class Stats:
    """Every outcome, under one lock."""

    def __init__(self, events_path=""):
        self.mu = threading.Lock()
        self.events_file = open(events_path, "w") if events_path else None
        self.events = []  # (kind, start, end, outcome, code)
        self.errors = collections.Counter()  # clear errors by code
        self.unclear = collections.Counter()
        self.known_race = 0  # NOT_FOUND for a resident tensor a rejoined worker lacks (docs/reliability.md)
        self.samples = {}  # a message per (outcome, code)
        self.wrong = []
        self.stuck = []

    def record(self, kind, start, end, outcome, code="OK", detail=""):
        with self.mu:
            self.events.append((kind, start, end, outcome, code))
            if self.events_file is not None:
                self.events_file.write(json.dumps({"kind": kind, "start": round(start, 4), "end": round(end, 4),
                                                   "outcome": outcome, "code": code, "detail": detail[:300]}) + "\n")
            if outcome == "error":
                self.errors[code] += 1
            elif outcome == "known_race":
                self.known_race += 1
            elif outcome == "unclear":
                self.unclear[code] += 1
            elif outcome == "wrong":
                self.wrong.append(f"{kind}: {detail}")
            if outcome != "ok" and (outcome, code) not in self.samples:
                self.samples[(outcome, code)] = f"{kind}: {detail}"[:300]

    def note_stuck(self, kind, took, bound, detail):
        with self.mu:
            self.stuck.append(f"{kind} took {took:.2f} s > bound {bound:.2f} s ({detail})"[:300])


class ClientThread(threading.Thread):
    def __init__(self, index, mesh, work, stats, stop, args):
        super().__init__(name=f"client{index}", daemon=True)
        self.index, self.mesh, self.work, self.stats, self.stop, self.args = index, mesh, work, stats, stop, args
        self.rng = np.random.default_rng([args.seed, index])
        self.client = Client(mesh.address, timeout=args.deadline_s)
        self.bound = min(args.deadline_s, args.step_timeout_s) + args.stuck_slack_s
        self.resident = None  # (name, data): this client's acknowledged tensor in use
        self.acknowledged = {}  # name -> data: acknowledged puts not deleted (checked at the end)
        self.unsure = set()  # names whose delete failed: may or may not be there
        self.puts = 0
        self.uses = 0

    # One call: its outcome recorded; returns (value or None, grpc error or None).
    def call(self, kind, fn, check=None, allow=()):
        start = time.time()
        try:
            value = fn()
            err = None
        except grpc.RpcError as e:
            value, err = None, e
        end = time.time()
        took = end - start
        if err is None:
            why = check(value) if check else None
            self.stats.record(kind, start, end, "ok" if why is None else "wrong", "OK", why or "")
        else:
            code, details = err.code(), err.details() or ""
            clear = (code in CLEAR or code in allow) and details.strip() != ""
            if not clear and code == grpc.StatusCode.NOT_FOUND and kind in RESIDENT_USES and \
                    "no resident shard of" in details:
                outcome = "known_race"  # docs/reliability.md: NOT_FOUND instead of DATA_LOSS, right after a rejoin
            else:
                outcome = "error" if clear else "unclear"
            self.stats.record(kind, start, end, outcome, code.name, details)
        if took > self.bound:
            self.stats.note_stuck(kind, took, self.bound, "ok" if err is None else err.code().name)
        if err is not None and self.args.backoff_s > 0:
            time.sleep(self.args.backoff_s)  # as a client would, before trying again
        return value, err

    def gemm(self):
        w, rng = self.work, self.rng
        lhs, rhs, sizes = w.rand(rng, w.m, w.k), w.rand(rng, w.groups, w.k, w.n), w.sizes(rng)
        req = self.client.gemm_request(lhs, rhs, sizes, lhs_spec=w.lhs_spec, rhs_spec=w.rhs_spec,
                                       group_sizes_spec=w.gs_spec)
        ref = w.gemm_reference(lhs, rhs, sizes)
        self.call("gemm", lambda: self.client.stub.GroupedGemm(req, timeout=self.args.deadline_s),
                  lambda resp: off_reference(from_tensor(resp.out), ref, w.k))

    def wgrad(self):
        w, rng = self.work, self.rng
        lhs, rhs, sizes = w.rand(rng, w.m, w.k), w.rand(rng, w.m, w.n), w.sizes(rng)
        req = self.client.gemm_request(lhs, rhs, sizes, ragged_k=True, lhs_spec=w.lhs_spec, rhs_spec=w.lhs_spec,
                                       group_sizes_spec=w.gs_spec)
        ref = w.wgrad_reference(lhs, rhs, sizes)
        self.call("wgrad", lambda: self.client.stub.GroupedGemm(req, timeout=self.args.deadline_s),
                  lambda resp: off_reference(from_tensor(resp.out), ref, w.rows))

    def delete(self, name):
        _, err = self.call("delete", lambda: self.client.delete(name))
        if err is None:
            self.acknowledged.pop(name, None)
        else:
            self.unsure.add(name)
            self.acknowledged.pop(name, None)

    def confirm_lost(self, name, kind, err):
        """A DATA_LOSS must concern a tensor the registry lists as lost."""
        try:
            listed = {t.name: t for t in self.client.list()}
        except grpc.RpcError:
            return  # cannot tell now; the final check covers it
        t = listed.get(name)
        if t is None or not t.lost:
            self.stats.record(kind, time.time(), time.time(), "wrong", "DATA_LOSS",
                              f"{name}: DATA_LOSS ({err.details()}) but listed {'absent' if t is None else 'not lost'}")

    def resident_op(self):
        w, rng = self.work, self.rng
        if self.resident is None:
            self.puts += 1
            name = f"soak-c{self.index}-{self.puts}"
            data = w.rand(rng, w.groups, w.k, w.n)
            _, err = self.call("put", lambda: self.client.put(name, data, spec=w.rhs_spec))
            if err is None:
                self.resident = (name, data)
                self.acknowledged[name] = data
                self.uses = 0
            else:
                self.unsure.add(name)  # a failed put changes nothing, but the final check need not rely on it
            return
        name, data = self.resident
        self.uses += 1
        if self.uses % 2:
            lhs, sizes = w.rand(rng, w.m, w.k), w.sizes(rng)
            ref = w.gemm_reference(lhs, data, sizes)
            req = self.client.gemm_request(lhs, name, sizes, lhs_spec=w.lhs_spec, group_sizes_spec=w.gs_spec)
            _, err = self.call("gemm_resident", lambda: self.client.stub.GroupedGemm(req, timeout=self.args.deadline_s),
                               lambda resp: off_reference(from_tensor(resp.out), ref, w.k),
                               allow={grpc.StatusCode.DATA_LOSS})
            kind = "gemm_resident"
        else:
            _, err = self.call("get", lambda: self.client.get(name),
                               lambda got: None if got.dtype == data.dtype and np.array_equal(got, data)
                               else "read back differs from what was put", allow={grpc.StatusCode.DATA_LOSS})
            kind = "get"
        if err is not None and (err.code() == grpc.StatusCode.DATA_LOSS or
                                (err.code() == grpc.StatusCode.NOT_FOUND and "no resident shard of" in
                                 (err.details() or ""))):
            if err.code() == grpc.StatusCode.DATA_LOSS:
                self.confirm_lost(name, kind, err)
            self.resident = None
            self.delete(name)
        elif self.uses >= 8:  # a fresh tensor now and then: puts and deletes under faults too
            self.resident = None
            self.delete(name)

    def run(self):
        ops = [self.gemm, self.wgrad, self.resident_op]
        i = self.index
        try:
            while not self.stop.is_set():
                ops[i % len(ops)]()
                i += 1
        finally:
            self.client.close()


# --- the soak --------------------------------------------------------------------------------

def check_tensors(client, tensors, deadline_s, replicas=1):
    """Every acknowledged tensor: listed, and read back bit-exact or DATA_LOSS
    when listed lost (with --replicas of 2 or more, lost is a problem too; a
    tensor being restored is read again until it is back, within
    `deadline_s`). Returns (counts, problems)."""
    counts = collections.Counter()
    problems = []
    listed = {t.name: t for t in client.stub.ListTensors(pb.ListTensorsRequest(), timeout=deadline_s).tensors}
    for name, data in tensors.items():
        t = listed.get(name)
        if t is None:
            problems.append(f"{name}: acknowledged, not listed")
            counts["missing"] += 1
            continue
        until = time.time() + deadline_s
        while True:
            try:
                got = client.get(name)
                err = None
            except grpc.RpcError as e:
                err = e
            if err is None or err.code() != grpc.StatusCode.UNAVAILABLE or "being restored" not in \
                    (err.details() or "") or time.time() > until:
                break
            time.sleep(0.05)
        if err is not None:
            e = err
            if e.code() == grpc.StatusCode.DATA_LOSS and t.lost and name in (e.details() or ""):
                counts["lost_reported"] += 1
                if replicas > 1:
                    problems.append(f"{name}: lost with --replicas={replicas}: {e.details()}")
            else:
                problems.append(f"{name}: listed {'lost' if t.lost else 'intact'}, get {e.code().name}: {e.details()}")
                counts["bad_read"] += 1
            continue
        if t.lost:
            problems.append(f"{name}: listed lost, yet read back")
            counts["served_lost"] += 1
        elif got.dtype != data.dtype or not np.array_equal(got, data):
            problems.append(f"{name}: read back differs from what was put")
            counts["differs"] += 1
        else:
            counts["intact"] += 1
    return counts, problems


def final_requests(mesh, work, args, stats):
    """After the soak: every kind of request must be right again (a few tries
    each, within the step timeout's bounds)."""
    t = ClientThread(999, mesh, work, stats, threading.Event(), args)
    results = {}
    for kind, fn in (("gemm", t.gemm), ("wgrad", t.wgrad)):
        results[kind] = False
        for _ in range(5):
            before = len(stats.events)
            fn()
            if stats.events[before][3] == "ok":
                results[kind] = True
                break
            time.sleep(0.5)
    results["resident"] = False
    for _ in range(10):
        before = len(stats.events)
        t.resident_op()
        if t.resident is not None and all(e[3] == "ok" for e in stats.events[before:]):
            if t.uses >= 2:
                results["resident"] = True
                break
        elif t.resident is None:
            time.sleep(0.5)
    if t.resident is not None:
        t.delete(t.resident[0])
    t.client.close()
    return results


def soak(args):
    logs = args.logs or os.path.join(ROOT, ".tmp", f"fault_soak-{int(time.time())}")
    mesh = Mesh(args, logs)
    stats = Stats(args.events)
    result = {"config": vars(args).copy(), "logs": logs, "load_average_before": os.getloadavg()[0]}
    threads = []
    try:
        if not mesh.wait_ready(30):
            raise RuntimeError("the mesh did not become ready:\n" + mesh.log_tail())
        work = Workload(mesh.axes["ep"], mesh.axes["fsdp"])
        # Tensors put before the faults: sharded, and replicated on every worker.
        rng = np.random.default_rng([args.seed, 12345])
        before = {"soak-before-sharded": work.rand(rng, work.groups, work.k, work.n),
                  "soak-before-replicated": work.rand(rng, work.groups, work.k, work.n)}
        mesh.client.timeout = args.deadline_s
        mesh.client.put("soak-before-sharded", before["soak-before-sharded"], spec=work.rhs_spec)
        mesh.client.put("soak-before-replicated", before["soak-before-replicated"])
        stop = threading.Event()
        threads = [ClientThread(i, mesh, work, stats, stop, args) for i in range(args.clients)]
        start = time.time()
        for t in threads:
            t.start()
        restarts = []
        problems = []
        slot = args.first_victim % mesh.num_workers
        next_kill = start + args.period_s
        next_print = start + args.print_every_s
        end = start + args.duration_s
        bar = None
        if HAVE_TQDM:
            import tqdm as _tqdm
            bar = _tqdm.tqdm(total=int(args.duration_s), unit="s", desc="soak")
        shown = 0
        while time.time() < end:
            now = time.time()
            if bar is not None and int(now - start) > shown:
                bar.update(int(now - start) - shown)
                shown = int(now - start)
            if bar is None and now >= next_print:
                with stats.mu:
                    n = len(stats.events)
                    ok = sum(1 for e in stats.events if e[3] == "ok")
                print(f"[{now - start:6.1f} s] requests={n} ok={ok} errors={sum(stats.errors.values())} "
                      f"wrong={len(stats.wrong)} unclear={sum(stats.unclear.values())} stuck={len(stats.stuck)} "
                      f"restarts={len(restarts)}", flush=True)
                next_print += args.print_every_s
            if now < next_kill or now + args.min_window_s > end:
                time.sleep(0.05)
                continue
            # Kill one worker and start it again at once on a new port.
            info = mesh.info()
            rank = next((w.rank for w in (info.workers if info else []) if w.address == mesh.workers[slot]["address"]),
                        None)
            killed = time.time()
            mesh.kill(slot)
            time.sleep(args.restart_delay_s)
            mesh.workers[slot] = mesh.start_worker(slot)
            new = mesh.workers[slot]
            r = {"slot": slot, "rank": rank, "killed_at_s": round(killed - start, 3), "down_s": None,
                 "ready_s": None, "restart_failed": 0}
            deadline = killed + args.ready_timeout_s
            while time.time() < deadline:
                info = mesh.info()
                if r["down_s"] is None and info is not None and not info.ready:
                    r["down_s"] = round(time.time() - killed, 3)
                if info is not None and info.ready and any(w.address == new["address"] and not w.down
                                                           for w in info.workers):
                    r["ready_s"] = round(time.time() - killed, 3)
                    break
                if new["proc"].poll() is not None:
                    # The replacement exited (e.g. registered before its rank was marked down): a
                    # supervisor starts it again.
                    r["restart_failed"] += 1
                    time.sleep(0.2)
                    mesh.workers[slot] = mesh.start_worker(slot)
                    new = mesh.workers[slot]
                time.sleep(0.02)
            if r["ready_s"] is None:
                problems.append(f"restart {len(restarts) + 1} (slot {slot}): the mesh was not ready within "
                                f"{args.ready_timeout_s} s of the kill")
            # The tensors put before: listed, and lost (every rank holds a shard: DATA_LOSS), or with
            # --replicas of 2 or more restored and read back bit-exact.
            try:
                counts, p = check_tensors(mesh.client, before, args.deadline_s, args.replicas)
                r["before_tensors"] = dict(counts)
                problems += p
            except grpc.RpcError as e:
                r["before_tensors"] = f"not checked: {e.code().name}"
            restarts.append(r)
            print(f"[{time.time() - start:6.1f} s] killed slot {slot} (rank {rank}): down after {r['down_s']} s, "
                  f"ready after {r['ready_s']} s" + (f", {r['restart_failed']} restarts refused"
                                                      if r["restart_failed"] else ""), flush=True)
            slot = (slot + 1) % mesh.num_workers
            next_kill = killed + args.period_s
        if bar is not None:
            bar.close()
        stop.set()
        for t in threads:
            t.join(timeout=args.deadline_s + 10)
        hung = [t.name for t in threads if t.is_alive()]
        elapsed = time.time() - start
        # Recovery: a right answer to a request that started after each restart was ready
        # (before the next kill; the last one is covered by the final requests).
        events = sorted(stats.events, key=lambda e: e[1])
        for i, r in enumerate(restarts):
            begin = start + r["killed_at_s"]
            until = start + restarts[i + 1]["killed_at_s"] if i + 1 < len(restarts) else float("inf")
            ready_at = begin + (r["ready_s"] or 0)
            # A right answer of a request with collectives (a put or a delete needs none).
            firsts = [e[2] for e in events if e[3] == "ok" and e[0] in COLLECTIVE_KINDS and e[1] >= ready_at and
                      e[2] < until]
            r["first_ok_s"] = round(min(firsts) - begin, 3) if firsts else None
            errs = [e for e in events if e[3] != "ok" and begin <= e[2] < until]
            r["errors_in_window"] = len(errs)
            r["last_error_s"] = round(max(e[2] for e in errs) - begin, 3) if errs else None
        final = final_requests(mesh, work, args, stats) if mesh.wait_ready(args.ready_timeout_s) else {}
        tensors = dict(before)
        for t in threads:
            for name, data in t.acknowledged.items():
                if name not in t.unsure:
                    tensors[name] = data
        try:
            counts, p = check_tensors(mesh.client, tensors, args.deadline_s, args.replicas)
            problems += p
        except grpc.RpcError as e:
            counts = {}
            problems.append(f"final tensor check failed: {e.code().name}: {e.details()}")
        not_recovered = [i + 1 for i, r in enumerate(restarts) if r["first_ok_s"] is None and i + 1 < len(restarts)]
        if not all(final.get(k) for k in ("gemm", "wgrad", "resident")):
            problems.append(f"after the soak not every kind of request was right again: {final}")
            if restarts:
                not_recovered.append(len(restarts))
        ok_lat = [e[2] - e[1] for e in stats.events if e[3] == "ok"]
        all_lat = [e[2] - e[1] for e in stats.events]
        by_kind = collections.defaultdict(collections.Counter)
        for e in stats.events:
            by_kind[e[0]][e[3] if e[3] != "error" else e[4]] += 1
        result.update({
            "elapsed_s": round(elapsed, 1),
            "load_average_after": os.getloadavg()[0],
            "requests": len(stats.events),
            "ok": sum(1 for e in stats.events if e[3] == "ok"),
            "errors": dict(stats.errors),
            "unclear": dict(stats.unclear),
            "known_race_not_found": stats.known_race,
            "wrong": len(stats.wrong),
            "wrong_samples": stats.wrong[:10],
            "stuck": len(stats.stuck) + len(hung),
            "stuck_samples": (stats.stuck + [f"{h} still running after the soak" for h in hung])[:10],
            "samples": {f"{o}/{c}": m for (o, c), m in stats.samples.items()},
            "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "latency_ok_s": {"p50": percentile(ok_lat, 50), "p99": percentile(ok_lat, 99),
                             "max": max(ok_lat) if ok_lat else float("nan")},
            "latency_all_s": {"p50": percentile(all_lat, 50), "p99": percentile(all_lat, 99),
                              "max": max(all_lat) if all_lat else float("nan")},
            "restarts": restarts,
            "not_recovered": not_recovered,
            "final_requests": final,
            "tensors_checked": dict(counts),
            "problems": problems,
        })
        result["passed"] = (result["wrong"] == 0 and result["stuck"] == 0 and not result["unclear"] and
                            not not_recovered and not problems)
        return result
    finally:
        for t in threads:
            t.stop.set()
        mesh.stop()
        if stats.events_file is not None:
            stats.events_file.close()


def report(r):
    lines = [f"soak: {r['elapsed_s']} s, mesh {r['config']['mesh']}, {r['config']['clients']} clients, "
             f"a kill every {r['config']['period_s']} s ({len(r['restarts'])} restarts); logs in {r['logs']}; "
             f"load average {r['load_average_before']:.1f} before, {r['load_average_after']:.1f} after",
             f"requests {r['requests']}  ok {r['ok']}  clear errors {sum(r['errors'].values())} {r['errors']}  "
             f"wrong {r['wrong']}  unclear {sum(r['unclear'].values())} {r['unclear']}  stuck {r['stuck']}"
             + (f"  (known race: NOT_FOUND for a lost tensor {r['known_race_not_found']})"
                if r["known_race_not_found"] else ""),
             f"latency (ok) p50 {r['latency_ok_s']['p50'] * 1e3:.1f} ms  p99 {r['latency_ok_s']['p99'] * 1e3:.1f} ms  "
             f"max {r['latency_ok_s']['max'] * 1e3:.1f} ms; (all answers) p99 {r['latency_all_s']['p99'] * 1e3:.1f} ms  "
             f"max {r['latency_all_s']['max'] * 1e3:.1f} ms",
             "by kind: " + "; ".join(f"{k} {dict(v)}" for k, v in sorted(r["by_kind"].items()))]
    for i, x in enumerate(r["restarts"]):
        lines.append(f"restart {i + 1}: rank {x['rank']} killed at {x['killed_at_s']:.1f} s: down {x['down_s']} s, "
                     f"ready {x['ready_s']} s, first right GEMM {x.get('first_ok_s')} s after the kill; "
                     f"{x.get('errors_in_window')} errors before the next kill, the last {x.get('last_error_s')} s "
                     f"after this one" + (f"; replacement refused {x['restart_failed']}x" if x["restart_failed"] else ""))
    if r["restarts"]:
        ready = [x["ready_s"] for x in r["restarts"] if x["ready_s"] is not None]
        first = [x["first_ok_s"] for x in r["restarts"] if x.get("first_ok_s") is not None]
        if ready:
            lines.append(f"time to ready after a kill: median {np.median(ready):.2f} s, max {max(ready):.2f} s")
        if first:
            lines.append(f"time to the first right GEMM after a kill: median {np.median(first):.2f} s, "
                         f"max {max(first):.2f} s")
    lines.append(f"final requests {r['final_requests']}; acknowledged tensors {r['tensors_checked']}")
    for key in ("wrong_samples", "stuck_samples", "problems"):
        for s in r[key]:
            lines.append(f"{key[:-8] if key.endswith('_samples') else 'problem'}: {s}")
    for k, m in sorted(r["samples"].items()):
        lines.append(f"first {k}: {m}")
    lines.append("PASSED" if r["passed"] else "FAILED")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--duration_s", type=float, default=600, help="how long the clients send requests")
    p.add_argument("--period_s", type=float, default=30, help="a worker is killed every this many seconds")
    p.add_argument("--clients", type=int, default=8, help="client threads")
    p.add_argument("--mesh", default="ep=2,fsdp=2", help="the mesh (axes ep and fsdp)")
    p.add_argument("--heartbeat_interval_s", type=float, default=0.2)
    p.add_argument("--heartbeat_misses", type=int, default=2)
    p.add_argument("--step_timeout_s", type=float, default=5, help="the coordinator's --step_timeout_s")
    p.add_argument("--replicas", type=int, default=1,
                   help="the coordinator's --replicas: with 2 or more no tensor may be lost")
    p.add_argument("--collective_timeout_s", type=int, default=3, help="the workers' --collective_timeout_s")
    p.add_argument("--worker_threads", type=int, default=1, help="each CPU worker's --threads")
    p.add_argument("--deadline_s", type=float, default=20, help="each client call's deadline")
    p.add_argument("--stuck_slack_s", type=float, default=3,
                   help="a call is stuck past min(deadline, step timeout) + this")
    p.add_argument("--backoff_s", type=float, default=0.05, help="a client's pause after an error")
    p.add_argument("--restart_delay_s", type=float, default=0, help="between a kill and the restart")
    p.add_argument("--ready_timeout_s", type=float, default=30, help="the longest a restart may take to be ready")
    p.add_argument("--min_window_s", type=float, default=5, help="no kill this close to the end")
    p.add_argument("--first_victim", type=int, default=1, help="the slot killed first (then each in turn)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print_every_s", type=float, default=10)
    p.add_argument("--logs", default="", help="the processes' logs (default .tmp/fault_soak-TIME)")
    p.add_argument("--json", default="", help="write the figures here")
    p.add_argument("--events", default="", help="write every call (kind, times, outcome, code, message) here, one JSON a line")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    r = soak(args)
    print(report(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
