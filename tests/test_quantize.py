"""Grouped quantize through the service, sharded, against the unsharded
quantize bit for bit (current and delayed per-group scaling)."""
import grpc
import ml_dtypes
import numpy as np
import pytest

from shardgemm_client import from_tensor, pb, to_tensor

rng = np.random.default_rng(5)
FP8 = {pb.F8E4M3: (ml_dtypes.float8_e4m3fn, 448.0), pb.F8E5M2: (ml_dtypes.float8_e5m2, 57344.0)}


def quantize(client, x, sizes, spec="", gs_spec="", out=pb.F8E4M3, scaling=pb.CURRENT,
             shared=False, colwise=False, scales=None):
    req = pb.GroupedQuantizeRequest(
        x=to_tensor(x, spec), group_sizes=to_tensor(np.asarray(sizes, np.int64), gs_spec),
        out_dtype=out, scaling=scaling, rowwise=True, colwise=colwise, shared_scales=shared,
        include_plan=True)
    if scales is not None:
        req.scales.CopyFrom(to_tensor(np.asarray(scales, np.float32)))
    return client.stub.GroupedQuantize(req, timeout=60)


def numpy_current(x, sizes, out):
    """Per-group amax -> scale = max/amax (1 for amax 0), saturating RNE cast."""
    dtype, fmax = FP8[out]
    x32 = x.astype(np.float32)
    data = np.zeros(x.shape, dtype)
    scale_inv, amax = [], []
    row = 0
    for s in sizes:
        g = x32[row:row + s]
        a = np.float32(np.abs(g).max(initial=0))
        scale = np.float32(fmax) / a if a > 0 else np.float32(1)
        data[row:row + s] = np.clip(g * scale, -fmax, fmax).astype(dtype)
        scale_inv.append(np.float32(1) / scale)
        amax.append(a)
        row += s
    return data, np.array(scale_inv, np.float32), np.array(amax, np.float32)


@pytest.mark.parametrize("out", [pb.F8E4M3, pb.F8E5M2])
def test_single_worker_current_scaling_matches_numpy(cluster, out):
    x = (rng.standard_normal((64, 32)) * 3).astype(ml_dtypes.bfloat16)
    sizes = [20, 0, 30, 10]
    r = quantize(cluster.client, x, sizes, out=out)
    data, scale_inv, amax = numpy_current(x, sizes, out)
    got = from_tensor(r.rowwise_data)
    assert np.array_equal(got.view(np.uint8), data.view(np.uint8))
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
    assert [c.kind for c in r.plan.collectives] == ["all_reduce_max"]
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
    (dict(scaling=pb.MXFP8), grpc.StatusCode.UNIMPLEMENTED),
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
        r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", f"--coordinator={c.address}",
                            "--x=256x64@(dp,None)", "--group-sizes=30,0,50,40,60,10,0,18@(dp,)",
                            "--dtype=bf16", "--check", *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "result matches reference" in r.stdout
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", f"--coordinator={c.address}",
                        "--x=256x64@(dp,None)", "--group-sizes=300,0,0,0,0,0,0,0@(dp,)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "INVALID_ARGUMENT" in r.stderr
