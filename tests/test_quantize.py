"""Grouped quantize through the service, sharded, against the unsharded
quantize bit for bit: current and delayed per-group scaling, MXFP8 and FP8
block scaling (1x128, 128x128)."""
import grpc
import ml_dtypes
import numpy as np
import pytest

import reference
from shardgemm_client import from_tensor, pb, to_tensor

rng = np.random.default_rng(5)
FORMATS = {"e4m3": pb.F8E4M3, "e5m2": pb.F8E5M2}


def quantize(client, x, sizes, spec="", gs_spec="", out=pb.F8E4M3, scaling=pb.CURRENT,
             shared=False, colwise=False, scales=None):
    req = pb.GroupedQuantizeRequest(
        x=to_tensor(x, spec), group_sizes=to_tensor(np.asarray(sizes, np.int64), gs_spec),
        out_dtype=out, scaling=scaling, rowwise=True, colwise=colwise, shared_scales=shared,
        include_plan=True)
    if scales is not None:
        req.scales.CopyFrom(to_tensor(np.asarray(scales, np.float32)))
    return client.stub.GroupedQuantize(req, timeout=60)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_single_worker_current_scaling_matches_numpy(cluster, fmt):
    x = (rng.standard_normal((64, 32)) * 3).astype(ml_dtypes.bfloat16)
    sizes = [20, 0, 30, 10]
    r = quantize(cluster.client, x, sizes, out=FORMATS[fmt])
    data, scale_inv, amax = reference.quantize_current(x, sizes, fmt)
    got = from_tensor(r.rowwise_data)
    assert np.array_equal(got.view(np.uint8), data)
    assert np.array_equal(from_tensor(r.scale_inv), scale_inv)
    assert np.array_equal(from_tensor(r.amax), amax)


def test_sharded_quantize_with_shared_scales_equals_unsharded_bit_for_bit(cluster_factory):
    # Rows over dp=2: each group's rows are split over the two workers; with
    # shared scales the amax is max-reduced so both use the group's scale.
    sharded = cluster_factory(mesh="dp=2", workers=2).client
    single = cluster_factory().client
    x = (rng.standard_normal((64, 48)) * 5).astype(np.float32)
    local_sizes = [10, 0, 12, 8]  # per shard, same groups on both shards
    r = quantize(sharded, x, local_sizes * 2, spec="(dp, None)", gs_spec="(dp,)", shared=True, colwise=True)
    assert [c.kind for c in r.plan.collectives] == [pb.COLLECTIVE_ALL_REDUCE_MAX]
    # Unsharded reference: each group's rows gathered from both shards.
    rows = [np.concatenate([x[s * 32 + sum(local_sizes[:g]): s * 32 + sum(local_sizes[:g + 1])] for s in range(2)])
            for g in range(4)]
    ref = quantize(single, np.concatenate(rows), [2 * n for n in local_sizes])
    ref_amax = from_tensor(ref.amax)
    assert np.array_equal(from_tensor(r.amax), np.concatenate([ref_amax, ref_amax]))
    assert np.array_equal(from_tensor(r.scale_inv)[:4], from_tensor(ref.scale_inv))
    got = from_tensor(r.rowwise_data).view(np.uint8)
    want = from_tensor(ref.rowwise_data).view(np.uint8)
    for g in range(4):
        n = local_sizes[g]
        start = sum(local_sizes[:g])
        for s in range(2):
            mine = got[s * 32 + start: s * 32 + start + n]
            assert np.array_equal(mine, want[2 * start + s * n: 2 * start + (s + 1) * n])


def test_sharded_without_shared_scales_uses_each_shards_amax(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2).client
    x = rng.standard_normal((32, 16)).astype(np.float32)
    r = quantize(c, x, [16, 0, 16, 0], spec="(dp, None)", gs_spec="(dp,)")
    assert len(r.plan.collectives) == 0
    amax = from_tensor(r.amax)
    assert amax[0] == np.abs(x[:16]).max() and amax[2] == np.abs(x[16:]).max()


