"""The Python package's CUDA IPC regions, without a GPU: the ctypes layer's
logic against a fake driver (allocation base and offset, the 64-byte
handle, error text), CUDA array introspection (the CUDA array interface and
DLPack capsules), and the registration and per-call RPCs against a CPU
mesh, which refuses requests naming a CUDA region (FAILED_PRECONDITION
naming the field) and must be left with no registration behind.
tests/test_cuda_ipc_gpu.py runs the real thing on a CUDA worker."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

import shardgemm
from shardgemm import _cuda

BASE = 0x7F0000000000
SEGMENT = 2 << 20


class FakeDriver(_cuda.Driver):
    """Allocations [base, base + size) on a device; handles from the base."""

    def __init__(self, allocations=((0, BASE, SEGMENT),), handle_bytes=64):
        self.allocations = list(allocations)
        self.handle_bytes = handle_bytes
        self.synchronized = []
        self.handles_asked = []

    def _find(self, ptr):
        for device, base, size in self.allocations:
            if base <= ptr < base + size:
                return device, base, size
        raise _cuda.CudaError(f"cuMemGetAddressRange({ptr:#x})", 1, "CUDA_ERROR_INVALID_VALUE")

    def device_of(self, ptr):
        return self._find(ptr)[0]

    def address_range(self, ptr, device):
        d, base, size = self._find(ptr)
        assert d == device
        return base, size

    def ipc_handle(self, base, device):
        self.handles_asked.append(base)
        return (base.to_bytes(8, "little") * 8)[:self.handle_bytes]

    def synchronize(self, device):
        self.synchronized.append(device)


class FakeCudaArray:
    """An array in device memory as CuPy and Numba show one: only its CUDA array interface."""

    def __init__(self, ptr, shape, typestr="<f4", strides=None, readonly=False):
        self.ptr, self.shape, self.typestr, self.strides, self.readonly = ptr, tuple(shape), typestr, strides, readonly

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, self.readonly),
                "strides": self.strides, "version": 3}


@pytest.fixture
def fake_driver(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(_cuda, "_driver", drv)
    return drv


def test_a_region_is_the_whole_allocation_and_a_tensor_its_offset(fake_driver):
    x = FakeCudaArray(BASE + 4096, (64, 32))
    region = _cuda._CudaRegion(x, name="r")
    assert (region.base, region.byte_size, region.offset, region.device) == (BASE, SEGMENT, 4096, 0)
    assert len(region.ipc_handle) == 64 and fake_driver.handles_asked == [BASE]  # the base's handle
    t = region.tensor()
    assert isinstance(t, shardgemm.SharedMemoryTensor) and t.source is x
    assert (t.region, t.offset, t.shape, t.dtype, t.nbytes) == ("r", 4096, (64, 32), np.float32, 64 * 32 * 4)
    other = FakeCudaArray(BASE + SEGMENT - 16 * 4, (16,))  # the segment's last bytes
    assert region.tensor(other, spec="(dp,)").offset == SEGMENT - 64
    with pytest.raises(ValueError, match="not in CUDA region 'r'"):
        region.tensor(FakeCudaArray(BASE + SEGMENT - 8, (16,)))  # runs past the segment
    region._release()
    with pytest.raises(ValueError, match="closed"):
        region.tensor()


def test_driver_answers_that_do_not_add_up_are_errors(monkeypatch):
    monkeypatch.setattr(_cuda, "_driver", FakeDriver(handle_bytes=12))
    with pytest.raises(RuntimeError, match="12 bytes; a cudaIpcMemHandle_t has 64"):
        _cuda._CudaRegion(FakeCudaArray(BASE, (4,)))
    monkeypatch.setattr(_cuda, "_driver", FakeDriver())
    with pytest.raises(_cuda.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        _cuda._CudaRegion(FakeCudaArray(0x1000, (4,)))  # no allocation holds it
    with pytest.raises(ValueError, match="empty CUDA array"):
        _cuda._CudaRegion(FakeCudaArray(BASE, (0, 4)))


def test_cuda_errors_name_the_call_the_code_and_what_it_means():
    e = _cuda.CudaError("cuIpcGetMemHandle(0x10)", 1, "CUDA_ERROR_INVALID_VALUE")
    assert (e.call, e.code, e.name) == ("cuIpcGetMemHandle(0x10)", 1, "CUDA_ERROR_INVALID_VALUE")
    assert "cuIpcGetMemHandle(0x10) failed: CUDA_ERROR_INVALID_VALUE (1)" in str(e)
    assert "expandable_segments" in str(e)  # the usual reason an allocation has no IPC handle
    assert str(_cuda.CudaError("cuInit", 999)) == "cuInit failed: CUresult 999 (999)"


def test_a_missing_driver_library_is_an_import_error_naming_it(monkeypatch):
    with pytest.raises(ImportError, match="libcuda-not-here.so.1"):
        _cuda.LibCuda("libcuda-not-here.so.1")
    try:
        ctypes.CDLL(_cuda.LIBCUDA)
    except OSError:
        monkeypatch.setattr(_cuda, "_driver", None)
        with pytest.raises(ImportError, match="libcuda.so.1"):
            _cuda.CudaMemoryRegion(object(), FakeCudaArray(BASE, (4,)))


def test_arrays_the_service_cannot_read_in_place_are_refused_by_name(fake_driver):
    with pytest.raises(ValueError, match=r"lhs: a non-contiguous CUDA array \(shape \(4, 8\), byte strides \(4, 16\)\)"):
        _cuda.describe(FakeCudaArray(BASE, (4, 8), strides=(4, 16)), "lhs")  # a transpose
    assert _cuda.describe(FakeCudaArray(BASE, (4, 8), strides=(32, 4)), "lhs").nbytes == 128  # explicit row-major
    assert _cuda.describe(FakeCudaArray(BASE, (4, 1), strides=(4, 999)), "lhs").shape == (4, 1)  # size-1 dims
    with pytest.raises(ValueError, match="rhs: unsupported dtype float64"):
        _cuda.describe(FakeCudaArray(BASE, (4,), typestr="<f8"), "rhs")
    with pytest.raises(TypeError, match="out: ndarray is not a CUDA array"):
        _cuda.describe(np.zeros(4, np.float32), "out")
    assert not _cuda.is_cuda_array(np.zeros(4)) and not _cuda.is_cuda_array("w")
    assert _cuda.is_cuda_array(FakeCudaArray(BASE, (4,)))


class FakeDLPack:
    """A producer of a DLPack capsule on a CUDA device (what JAX and others hand out)."""

    def __init__(self, data, shape, code, bits, strides=None, byte_offset=0, device=(2, 1)):
        self.device = device
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self._managed = (ctypes.c_byte * (ctypes.sizeof(_cuda._DLTensor) + 16))()  # DLTensor, manager_ctx, deleter
        t = _cuda._DLTensor.from_buffer(self._managed)
        t.data, t.device_type, t.device_id, t.ndim = data, device[0], device[1], len(shape)
        t.code, t.bits, t.lanes = code, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._managed), b"dltensor", None)


def test_dlpack_capsules_give_pointer_dtype_shape_and_device():
    x = FakeDLPack(BASE, (8, 4), code=4, bits=16, byte_offset=256)
    a = _cuda.describe(x, "lhs")
    assert (a.ptr, a.dtype, a.shape, a.nbytes, a.device) == (BASE + 256, np.dtype(ml_dtypes.bfloat16), (8, 4), 64, 1)
    assert _cuda.is_cuda_array(x) and not _cuda.is_cuda_array(FakeDLPack(BASE, (4,), 2, 32, device=(1, 0)))
    with pytest.raises(ValueError, match="non-contiguous"):
        _cuda.describe(FakeDLPack(BASE, (8, 4), code=2, bits=32, strides=(1, 8)), "lhs")
    with pytest.raises(ValueError, match="DLPack dtype .code 2, bits 64"):
        _cuda.describe(FakeDLPack(BASE, (4,), code=2, bits=64), "lhs")


def test_a_calls_arrays_share_a_region_per_allocation_and_reuse_registered_ones(monkeypatch):
    drv = FakeDriver(allocations=((0, BASE, SEGMENT), (1, BASE + SEGMENT, SEGMENT)))
    monkeypatch.setattr(_cuda, "_driver", drv)
    registered = _cuda._CudaRegion(FakeCudaArray(BASE + SEGMENT, (4,)), name="kept")
    lhs, out = FakeCudaArray(BASE + 512, (8, 4)), FakeCudaArray(BASE + 4096, (8, 2))
    rhs = FakeCudaArray(BASE + SEGMENT + 1024, (2, 4, 2))
    made = []

    def make(x, field):
        made.append(field)
        return _cuda._CudaRegion(x, name=f"call-{field}", what=field)

    mem = _cuda.call_memory({"lhs": lhs, "rhs": rhs, "out": out, "bias": np.zeros(2, np.float32)}, [registered],
                            make, enabled=True)
    assert made == ["lhs"] and [r.name for r in mem.new] == ["call-lhs"]  # out shares lhs's allocation
    assert (mem.fields["lhs"].region, mem.fields["lhs"].offset) == ("call-lhs", 512)
    assert (mem.fields["out"].region, mem.fields["out"].offset) == ("call-lhs", 4096)
    assert (mem.fields["rhs"].region, mem.fields["rhs"].offset) == ("kept", 1024)
    assert isinstance(mem.fields["bias"], np.ndarray) and mem.devices == {0, 1}
    with pytest.raises(ValueError, match="out=: the CUDA array is read-only"):
        _cuda.call_memory({"out": FakeCudaArray(BASE, (4,), readonly=True)}, [], make, enabled=True)
    off = _cuda.call_memory({"lhs": lhs}, [], make, enabled=False)
    assert off.fields["lhs"] is lhs and not off.new  # copied through the host, as before
    with pytest.raises(TypeError, match="cuda_ipc=False"):
        _cuda.call_memory({"out": out}, [], make, enabled=False)


def _operands():
    rng = np.random.default_rng(5)
    return rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((2, 32, 16)).astype(np.float32)


def test_cuda_regions_on_a_cpu_mesh_fail_naming_the_field_and_leave_nothing_registered(cluster_factory, fake_driver,
                                                                                     monkeypatch):
    c = cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--shared_memory"])
    lhs, rhs = _operands()
    with shardgemm.Client(c.address, timeout=30) as client:
        client.put("w", rhs)
        with pytest.raises(shardgemm.InvalidArgumentError, match="cuda.ipc_handle"):
            client.register_cuda_memory("short", b"\x01" * 12, 1024)

        # Per call: lhs and out (one allocation) registered for the call, refused by the CPU worker, unregistered.
        monkeypatch.setattr(_cuda, "fresh_name", lambda: "per-call")
        x, y = FakeCudaArray(BASE + 256, lhs.shape), FakeCudaArray(BASE + 65536, (64, 16))
        with pytest.raises(shardgemm.FailedPreconditionError, match="lhs.shared_memory") as err:
            client.grouped_gemm(x, "w", [40, 24], out=y)
        assert "cpu" in err.value.details
        assert fake_driver.synchronized == [0]  # the device was synchronized before the request
        client.register_cuda_memory("per-call", bytes(64), 1024)  # the name is free again: it was unregistered
        client.unregister_shared_memory("per-call")
        with pytest.raises(shardgemm.FailedPreconditionError, match="out_shared_memory"):
            client.grouped_gemm(lhs, "w", [40, 24], out=y)

        # Registered once: calls name it (no registration of their own), and close() of the client unregisters it.
        region = shardgemm.CudaMemoryRegion(client, x, name="kept")
        assert region.registered and region.offset == 256 and region.byte_size == SEGMENT
        with pytest.raises(shardgemm.AlreadyExistsError):
            client.register_cuda_memory("kept", region.ipc_handle, region.byte_size)
        monkeypatch.setattr(_cuda, "fresh_name", lambda: pytest.fail("a call registered its own region"))
        with pytest.raises(shardgemm.FailedPreconditionError, match="lhs.shared_memory"):
            client.grouped_gemm(region.tensor(), "w", [40, 24])
        with pytest.raises(shardgemm.FailedPreconditionError, match="lhs.shared_memory"):
            client.grouped_gemm(x, "w", [40, 24])  # the same array, found in the region

        out, _ = client.grouped_gemm(lhs, "w", [40, 24])  # host operands are unaffected
        want = np.concatenate([lhs[:40] @ rhs[0], lhs[40:] @ rhs[1]])
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    with shardgemm.Client(c.address, timeout=30) as again:
        again.register_cuda_memory("kept", bytes(64), 1024)  # free: the first client's close() unregistered it
        again.unregister_shared_memory("kept")
        np.testing.assert_array_equal(again.get("w"), rhs)
    assert region.closed and not region.registered


def test_without_shared_memory_a_cuda_argument_says_what_it_needs(cluster_factory, fake_driver):
    c = cluster_factory(mesh="dp=1", workers=1)
    lhs, rhs = _operands()
    with shardgemm.Client(c.address, timeout=30) as client:
        with pytest.raises(shardgemm.FailedPreconditionError) as err:
            client.grouped_gemm(FakeCudaArray(BASE, lhs.shape), rhs, [40, 24])
        assert "--shared_memory" in err.value.details and "cuda_ipc=False" in err.value.details, err.value.details
        assert fake_driver.synchronized == []  # nothing was sent


def test_the_asyncio_client_registers_and_unregisters_the_same_way(cluster_factory, fake_driver, monkeypatch):
    import asyncio

    import shardgemm.aio

    c = cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--shared_memory"])
    lhs, rhs = _operands()
    monkeypatch.setattr(_cuda, "fresh_name", lambda: "aio-call")

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=30) as client:
            await client.put("w", rhs)
            with pytest.raises(shardgemm.FailedPreconditionError, match="lhs.shared_memory"):
                await client.grouped_gemm(FakeCudaArray(BASE, lhs.shape), "w", [40, 24])
            await client.register_cuda_memory("aio-call", bytes(64), 1024)  # unregistered after the call
            await client.unregister_shared_memory("aio-call")
            region = await shardgemm.aio.CudaMemoryRegion.create(client, FakeCudaArray(BASE, lhs.shape), "aio-kept")
            assert region.registered
        assert region.closed  # the client's close() unregistered it
        async with shardgemm.aio.Client(c.address, timeout=30) as client:
            await client.register_cuda_memory("aio-kept", bytes(64), 1024)
            await client.unregister_shared_memory("aio-kept")

    asyncio.run(run())


def test_a_registration_whose_call_ended_on_the_client_is_not_left_behind(cluster_factory, fake_driver, monkeypatch):
    """The coordinator registered the region, but the client saw the call end
    (its deadline): the region is unregistered all the same, so the name and
    the tenant's region count are not taken for good."""
    import asyncio

    import grpc

    import shardgemm.aio
    from shardgemm.errors import error_for

    c = cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--shared_memory"])
    lhs, rhs = _operands()

    def made_then_timed_out(register):
        def call(name, *args, **kwargs):
            register(name, *args, **kwargs)
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return call

    with shardgemm.Client(c.address, timeout=30) as client:
        client.put("w", rhs)
        real = client.register_cuda_memory
        monkeypatch.setattr(client, "register_cuda_memory", made_then_timed_out(real))
        monkeypatch.setattr(_cuda, "fresh_name", lambda: "per-call")
        with pytest.raises(shardgemm.DeadlineExceededError, match="registering CUDA region 'per-call'"):
            client.grouped_gemm(FakeCudaArray(BASE, lhs.shape), "w", [40, 24])
        with pytest.raises(shardgemm.DeadlineExceededError):
            shardgemm.CudaMemoryRegion(client, FakeCudaArray(BASE, lhs.shape), name="kept")
        assert client._cuda_regions == []
        for name in ("per-call", "kept"):
            real(name, bytes(64), 1024)  # free: the ended registrations were undone
            client.unregister_shared_memory(name)

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=30) as client:
            real = client.register_cuda_memory

            async def made_then_timed_out_async(name, *args, **kwargs):
                await real(name, *args, **kwargs)
                raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

            client.register_cuda_memory = made_then_timed_out_async
            with pytest.raises(shardgemm.DeadlineExceededError):
                await client.grouped_gemm(FakeCudaArray(BASE, lhs.shape), "w", [40, 24])
            with pytest.raises(shardgemm.DeadlineExceededError):
                await shardgemm.aio.CudaMemoryRegion.create(client, FakeCudaArray(BASE, lhs.shape), "aio-kept")
            for name in ("per-call", "aio-kept"):
                await real(name, bytes(64), 1024)
                await client.unregister_shared_memory(name)

    asyncio.run(run())
