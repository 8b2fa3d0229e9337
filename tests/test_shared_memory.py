"""Same-host clients and POSIX shared memory (--shared_memory): a client
registers a region, names (region, offset, bytes) as a GEMM operand's
source and as the output's destination; the workers read and write their
blocks themselves, so the request carries no activation bytes. Bad
references get a status naming the field, and nothing resident is lost."""
import shutil
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

import shardgemm

from reference import assert_close
from shardgemm_client import from_tensor, pb

rng = np.random.default_rng(11)


class Region:
    """A shared-memory object of `nbytes`, unlinked afterwards."""

    def __init__(self, nbytes):
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self.key = "/" + self.shm.name

    def array(self, dtype, shape, offset=0):
        return np.ndarray(shape, dtype=dtype, buffer=self.shm.buf, offset=offset)

    def close(self):
        self.shm.close()
        self.shm.unlink()


@pytest.fixture
def regions():
    made = []

    def make(nbytes):
        made.append(Region(nbytes))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _register(client, name, region, nbytes):
    client.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, key=region.key, byte_size=nbytes))


def _in_shm(tensor_proto, region_name, offset, nbytes):
    tensor_proto.shared_memory.region = region_name
    tensor_proto.shared_memory.offset = offset
    tensor_proto.shared_memory.byte_size = nbytes


def _reference(lhs, rhs, sizes, shards):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    rows = lhs.shape[0] // shards
    g = rhs.shape[0]
    for s in range(shards):
        row = s * rows
        for e, n in enumerate(sizes[s * g:(s + 1) * g]):
            out[row:row + n] = lhs[row:row + n] @ rhs[e]
            row += n
    return out


def test_operands_and_output_in_shared_memory_match_the_reference(cluster_factory, regions):
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--shared_memory"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    offset = 64  # the tensors need not start at the region's start
    inputs = regions(offset + lhs.nbytes)
    inputs.array(np.float32, lhs.shape, offset)[:] = lhs
    outputs = regions(64 * 16 * 4)
    _register(client, "in", inputs, offset + lhs.nbytes)
    _register(client, "out", outputs, 64 * 16 * 4)

    req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    _in_shm(req.lhs, "in", offset, lhs.nbytes)
    req.out_shared_memory.region = "out"
    req.out_shared_memory.byte_size = 64 * 16 * 4
    assert req.ByteSize() < rhs.nbytes + 1024, "no activation bytes in the request"
    def counted():  # the operand and output bytes the coordinator decoded or encoded itself
        info = client.cluster_info()
        return info.inline_activation_bytes, info.direct_activation_bytes

    before = counted()
    resp = client.stub.GroupedGemm(req, timeout=30)
    # Of this request the coordinator touched the inline weights only, not
    # the lhs or the output in shared memory.
    assert counted() == (before[0] + rhs.nbytes, 0)
    assert resp.out.WhichOneof("source") == "shared_memory" and resp.out.shared_memory.region == "out"
    assert resp.out.spec == "(dp, None)"
    assert list(resp.out.shape) == [64, 16]
    assert_close(outputs.array(np.float32, (64, 16)).copy(), _reference(lhs, rhs, sizes, 2), 32)

    # The weights in shared memory too, replicated: each worker reads all of them.
    w = regions(rhs.nbytes)
    w.array(np.float32, rhs.shape)[:] = rhs
    _register(client, "w", w, rhs.nbytes)
    outputs.array(np.float32, (64, 16))[:] = 0
    req2 = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    _in_shm(req2.lhs, "in", offset, lhs.nbytes)
    _in_shm(req2.rhs, "w", 0, rhs.nbytes)
    req2.out_shared_memory.region = "out"
    req2.out_shared_memory.byte_size = 64 * 16 * 4
    before = counted()
    client.stub.GroupedGemm(req2, timeout=30)
    assert_close(outputs.array(np.float32, (64, 16)).copy(), _reference(lhs, rhs, sizes, 2), 32)
    assert counted() == before  # every operand and the output in shared memory: none

    # A replicated output (TP row: all-reduced on every worker) is written once, whole.
    k_split_lhs = rng.standard_normal((32, 64)).astype(np.float32)
    k_split_rhs = rng.standard_normal((2, 64, 16)).astype(np.float32)
    region = regions(k_split_lhs.nbytes)
    region.array(np.float32, k_split_lhs.shape)[:] = k_split_lhs
    _register(client, "tp", region, k_split_lhs.nbytes)
    out2 = regions(32 * 16 * 4)
    _register(client, "out2", out2, 32 * 16 * 4)
    req3 = client.gemm_request(k_split_lhs, k_split_rhs, [12, 20], lhs_spec="(None, dp)", rhs_spec="(None, dp, None)")
    _in_shm(req3.lhs, "tp", 0, k_split_lhs.nbytes)
    req3.out_shared_memory.region = "out2"
    req3.out_shared_memory.byte_size = 32 * 16 * 4
    client.stub.GroupedGemm(req3, timeout=30)
    assert_close(out2.array(np.float32, (32, 16)).copy(), _reference(k_split_lhs, k_split_rhs, [12, 20], 1), 64)
    assert counted() == (before[0] + k_split_rhs.nbytes, 0)
    # All inline, for contrast: lhs, weights and output each counted.
    before = counted()
    client.stub.GroupedGemm(client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)"),
                            timeout=30)
    assert counted() == (before[0] + lhs.nbytes + rhs.nbytes + 64 * 16 * 4, 0)


