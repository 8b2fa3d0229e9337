"""The direct path (docs/architecture.md, "Data paths"): the client streams
each worker its blocks under the coordinator's tickets and fetches the
output blocks from the workers, and the coordinator touches none of those
bytes; every bad input gets a status naming the field and leaves nothing
staged or lost."""
import asyncio
import hashlib
import os
import shutil
import time

import grpc
import numpy as np
import pytest

import shardgemm
from shardgemm import _direct
from shardgemm_client import pb, pb_grpc

rng = np.random.default_rng(22)


def rand(*shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def sizes_for(shards, groups, rows):
    out = []
    for _ in range(shards):
        cut = np.sort(rng.integers(0, rows + 1, size=groups))
        out += [int(x) for x in np.diff(np.concatenate([[0], cut]))]
    return np.array(out, np.int64)


def staged_bytes(cluster):
    """Each worker's staged bytes (Worker.Status: a plaintext mesh answers anyone)."""
    held = []
    for w in cluster.client.cluster_info().workers:
        with grpc.insecure_channel(w.address) as ch:
            held.append(pb_grpc.WorkerStub(ch).Status(pb.WorkerStatusRequest(), timeout=10).staged_bytes)
    return held


def activation_bytes(cluster):
    info = cluster.client.cluster_info()
    return info.inline_activation_bytes, info.direct_activation_bytes


# (name, mesh, workers, M, K, N, G, lhs_spec, rhs_spec, gs_spec, out_spec, row_shards, groups_per_shard, options)
CASES = [
    ("ep", "ep=2", 2, 64, 32, 16, 4, "(ep, None)", "(ep, None, None)", "(ep,)", "", 2, 2, {}),
    ("ep_replicated_rhs", "ep=2", 2, 64, 32, 16, 4, "(ep, None)", "", "(ep,)", "", 2, 2, {}),
    ("tp_column", "tp=2", 2, 64, 32, 16, 4, "", "(None, None, tp)", "", "", 1, 4, {}),
    ("tp_row_reduce_scatter", "tp=2", 2, 64, 32, 16, 4, "(None, tp)", "(None, tp, None)", "", "(None, tp)", 1, 4, {}),
    ("fsdp_x_ep", "fsdp=2,ep=2", 4, 128, 32, 16, 4, "((fsdp, ep), None)", "(ep, fsdp, None)", "((fsdp, ep),)", "",
     4, 2, {}),
    ("fsdp_wgrad", "fsdp=2,ep=2", 4, 128, 32, 16, 4, "((fsdp, ep), None)", "((fsdp, ep), None)", "((fsdp, ep),)",
     "", 4, 4, {"ragged_k": True}),
    ("dp_x_tp_transposed_bias", "dp=2,tp=2", 4, 64, 32, 16, 4, "(dp, None)", "(None, tp, None)", "(dp,)", "", 2, 4,
     {"rhs_transposed": True, "bias": True}),
]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """One cluster per mesh, shared by the cases on it."""
    from conftest import Cluster
    made = {}

    def get(mesh, workers):
        if mesh not in made:
            made[mesh] = Cluster(tmp_path_factory.mktemp(mesh.replace(",", "_").replace("=", "")), mesh=mesh,
                                 workers=workers)
        return made[mesh]

    yield get
    for c in made.values():
        c.stop()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_direct_path_equals_inline_bit_for_bit_and_the_coordinator_touches_no_bytes(clusters, case, monkeypatch):
    name, mesh, workers, m, k, n, g, lhs_spec, rhs_spec, gs_spec, out_spec, shards, gps, opts = case
    cluster = clusters(mesh, workers)
    ragged_k = opts.get("ragged_k", False)
    lhs = rand(m, k)
    if ragged_k:
        rhs = rand(m, n)
    else:
        rhs = rand(g, n, k) if opts.get("rhs_transposed") else rand(g, k, n)
    bias = rand(g, n) if opts.get("bias") else None
    sizes = sizes_for(shards, gps, m // shards)
    kwargs = dict(lhs_spec=lhs_spec, rhs_spec=rhs_spec, group_sizes_spec=gs_spec, out_spec=out_spec,
                  rhs_transposed=opts.get("rhs_transposed", False), ragged_k=ragged_k)
    with shardgemm.Client(cluster.address, timeout=60) as c:
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, bias, path="inline", **kwargs)
        before = activation_bytes(cluster)
        direct, _ = c.grouped_gemm(lhs, rhs, sizes, bias, path="direct", **kwargs)
        after = activation_bytes(cluster)
        # By default NumPy operands go direct from DIRECT_MIN_BYTES up (lowered
        # here to keep the test small), inline below it.
        monkeypatch.setattr(_direct, "DIRECT_MIN_BYTES", lhs.nbytes)
        default, _ = c.grouped_gemm(lhs, rhs, sizes, bias, **kwargs)
        assert activation_bytes(cluster) == after
        monkeypatch.setattr(_direct, "DIRECT_MIN_BYTES", lhs.nbytes + 1)
        small_default, _ = c.grouped_gemm(lhs, rhs, sizes, bias, **kwargs)
        assert activation_bytes(cluster)[0] > after[0]
    assert direct.dtype == inline.dtype and direct.shape == inline.shape
    assert direct.tobytes() == inline.tobytes()
    assert default.tobytes() == inline.tobytes()
    assert small_default.tobytes() == inline.tobytes()
    assert after == before  # neither path's counter moved: the direct request's bytes never reached it
    assert before[0] > 0 and before[1] == 0
    assert staged_bytes(cluster) == [0] * workers


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "refused by the test"


def test_a_failed_upload_leaves_no_other_running_after_the_call_raises(clusters):
    cluster = clusters("dp=2", 2)
    lhs, rhs, sizes = rand(64, 32), rand(2, 32, 16), sizes_for(2, 2, 32)
    kwargs = dict(lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="direct")
    info = cluster.client.cluster_info()
    bad = min(info.workers, key=lambda w: w.rank).staging_address  # the plan lists rank 0's first
    calls = {"started": 0, "ended": 0}

    class Stub:  # rank 0's Stage fails at once; the others take a while
        def __init__(self, address):
            self.address = address

        def Stage(self, chunks, timeout=None, metadata=None):
            if self.address == bad:
                raise Refused()
            calls["started"] += 1
            try:
                time.sleep(0.3)
            finally:
                calls["ended"] += 1

    class AioStub(Stub):
        async def Stage(self, chunks, timeout=None, metadata=None):
            if self.address == bad:
                raise Refused()
            calls["started"] += 1
            try:
                await asyncio.sleep(0.3)
            finally:  # cancelled, or done
                calls["ended"] += 1

    with shardgemm.Client(cluster.address, timeout=30) as c:
        c._staging_stub = Stub
        with pytest.raises(shardgemm.ShardGemmError):
            c.grouped_gemm(lhs, rhs, sizes, **kwargs)
        assert calls["started"] >= 1 and calls["ended"] == calls["started"]  # none still running

    async def run():
        async with shardgemm.aio.Client(cluster.address, timeout=30) as c:
            c._staging_stub = AioStub
            with pytest.raises(shardgemm.ShardGemmError):
                await c.grouped_gemm(lhs, rhs, sizes, **kwargs)
            return dict(calls)

    calls.update(started=0, ended=0)
    after = asyncio.run(run())
    assert after["started"] == 2 and after["ended"] == 2


def test_asyncio_client_takes_the_direct_path_too(clusters):
    cluster = clusters("ep=2", 2)
    lhs, rhs, sizes = rand(64, 32), rand(4, 32, 16), sizes_for(2, 2, 32)
    kwargs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")

    async def run():
        async with shardgemm.aio.Client(cluster.address, timeout=60) as c:
            inline, _ = await c.grouped_gemm(lhs, rhs, sizes, path="inline", **kwargs)
            outs = await asyncio.gather(*(c.grouped_gemm(lhs, rhs, sizes, path="direct", **kwargs)
                                          for _ in range(3)))
            return inline, [o for o, _ in outs]

    before = activation_bytes(cluster)
    inline, directs = asyncio.run(run())
    for d in directs:
        assert d.tobytes() == inline.tobytes()
    assert activation_bytes(cluster)[1] == before[1]
    assert staged_bytes(cluster) == [0, 0]


def test_a_resident_weight_with_staged_activations_and_a_kept_output(clusters):
    cluster = clusters("ep=2", 2)
    lhs, rhs, sizes = rand(64, 32), rand(4, 32, 16), sizes_for(2, 2, 32)
    kwargs = dict(lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    with shardgemm.Client(cluster.address, timeout=60) as c:
        c.put("experts_direct", rhs, "(ep, None, None)", overwrite=True)
        inline, _ = c.grouped_gemm(lhs, "experts_direct", sizes, path="inline", **kwargs)
        direct, _ = c.grouped_gemm(lhs, "experts_direct", sizes, path="direct", **kwargs)
        assert direct.tobytes() == inline.tobytes()
        kept, _ = c.grouped_gemm(lhs, "experts_direct", sizes, path="direct", keep_output_as="y_direct",
                                 overwrite_output=True, **kwargs)
        assert kept is None
        assert c.get("y_direct").tobytes() == inline.tobytes()
    assert staged_bytes(cluster) == [0, 0]


def test_blocks_past_a_stream_message_and_concurrent_callers(clusters):
    """Blocks of several 1 MiB messages each way, and callers at once whose
    tickets never cross."""
    import concurrent.futures
    cluster = clusters("ep=2", 2)
    kwargs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    big_lhs, rhs = rand(6144, 256), rand(4, 256, 256)  # 3 MiB lhs blocks, 3 MiB output blocks
    big_sizes = np.array([1000, 2072, 3000, 72], np.int64)
    with shardgemm.Client(cluster.address, timeout=60) as c:
        inline, _ = c.grouped_gemm(big_lhs, rhs, big_sizes, path="inline", **kwargs)
        direct, _ = c.grouped_gemm(big_lhs, rhs, big_sizes, path="direct", **kwargs)
        assert direct.tobytes() == inline.tobytes()
        inputs = [(rand(64, 32), rand(4, 32, 16), sizes_for(2, 2, 32)) for _ in range(6)]
        wants = [c.grouped_gemm(l, r, s, path="inline", **kwargs)[0] for l, r, s in inputs]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            gots = list(pool.map(lambda a: c.grouped_gemm(*a, path="direct", **kwargs)[0], inputs))
    for got, want in zip(gots, wants):
        assert got.tobytes() == want.tobytes()
    assert staged_bytes(cluster) == [0, 0]


def test_a_direct_put_stores_each_block_where_it_belongs(clusters):
    cluster = clusters("fsdp=2,ep=2", 4)
    w, x = rand(4, 32, 16), rand(128, 32)
    sizes = sizes_for(4, 2, 32)
    kwargs = dict(lhs_spec="((fsdp, ep), None)", group_sizes_spec="((fsdp, ep),)")
    with shardgemm.Client(cluster.address, timeout=60) as c:
        seen = []
        r = c.put("w_direct", w, "(ep, fsdp, None)", overwrite=True, path="direct",
                  progress=lambda done, total: seen.append((done, total)))
        assert r.bytes == w.nbytes and seen[-1] == (w.nbytes, w.nbytes)  # four distinct blocks, one copy each
        assert c.get("w_direct").tobytes() == w.tobytes()  # the default: each block from a worker
        assert c.get("w_direct", path="inline").tobytes() == w.tobytes()
        got = []
        assert c.get("w_direct", path="direct", progress=lambda done, total: got.append((done, total))).tobytes() \
            == w.tobytes()
        assert got[-1] == (w.nbytes, w.nbytes) and len(got) == 4  # four distinct blocks, each read once
        c.put("w_inline", w, "(ep, fsdp, None)", overwrite=True, path="inline")
        a, _ = c.grouped_gemm(x, "w_direct", sizes, path="inline", **kwargs)
        b, _ = c.grouped_gemm(x, "w_inline", sizes, path="inline", **kwargs)
        assert a.tobytes() == b.tobytes()
        c.put("replicated_direct", w, "", overwrite=True)  # the default: direct; every rank its copy
        assert c.get("replicated_direct", path="direct").tobytes() == w.tobytes()
        with pytest.raises(shardgemm.NotFoundError):
            c.get("no_such_tensor", path="direct")
        with pytest.raises(shardgemm.AlreadyExistsError):
            c.put("w_direct", w, "(ep, fsdp, None)", path="direct")
        assert c.get("w_direct").tobytes() == w.tobytes()  # the refused put changed nothing
    assert staged_bytes(cluster) == [0] * 4


def test_a_direct_put_with_replicas_stages_the_standby_copies_too(cluster_factory):
    cluster = cluster_factory(mesh="ep=2,tp=2", workers=4, coordinator_flags=("--replicas=2",))
    w = rand(4, 32, 16)
    with shardgemm.Client(cluster.address, timeout=60) as c:
        seen = []
        c.put("w", w, "(ep, tp, None)", path="direct", progress=lambda done, total: seen.append((done, total)))
        assert seen[-1] == (2 * w.nbytes, 2 * w.nbytes)  # each block to its rank and to one standby holder
        assert c.get("w").tobytes() == w.tobytes()
        info = c.cluster_info()
        assert sum(x.standby_bytes for x in info.workers) == w.nbytes
    assert staged_bytes(cluster) == [0] * 4


QUANTIZE_CASES = [
    ("current_shared_scales", dict(shared_scales=True, colwise=True)),
    ("mxfp8", dict(scaling="mxfp8", rowwise=True, colwise=True)),
    ("block", dict(scaling="block")),
]


@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=[c[0] for c in QUANTIZE_CASES])
def test_quantize_with_a_staged_x_equals_inline_bit_for_bit(clusters, case):
    _, opts = case
    cluster = clusters("fsdp=2,ep=2", 4)
    x = (rng.standard_normal((512, 256)) * 3).astype(np.float32)
    sizes = np.array([64, 64] * 4, np.int64)  # per row shard: 2 groups of 64 rows (block-aligned)
    kwargs = dict(x_spec="((fsdp, ep), None)", group_sizes_spec="((fsdp, ep),)", **opts)
    fields = ("rowwise_data", "colwise_data", "scale_inv", "colwise_scale_inv", "amax")
    with shardgemm.Client(cluster.address, timeout=60) as c:
        inline = c.grouped_quantize(x, sizes, path="inline", **kwargs)
        before = activation_bytes(cluster)
        direct = c.grouped_quantize(x, sizes, path="direct", **kwargs)
        after = activation_bytes(cluster)
    for f in fields:
        assert getattr(direct, f).data == getattr(inline, f).data, f
    # x never reached the coordinator; the outputs came back through it.
    assert after[0] == before[0]
    assert after[1] - before[1] == sum(len(getattr(direct, f).data) for f in fields)
    assert staged_bytes(cluster) == [0] * 4


# ------------------------------------------------------------- bad input --

def raw(cluster):
    ch = grpc.insecure_channel(cluster.address)
    return ch, pb_grpc.ShardGemmStub(ch)


def stage(address, ticket, data, chunk=(1 << 20) - 4096, metadata=None):  # with its header within 1 MiB
    with grpc.insecure_channel(address) as ch:
        pieces = [data[i:i + chunk] for i in range(0, max(len(data), 1), chunk)]
        msgs = [pb.StageChunk(ticket=ticket, data=pieces[0])] + [pb.StageChunk(data=p) for p in pieces[1:]]
        return pb_grpc.StagingStub(ch).Stage(iter(msgs), timeout=10, metadata=metadata)


def gemm_meta(lhs, rhs, sizes):
    """A request whose lhs and rhs are to be staged (dtype, shape, spec; no data)."""
    return pb.GroupedGemmRequest(
        lhs=pb.Tensor(dtype=pb.F32, shape=list(lhs.shape), spec="(dp, None)"),
        rhs=pb.Tensor(dtype=pb.F32, shape=list(rhs.shape)),
        group_sizes=shardgemm.to_tensor(sizes, "(dp,)"))


def stage_plan(plan, lhs, rhs, skip=()):
    arrays = {pb.TENSOR_LHS: lhs, pb.TENSOR_RHS: rhs}
    for op in plan.operands:
        for b in op.blocks:
            block = np.ascontiguousarray(arrays[op.role][tuple(slice(o, o + s) for o, s in zip(b.offsets, b.shape))])
            for d in b.destinations:
                if (op.role, d.rank) not in skip:
                    stage(d.address, d.ticket, block.tobytes())


def submit(stub, req, staging_id, direct_output=False):
    """The request naming the staged blocks; its output inline unless
    direct_output (held on the workers until fetched or expired)."""
    r = pb.GroupedGemmRequest()
    r.CopyFrom(req)
    r.lhs.staged = staging_id
    r.rhs.staged = staging_id
    r.direct_output = direct_output
    return stub.GroupedGemm(r, timeout=30)


@pytest.fixture(scope="module")
def dp_cluster(clusters):
    cluster = clusters("dp=2", 2)
    with shardgemm.Client(cluster.address, timeout=30) as c:
        c.put("kept_weight", rand(2, 32, 16), "", overwrite=True)
    return cluster


def fetch_output(resp, shape):
    """A direct output (f32) fetched from its workers, each block once, assembled."""
    out = np.empty(shape, np.float32)
    for b in resp.out_blocks:
        t = b.destinations[0]
        with grpc.insecure_channel(t.address) as wch:
            data = b"".join(c.data for c in pb_grpc.StagingStub(wch).Fetch(pb.FetchRequest(ticket=t.ticket),
                                                                            timeout=10))
        out[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.shape))] = np.frombuffer(data, np.float32).reshape(
            b.shape)
    return out


