"""Metrics endpoints and request logs of a real mesh (issue: operations).

A coordinator and two CPU workers with --metrics_listen and JSON logs: a
request id sent by the Python client shows in the coordinator's and every
worker's log line for that request, and the metrics endpoints show every
metric with HELP and TYPE and count what was sent."""
import json
import os
import re
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest

from conftest import BIN

COORDINATOR_METRICS = [
    "shardgemm_requests_total", "shardgemm_request_duration_seconds", "shardgemm_request_bytes_total",
    "shardgemm_requests_in_progress", "shardgemm_steps_in_flight", "shardgemm_workers",
    "shardgemm_mesh_ready", "shardgemm_mesh_epoch", "shardgemm_resident_tensors", "shardgemm_resident_bytes",
    "shardgemm_worker_call_failures_total", "shardgemm_standby_bytes", "shardgemm_resident_tensors_restoring",
    "shardgemm_restores_total", "shardgemm_restored_bytes_total", "shardgemm_coordinator_activation_bytes_total",
]
WORKER_METRICS = [
    "shardgemm_worker_steps_total", "shardgemm_worker_step_duration_seconds",
    "shardgemm_worker_step_phase_seconds", "shardgemm_worker_step_bytes_total",
    "shardgemm_worker_transfer_bytes_total", "shardgemm_worker_steps_waiting",
    "shardgemm_worker_memory_bytes", "shardgemm_worker_resident_shards",
    "shardgemm_worker_collective_failures_total", "shardgemm_worker_info", "shardgemm_worker_staged_bytes",
]


def log_events(path):
    events = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                events.append(json.loads(line))
    return events


def wait_for_event(path, predicate, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in log_events(path) if predicate(e)]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no matching line in {path}:\n" + open(path).read())


