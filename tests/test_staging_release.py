"""Staged blocks a request will never use leave the workers at once, not
at their TTL (docs/architecture.md, "The direct path"): a failed request's
other blocks and held outputs, a plan its client releases (ReleaseStaging),
a get whose holds failed partway; and one tenant holds at most its share of
a worker's staging budget (--staging_tenant_share)."""
import asyncio
import hashlib
import os
import shutil
import time

import grpc
import numpy as np
import pytest

import shardgemm
from shardgemm_client import pb, pb_grpc
from test_direct_path import gemm_meta, rand, raw, stage, stage_plan, staged_bytes, submit

# Every test here runs with the default --staged_block_ttl (60 s): what it
# sees freed within this bound was dropped, not expired.
FREED_WITHIN_S = 2.0


def wait_freed(cluster, want=None, bound=FREED_WITHIN_S):
    """Polls each worker's staged bytes until they are `want` (all 0 by
    default) or the bound passes; returns the last reading."""
    deadline = time.monotonic() + bound
    while True:
        held = staged_bytes(cluster)
        if held == (want if want is not None else [0] * len(held)) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def test_a_failed_request_drops_the_other_ranks_held_outputs_at_once(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2)
    ch, stub = raw(cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs, skip={(pb.TENSOR_LHS, 1)})  # rank 1's step fails; rank 0's runs and holds its out
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, req, plan.staging_id, direct_output=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "lhs.staged" in e.value.details()
    assert wait_freed(cluster) == [0, 0]
    ch.close()


def test_a_failed_quantize_drops_its_staged_blocks_at_once(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2)
    ch, stub = raw(cluster)
    x = rand(64, 32)
    req = pb.GroupedQuantizeRequest(x=pb.Tensor(dtype=pb.F32, shape=[64, 32], spec="(dp, None)"),
                                    group_sizes=shardgemm.to_tensor(np.array([32, 32], np.int64), "(dp,)"),
                                    out_dtype=pb.F8E4M3, rowwise=True)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_quantize=req), timeout=10)
    blocks = plan.operands[0].blocks
    stage(blocks[0].destinations[0].address, blocks[0].destinations[0].ticket,
          np.ascontiguousarray(x[:32]).tobytes())  # rank 1's never comes
    assert sum(staged_bytes(cluster)) == 32 * 32 * 4
    r = pb.GroupedQuantizeRequest()
    r.CopyFrom(req)
    r.x.staged = plan.staging_id
    with pytest.raises(grpc.RpcError) as e:
        stub.GroupedQuantize(r, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "x.staged" in e.value.details()
    assert wait_freed(cluster) == [0, 0]
    ch.close()


def test_release_staging_drops_a_plans_blocks_and_says_what_it_did(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2)
    ch, stub = raw(cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs, skip={(pb.TENSOR_RHS, 1)})
    assert all(b > 0 for b in staged_bytes(cluster))
    r = stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=plan.staging_id), timeout=10)
    assert r.outcome == pb.RELEASE_DROPPED
    assert staged_bytes(cluster) == [0, 0]  # dropped before the answer
    again = stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=plan.staging_id), timeout=10)
    assert again.outcome == pb.RELEASE_ALREADY_RELEASED
    d = [x for o in plan.operands if o.role == pb.TENSOR_RHS for b in o.blocks for x in b.destinations
         if x.rank == 1][0]
    with pytest.raises(grpc.RpcError) as e:  # its tickets are gone from the workers too
        stage(d.address, d.ticket, rhs.tobytes())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, req, plan.staging_id)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "released" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id="0" * 32), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "staging_id" in e.value.details()
    # A plan already submitted is its request's: nothing is dropped.
    used = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(used, lhs, rhs)
    resp = submit(stub, req, used.staging_id, direct_output=True)
    assert stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=used.staging_id),
                               timeout=10).outcome == pb.RELEASE_PLAN_SUBMITTED
    assert sum(staged_bytes(cluster)) == sum(int(np.prod(b.shape)) * 4 for b in resp.out_blocks)  # still fetchable
    for b in resp.out_blocks:
        t = b.destinations[0]
        with grpc.insecure_channel(t.address) as wch:
            list(pb_grpc.StagingStub(wch).Fetch(pb.FetchRequest(ticket=t.ticket), timeout=10))
    assert staged_bytes(cluster) == [0, 0]
    ch.close()