def check_nothing_lost(cluster):
    assert staged_bytes(cluster) == [0, 0]
    with shardgemm.Client(cluster.address, timeout=30) as c:
        assert "kept_weight" in [t.name for t in c.list()]
        assert c.get("kept_weight").shape == (2, 32, 16)


def test_unknown_ticket_is_not_found_and_wrong_size_is_invalid_argument_naming_the_bytes(dp_cluster):
    ch, stub = raw(dp_cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=gemm_meta(lhs, rhs, sizes)), timeout=10)
    lhs_op = next(o for o in plan.operands if o.role == pb.TENSOR_LHS)
    dest = lhs_op.blocks[0].destinations[0]
    assert len(dest.ticket) >= 32 and lhs_op.blocks[0].shape == [8, 32]
    with pytest.raises(grpc.RpcError) as e:
        stage(dest.address, "0" * 32, b"\0" * 1024)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "ticket" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stage(dest.address, dest.ticket, b"\0" * 1000)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expects 1024" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stage(dest.address, dest.ticket, b"\0" * 1100, chunk=512)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1024 bytes" in e.value.details()
    # Another worker's ticket is unknown here: a worker accepts only its own.
    other = next(d for b in lhs_op.blocks for d in b.destinations if d.address != dest.address)
    with pytest.raises(grpc.RpcError) as e:
        stage(dest.address, other.ticket, b"\0" * 1024)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("ticket:")
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_reused_ticket_or_plan_is_failed_precondition_and_the_result_is_right(dp_cluster):
    ch, stub = raw(dp_cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs)
    d = plan.operands[0].blocks[0].destinations[0]
    with pytest.raises(grpc.RpcError) as e:
        stage(d.address, d.ticket, np.zeros(list(plan.operands[0].blocks[0].shape), np.float32).tobytes())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and e.value.details().startswith("ticket:")
    assert "staged already" in e.value.details()
    resp = submit(stub, req, plan.staging_id, direct_output=True)
    assert not resp.out.data and len(resp.out_blocks) == 2
    with shardgemm.Client(dp_cluster.address, timeout=30) as c:
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="inline")
    assert fetch_output(resp, inline.shape).tobytes() == inline.tobytes()
    for b in resp.out_blocks:
        t = b.destinations[0]
        with grpc.insecure_channel(t.address) as wch:
            with pytest.raises(grpc.RpcError) as e:  # each output block is fetched once
                list(pb_grpc.StagingStub(wch).Fetch(pb.FetchRequest(ticket=t.ticket), timeout=10))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, req, plan.staging_id, direct_output=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "lhs.staged" in e.value.details()
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_staged_block_of_the_wrong_shape_or_dtype_is_invalid_argument_naming_the_field(dp_cluster):
    ch, stub = raw(dp_cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs)
    for field, change, named in [("lhs", lambda t: t.shape.__setitem__(0, 32), "lhs.shape"),
                                 ("rhs", lambda t: setattr(t, "dtype", pb.BF16), "rhs.dtype"),
                                 ("lhs", lambda t: setattr(t, "spec", ""), "lhs.spec")]:
        bad = pb.GroupedGemmRequest()
        bad.CopyFrom(req)
        change(getattr(bad, field))
        with pytest.raises(grpc.RpcError) as e:
            submit(stub, bad, plan.staging_id)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value.details()
    submit(stub, req, plan.staging_id)  # the blocks were not consumed by the refused requests
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_block_not_staged_fails_the_request_naming_it_and_the_staged_ones_expire(dp_cluster):
    ch, stub = raw(dp_cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs, skip={(pb.TENSOR_LHS, 1)})
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, req, plan.staging_id)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lhs.staged" in e.value.details() and "not staged" in e.value.details()
    with shardgemm.Client(dp_cluster.address, timeout=30) as c:  # the mesh goes on
        c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="direct")
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_client_that_disconnects_mid_stream_leaves_nothing_staged(dp_cluster):
    ch, stub = raw(dp_cluster)
    lhs, rhs, sizes = rand(1024, 256), rand(2, 256, 16), np.array([256, 256, 256, 256], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    d = plan.operands[0].blocks[0].destinations[0]

    def gone():
        yield pb.StageChunk(ticket=d.ticket, data=b"\0" * (1 << 16))
        time.sleep(0.3)  # the worker holds a reservation meanwhile
        raise ConnectionError("the client went away")

    with grpc.insecure_channel(d.address) as wch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.StagingStub(wch).Stage(gone(), timeout=10)
        assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    deadline = time.time() + 10
    while staged_bytes(dp_cluster) != [0, 0] and time.time() < deadline:
        time.sleep(0.05)
    assert staged_bytes(dp_cluster) == [0, 0]
    # The ticket may be staged again, and the request then runs.
    stage_plan(plan, lhs, rhs)
    submit(stub, req, plan.staging_id)
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_client_that_disconnects_mid_fetch_may_fetch_again_and_nothing_leaks(dp_cluster):
    ch, stub = raw(dp_cluster)
    # 16 MiB output blocks: far more than the transport buffers, so the
    # worker is still writing when the client goes.
    lhs, rhs, sizes = rand(1024, 64), rand(2, 64, 8192), np.array([256, 256, 400, 112], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs)
    resp = submit(stub, req, plan.staging_id, direct_output=True)
    assert len(resp.out_blocks) == 2
    first = resp.out_blocks[0].destinations[0]
    with grpc.insecure_channel(first.address) as wch:
        chunks = pb_grpc.StagingStub(wch).Fetch(pb.FetchRequest(ticket=first.ticket), timeout=10)
        assert len(next(chunks).data) < 512 * 8192 * 4  # more than one chunk: the client goes mid-stream
        chunks.cancel()
    # The block is held still: fetched whole now, and then gone from the worker.
    with shardgemm.Client(dp_cluster.address, timeout=30) as c:
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="inline")
    assert fetch_output(resp, inline.shape).tobytes() == inline.tobytes()
    deadline = time.time() + 10
    while staged_bytes(dp_cluster) != [0, 0] and time.time() < deadline:
        time.sleep(0.05)
    assert staged_bytes(dp_cluster) == [0, 0]
    check_nothing_lost(dp_cluster)
    ch.close()


