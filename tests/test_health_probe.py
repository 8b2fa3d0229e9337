"""shardgemm-health-probe (the images' HEALTHCHECK): exit 0 only when the server
answers grpc.health.v1 SERVING; a closed port fails within --timeout_s."""
import os
import subprocess
import time

import pytest

from conftest import BIN, ROOT, free_port


def probe_path():
    for path in (os.path.join(BIN, "shardgemm-health-probe"),
                 os.path.join(ROOT, "bazel-bin", "client", "shardgemm-health-probe")):
        if os.access(path, os.X_OK):
            return path
    pytest.fail("shardgemm-health-probe is not built (bazel build //client:shardgemm-health-probe)")


def probe(*flags, timeout=30):
    start = time.monotonic()
    r = subprocess.run([probe_path(), *flags], capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - start


def test_probe_serving_coordinator_and_worker(cluster):
    r, _ = probe(f"--addr={cluster.address}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "status: SERVING" in r.stdout
    worker = cluster.client.cluster_info().workers[0].address
    r, _ = probe(f"--addr={worker}")
    assert r.returncode == 0, r.stdout + r.stderr


def test_probe_unknown_service_fails(cluster):
    r, _ = probe(f"--addr={cluster.address}", "--service=no.such.Service")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "service name unknown" in r.stderr


def test_probe_closed_port_fails_within_timeout():
    r, elapsed = probe(f"--addr=127.0.0.1:{free_port()}", "--timeout_s=1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert elapsed < 5, f"took {elapsed:.1f} s with --timeout_s=1"


def test_probe_fails_once_the_server_stopped(cluster):
    assert probe(f"--addr={cluster.address}")[0].returncode == 0
    cluster.stop()
    r, elapsed = probe(f"--addr={cluster.address}", "--timeout_s=1")
    assert r.returncode != 0
    assert elapsed < 5


def test_probe_refuses_missing_addr():
    r, _ = probe()
    assert r.returncode == 1


def test_probe_on_the_health_ports_of_a_tls_mesh(cluster_factory, mesh_certs):
    """As in the images: the servers speak TLS on their main ports and serve a
    plaintext health-only port (--health_listen), which the probe checks."""
    coordinator_health, worker_health = free_port(), free_port()
    c = cluster_factory(tls_dir=mesh_certs, coordinator_flags=[f"--health_listen=127.0.0.1:{coordinator_health}"],
                        worker_flags=[f"--health_listen=127.0.0.1:{worker_health}"])
    for port in (coordinator_health, worker_health):
        r, _ = probe(f"--addr=127.0.0.1:{port}")
        assert r.returncode == 0, r.stdout + r.stderr
    r, elapsed = probe(f"--addr={c.address}", "--timeout_s=1")  # plaintext against the TLS port
    assert r.returncode != 0, r.stdout
    assert elapsed < 5