def test_bad_shared_memory_references_name_the_field_and_lose_nothing(cluster_factory, regions):
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--shared_memory"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    client.put("w", rhs)
    region = regions(lhs.nbytes)
    region.array(np.float32, lhs.shape)[:] = lhs
    _register(client, "in", region, lhs.nbytes)

    def gemm_with(offset, nbytes, name="in", **kw):
        req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)", **kw)
        _in_shm(req.lhs, name, offset, nbytes)
        req.rhs.Clear()
        req.rhs.resident = "w"
        return client.stub.GroupedGemm(req, timeout=30)

    cases = [
        (dict(offset=4, nbytes=lhs.nbytes), grpc.StatusCode.INVALID_ARGUMENT, "lhs.shared_memory"),  # past the end
        (dict(offset=0, nbytes=lhs.nbytes - 4), grpc.StatusCode.INVALID_ARGUMENT, "byte_size"),
        (dict(offset=0, nbytes=lhs.nbytes, name="nope"), grpc.StatusCode.NOT_FOUND, "lhs.shared_memory.region"),
        (dict(offset=0, nbytes=lhs.nbytes, keep_output_as="y"), None, None),  # fine: output kept
    ]
    for kwargs, code, text in cases:
        if code is None:
            gemm_with(**kwargs)
            continue
        with pytest.raises(grpc.RpcError) as err:
            gemm_with(**kwargs)
        assert err.value.code() == code, (kwargs, err.value.details())
        assert text in err.value.details(), err.value.details()

    # Registration: a missing object, one smaller than claimed, a bad key, a name twice.
    for key, nbytes, code in [("/shardgemm_no_such_region", 8, grpc.StatusCode.NOT_FOUND),
                              (region.key, lhs.nbytes + 1, grpc.StatusCode.INVALID_ARGUMENT),
                              ("relative", 8, grpc.StatusCode.INVALID_ARGUMENT),
                              (region.key, 8, grpc.StatusCode.ALREADY_EXISTS)]:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name="in", key=key, byte_size=nbytes))
        assert err.value.code() == code, (key, err.value.details())
    # An output region of the wrong size, and output both kept and in shared memory.
    req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    req.out_shared_memory.region = "in"
    req.out_shared_memory.byte_size = 100
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedGemm(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out_shared_memory" in err.value.details()
    req.keep_output_as = "z"
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedGemm(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out_shared_memory" in err.value.details()
    # Quantize does not read shared memory (yet): a clear UNIMPLEMENTED.
    q = pb.GroupedQuantizeRequest(out_dtype=pb.F8E4M3, rowwise=True)
    q.x.dtype = pb.F32
    q.x.shape.extend(lhs.shape)
    _in_shm(q.x, "in", 0, lhs.nbytes)
    q.group_sizes.CopyFrom(client.gemm_request(lhs, rhs, [64, 0]).group_sizes)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedQuantize(q, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()

    # Unregistered: gone for requests; everything resident still there and right.
    client.stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="in"))
    with pytest.raises(grpc.RpcError) as err:
        gemm_with(0, lhs.nbytes)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert {t.name for t in client.list()} == {"w", "y"}
    np.testing.assert_array_equal(client.get("w"), rhs)
    assert_close(client.get("y"), _reference(lhs, rhs, sizes, 2), 32)


def test_shared_memory_is_off_unless_the_coordinator_allows_it(cluster_factory, regions):
    c = cluster_factory(mesh="dp=1", workers=1)
    region = regions(64)
    with pytest.raises(grpc.RpcError) as err:
        _register(c.client, "r", region, 64)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--shared_memory" in err.value.details()


def test_global_sorted_refuses_every_shared_memory_operand(cluster_factory, regions):
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--shared_memory"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    bias = rng.standard_normal((2, 16)).astype(np.float32)
    region = regions(bias.nbytes)
    region.array(np.float32, bias.shape)[:] = bias
    _register(client, "b", region, bias.nbytes)
    req = client.gemm_request(lhs, rhs, [32, 32], bias, lhs_spec="(dp, None)", global_sorted=True)
    _in_shm(req.bias, "b", 0, bias.nbytes)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedGemm(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GLOBAL_SORTED" in err.value.details()


def _register_cuda(client, name, handle, nbytes):
    client.stub.RegisterSharedMemory(
        pb.RegisterSharedMemoryRequest(name=name, cuda=pb.CudaIpcMemory(ipc_handle=handle), byte_size=nbytes))


def test_cuda_ipc_regions_on_cpu_workers_fail_clearly_and_lose_nothing(cluster_factory):
    """A CUDA allocation registers by its IPC handle; CPU workers cannot open
    one, so a request that names it as an operand or as the output is
    refused naming the field and the backend, and what is resident stays."""
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=["--shared_memory"])
    client = c.client
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    client.put("w", rhs)
    with pytest.raises(grpc.RpcError) as err:
        _register_cuda(client, "dev", b"\x01" * 12, lhs.nbytes)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cuda.ipc_handle" in err.value.details()
    _register_cuda(client, "dev", bytes(range(64)), 1 << 20)
    with pytest.raises(grpc.RpcError) as err:
        _register_cuda(client, "dev", bytes(range(64)), 1 << 20)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS

    req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    _in_shm(req.lhs, "dev", 0, lhs.nbytes)
    req.rhs.Clear()
    req.rhs.resident = "w"
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedGemm(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "lhs.shared_memory" in err.value.details() and "cpu" in err.value.details(), err.value.details()

    req = client.gemm_request(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
    req.rhs.Clear()
    req.rhs.resident = "w"
    req.out_shared_memory.region = "dev"
    req.out_shared_memory.byte_size = 64 * 16 * 4
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GroupedGemm(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "out_shared_memory" in err.value.details(), err.value.details()

    # The same request without the region runs, and the weight is intact.
    req.ClearField("out_shared_memory")
    out = client.stub.GroupedGemm(req, timeout=30)
    assert_close(np.frombuffer(out.out.data, np.float32).reshape(64, 16), _reference(lhs, rhs, sizes, 2), 32)
    np.testing.assert_array_equal(client.get("w"), rhs)
    client.stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="dev"))


def _maps_object(pid, key):
    """Whether process `pid` has the POSIX shared-memory object `key` mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith("/dev/shm" + key) for line in f)


def test_a_worker_lets_go_of_a_region_once_it_is_unregistered_or_its_lease_lapses(cluster_factory, regions):
    from polling import wait_until

    c = cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--shared_memory", "--heartbeat_interval_s=0.2"])
    worker = next(p for name, p in c.procs if name.startswith("worker"))
    lhs = rng.standard_normal((16, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 8)).astype(np.float32)

    def use(name, region):
        region.array(np.float32, lhs.shape)[:] = lhs
        req = c.client.gemm_request(lhs, rhs, [6, 10])
        _in_shm(req.lhs, name, 0, lhs.nbytes)
        resp = c.client.stub.GroupedGemm(req, timeout=30)
        assert list(resp.out.shape) == [16, 8]

    # Unregistered: the worker's mapping goes before the unregister returns.
    kept = regions(lhs.nbytes)
    _register(c.client, "kept", kept, lhs.nbytes)
    use("kept", kept)
    assert _maps_object(worker.pid, kept.key), "the worker keeps a used region mapped across steps"
    # A second name for the same object: the mapping stays while one still names it.
    _register(c.client, "alias", kept, lhs.nbytes)
    c.client.stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="kept"), timeout=30)
    assert _maps_object(worker.pid, kept.key), "still registered as 'alias'"
    c.client.stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="alias"), timeout=30)
    assert not _maps_object(worker.pid, kept.key), "unmapped once no region names it"

    # Lapsed unrenewed: gone within a lease and a few heartbeats.
    leased = regions(lhs.nbytes)
    c.client.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
        name="leased", key=leased.key, byte_size=lhs.nbytes, lease_ms=500), timeout=30)
    use("leased", leased)
    assert _maps_object(worker.pid, leased.key)
    assert wait_until(lambda: not _maps_object(worker.pid, leased.key), 5.0), "unmapped after its lease lapsed"
    # A region used again after it was let go is mapped afresh and still right.
    _register(c.client, "kept", kept, lhs.nbytes)
    use("kept", kept)
    assert c.alive()


def test_a_region_is_its_tenants_alone(cluster_factory, regions, mesh_certs, tmp_path):
    """Over TLS with two tenants' tokens: a region registered by one is
    unknown to the other, as an operand or as the output's destination, and
    the other may register its own under the same name; the first tenant's
    region serves it still."""
    from test_direct_path import add_token
    tls = str(tmp_path / "tls")
    shutil.copytree(mesh_certs, tls)
    other_token = add_token(tls, "other")
    c = cluster_factory(mesh="dp=1", workers=1, tls_dir=tls, coordinator_flags=["--shared_memory"])
    lhs = rng.standard_normal((16, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 8)).astype(np.float32)
    sizes = [6, 10]
    inputs = regions(lhs.nbytes)
    inputs.array(np.float32, lhs.shape)[:] = lhs
    outputs = regions(16 * 8 * 4)
    with shardgemm.Client(c.address, timeout=30, tls_dir=tls) as owner, \
            shardgemm.Client(c.address, timeout=30, tls_dir=tls, token=other_token) as other:
        _register(owner, "in", inputs, lhs.nbytes)
        _register(owner, "out", outputs, 16 * 8 * 4)

        def request(client, lhs_region, out_region):
            req = client.gemm_request(lhs, rhs, sizes)
            if lhs_region:
                _in_shm(req.lhs, lhs_region, 0, lhs.nbytes)
            if out_region:
                req.out_shared_memory.region = out_region
                req.out_shared_memory.byte_size = 16 * 8 * 4
            return req

        for req, field in [(request(other, "in", None), "lhs.shared_memory"),
                           (request(other, None, "out"), "out_shared_memory")]:
            with pytest.raises(grpc.RpcError) as e:
                other.stub.GroupedGemm(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
            assert field in e.value.details(), e.value.details()
        assert not outputs.array(np.float32, (16, 8)).any()  # nothing written into the owner's region
        # Its own region under the same name is another region.
        mine = regions(lhs.nbytes)
        mine.array(np.float32, lhs.shape)[:] = lhs * 2
        _register(other, "in", mine, lhs.nbytes)
        got = from_tensor(other.stub.GroupedGemm(request(other, "in", None), timeout=30).out)
        owner.stub.GroupedGemm(request(owner, "in", "out"), timeout=30)
        assert_close(outputs.array(np.float32, (16, 8)).copy(), _reference(lhs, rhs, sizes, 1), 32)
        assert_close(got, _reference(lhs * 2, rhs, sizes, 1), 32)