def test_staging_past_the_budget_is_resource_exhausted_naming_it(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--staging_budget=4096",))
    ch, stub = raw(cluster)
    lhs, rhs, sizes = rand(64, 32), rand(2, 32, 16), np.array([16, 16, 16, 16], np.int64)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=gemm_meta(lhs, rhs, sizes)), timeout=10)
    d = plan.operands[0].blocks[0].destinations[0]  # a 32x32 F32 block: 4096 bytes, the whole budget
    stage(d.address, d.ticket, b"\0" * 4096)
    rhs_d = next(x for o in plan.operands if o.role == pb.TENSOR_RHS for b in o.blocks for x in b.destinations
                 if x.address == d.address)
    with pytest.raises(grpc.RpcError) as e:
        stage(rhs_d.address, rhs_d.ticket, b"\0" * (2 * 32 * 16 * 4))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--staging_budget" in e.value.details()
    with shardgemm.Client(cluster.address, timeout=30) as c:  # the inline path is no worse off
        c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="inline")
    ch.close()


def test_stale_tickets_and_plans_are_not_found_and_their_bytes_expire(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--staged_block_ttl=1s",),
                              coordinator_flags=("--staging_ttl=1s",))
    ch, stub = raw(cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    req = gemm_meta(lhs, rhs, sizes)
    plan = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
    stage_plan(plan, lhs, rhs, skip={(pb.TENSOR_RHS, 0), (pb.TENSOR_RHS, 1)})
    assert sum(staged_bytes(cluster)) == lhs.nbytes
    time.sleep(1.5)
    assert staged_bytes(cluster) == [0, 0]  # the sweep freed the unclaimed blocks
    d = next(o for o in plan.operands if o.role == pb.TENSOR_RHS).blocks[0].destinations[0]
    with pytest.raises(grpc.RpcError) as e:
        stage(d.address, d.ticket, rhs.tobytes())
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("ticket:")
    assert "expired" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, req, plan.staging_id)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "lhs.staged" in e.value.details()
    # An output nobody fetches expires too.
    with shardgemm.Client(cluster.address, timeout=30) as c:
        p2 = stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        stage_plan(p2, lhs, rhs)
        resp = submit(stub, req, p2.staging_id, direct_output=True)
        assert len(resp.out_blocks) == 2 and sum(staged_bytes(cluster)) > 0
        time.sleep(1.5)
        assert staged_bytes(cluster) == [0, 0]
        c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", path="direct")
    ch.close()