def metrics_port(cluster, name):
    serving = wait_for_event(os.path.join(cluster.logs, f"{name}.log"), lambda e: e.get("event") == "serving")
    return serving[0]["metrics_port"]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def sample(text, name, **labels):
    """The value of the sample `name{labels}` (labels in any order), or None."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if got == {k: str(v) for k, v in labels.items()}:
            return float(m.group(4))
    return None


@pytest.fixture
def observed(cluster_factory):
    return cluster_factory(
        mesh="ep=2", workers=2,
        coordinator_flags=["--metrics_listen=127.0.0.1:0", "--log_format=json"],
        worker_flags=["--metrics_listen=127.0.0.1:0", "--log_format=json"])


def gemm_inputs(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((4, 32, 16)).astype(np.float32)
    return lhs, rhs, [10, 22, 20, 12]  # per row shard (ep=2): its 2 local experts


def test_request_id_appears_in_the_coordinator_and_every_worker_log(observed):
    c = observed.client
    lhs, rhs, sizes = gemm_inputs()
    c.put("experts", rhs, spec="(ep, None, None)", request_id="put-7")
    out, _ = c.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)",
                            request_id="moe-layer-3.step-41")
    assert c.last_request_id == "moe-layer-3.step-41"
    assert out.shape == (64, 16)

    coord = os.path.join(observed.logs, "coordinator.log")
    [line] = wait_for_event(coord, lambda e: e.get("event") == "request" and
                            e.get("request_id") == "moe-layer-3.step-41")
    assert line["op"] == "grouped_gemm" and line["code"] == "OK" and line["component"] == "coordinator"
    assert "grouped_gemm_ragged_m" in line["plan"] and line["server_ms"] > 0 and line["worker_ms"] > 0
    assert line["bytes_in"] > lhs.nbytes and line["bytes_out"] > 0
    for w in ("worker0", "worker1"):
        path = os.path.join(observed.logs, f"{w}.log")
        [step] = wait_for_event(path, lambda e: e.get("event") == "step" and
                                e.get("request_id") == "moe-layer-3.step-41")
        assert step["op"] == "gemm" and step["code"] == "OK" and step["component"] == "worker"
        for key in ("step_ms", "kernel_ms", "collective_ms", "transfer_ms"):
            assert step[key] >= 0
        wait_for_event(path, lambda e: e.get("event") == "step" and e.get("request_id") == "put-7"
                       and e["op"] == "store")


def test_a_request_without_an_id_gets_one_and_a_bad_id_is_replaced(observed):
    c = observed.client
    lhs, rhs, sizes = gemm_inputs(1)
    c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    made = c.last_request_id
    assert made and re.fullmatch(r"[0-9a-f]{16}", made)
    coord = os.path.join(observed.logs, "coordinator.log")
    wait_for_event(coord, lambda e: e.get("request_id") == made and e.get("op") == "grouped_gemm")
    c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                   group_sizes_spec="(ep,)", request_id="has spaces & quotes\"" + "x" * 200)
    assert c.last_request_id != made and re.fullmatch(r"[0-9a-f]{16}", c.last_request_id)


def test_failed_requests_log_a_warning_with_the_message(observed):
    c = observed.client
    with pytest.raises(grpc.RpcError) as e:
        c.delete("no-such-tensor", request_id="del-1")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    coord = os.path.join(observed.logs, "coordinator.log")
    [line] = wait_for_event(coord, lambda e: e.get("request_id") == "del-1")
    assert line["level"] == "warning" and line["code"] == "NOT_FOUND" and "no-such-tensor" in line["message"]


def test_metrics_endpoints_show_every_metric_and_count_what_was_sent(observed):
    c = observed.client
    lhs, rhs, sizes = gemm_inputs(2)
    c.put("w", rhs, spec="(ep, None, None)")
    for _ in range(3):
        c.grouped_gemm(lhs, "w", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            c.grouped_gemm(lhs, "w", sizes[:3], lhs_spec="(ep, None)", group_sizes_spec="(ep,)")

    text = scrape(metrics_port(observed, "coordinator"))
    for name in COORDINATOR_METRICS:
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text, name
    assert sample(text, "shardgemm_requests_total", op="grouped_gemm", code="OK") == 3
    assert sample(text, "shardgemm_requests_total", op="grouped_gemm", code="INVALID_ARGUMENT") == 2
    assert sample(text, "shardgemm_requests_total", op="put_tensor", code="OK") == 1
    assert sample(text, "shardgemm_request_duration_seconds_count", op="grouped_gemm") == 5
    assert sample(text, "shardgemm_request_duration_seconds_bucket", op="grouped_gemm", le="+Inf") == 5
    assert sample(text, "shardgemm_request_bytes_total", direction="in", path="stream") == rhs.nbytes
    assert sample(text, "shardgemm_workers", state="registered") == 2
    assert sample(text, "shardgemm_mesh_ready") == 1
    assert sample(text, "shardgemm_resident_tensors") == 1
    assert sample(text, "shardgemm_resident_bytes") == rhs.nbytes
    assert sample(text, "shardgemm_requests_in_progress") == 0

    for w in ("worker0", "worker1"):
        wtext = scrape(metrics_port(observed, w))
        for name in WORKER_METRICS:
            assert f"# HELP {name} " in wtext and f"# TYPE {name} " in wtext, (w, name)
        # The bad requests failed on the coordinator: workers saw 3 GEMM steps and one store.
        assert sample(wtext, "shardgemm_worker_steps_total", op="gemm", code="OK") == 3
        assert sample(wtext, "shardgemm_worker_steps_total", op="store", code="OK") == 1
        assert sample(wtext, "shardgemm_worker_step_phase_seconds_count", phase="kernel") == 3
        assert sample(wtext, "shardgemm_worker_resident_shards") == 1
        assert sample(wtext, "shardgemm_worker_memory_bytes", memory="host", kind="budget") == 4096 * 2**20
        assert sample(wtext, "shardgemm_worker_memory_bytes", memory="host", kind="used") == rhs.nbytes // 2


def test_metrics_show_the_direct_path_touching_no_coordinator_bytes(observed):
    c = observed.client
    lhs, rhs, sizes = gemm_inputs(3)
    kwargs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    inline, _ = c.grouped_gemm(lhs, rhs, sizes, path="inline", **kwargs)
    direct, _ = c.grouped_gemm(lhs, rhs, sizes, path="direct", **kwargs)
    assert direct.tobytes() == inline.tobytes()
    text = scrape(metrics_port(observed, "coordinator"))
    # Inline: lhs and rhs decoded, the output encoded; direct: none of them.
    assert sample(text, "shardgemm_coordinator_activation_bytes_total", path="inline") == \
        lhs.nbytes + rhs.nbytes + inline.nbytes
    assert sample(text, "shardgemm_coordinator_activation_bytes_total", path="direct") == 0
    assert sample(text, "shardgemm_requests_total", op="plan_staging", code="OK") == 1
    for w in ("worker0", "worker1"):
        wtext = scrape(metrics_port(observed, w))
        assert sample(wtext, "shardgemm_worker_staged_bytes", kind="used") == 0  # claimed and fetched
        assert sample(wtext, "shardgemm_worker_staged_bytes", kind="budget") == 2**30
    # A quantize is inline: x decoded, its outputs encoded.
    before = sample(text, "shardgemm_coordinator_activation_bytes_total", path="inline")
    q = c.grouped_quantize(lhs, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)")
    out_bytes = sum(len(t.data) for t in (q.rowwise_data, q.colwise_data, q.scale_inv, q.colwise_scale_inv, q.amax))
    assert out_bytes > 0
    after = sample(scrape(metrics_port(observed, "coordinator")), "shardgemm_coordinator_activation_bytes_total",
                   path="inline")
    assert after - before == lhs.nbytes + out_bytes


def run_fails(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    return p.returncode, p.stderr


def test_bad_observability_flags_are_refused_naming_the_flag():
    rc, err = run_fails([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0", "--insecure", "--log_format=xml"])
    assert rc != 0 and "log_format" in err
    rc, err = run_fails([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0", "--insecure", "--log_level=loud"])
    assert rc != 0 and "log_level" in err
    rc, err = run_fails([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0", "--insecure",
                         "--metrics_listen=nowhere"])
    assert rc != 0 and "metrics_listen" in err
    rc, err = run_fails([os.path.join(BIN, "shardgemm-worker"), "--backend=cpu", "--insecure", "--log_format=yaml"])
    assert rc != 0 and "log_format" in err


def test_logfmt_lines_carry_the_request_id(cluster_factory):
    cl = cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--log_format=logfmt"],
                         worker_flags=["--log_format=logfmt"])
    lhs, rhs, sizes = gemm_inputs(3)
    cl.client.grouped_gemm(lhs, rhs, sizes, request_id="lf-1")
    deadline = time.time() + 10
    while time.time() < deadline:
        coord = open(os.path.join(cl.logs, "coordinator.log")).read()
        worker = open(os.path.join(cl.logs, "worker0.log")).read()
        if "request_id=lf-1" in coord and "request_id=lf-1" in worker:
            break
        time.sleep(0.05)
    assert re.search(r"level=info component=coordinator event=request request_id=lf-1 op=grouped_gemm code=OK", coord)
    assert re.search(r"component=worker event=step request_id=lf-1 sequence=\d+ op=gemm code=OK", worker)


def test_the_rendezvous_store_forgets_a_groups_keys_once_it_is_connected(cluster_factory):
    cl = cluster_factory(mesh="fsdp=2", workers=2, coordinator_flags=["--metrics_listen=127.0.0.1:0",
                                                                     "--log_format=json"])
    rng = np.random.default_rng(7)
    lhs = rng.standard_normal((32, 16)).astype(np.float32)
    rhs = rng.standard_normal((2, 16, 8)).astype(np.float32)
    # The weight's K split over fsdp: the plan all-gathers it, which builds the workers' Gloo group.
    out, plan = cl.client.grouped_gemm(lhs, rhs, [10, 6, 8, 8], lhs_spec="(fsdp, None)",
                                       rhs_spec="(None, fsdp, None)", group_sizes_spec="(fsdp,)", include_plan=True)
    assert len(plan.collectives) > 0 and out.shape == (32, 8)
    port = metrics_port(cl, "coordinator")
    deadline = time.time() + 10
    while time.time() < deadline:
        if sample(scrape(port), "shardgemm_rendezvous_keys") == 0:
            break
        time.sleep(0.1)
    text = scrape(port)
    assert sample(text, "shardgemm_rendezvous_keys") == 0, text
    assert sample(text, "shardgemm_rendezvous_bytes") == 0
