"""A real Prometheus server (Debian's prometheus) scrapes a coordinator and
two workers; the counts it stores, read back through its HTTP query API,
match the requests sent (some failing)."""
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

from conftest import free_port, wait_for_port
from test_observability import gemm_inputs, metrics_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (tools/setup.sh installs it)")


def query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(port, expr, want, timeout=30):
    """Polls `expr` until its single value is `want`; returns the last result."""
    deadline = time.time() + timeout
    result = None
    while time.time() < deadline:
        try:
            result = query(port, expr)
        except urllib.error.HTTPError as e:
            if e.code != 503:  # 503: Prometheus not ready yet (starting, or busy on a loaded machine)
                raise
            time.sleep(0.25)
            continue
        if len(result) == 1 and float(result[0]["value"][1]) == want:
            return result
        time.sleep(0.25)
    raise AssertionError(f"{expr}: wanted {want}, Prometheus has {result}")


@pytest.fixture
def prometheus(tmp_path):
    procs = []

    def start(targets):
        port = free_port()
        config = tmp_path / "prometheus.yml"
        jobs = [{"job_name": job, "scrape_interval": "1s", "scrape_timeout": "1s",
                 "static_configs": [{"targets": addrs}]} for job, addrs in targets.items()]
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
        log = open(tmp_path / "prometheus.log", "w")
        p = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        wait_for_port(port)
        return port

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_prometheus_scrapes_the_mesh_and_its_counts_match(cluster_factory, prometheus):
    cl = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--metrics_listen=127.0.0.1:0"],
                         worker_flags=["--metrics_listen=127.0.0.1:0", "--log_format=json"])
    coord_port = coordinator_metrics_port(cl)
    worker_ports = [metrics_port(cl, "worker0"), metrics_port(cl, "worker1")]
    prom = prometheus({"shardgemm-coordinator": [f"127.0.0.1:{coord_port}"],
                       "shardgemm-worker": [f"127.0.0.1:{p}" for p in worker_ports]})

    c = cl.client
    lhs, rhs, sizes = gemm_inputs(5)
    c.put("experts", rhs, spec="(ep, None, None)")
    for _ in range(4):
        c.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    for _ in range(3):  # group sizes that do not fit the mesh
        with pytest.raises(grpc.RpcError) as e:
            c.grouped_gemm(lhs, "experts", sizes[:3], lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        c.get("missing")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    wait_for(prom, 'up{job="shardgemm-coordinator"}', 1)
    wait_for(prom, 'sum(up{job="shardgemm-worker"})', 2)
    wait_for(prom, 'shardgemm_requests_total{op="grouped_gemm",code="OK"}', 4)
    wait_for(prom, 'shardgemm_requests_total{op="grouped_gemm",code="INVALID_ARGUMENT"}', 3)
    wait_for(prom, 'shardgemm_requests_total{op="get_tensor",code="NOT_FOUND"}', 1)
    wait_for(prom, 'shardgemm_requests_total{op="put_tensor",code="OK"}', 1)
    wait_for(prom, 'sum(shardgemm_requests_total{code!="OK",op!="get_cluster_info"})', 4)
    wait_for(prom, 'shardgemm_request_duration_seconds_count{op="grouped_gemm"}', 7)
    wait_for(prom, 'shardgemm_mesh_ready', 1)
    wait_for(prom, 'shardgemm_workers{state="registered"}', 2)
    wait_for(prom, 'shardgemm_resident_tensors', 1)
    # Every worker ran the 4 GEMM steps and the store; the failed requests never reached them.
    wait_for(prom, 'sum(shardgemm_worker_steps_total{op="gemm",code="OK"})', 8)
    wait_for(prom, 'count(shardgemm_worker_steps_total{op="store",code="OK"} == 1)', 2)
    wait_for(prom, 'sum(shardgemm_worker_step_duration_seconds_count{op="gemm"})', 8)
    # A histogram query Prometheus understands: the p99 GEMM latency is a finite number of seconds.
    p99 = query(prom, 'histogram_quantile(0.99, sum by (le) (shardgemm_request_duration_seconds_bucket{op="grouped_gemm"}))')
    assert len(p99) == 1 and 0 < float(p99[0]["value"][1]) < 60


def coordinator_metrics_port(cl):
    """The coordinator's serving line (text format) names its metrics port."""
    deadline = time.time() + 10
    path = os.path.join(cl.logs, "coordinator.log")
    while time.time() < deadline:
        for line in open(path):
            if " serving " in f" {line} " and "metrics_port=" in line:
                return int(line.split("metrics_port=")[1].split()[0])
        time.sleep(0.05)
    raise AssertionError(open(path).read())
