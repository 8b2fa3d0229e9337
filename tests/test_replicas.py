"""--replicas=2 (issue 26): every block of a resident tensor on two workers,
so that killing one loses none; the worker that takes its rank gets its
copies back from the others. CPU workers on loopback.

Mesh ep=2,fsdp=2 (rank = 2 * ep + fsdp): a tensor split over (ep, fsdp) has
four blocks, each with a standby copy on another worker; one split over ep
alone is on both fsdp ranks already (no standby copy); a replicated one is
on all four."""
import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest

from conftest import BIN
from polling import wait_until

MESH = "ep=2,fsdp=2"
FAST = ["--heartbeat_interval_s=0.2", "--heartbeat_misses=2"]


def ready(client):
    try:
        return client.cluster_info().ready
    except grpc.RpcError:
        return False


def restoring(client):
    return [t.name for t in client.list() if t.restoring]


def replace(cl, victim_name, new_name):
    """SIGKILLs the worker process `victim_name` and starts `new_name` on a port of its own;
    returns (its rank, the time the new worker's rank was ready)."""
    victim = dict(cl.procs)[victim_name]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert wait_until(lambda: not cl.client.cluster_info().ready, 5), "the mesh still reports ready"
    rank = [w.rank for w in cl.client.cluster_info().workers if w.down][0]
    cl._start(new_name, [os.path.join(BIN, "shardgemm-worker"), f"--coordinator={cl.address}", "--backend=cpu",
                         "--insecure", "--threads=1"])
    assert wait_until(lambda: ready(cl.client), 10), cl.log_text()
    return rank, time.time()


def ep_gemm(client, lhs, rhs, sizes, **kwargs):
    """Rows and experts over ep (each fsdp pair computes the same): no collectives."""
    return client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                               group_sizes_spec="(ep,)", **kwargs)[0]