def test_the_clients_release_a_plan_whose_stage_failed(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2)
    lhs, rhs, sizes = rand(64, 32), rand(2, 32, 16), np.array([16, 16, 16, 16], np.int64)
    kwargs = dict(lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="direct")
    bad = min(cluster.client.cluster_info().workers, key=lambda w: w.rank).staging_address

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "refused by the test"

    with shardgemm.Client(cluster.address, timeout=30) as c:
        real = c._staging_stub

        def stub_of(address):
            if address != bad:
                return real(address)

            class Failing:
                def Stage(self, chunks, timeout=None, metadata=None):
                    time.sleep(0.2)  # rank 1's blocks are staged by then
                    raise Refused()
            return Failing()

        c._staging_stub = stub_of
        with pytest.raises(shardgemm.ShardGemmError):
            c.grouped_gemm(lhs, rhs, sizes, **kwargs)
        assert staged_bytes(cluster) == [0, 0]  # released before the call raised
        c._staging_stub = real
        c.grouped_gemm(lhs, rhs, sizes, **kwargs)

    async def run():
        async with shardgemm.aio.Client(cluster.address, timeout=30) as c:
            real = c._staging_stub

            def stub_of(address):
                if address != bad:
                    return real(address)

                class Failing:
                    async def Stage(self, chunks, timeout=None, metadata=None):
                        await asyncio.sleep(0.2)
                        raise Refused()
                return Failing()

            c._staging_stub = stub_of
            with pytest.raises(shardgemm.ShardGemmError):
                await c.grouped_gemm(lhs, rhs, sizes, **kwargs)
            return staged_bytes(cluster)

    assert asyncio.run(run()) == [0, 0]


def test_a_get_whose_holds_fail_partway_frees_the_others_at_once(cluster_factory):
    # 8 KiB of staging per worker: rank 1's is filled, so its hold of the
    # tensor's block fails while rank 0's succeeds.
    cluster = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--staging_budget=8192",))
    ch, stub = raw(cluster)
    t = rand(64, 32)  # (dp, None): a 4096-byte block per rank
    with shardgemm.Client(cluster.address, timeout=30) as c:
        c.put("t", t, "(dp, None)", path="inline")
        lhs, rhs, sizes = rand(64, 32), rand(2, 32, 16), np.array([16, 16, 16, 16], np.int64)
        req = gemm_meta(lhs, rhs, sizes)
        plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        stage_plan(plan, lhs, rhs, skip={(pb.TENSOR_LHS, 0), (pb.TENSOR_RHS, 0)})  # rank 1: 4096 + 4096 bytes
        assert staged_bytes(cluster) == [0, 8192]
        with pytest.raises(grpc.RpcError) as e:
            stub.PlanFetch(pb.GetTensorRequest(name="t"), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--staging_budget" in e.value.details()
        assert wait_freed(cluster, want=[0, 8192]) == [0, 8192]  # rank 0's copy went at once
        assert stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=plan.staging_id),
                                   timeout=10).outcome == pb.RELEASE_DROPPED
        assert staged_bytes(cluster) == [0, 0]
        assert c.get("t", path="direct").tobytes() == t.tobytes()
    ch.close()


# ---------------------------------------------------------------- tenants --

@pytest.fixture
def tls_copy(mesh_certs, tmp_path):
    d = str(tmp_path / "tls")
    shutil.copytree(mesh_certs, d)
    return d


def add_token(tls_dir, tenant, grants=""):
    token = hashlib.sha256(os.urandom(16)).hexdigest()
    with open(os.path.join(tls_dir, "tokens"), "a") as f:
        f.write(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} {tenant} {grants}\n")
    return token


def test_a_tenant_holds_at_most_its_share_of_a_workers_staging(cluster_factory, tls_copy):
    other_token = add_token(tls_copy, "other")
    read_only = add_token(tls_copy, "demo", "read")
    # 16 KiB of staging per worker, half of it per tenant.
    cluster = cluster_factory(mesh="dp=2", workers=2, tls_dir=tls_copy,
                              worker_flags=("--staging_budget=16384", "--staging_tenant_share=0.5"))
    lhs, rhs, sizes = rand(64, 32), rand(2, 32, 16), np.array([16, 16, 16, 16], np.int64)
    req = gemm_meta(lhs, rhs, sizes)  # a 4096-byte lhs block and a 4096-byte rhs copy per rank
    with shardgemm.Client(cluster.address, timeout=30, tls_dir=tls_copy) as demo, \
            shardgemm.Client(cluster.address, timeout=30, tls_dir=tls_copy, token=other_token) as other, \
            shardgemm.Client(cluster.address, timeout=30, tls_dir=tls_copy, token=read_only) as reader:
        assert all(w.staging_tenant_limit_bytes == 8192 for w in demo.cluster_info().workers)

        def stage_as(client, plan, role, rank, data):
            d = [x for o in plan.operands if o.role == role for b in o.blocks for x in b.destinations
                 if x.rank == rank][0]
            return client._staging_stub(d.address).Stage(iter([pb.StageChunk(ticket=d.ticket, data=data)]),
                                                         timeout=10)

        first = demo.stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        second = demo.stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        stage_as(demo, first, pb.TENSOR_LHS, 0, b"\0" * 4096)
        stage_as(demo, first, pb.TENSOR_RHS, 0, b"\0" * 4096)  # demo holds its 8192 on rank 0
        with pytest.raises(grpc.RpcError) as e:
            stage_as(demo, second, pb.TENSOR_LHS, 0, b"\0" * 4096)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for part in ("tenant 'demo'", "holds 8192 bytes", "asks 4096", "limit there is 8192",
                     "--staging_tenant_share", "the worker at "):
            assert part in e.value.details(), (part, e.value.details())
        # The other tenant's share is its own, on the same worker.
        theirs = other.stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        stage_as(other, theirs, pb.TENSOR_LHS, 0, b"\0" * 4096)
        stage_as(other, theirs, pb.TENSOR_RHS, 0, b"\0" * 4096)
        # Releasing needs the plan's grant, and the plan's tenant.
        with pytest.raises(grpc.RpcError) as e:
            reader.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=first.staging_id), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "compute" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            other.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=first.staging_id), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another tenant" in e.value.details()
        demo.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=first.staging_id), timeout=10)
        stage_as(demo, second, pb.TENSOR_LHS, 0, b"\0" * 4096)  # its share is free again
        for client, plan in ((demo, second), (other, theirs)):
            client.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=plan.staging_id), timeout=10)
        # A GEMM that fits its share runs as before.
        inline, _ = demo.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)",
                                      path="inline")
        direct, _ = demo.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)",
                                      path="direct")
        assert direct.tobytes() == inline.tobytes()