def test_delayed_scaling_uses_the_given_scales(cluster):
    x = rng.standard_normal((16, 16)).astype(np.float32)
    r = quantize(cluster.client, x, [8, 8], scaling=pb.DELAYED, scales=[2.0, 4.0])
    got = from_tensor(r.rowwise_data).astype(np.float32)
    want = np.concatenate([x[:8] * 2, x[8:] * 4]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(got, want)
    assert np.array_equal(from_tensor(r.scale_inv), np.array([0.5, 0.25], np.float32))


@pytest.mark.parametrize("change, code", [
    (dict(out=pb.BF16), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(scaling=pb.DELAYED), grpc.StatusCode.INVALID_ARGUMENT),  # no scales
    (dict(sizes=[40, 0]), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(sizes=[1, 2**63 - 1]), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_quantize_bad_input(cluster, change, code):
    x = rng.standard_normal((32, 32)).astype(np.float32)
    kwargs = dict(sizes=[16, 16])
    kwargs.update(change)
    with pytest.raises(grpc.RpcError) as e:
        quantize(cluster.client, x, **kwargs)
    assert e.value.code() == code, e.value.details()


def test_cli_quantize_sharded_with_check(cluster_factory):
    import os
    import subprocess
    from conftest import BIN
    c = cluster_factory(mesh="dp=2", workers=2)
    for extra in (["--shared_scales"], ["--format=e5m2"]):
        r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", *c.cli_flags(),
                            "--x=256x64@(dp,None)", "--group-sizes=30,0,50,40,60,10,0,18@(dp,)",
                            "--dtype=bf16", "--check", *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "result matches reference" in r.stdout
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", *c.cli_flags(),
                        "--x=256x64@(dp,None)", "--group-sizes=300,0,0,0,0,0,0,0@(dp,)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "INVALID_ARGUMENT" in r.stderr


# --- MXFP8 and FP8 block scaling -------------------------------------------

BLOCK_MODES = {"mxfp8": (pb.MXFP8, False, 32), "block": (pb.BLOCK_FP8, False, 128),
               "block2d": (pb.BLOCK_FP8, True, 128)}
DIRECTIONS = [(True, False), (False, True), (True, True)]


def block_quantize(client, x, sizes, mode, fmt="e4m3", rowwise=True, colwise=False, spec="", gs_spec=""):
    scaling, block_2d, _ = BLOCK_MODES[mode]
    req = pb.GroupedQuantizeRequest(
        x=to_tensor(x, spec), group_sizes=to_tensor(np.asarray(sizes, np.int64), gs_spec),
        out_dtype=FORMATS[fmt], scaling=scaling, block_2d=block_2d, rowwise=rowwise,
        colwise=colwise, include_plan=True)
    return client.stub.GroupedQuantize(req, timeout=60)


def raw(t):
    """A response tensor's bytes as uint8 (scales) or float32."""
    a = from_tensor(t)
    return a.view(np.uint8).reshape(-1) if a.dtype.itemsize == 1 else a.reshape(-1)


def expect_matches_reference(r, want, rowwise, colwise):
    if rowwise:
        assert np.array_equal(from_tensor(r.rowwise_data).view(np.uint8), want["data"])
        assert np.array_equal(raw(r.scale_inv), want["scale_inv"])
    if colwise:
        assert np.array_equal(from_tensor(r.colwise_data).view(np.uint8), want["colwise_data"])
        assert np.array_equal(raw(r.colwise_scale_inv), want["colwise_scale_inv"])


@pytest.mark.parametrize("mode", list(BLOCK_MODES))
def test_block_scaling_single_worker_matches_numpy(cluster, mode):
    # Uneven groups, an empty one, partial colwise blocks, padding rows.
    x = (rng.standard_normal((300, 256)) * 4).astype(ml_dtypes.bfloat16)
    x[5, :40] = 0  # an all-zero MXFP8 block
    sizes = [129, 0, 33, 100]
    for fmt in FORMATS:
        for rowwise, colwise in DIRECTIONS:
            r = block_quantize(cluster.client, x, sizes, mode, fmt, rowwise, colwise)
            assert list(r.scale_group_sizes) == sizes
            want = reference.quantize_blocks(x, sizes, mode, fmt, rowwise, colwise)
            expect_matches_reference(r, want, rowwise, colwise)
            assert not r.HasField("amax")
            expect_group_offsets(r, mode, x.shape[1], sizes, rowwise, colwise)


def expect_group_offsets(r, mode, k, sizes, rowwise, colwise):
    """The response says where each group's scale block is and its shape
    (docs/quantization.md's padded layouts), covering the flat scales."""
    up = lambda a, b: -(-a // b) * b  # noqa: E731
    for on, offsets, shapes, scales, colwise_side in [
            (rowwise, r.scale_inv_offsets, r.scale_inv_block_shape, r.scale_inv, False),
            (colwise, r.colwise_scale_inv_offsets, r.colwise_scale_inv_block_shape, r.colwise_scale_inv, True)]:
        if not on:
            assert len(offsets) == 0
            continue
        assert len(offsets) == len(sizes) + 1 and offsets[0] == 0
        assert offsets[-1] == np.prod(scales.shape)
        for g, mg in enumerate(sizes):
            rows, cols = shapes[2 * g], shapes[2 * g + 1]
            assert offsets[g + 1] - offsets[g] == rows * cols
            if mode == "block" and not colwise_side:
                assert (rows, cols) == (-(-k // 128), up(mg, 4))  # [ceil(K/128), roundup(m_g, 4)]
            if mode == "mxfp8" and not colwise_side:
                assert (rows, cols) == (up(mg, 128), up(k // 32, 4))


def shard_sizes(workers, block):
    """Per row shard, 3 groups; every group's rows on a shard before its last
    start at a block boundary (the rule for colwise / 128x128 blocks); group 1
    lives on shard 0 alone, with an uneven size; shards end in padding rows."""
    per_shard = []
    for r in range(workers):
        if r == workers - 1:
            per_shard.append([block // 2 + 3, 7 if workers == 1 else 0, 5])
        elif r == 0:
            per_shard.append([block, 7, 2 * block])
        else:
            per_shard.append([2 * block, 0, block] if r % 2 else [0, 0, block])
    return per_shard, 4 * block


def gather_groups(x, per_shard, shard_rows, first_groups, num_groups):
    """The unsharded op's input: group g's rows from every row shard holding
    it, in shard order; and, per shard, where each of its rows went."""
    rows, where = [[] for _ in range(num_groups)], []
    for s, sizes in enumerate(per_shard):
        row, mine = s * shard_rows, []
        for j, n in enumerate(sizes):
            g = first_groups[s] + j
            mine.append((row, n, g, sum(len(p) for p in rows[g])))
            rows[g].append(x[row:row + n])
            row += n
        where.append(mine)
    global_sizes = [sum(len(p) for p in parts) for parts in rows]
    gathered = np.zeros_like(x)
    flat = [p for parts in rows for p in parts]
    if flat:
        stacked = np.concatenate(flat)
        gathered[:len(stacked)] = stacked
    offsets = np.concatenate([[0], np.cumsum(global_sizes)])
    return gathered, global_sizes, where, offsets


def expect_sharded_equals_unsharded(sharded, single, mode, fmt, rowwise, colwise, x, gathered,
                                    global_sizes, where, offsets):
    s, u = sharded, single
    assert list(s.scale_group_sizes) == global_sizes
    want = reference.quantize_blocks(gathered, global_sizes, mode, fmt, rowwise, colwise)
    expect_matches_reference(u, want, rowwise, colwise)  # the unsharded op is the CPU reference's
    if rowwise:
        assert np.array_equal(raw(s.scale_inv), raw(u.scale_inv))
    if colwise:
        assert np.array_equal(raw(s.colwise_scale_inv), raw(u.colwise_scale_inv))
    # Row-shaped data follows x's rows: each piece is the unsharded op's rows.
    row_shaped = [("rowwise_data", rowwise), ("colwise_data", colwise and mode == "mxfp8")]
    for field, wanted in row_shaped:
        if not wanted:
            continue
        got = from_tensor(getattr(s, field)).view(np.uint8)
        ref = from_tensor(getattr(u, field)).view(np.uint8)
        covered = np.zeros(len(x), bool)
        for pieces in where:
            for row, n, g, start in pieces:
                at = offsets[g] + start
                assert np.array_equal(got[row:row + n], ref[at:at + n])
                covered[row:row + n] = True
        assert not got[~covered].any()  # padding rows
    if colwise and mode != "mxfp8":  # transposed per group: the unsharded layout
        assert np.array_equal(from_tensor(s.colwise_data).view(np.uint8),
                              from_tensor(u.colwise_data).view(np.uint8))


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("mode", list(BLOCK_MODES))
def test_block_scaling_sharded_equals_unsharded_bit_for_bit(cluster_factory, mode, workers):
    block = BLOCK_MODES[mode][2]
    sharded = cluster_factory(mesh=f"dp={workers}", workers=workers).client
    single = cluster_factory().client
    per_shard, shard_rows = shard_sizes(workers, block)
    x = (rng.standard_normal((workers * shard_rows, 256)) * 3).astype(np.float32)
    gathered, global_sizes, where, offsets = gather_groups(x, per_shard, shard_rows, [0] * workers, 3)
    sizes = [n for s in per_shard for n in s]
    for fmt in FORMATS:
        for rowwise, colwise in DIRECTIONS:
            s = block_quantize(sharded, x, sizes, mode, fmt, rowwise, colwise, "(dp, None)", "(dp,)")
            assert len(s.plan.collectives) == 0
            # Each output names its spec: data split as x is, the scales (and
            # the per-group transposed data) whole in their block layouts.
            if rowwise:
                assert (s.rowwise_data.spec, s.scale_inv.spec) == ("(dp, None)", "(None,)")
            if colwise:
                assert s.colwise_scale_inv.spec == "(None,)"
                assert s.colwise_data.spec == ("(dp, None)" if mode == "mxfp8" else "(None, None)")
            u = block_quantize(single, gathered, global_sizes, mode, fmt, rowwise, colwise)
            expect_sharded_equals_unsharded(s, u, mode, fmt, rowwise, colwise, x, gathered,
                                            global_sizes, where, offsets)


def test_mxfp8_expert_parallel_rows(cluster_factory):
    # Rows over (fsdp, ep): shards (f, e) hold experts 2e, 2e+1; group g of the
    # unsharded op is expert g's rows on fsdp=0 then fsdp=1.
    sharded = cluster_factory(mesh="fsdp=2,ep=2", workers=4).client
    single = cluster_factory().client
    per_shard = [[32, 5], [64, 32], [3, 0], [10, 7]]
    x = (rng.standard_normal((4 * 128, 64)) * 2).astype(ml_dtypes.bfloat16)
    gathered, global_sizes, where, offsets = gather_groups(x, per_shard, 128, [0, 2, 0, 2], 4)
    assert global_sizes == [35, 5, 74, 39]
    sizes = [n for s in per_shard for n in s]
    for fmt in FORMATS:
        s = block_quantize(sharded, x, sizes, "mxfp8", fmt, True, True, "((fsdp, ep), None)", "((fsdp, ep),)")
        u = block_quantize(single, gathered, global_sizes, "mxfp8", fmt, True, True)
        expect_sharded_equals_unsharded(s, u, "mxfp8", fmt, True, True, x, gathered, global_sizes,
                                        where, offsets)


def test_misaligned_split_is_rejected_and_the_mesh_stays_usable(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2).client
    x = rng.standard_normal((128, 64)).astype(np.float32)
    bad = [40, 7, 5, 0]  # group 0: 40 rows on shard 0, so shard 1's rows start mid-block
    with pytest.raises(grpc.RpcError) as e:
        block_quantize(c, x, bad, "mxfp8", colwise=True, spec="(dp, None)", gs_spec="(dp,)")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group_sizes[2]" in e.value.details() and "32-row blocks" in e.value.details()
    # Rowwise-only scales run along K: any split is fine.
    r = block_quantize(c, x, bad, "mxfp8", spec="(dp, None)", gs_spec="(dp,)")
    assert list(r.scale_group_sizes) == [45, 7]
    x2 = rng.standard_normal((512, 128)).astype(np.float32)
    with pytest.raises(grpc.RpcError) as e:
        block_quantize(c, x2, [100, 0, 28, 0], "block2d", spec="(dp, None)", gs_spec="(dp,)")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "group_sizes[2]" in e.value.details()
    ok = block_quantize(c, x, [32, 7, 5, 0], "mxfp8", colwise=True, spec="(dp, None)", gs_spec="(dp,)")
    assert list(ok.scale_group_sizes) == [37, 7]


@pytest.mark.parametrize("change, field", [
    (dict(x=np.zeros((64, 48), np.float32)), "column count"),           # MXFP8 rowwise: K % 32
    (dict(x=np.zeros((64, 48), np.float32), rowwise=False, colwise=True), "k: 48"),
    (dict(block_2d=True), "block_2d"),                                   # 128x128 is BLOCK_FP8's
    (dict(shared_scales=True), "shared_scales"),
    (dict(scaling=9), "scaling"),
])
def test_block_scaling_bad_input(cluster, change, field):
    fields = dict(x=np.zeros((64, 64), np.float32), scaling=pb.MXFP8, rowwise=True)
    fields.update(change)
    x = fields.pop("x")
    req = pb.GroupedQuantizeRequest(x=to_tensor(x), group_sizes=to_tensor(np.array([30, 34], np.int64)),
                                    out_dtype=pb.F8E4M3, **fields)
    with pytest.raises(grpc.RpcError) as e:
        cluster.client.stub.GroupedQuantize(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


@pytest.mark.parametrize("scaling, extra", [
    ("mxfp8", ["--colwise"]), ("mxfp8", ["--format=e5m2"]), ("block", ["--colwise"]),
    ("block128x128", ["--colwise"]), ("delayed", ["--scales=1,2,0.5,4,8,1,1,1"]),
    ("current", ["--colwise_only"]),
])
def test_cli_quantize_scaling_modes_with_check(cluster_factory, scaling, extra):
    import os
    import subprocess
    from conftest import BIN
    c = cluster_factory(mesh="dp=2", workers=2)
    # Aligned for 128-row blocks: group 0 has 128 rows on shard 0, groups 1-3 one shard each.
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", *c.cli_flags(),
                        "--x=512x256@(dp,None)", "--group-sizes=128,0,50,40,60,10,0,0@(dp,)",
                        "--dtype=bf16", f"--scaling={scaling}", "--check", *extra],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result matches reference" in r.stdout