def test_a_put_refused_for_its_name_leaves_its_plan_and_staged_blocks_for_another_try(dp_cluster):
    ch, stub = raw(dp_cluster)
    w = rand(2, 32, 16)
    plan = stub.PlanStaging(pb.StagingPlanRequest(put=pb.PutStagingRequest(
        name="taken_meanwhile", dtype=pb.F32, shape=list(w.shape), spec="")), timeout=10)
    for b in plan.operands[0].blocks:
        for d in b.destinations:
            stage(d.address, d.ticket, w.tobytes())
    with shardgemm.Client(dp_cluster.address, timeout=30) as c:
        c.put("taken_meanwhile", rand(2, 32, 16), path="inline")  # the name is taken after the plan
        with pytest.raises(grpc.RpcError) as e:
            stub.PutStaged(pb.PutStagedRequest(staging_id=plan.staging_id), timeout=10)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert sum(staged_bytes(dp_cluster)) == 2 * w.nbytes  # still staged, for the same plan
        c.delete("taken_meanwhile")
        stub.PutStaged(pb.PutStagedRequest(staging_id=plan.staging_id), timeout=10)
        np.testing.assert_array_equal(c.get("taken_meanwhile"), w)
        c.delete("taken_meanwhile")
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_put_plan_is_used_once_and_only_by_its_tenant(dp_cluster):
    ch, stub = raw(dp_cluster)
    w = rand(2, 32, 16)
    plan = stub.PlanStaging(pb.StagingPlanRequest(put=pb.PutStagingRequest(
        name="put_once", dtype=pb.F32, shape=list(w.shape), spec="")), timeout=10)
    assert len(plan.operands) == 1 and len(plan.operands[0].blocks) == 1
    assert len(plan.operands[0].blocks[0].destinations) == 2  # replicated: each rank its copy
    with pytest.raises(grpc.RpcError) as e:  # a block not staged yet fails the put, naming it
        stub.PutStaged(pb.PutStagedRequest(staging_id=plan.staging_id), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "shard.staged" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.PutStaged(pb.PutStagedRequest(staging_id=plan.staging_id), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "used already" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.PutStaged(pb.PutStagedRequest(staging_id="0" * 32), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "staging_id" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.PlanStaging(pb.StagingPlanRequest(put=pb.PutStagingRequest(
            name="bad", dtype=pb.F32, shape=[3, 32], spec="(dp, None)")), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with shardgemm.Client(dp_cluster.address, timeout=30) as c:
        assert "put_once" not in [t.name for t in c.list()]
    check_nothing_lost(dp_cluster)
    ch.close()


def test_a_plan_without_staging_workers_is_failed_precondition(cluster_factory):
    cluster = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--staging_port=-1",))
    ch, stub = raw(cluster)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    with pytest.raises(grpc.RpcError) as e:
        stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=gemm_meta(lhs, rhs, sizes)), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "staging" in e.value.details()
    with shardgemm.Client(cluster.address, timeout=30) as c:  # "auto" goes inline there
        out, _ = c.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
        assert out.shape == (16, 16)
    ch.close()


# ---------------------------------------------------------------- tenants --

@pytest.fixture
def tls_copy(mesh_certs, tmp_path):
    d = str(tmp_path / "tls")
    shutil.copytree(mesh_certs, d)
    return d


def add_token(tls_dir, tenant):
    token = hashlib.sha256(os.urandom(16)).hexdigest()
    with open(os.path.join(tls_dir, "tokens"), "a") as f:
        f.write(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} {tenant}\n")
    return token


def test_over_tls_a_ticket_or_plan_is_only_its_tenants(cluster_factory, tls_copy):
    other_token = add_token(tls_copy, "other")
    cluster = cluster_factory(mesh="dp=2", workers=2, tls_dir=tls_copy)
    lhs, rhs, sizes = rand(16, 32), rand(2, 32, 16), np.array([4, 4, 3, 5], np.int64)
    kwargs = dict(lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    with shardgemm.Client(cluster.address, timeout=30, tls_dir=tls_copy) as demo, \
            shardgemm.Client(cluster.address, timeout=30, tls_dir=tls_copy, token=other_token) as other:
        inline, _ = demo.grouped_gemm(lhs, rhs, sizes, path="inline", **kwargs)
        direct, _ = demo.grouped_gemm(lhs, rhs, sizes, path="direct", **kwargs)  # TLS to each staging port
        assert direct.tobytes() == inline.tobytes()
        req = gemm_meta(lhs, rhs, sizes)
        plan = demo.stub.PlanStaging(pb.StagingPlanRequest(grouped_gemm=req), timeout=10)
        d = plan.operands[0].blocks[0].destinations[0]
        block = np.ascontiguousarray(lhs[:8]).tobytes()
        with pytest.raises(grpc.RpcError) as e:
            other._staging_stub(d.address).Stage(iter([pb.StageChunk(ticket=d.ticket, data=block)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another tenant" in e.value.details()
        # Without a token the staging port answers nothing.
        with open(os.path.join(tls_copy, "ca.crt"), "rb") as f:
            bare = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(d.address, bare) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.StagingStub(ch).Stage(iter([pb.StageChunk(ticket=d.ticket, data=block)]), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A plaintext client cannot reach the staging port of a TLS mesh.
        with grpc.insecure_channel(d.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.StagingStub(ch).Stage(iter([pb.StageChunk(ticket=d.ticket, data=block)]), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        put_plan = demo.stub.PlanStaging(pb.StagingPlanRequest(put=pb.PutStagingRequest(
            name="mine", dtype=pb.F32, shape=[2, 32, 16], spec="")), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            other.stub.PutStaged(pb.PutStagedRequest(staging_id=put_plan.staging_id), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Another tenant cannot submit the plan either.
        r = pb.GroupedGemmRequest()
        r.CopyFrom(req)
        r.lhs.staged = plan.staging_id
        r.rhs.staged = plan.staging_id
        with pytest.raises(grpc.RpcError) as e:
            other.stub.GroupedGemm(r, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "lhs.staged" in e.value.details()


# -------------------------------------------------------------------- CLI --

def test_cli_direct_path_writes_what_the_inline_path_writes(clusters, tmp_path):
    import subprocess
    from conftest import BIN
    cluster = clusters("ep=2", 2)
    lhs, rhs = rand(64, 32), rand(4, 32, 16)
    np.save(tmp_path / "lhs.npy", lhs)
    np.save(tmp_path / "rhs.npy", rhs)
    outs = {}
    before = activation_bytes(cluster)
    for path in ("direct", "inline"):
        r = subprocess.run([os.path.join(BIN, "shardgemm"), "gemm", f"--lhs={tmp_path}/lhs.npy@(ep, None)",
                            f"--rhs={tmp_path}/rhs.npy@(ep, None, None)", "--group-sizes=10,6,20,12@(ep,)", "--check",
                            f"--path={path}", f"--out={tmp_path}/{path}.npy", *cluster.cli_flags()],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "result matches reference" in r.stdout
        outs[path] = np.load(tmp_path / f"{path}.npy")
        if path == "direct":
            assert activation_bytes(cluster) == before  # the CLI's bytes went to the workers
    assert outs["direct"].tobytes() == outs["inline"].tobytes()
    assert staged_bytes(cluster) == [0, 0]