def ep_reference(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    for shard in range(2):
        row = shard * lhs.shape[0] // 2
        for g in range(2):
            n = sizes[shard * 2 + g]
            out[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
    return out


def test_killing_a_worker_loses_no_resident_tensor_and_its_replacement_gets_every_copy_back(cluster_factory):
    cl = cluster_factory(mesh=MESH, workers=4, coordinator_flags=[*FAST, "--replicas=2"],
                         worker_flags=["--threads=1"])
    c = cl.client
    rng = np.random.default_rng(26)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    experts = rng.standard_normal((4, 32, 16)).astype(np.float32)
    sizes = [10, 22, 20, 12]
    big = rng.standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: 2 MiB a block
    c.put("experts", experts, spec="(ep, None, None)")      # each block on both fsdp ranks
    c.put("sharded", big, spec="((ep, fsdp), None)")        # four blocks, each with a standby copy
    c.put("replicated", experts * 2)                        # on every rank
    # A kept GEMM output, rows over (ep, fsdp): four blocks made on the workers.
    c.grouped_gemm(lhs, "experts", [4, 12, 10, 6, 8, 8, 12, 4], lhs_spec="((ep, fsdp), None)",
                   group_sizes_spec="((ep, fsdp),)", keep_output_as="kept")
    # Kept quantize outputs (FP8 data and scales), one expert a rank.
    w = rng.standard_normal((4, 32, 64)).astype(np.float32)
    c.put("w", w, spec="((ep, fsdp), None, None)")
    c.grouped_quantize("w", [32] * 4, group_sizes_spec="((ep, fsdp),)", flatten_axis=2,
                       keep_rowwise_data_as="w8", keep_scale_inv_as="w8_scale")
    names = ["experts", "sharded", "replicated", "kept", "w", "w8", "w8_scale"]
    want = {name: c.get(name) for name in names}
    assert all(t.replicas == 2 for t in c.list())

    info = c.cluster_info()
    assert info.replicas == 2
    standby = {w.rank: w.standby_bytes for w in info.workers}
    block = big.nbytes // 4
    assert all(b >= block for b in standby.values()), standby  # each holds another rank's block of "sharded"
    assert sum(standby.values()) == sum(want[n].nbytes for n in ["sharded", "kept", "w", "w8", "w8_scale"]), standby

    def check_everything():
        listed = {t.name: t for t in c.list()}
        assert set(listed) == set(names)
        for name in names:
            assert not listed[name].lost and not listed[name].restoring, listed[name]
            got = c.get(name)
            assert got.dtype == want[name].dtype and np.array_equal(got.view(np.uint8), want[name].view(np.uint8)), name
        np.testing.assert_allclose(ep_gemm(c, lhs, "experts", sizes), ep_reference(lhs, experts, sizes),
                                   rtol=1e-4, atol=1e-4)

    # Kill rank-holding worker 1; a new worker takes its rank.
    rank, joined = replace(cl, "worker1", "worker1-replacement")
    # Until its copies are back, a request that needs them is UNAVAILABLE and says so (never NOT_FOUND,
    # never DATA_LOSS, never a wrong answer).
    try:
        got = c.get("sharded")
        assert np.array_equal(got, big)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE and "restored" in e.details(), (e.code(), e.details())
    assert wait_until(lambda: not restoring(c), 30), cl.log_text()
    restored_after = time.time() - joined
    check_everything()
    print(f"rank {rank}: every copy back {restored_after:.2f} s after the new worker joined "
          f"({2 * block / 2**20:.0f} MiB of 'sharded' among them)")

    # A second worker after the restore: still nothing lost.
    rank2, joined = replace(cl, "worker2", "worker2-replacement")
    assert rank2 != rank
    assert wait_until(lambda: not restoring(c), 30), cl.log_text()
    print(f"rank {rank2}: every copy back {time.time() - joined:.2f} s after the new worker joined")
    check_everything()
    # Delete takes every copy: the name is free and the standby bytes are gone.
    for name in names:
        c.delete(name)
    assert wait_until(lambda: all(w.standby_bytes == 0 for w in c.cluster_info().workers), 5)


def test_a_restarted_coordinator_knows_where_the_copies_are(cluster_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    flags = [*FAST, "--replicas=2", f"--state_dir={state}"]
    cl = cluster_factory(mesh="fsdp=2", workers=2, coordinator_flags=flags)
    rng = np.random.default_rng(7)
    t = rng.standard_normal((64, 16)).astype(np.float32)
    cl.client.put("t", t, spec="(fsdp, None)")  # rank r's half also on the other rank
    cl.coordinator.send_signal(signal.SIGKILL)
    cl.coordinator.wait(timeout=10)
    cl._start("coordinator-restarted", [os.path.join(BIN, "shardgemm-coordinator"), f"--listen={cl.address}",
                                        "--mesh=fsdp=2", "--insecure", *flags])
    assert wait_until(lambda: ready(cl.client), 10), cl.log_text()
    assert wait_until(lambda: not restoring(cl.client), 10)
    listed = cl.client.list()
    assert len(listed) == 1 and not listed[0].lost and listed[0].replicas == 2
    assert sum(w.standby_bytes for w in cl.client.cluster_info().workers) == t.nbytes
    # A worker dies: its half comes back from the standby copy the restarted coordinator knew of.
    replace(cl, "worker0", "worker0-replacement")
    assert wait_until(lambda: not restoring(cl.client), 10), cl.log_text()
    np.testing.assert_array_equal(cl.client.get("t"), t)


def test_a_put_whose_standby_copies_do_not_fit_keeps_nothing(cluster_factory):
    cl = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--replicas=2"],
                         worker_flags=["--memory_budget_mb=1"])
    c = cl.client
    filler = np.ones((256, 256), np.float32)  # 256 KiB a worker: its half and the other's
    c.put("filler", filler, spec="(ep, None)")
    too_big = np.ones((448, 512), np.float32)  # 896 KiB: its half fits a worker, its half and a standby do not
    with pytest.raises(grpc.RpcError) as e:
        c.put("too_big", too_big, spec="(ep, None)")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--memory_budget_mb" in e.value.details() and "standby" in e.value.details(), e.value.details()
    assert [t.name for t in c.list()] == ["filler"]
    np.testing.assert_array_equal(c.get("filler"), filler)
    c.put("too_big", np.ones((64, 64), np.float32), spec="(ep, None)")  # the name is free, the room too
    assert sorted(t.name for t in c.list()) == ["filler", "too_big"]


@pytest.mark.parametrize("replicas", ["0", "5"])
def test_replicas_outside_the_mesh_are_refused_naming_the_flag(replicas):
    p = subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0", "--insecure",
                        f"--mesh={MESH}", f"--replicas={replicas}"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and f"--replicas={replicas}" in p.stderr, p.stderr
