"""Every request's steps carry a deadline (the client's, or the server's
--step_timeout, an absl duration): a frozen worker fails a request in time instead of holding
it, and the mesh serves the next request once the worker is back."""
import os
import signal
import time

import grpc
import numpy as np
import pytest

from reference import assert_close

rng = np.random.default_rng(5)


def _gemm(client, lhs, rhs, sizes, timeout):
    req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    return client.stub.GroupedGemm(req, timeout=timeout)


def _reference(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    rows = lhs.shape[0] // 2
    for shard in range(2):
        row = shard * rows
        for g, n in enumerate(sizes[shard * 2:(shard + 1) * 2]):
            out[row:row + n] = lhs[row:row + n] @ rhs[g]
            row += n
    return out


def test_frozen_worker_fails_requests_by_their_deadline_and_the_mesh_recovers(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--step_timeout=3s"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    out, _ = client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    assert_close(out, _reference(lhs, rhs, sizes), 32)

    worker = next(p for name, p in c.procs if name == "worker1")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # The client's deadline.
        start = time.time()
        with pytest.raises(grpc.RpcError) as err:
            _gemm(client, lhs, rhs, sizes, timeout=1.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.time() - start < 4
        # No earlier client deadline: the server's step timeout (3 s) bounds it.
        start = time.time()
        with pytest.raises(grpc.RpcError) as err:
            _gemm(client, lhs, rhs, sizes, timeout=60)
        took = time.time() - start
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert "worker" in err.value.details()
        assert 2.5 < took < 10, took
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    # Back: the worker runs the steps it missed in order, then this one.
    resp = _gemm(client, lhs, rhs, sizes, timeout=30)
    from shardgemm_client import from_tensor
    assert_close(from_tensor(resp.out), _reference(lhs, rhs, sizes), 32)
    assert c.alive()


def test_a_cancelled_keep_output_as_keeps_nothing_and_the_mesh_serves_the_next(cluster_factory):
    """A client that cancels while a worker is frozen: the request ends
    CANCELLED (the coordinator's log line says so), nothing is kept under
    the name, and once the worker is back the name is free and the next
    request is right. (gRPC 1.51's server hears of the cancellation only when
    the frozen worker answers, on the callback API as on the sync one, so
    the wait itself is bounded by the deadline, not cut short.)"""
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--step_timeout_s=20"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    worker = next(p for name, p in c.procs if name == "worker1")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)",
                                  keep_output_as="y")
        call = client.stub.GroupedGemm.future(req, timeout=60)
        time.sleep(0.5)
        call.cancel()
        time.sleep(0.5)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    deadline = time.time() + 10
    while time.time() < deadline and "code=CANCELLED" not in c.log_text():
        time.sleep(0.05)
    assert "op=grouped_gemm code=CANCELLED" in c.log_text(), c.log_text()
    assert "y" not in {t.name for t in client.list()}
    out, _ = client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)",
                                 keep_output_as="y")
    assert out is None and "y" in {t.name for t in client.list()}
    assert_close(client.get("y"), _reference(lhs, rhs, sizes), 32)



def test_the_request_after_an_expired_large_gemm_is_not_held_by_it(cluster_factory):
    """A GEMM whose deadline passes while its worker computes stops between
    tiles (its step's deadline, and the coordinator's CancelSteps), so the
    request sent right after it waits for no leftover work: over 5 tries its
    p50 is within 1.5x (+10 ms) of the idle mesh's. Before, each such request
    waited out the rest of the large GEMM (about a second here)."""
    import ml_dtypes
    c = cluster_factory(mesh="dp=1", workers=1)
    client = c.client
    big = np.random.default_rng(7)
    client.put("big_x", big.standard_normal((8192, 4096), np.float32).astype(ml_dtypes.bfloat16), spec="()")
    client.put("big_w", big.standard_normal((2, 4096, 4096), np.float32).astype(ml_dtypes.bfloat16), spec="()")
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [40, 24]
    client.put("x", lhs, spec="()")
    client.put("w", rhs, spec="()")

    def small():
        start = time.perf_counter()
        out, _ = client.grouped_gemm("x", "w", sizes)
        took = time.perf_counter() - start
        np.testing.assert_allclose(out[:40], lhs[:40] @ rhs[0], rtol=1e-4, atol=1e-4)
        return took

    for _ in range(3):
        small()
    idle = float(np.median([small() for _ in range(9)]))
    after = []
    for _ in range(5):
        req = client.gemm_request("big_x", "big_w", [4096, 4096], keep_output_as="big_y", overwrite_output=True)
        with pytest.raises(grpc.RpcError) as e:
            client.stub.GroupedGemm(req, timeout=0.4)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        after.append(small())
    print(f"idle p50 {idle * 1e3:.2f} ms; after an expired large GEMM: "
          f"{', '.join(f'{t * 1e3:.2f}' for t in after)} ms (p50 {np.median(after) * 1e3:.2f})")
    assert float(np.median(after)) <= 1.5 * idle + 0.010, (idle, after)
    assert "big_y" not in {t.name for t in client.list()}


@pytest.mark.parametrize("flag", ["--step_timeout=soon", "--step_timeout=-1s", "--step_timeout=0s",
                                  "--step_timeout_s=-2", "--step_timeout=inf"])
def test_the_coordinator_refuses_a_step_timeout_that_is_no_positive_finite_duration(flag):
    import subprocess
    from conftest import BIN
    r = subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), "--insecure", "--mesh=dp=1",
                        "--listen=127.0.0.1:0", flag], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "step_timeout" in r.stderr, r.stderr
