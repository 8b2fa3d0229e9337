"""The service benchmark sweep (tools/bench/sweep.py) on a small CPU mesh:
the figures it writes must be consistent with each other and with what was
asked (no timing asserts), every checked output right, the plots real PNGs.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(ROOT, "tools", "bench", "sweep.py")
LEVELS = [1, 2, 4]
ITERS = 3
# cpu-small per worker: 4 groups x 16 rows, k 128, n 64, BF16; two row shards.
ROW_SHARDS = 2
LHS_BYTES = ROW_SHARDS * 4 * 16 * 128 * 2
OUT_BYTES = ROW_SHARDS * 4 * 16 * 64 * 2
SHARDED = ["--", "--lhs_spec=(dp, None)", "--group_sizes_spec=(dp,)", f"--row_shards={ROW_SHARDS}"]
# Little's law: each caller's calls follow one another, so calls/s can never
# pass concurrency / mean round trip; below it by at most this factor (the
# callers' time between calls: checks, thread wake-ups on a loaded machine).
LITTLE_FACTOR = 10
CLOCK_SLACK_US = 50
PHASES = {"plan", "queue", "transfer", "kernel", "collective", "transport", "assemble"}


def sweep(tmp_path, *flags):
    out = tmp_path / "sweep"
    env = dict(os.environ, MESH=f"dp={ROW_SHARDS}", WORKERS=str(ROW_SHARDS))
    r = subprocess.run([sys.executable, SWEEP, "--presets", os.path.join(ROOT, "tools", "bench", "cpu_presets.json"),
                        "--only=cpu-small", "--local=cpu", f"--iters={ITERS}", "--warmup=1", f"--out={out}", *flags,
                        *SHARDED], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "sweep.json") as f:
        return out, json.load(f)


def assert_ordered(row, what):
    assert row[f"{what}_p50_us"] <= row[f"{what}_p90_us"] <= row[f"{what}_p99_us"], (what, row)
    assert row[f"{what}_p50_us"] > 0, (what, row)


def assert_valid_png(path):
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100, (path, im.size)


def test_concurrency_sweep_figures_are_consistent(tmp_path):
    out, doc = sweep(tmp_path, f"--concurrency={','.join(map(str, LEVELS))}")
    assert doc["failures"] == [] and doc["wrong"] == 0
    results = doc["results"]
    service = [r for r in results if r["kind"] == "service"]
    transport = [r for r in results if r["kind"] == "transport"]

    # Every path a CPU mesh runs, at every level asked, none skipped.
    for path in ("inline", "direct", "shared_memory", "resident", "resident_fetched"):
        assert sorted(r["concurrency"] for r in service if r["path"] == path) == LEVELS, path
    assert not [s for s in doc["skipped"] if "preset" not in s], doc["skipped"]
    for variant in ("raw_stream", "raw_stream_chunked"):
        assert sorted(r["concurrency"] for r in transport if r["path"] == variant) == LEVELS, variant

    for r in results:
        n = r["concurrency"]
        assert r["completed"] == n * ITERS, r
        assert r["wrong"] == 0, r
        assert_ordered(r, "rtt")
        # Throughput is completed calls over the wall clock, GB/s the bytes over it.
        assert r["calls_per_s"] == pytest.approx(r["completed"] / r["wall_s"], rel=1e-9), r
        assert r["gbps"] == pytest.approx(r["payload_bytes"] / r["wall_s"] / 1e9, rel=1e-9, abs=1e-12), r
        little = n / (r["rtt_mean_us"] * 1e-6)
        assert little / LITTLE_FACTOR <= r["calls_per_s"] <= little * (1 + 1e-9), (little, r)

    for r in service:
        assert r["attempted"] == r["completed"], r
        assert_ordered(r, "server")
        assert_ordered(r, "worker")
        assert r["check"].startswith("ok"), r
        returned = r["returned"]
        # Every returned output checked; a kept one once per caller, read back.
        assert r["checked"] == (r["completed"] if returned else r["concurrency"]), r
        want_in = 0 if r["activations"] == "resident" else LHS_BYTES
        want_out = OUT_BYTES if returned else 0
        assert (r["payload_in_bytes"], r["payload_out_bytes"]) == (want_in, want_out), r
        assert r["payload_bytes"] == r["completed"] * (want_in + want_out), r
        # Inline tensors ride in the gRPC messages; through shared memory or resident, none does.
        per_call_sent = r["wire_sent_bytes"] / r["completed"]
        per_call_received = r["wire_received_bytes"] / r["completed"]
        if r["activations"] == "inline":
            assert per_call_sent > LHS_BYTES and per_call_received > OUT_BYTES, r
        else:
            assert per_call_sent < 4096 and (per_call_received < 4096 or r["path"] == "resident_returned"), r
        # Each call's worker time lies within its server time, which lies
        # within its round trip, so every percentile keeps that order
        # (CLOCK_SLACK_US: the three are read on different clocks).
        for q in ("p50", "p90", "p99"):
            assert r[f"worker_{q}_us"] <= r[f"server_{q}_us"] + CLOCK_SLACK_US, (q, r)
            assert r[f"server_{q}_us"] <= r[f"rtt_{q}_us"] + CLOCK_SLACK_US, (q, r)
        # The server time's phases: every one, each within the server time (so is each call's).
        assert set(r["phases_p50_us"]) == set(PHASES), r
        for phase, us in r["phases_p50_us"].items():
            assert 0 <= us <= r["server_p50_us"] + CLOCK_SLACK_US, (phase, r)
        assert r["phases_p50_us"]["kernel"] > 0 and r["phases_p50_us"]["plan"] > 0, r

    # The raw stream moves the bytes the inline path moves.
    for r in transport:
        assert (r["in_bytes"], r["out_bytes"]) == (LHS_BYTES, OUT_BYTES), r
        assert r["checked"] == r["completed"], r
        assert r["payload_bytes"] == r["completed"] * (LHS_BYTES + OUT_BYTES), r

    floors = doc["floors"]["cpu-small"]
    assert floors["local_p50_us"] > 0 and floors["raw_stream_rtt_p50_us"] > 0

    assert sorted(doc["plots"]) == sorted(f"{kind}_cpu-small.png" for kind in ("latency", "throughput", "phases"))
    for name in doc["plots"]:
        assert_valid_png(out / name)


def test_request_rate_sweep_counts_what_it_sent(tmp_path):
    rate, outstanding, iters = 2000, 2, 12
    _, doc = sweep(tmp_path, "--paths=resident,inline", "--transport=", f"--request_rate={rate}",
                   "--arrivals=constant", f"--max_outstanding={outstanding}", f"--iters={iters}")
    assert doc["failures"] == [] and doc["wrong"] == 0
    rows = doc["results"]
    assert sorted(r["path"] for r in rows) == ["inline", "resident"]
    for r in rows:
        assert r["mode"] == "rate" and r["request_rate"] == rate and r["max_outstanding"] == outstanding, r
        assert r["attempted"] == r["completed"] == iters, r
        assert 0 <= r["late"] <= iters and r["late_max_us"] >= 0, r
        assert r["late"] > 0 or r["late_max_us"] == 0, r
        assert_ordered(r, "rtt")
        assert r["calls_per_s"] == pytest.approx(r["completed"] / r["wall_s"], rel=1e-9), r
        # An open loop at `rate` spends at least the last arrival's time: (iters - 1) / rate.
        assert r["wall_s"] >= (iters - 1) / rate, r
        assert r["calls_per_s"] <= outstanding / (r["rtt_mean_us"] * 1e-6) * (1 + 1e-9), r
    assert doc["plots"]
