"""The Python package's shared-memory path (coordinator --shared_memory):
shardgemm.SharedMemoryRegion makes and registers a POSIX object, its
tensor() references are GEMM operands and grouped_gemm's out=, so the
request carries no activation bytes and the output is the region's view.
Sync and asyncio clients, the package's errors, close() unregistering and
unlinking. (tests/test_shared_memory.py drives the same RPCs with raw stubs.)"""
import asyncio
import os

import grpc
import numpy as np
import pytest

from reference import assert_close
import shardgemm
import shardgemm.aio

rng = np.random.default_rng(23)
SPECS = dict(lhs_spec="(dp, None)", group_sizes_spec="(dp,)")


def _reference(lhs, rhs, sizes, shards, bias=None):
    """Per-shard ragged GEMM: each of `shards` row blocks has its own group sizes."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    rows, g = lhs.shape[0] // shards, rhs.shape[0]
    for s in range(shards):
        row = s * rows
        for e, n in enumerate(sizes[s * g:(s + 1) * g]):
            out[row:row + n] = lhs[row:row + n].astype(np.float64) @ rhs[e].astype(np.float64)
            if bias is not None:
                out[row:row + n] += bias[e]
            row += n
    return out


def _operands():
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    return lhs, rhs, [10, 22, 16, 16]  # two row shards of 32 rows, two groups each


def _exists(region):
    return os.path.exists("/dev/shm/" + region.key[1:])


@pytest.fixture
def shm_cluster(cluster_factory):
    return cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--shared_memory"])


def test_lhs_bias_and_output_in_a_region_match_numpy(shm_cluster):
    lhs, rhs, sizes = _operands()
    bias = rng.standard_normal((2, 16)).astype(np.float32)
    with shardgemm.Client(shm_cluster.address, timeout=30) as c, \
            shardgemm.SharedMemoryRegion(c, 64 + lhs.nbytes + bias.nbytes + 64 * 16 * 4, name="acts") as r:
        assert r.registered and _exists(r) and r.key == "/" + r.shm.name
        x = r.tensor(np.float32, lhs.shape, offset=64, spec="(dp, None)")  # need not start at 0
        b = r.tensor(np.float32, bias.shape, offset=64 + lhs.nbytes)
        y = r.tensor(np.float32, (64, 16), offset=64 + lhs.nbytes + bias.nbytes)
        x.array[:] = lhs
        b.array[:] = bias
        assert np.shares_memory(x.array, r.ndarray(np.uint8, r.byte_size))

        req = c.gemm_request(x, rhs, sizes, b, group_sizes_spec="(dp,)", out=y)
        assert req.lhs.WhichOneof("source") == "shared_memory" and req.lhs.spec == "(dp, None)"
        assert (req.lhs.shared_memory.region, req.lhs.shared_memory.offset,
                req.lhs.shared_memory.byte_size) == ("acts", 64, lhs.nbytes)
        assert req.bias.WhichOneof("source") == "shared_memory"
        assert req.out_shared_memory.byte_size == 64 * 16 * 4 and req.out_dtype == shardgemm.pb.F32
        assert req.ByteSize() < rhs.nbytes + 1024, "no activation bytes in the request"

        out, _ = c.grouped_gemm(x, rhs, sizes, b, group_sizes_spec="(dp,)", out=y, request_id="shm-py-1")
        assert out is y.array and np.shares_memory(out, r.ndarray(np.uint8, r.byte_size))
        assert c.last_request_id == "shm-py-1"
        ref = _reference(lhs, rhs, sizes, 2, bias)
        assert_close(out.copy(), ref, 32)

        # The weights in the region too (replicated: each worker reads them all), the call's
        # lhs_spec instead of the reference's, and an out= made by hand: None back, bytes there.
        w = shardgemm.SharedMemoryRegion(c, rhs.nbytes)
        try:
            w.ndarray(np.float32, rhs.shape)[:] = rhs
            y.array[:] = 0
            by_hand = shardgemm.SharedMemoryTensor("acts", np.float32, (64, 16), offset=y.offset)
            out2, _ = c.grouped_gemm(r.tensor(np.float32, lhs.shape, 64), w.tensor(np.float32, rhs.shape), sizes,
                                     out=by_hand, **SPECS)
            assert out2 is None
            assert_close(y.array.copy(), _reference(lhs, rhs, sizes, 2), 32)
        finally:
            w.close()
        assert not _exists(w)

        # Operands in the region, output returned inline as usual.
        out3, _ = c.grouped_gemm(x, rhs, sizes, **SPECS)
        assert isinstance(out3, np.ndarray) and not np.shares_memory(out3, y.array)
        assert_close(out3, _reference(lhs, rhs, sizes, 2), 32)

        # Caught before anything is sent.
        with pytest.raises(ValueError, match="do not fit"):
            r.tensor(np.float32, (64, 64), offset=64)
        with pytest.raises(ValueError, match="not both"):
            c.grouped_gemm(x, rhs, sizes, out=y, keep_output_as="kept", **SPECS)
        with pytest.raises(ValueError, match="out_dtype"):
            c.grouped_gemm(x, rhs, sizes, out=y, out_dtype=np.float16, **SPECS)
        with pytest.raises(TypeError, match="out="):
            c.grouped_gemm(x, rhs, sizes, out=np.zeros((64, 16), np.float32), **SPECS)
        # The service's own check: an output region of the wrong size.
        with pytest.raises(shardgemm.InvalidArgumentError) as err:
            c.grouped_gemm(x, rhs, sizes, out=r.tensor(np.float32, (64, 8)), **SPECS)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "out_shared_memory" in err.value.details
    assert r.closed and not r.registered and not _exists(r)


def test_the_asyncio_client_and_region(shm_cluster):
    lhs, rhs, sizes = _operands()

    async def main():
        async with shardgemm.aio.Client(shm_cluster.address, timeout=30) as a:
            async with shardgemm.aio.SharedMemoryRegion(a, lhs.nbytes + 64 * 16 * 4) as r:
                assert r.registered and _exists(r)
                x = r.tensor(np.float32, lhs.shape)
                y = r.tensor(np.float32, (64, 16), offset=lhs.nbytes)
                x.array[:] = lhs
                (out, _), (inline, _) = await asyncio.gather(a.grouped_gemm(x, rhs, sizes, out=y, **SPECS),
                                                             a.grouped_gemm(lhs, rhs, sizes, **SPECS))
                assert out is y.array
                assert_close(out.copy(), _reference(lhs, rhs, sizes, 2), 32)
                np.testing.assert_array_equal(out, inline)
            assert r.closed and not _exists(r)
            # create(): made and registered in one await; its name is free again after close().
            r2 = await shardgemm.aio.SharedMemoryRegion.create(a, 64, name="again")
            with pytest.raises(shardgemm.AlreadyExistsError):
                await a.register_shared_memory("again", r2.key, 64)
            await r2.close()
            r3 = await shardgemm.aio.SharedMemoryRegion.create(a, 64, name="again")
            await r3.close()
            with pytest.raises(shardgemm.NotFoundError) as err:
                await a.unregister_shared_memory("again")
            assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_unregistered_region_is_not_found_and_close_frees_the_name(shm_cluster):
    lhs, rhs, sizes = _operands()
    with shardgemm.Client(shm_cluster.address, timeout=30) as c:
        with pytest.raises(shardgemm.NotFoundError) as err:
            c.grouped_gemm(shardgemm.SharedMemoryTensor("nope", np.float32, lhs.shape), rhs, sizes, **SPECS)
        assert isinstance(err.value, shardgemm.ShardGemmError) and err.value.code == grpc.StatusCode.NOT_FOUND
        assert "lhs.shared_memory.region" in err.value.details and "nope" in err.value.details, err.value.details
        with pytest.raises(shardgemm.NotFoundError):  # no such object on this host
            c.register_shared_memory("ghost", "/shardgemm_no_such_object", 8)

        r = shardgemm.SharedMemoryRegion(c, lhs.nbytes, name="in")
        x = r.tensor(np.float32, lhs.shape)
        x.array[:] = lhs
        out, _ = c.grouped_gemm(x, rhs, sizes, **SPECS)
        assert_close(out, _reference(lhs, rhs, sizes, 2), 32)
        with pytest.raises(shardgemm.AlreadyExistsError):
            shardgemm.SharedMemoryRegion(c, 64, name="in")  # the name is taken; the new object is unlinked
        key = r.key
        r.close()  # a view (x.array) is still alive: unregistered and unlinked all the same
        assert r.closed and not os.path.exists("/dev/shm/" + key[1:])
        x.array[:] = 2  # the view still maps the (unlinked) object: no use after unmap
        np.testing.assert_array_equal(x.array, np.full(lhs.shape, 2, np.float32))
        r.close()  # again: nothing
        with pytest.raises(shardgemm.NotFoundError) as err:
            c.grouped_gemm(x, rhs, sizes, **SPECS)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "'in'" in err.value.details
        with pytest.raises(ValueError, match="closed"):
            r.tensor(np.float32, (4,))
        with pytest.raises(shardgemm.NotFoundError):
            c.unregister_shared_memory("in")
        with shardgemm.SharedMemoryRegion(c, lhs.nbytes, name="in") as again:  # the name registers again
            again.ndarray(np.float32, lhs.shape)[:] = lhs
            out2, _ = c.grouped_gemm(again.tensor(np.float32, lhs.shape), rhs, sizes, **SPECS)
            np.testing.assert_array_equal(out2, out)


def test_a_coordinator_without_the_flag_refuses_the_region_and_leaves_no_object(cluster_factory):
    cl = cluster_factory(mesh="dp=1", workers=1)
    before = set(os.listdir("/dev/shm"))
    with shardgemm.Client(cl.address, timeout=30) as c:
        with pytest.raises(shardgemm.FailedPreconditionError) as err:
            shardgemm.SharedMemoryRegion(c, 64)
        assert "--shared_memory" in err.value.details
    assert set(os.listdir("/dev/shm")) <= before
