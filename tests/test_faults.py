"""A worker killed and replaced (issue: faults), CPU workers on loopback.

The coordinator's heartbeat marks a killed worker down within a few
heartbeats: the mesh reports it, requests fail at once naming the rank, and
a worker started afresh (on a new port) takes the rank; the next request is
right."""
import os
import signal
import time

import grpc
import numpy as np
import pytest

from conftest import BIN


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((4, 32, 16)).astype(np.float32),
            [10, 22, 20, 12])


def reference(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    for shard in range(2):
        row = shard * lhs.shape[0] // 2
        for g in range(2):
            n = sizes[shard * 2 + g]
            out[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
    return out


def gemm(client, seed):
    lhs, rhs, sizes = inputs(seed)
    out, _ = client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                 group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)


def wait_until(predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_killed_worker_is_down_within_its_heartbeats_and_a_new_one_takes_its_rank(cluster_factory):
    cl = cluster_factory(mesh="ep=2", workers=2,
                         coordinator_flags=["--heartbeat_interval_s=0.2", "--heartbeat_misses=2"])
    gemm(cl.client, 1)
    victim = dict(cl.procs)["worker1"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    killed = time.time()
    assert wait_until(lambda: not cl.client.cluster_info().ready, 5), "the mesh still reports ready"
    detected = time.time() - killed
    info = cl.client.cluster_info()
    down = [w.rank for w in info.workers if w.down]
    assert len(down) == 1
    rank = down[0]
    start = time.time()
    with pytest.raises(grpc.RpcError) as e:
        gemm(cl.client, 2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and f"worker rank {rank}" in e.value.details()
    assert time.time() - start < 1.0, "a request to a mesh with a dead worker fails at once"
    # A worker started afresh, on a port of its own, takes the rank.
    cl._start("worker1-restarted", [os.path.join(BIN, "shardgemm-worker"), f"--coordinator={cl.address}",
                                    "--backend=cpu", "--insecure"])
    assert wait_until(lambda: cl.client.cluster_info().ready, 10), cl.log_text()
    info = cl.client.cluster_info()
    assert not any(w.down for w in info.workers)
    gemm(cl.client, 3)
    print(f"down detected {detected:.2f} s after the kill")


def test_workers_register_again_by_themselves_with_a_restarted_coordinator(cluster_factory):
    cl = cluster_factory(mesh="fsdp=2", workers=2)
    rng = np.random.default_rng(11)
    lhs = rng.standard_normal((32, 16)).astype(np.float32)
    rhs = rng.standard_normal((2, 16, 8)).astype(np.float32)
    sizes = [10, 6, 8, 8]

    def gathered_gemm():
        # K of the weight split over fsdp: the plan all-gathers it, through the workers' Gloo group.
        out, _ = cl.client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(fsdp, None)", rhs_spec="(None, fsdp, None)",
                                        group_sizes_spec="(fsdp,)")
        want = np.zeros((32, 8), np.float32)
        for shard in range(2):
            row = shard * 16
            for g in range(2):
                n = sizes[shard * 2 + g]
                want[row:row + n] = lhs[row:row + n] @ rhs[g]
                row += n
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)

    gathered_gemm()
    cl.coordinator.send_signal(signal.SIGKILL)
    cl.coordinator.wait(timeout=10)
    restarted = time.time()
    cl._start("coordinator-restarted", [os.path.join(BIN, "shardgemm-coordinator"), f"--listen={cl.address}",
                                        "--mesh=fsdp=2", "--insecure"])

    def ready():
        try:
            return cl.client.cluster_info().ready
        except grpc.RpcError:
            return False

    assert wait_until(ready, 10), "the workers did not register again:\n" + cl.log_text()
    rejoined = time.time() - restarted
    assert rejoined < 5, f"the mesh took {rejoined:.1f} s"
    gathered_gemm()  # the collectives are rebuilt for the new session
    print(f"mesh ready {rejoined:.2f} s after the coordinator restarted")


def test_tensors_whose_shards_died_with_a_worker_are_reported_lost_never_served(cluster_factory):
    cl = cluster_factory(mesh="ep=2", workers=2,
                         coordinator_flags=["--heartbeat_interval_s=0.2", "--heartbeat_misses=2"])
    lhs, rhs, sizes = inputs(5)
    cl.client.put("experts", rhs, spec="(ep, None, None)")
    cl.client.put("replicated", rhs)  # every worker holds all of it: a survivor could serve it whole
    victim = dict(cl.procs)["worker0"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert wait_until(lambda: not cl.client.cluster_info().ready, 5)
    cl._start("worker0-restarted", [os.path.join(BIN, "shardgemm-worker"), f"--coordinator={cl.address}",
                                    "--backend=cpu", "--insecure"])
    assert wait_until(lambda: cl.client.cluster_info().ready, 10), cl.log_text()
    listed = {t.name: t for t in cl.client.list()}
    assert set(listed) == {"experts", "replicated"}
    for name in listed:
        assert listed[name].lost and "rejoined without its shard" in listed[name].lost_reason
        with pytest.raises(grpc.RpcError) as e:
            cl.client.get(name)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and name in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        cl.client.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    cl.client.delete("experts")
    cl.client.put("experts", rhs, spec="(ep, None, None)")
    out, _ = cl.client.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)


def test_a_coordinator_restarted_with_its_state_dir_serves_every_tensor_again(cluster_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    cl = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--state_dir={state}"])
    lhs, rhs, sizes = inputs(6)
    cl.client.put("experts", rhs, spec="(ep, None, None)")
    cl.client.put("replicated", rhs * 2)
    cl.client.put("dropped", rhs)
    cl.client.delete("dropped")
    cl.coordinator.send_signal(signal.SIGKILL)
    cl.coordinator.wait(timeout=10)
    restarted = time.time()
    cl._start("coordinator-restarted", [os.path.join(BIN, "shardgemm-coordinator"), f"--listen={cl.address}",
                                        "--mesh=ep=2", "--insecure", f"--state_dir={state}"])

    def ready():
        try:
            return cl.client.cluster_info().ready
        except grpc.RpcError:
            return False

    assert wait_until(ready, 10), cl.log_text()
    assert time.time() - restarted < 5
    listed = {t.name: t for t in cl.client.list()}
    assert set(listed) == {"experts", "replicated"} and not any(t.lost for t in listed.values())
    np.testing.assert_array_equal(cl.client.get("experts"), rhs)
    np.testing.assert_array_equal(cl.client.get("replicated"), rhs * 2)
    out, _ = cl.client.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)


def test_a_coordinator_refuses_a_state_file_it_cannot_read(tmp_path):
    (tmp_path / "registry.pb").write_bytes(b"\xff\xff not a registry")
    import subprocess
    p = subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0", "--insecure",
                        f"--state_dir={tmp_path}"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and "registry.pb" in p.stderr, p.stderr
