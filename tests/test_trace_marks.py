"""--trace_requests / --trace_steps: each GroupedGemm's instants on the
coordinator and its steps' on the workers, joined by tools/trace_timeline.py
into one time axis (what finding a fixed cost reads)."""
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path, event):
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                j = json.loads(line)
                if j.get("event") == event:
                    out.append(j)
    return out


def test_request_and_step_marks_line_up(cluster_factory):
    c = cluster_factory(mesh="ep=2", workers=2,
                        coordinator_flags=("--trace_requests", "--log_format=json"),
                        worker_flags=("--trace_steps", "--log_format=json"))
    rng = np.random.default_rng(3)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((4, 32, 16)).astype(np.float32)
    calls = 6
    for _ in range(calls):
        c.client.grouped_gemm(lhs, rhs, [10, 22, 20, 12], lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                              group_sizes_spec="(ep,)")
    c.stop()  # the lines are all written
    coordinator_log = os.path.join(c.logs, "coordinator.log")
    worker_logs = [os.path.join(c.logs, f"worker{i}.log") for i in range(2)]
    requests = _lines(coordinator_log, "request_marks")
    assert len(requests) == calls
    for r in requests:
        assert r["ok"] is True
        marks = [(k, v) for k, v in r.items() if k.endswith("_us") and k != "start_unix_us"]
        labels = [k for k, _ in marks]
        for want in ("admitted_us", "planned_us", "dispatching_us", "answered_us", "finished_us"):
            assert want in labels, labels
        offsets = [v for _, v in marks]
        assert offsets == sorted(offsets), marks  # marked in the order they happen
    ids = {r["request_id"] for r in requests}
    for path in worker_logs:
        steps = [s for s in _lines(path, "step_marks") if s["request_id"] in ids]
        assert len(steps) == calls, path
        for s in steps:
            assert {"turn_us", "inputs_us", "executed_us", "recorded_us"} <= set(s), s
    # Each worker's step lies inside its request's span on the shared clock.
    by_id = {r["request_id"]: r for r in requests}
    for path in worker_logs:
        for s in _lines(path, "step_marks"):
            r = by_id.get(s["request_id"])
            if r is None:
                continue
            assert r["start_unix_us"] + r["dispatching_us"] - 1 <= s["start_unix_us"]
            assert s["start_unix_us"] + s["executed_us"] <= r["start_unix_us"] + r["answered_us"] + 1
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools/trace_timeline.py"), "--skip=1",
                          f"--coordinator={coordinator_log}", *worker_logs],
                         check=True, capture_output=True, text=True).stdout
    assert f"{calls - 1} requests, {calls - 1} joined" in out, out
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    # The timeline shows each request's slowest worker: one of them, or both.
    arrived = [row for row in ("w0.arrived", "w1.arrived") if row in rows]
    assert arrived, out
    assert any(rows.index("dispatching") < rows.index(a) < rows.index("answered") for a in arrived), out


def test_no_marks_without_the_flags(cluster):
    rng = np.random.default_rng(4)
    lhs = rng.standard_normal((16, 8)).astype(np.float32)
    rhs = rng.standard_normal((2, 8, 4)).astype(np.float32)
    cluster.client.grouped_gemm(lhs, rhs, [8, 8])
    cluster.stop()
    text = cluster.log_text()
    assert "request_marks" not in text and "step_marks" not in text