# -------------------------------------------------------------------- CLI --

def cli(cluster, *args, timeout=60):
    import subprocess
    from conftest import BIN
    return subprocess.run([os.path.join(BIN, "shardgemm"), *args, *cluster.cli_flags()], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("spec", ["(dp, None)", ""], ids=["rows_split", "replicated"])
def test_cli_direct_put_then_get_is_bit_exact(cluster_factory, tmp_path, spec):
    cluster = cluster_factory(mesh="dp=2", workers=2)
    t = rand(96, 40)
    np.save(tmp_path / "t.npy", t)
    before = cluster.client.cluster_info()
    r = cli(cluster, "put", "t", f"--data={tmp_path}/t.npy", f"--spec={spec}", "--path=direct",
            "--direct_timeout=30s")
    assert r.returncode == 0, r.stderr
    assert f"{t.nbytes} bytes" in r.stdout
    r = cli(cluster, "get", "t", f"--out={tmp_path}/direct.npy", "--path=direct")
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "direct.npy")
    assert got.dtype == t.dtype and got.shape == t.shape and got.tobytes() == t.tobytes()
    r = cli(cluster, "get", "t", f"--out={tmp_path}/inline.npy")  # the inline path reads the same
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "inline.npy").tobytes() == t.tobytes()
    after = cluster.client.cluster_info()
    assert (after.inline_activation_bytes, after.direct_activation_bytes) == \
        (before.inline_activation_bytes, before.direct_activation_bytes)
    assert staged_bytes(cluster) == [0, 0]
    r = cli(cluster, "put", "t", f"--data={tmp_path}/t.npy", f"--spec={spec}", "--path=direct")
    assert r.returncode == 1 and "ALREADY_EXISTS" in r.stderr
    r = cli(cluster, "get", "nope", "--path=direct")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    r = cli(cluster, "get", "t", "--path=sideways")
    assert r.returncode == 1 and "--path" in r.stderr


def test_cli_direct_put_whose_stage_fails_releases_its_plan(cluster_factory, tmp_path):
    # With --replicas=2 rank 0 holds its block and a standby copy of rank
    # 1's, but its staging budget fits one: one of its stages fails, and the
    # copies staged meanwhile must not wait for their TTL.
    t = rand(64, 32)  # (dp, None): 4096-byte blocks
    cluster = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=("--replicas=2",),
                              worker_flags=("--staging_budget=4096",))
    np.save(tmp_path / "t.npy", t)
    r = cli(cluster, "put", "t", f"--data={tmp_path}/t.npy", "--spec=(dp, None)", "--path=direct")
    assert r.returncode == 1 and "RESOURCE_EXHAUSTED" in r.stderr and "staging at worker rank" in r.stderr
    assert staged_bytes(cluster) == [0, 0]
    assert "t" not in [x.name for x in cluster.client.list()]


def test_cli_direct_gemm_and_get_are_bounded_by_direct_timeout(cluster_factory, tmp_path):
    import signal
    cluster = cluster_factory(mesh="dp=2", workers=2)
    t = rand(64, 32)
    np.save(tmp_path / "t.npy", t)
    assert cli(cluster, "put", "t", f"--data={tmp_path}/t.npy", "--spec=(dp, None)").returncode == 0
    victim = dict(cluster.procs)["worker1"]
    os.kill(victim.pid, signal.SIGSTOP)  # its HoldShard never answers
    try:
        start = time.monotonic()
        r = cli(cluster, "get", "t", "--path=direct", "--direct_timeout=1s", timeout=30)
        elapsed = time.monotonic() - start
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert r.returncode == 1 and "DEADLINE_EXCEEDED" in r.stderr
    assert elapsed < 10, elapsed
