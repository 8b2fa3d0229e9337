"""CUDA IPC regions for same-host CUDA clients (the coordinator's
--shared_memory, CUDA workers on this host): a device allocation of this
process, exported by its cudaIpcMemHandle_t, which the workers open and
read operands from or write outputs into in place, device to device.

    with shardgemm.Client(address) as c:
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        c.grouped_gemm(x_cuda, "weights", sizes, out=y)       # registered for the call
        with shardgemm.CudaMemoryRegion(c, x_cuda) as r:      # or once, for many calls
            c.grouped_gemm(r.tensor(x_cuda), "weights", sizes, out=y)

Any CUDA array: a torch tensor, a CuPy array, anything with
``__cuda_array_interface__`` or a DLPack capsule on a CUDA device. The
allocation's base and size come from the CUDA driver (libcuda.so.1 through
ctypes; no torch needed): caching allocators (torch, CuPy) hand out pieces
of larger cudaMalloc segments, and an IPC handle names a whole segment, so
the region is the segment and a tensor is an offset in it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import grpc
import ml_dtypes
import numpy as np

from ._convert import SharedMemoryTensor, proto_dtype
from .errors import ShardGemmError

if TYPE_CHECKING:
    from . import aio
    from .client import Client

#: The CUDA driver library the regions need.
LIBCUDA = "libcuda.so.1"
#: sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle).
IPC_HANDLE_BYTES = 64

_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CUDA_ERROR_INVALID_CONTEXT = 201
# DLDeviceType: CUDA memory and CUDA managed memory (kDLCUDAHost, 3, is host memory).
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
# DLDataTypeCode and bits -> NumPy (lanes 1). FP8 goes through torch's own path.
_DL_DTYPES = {(0, 32): np.dtype(np.int32), (0, 64): np.dtype(np.int64), (2, 16): np.dtype(np.float16),
              (2, 32): np.dtype(np.float32), (4, 16): np.dtype(ml_dtypes.bfloat16)}
_TORCH_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                 "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
                 "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu, "int32": np.int32, "int64": np.int64}

# What a failed driver call most likely means, for the codes users meet.
_HINTS = {
    1: "not memory of this CUDA context, or memory without a legacy IPC handle: cudaMallocAsync pools, "
       "cuMemCreate (PyTorch's expandable_segments) and managed memory cannot be exported this way",
    3: "the CUDA driver is not initialized",
    100: "no CUDA device is visible to this process",
    201: "no CUDA context is current on this thread",
    400: "the handle is not valid here",
}


class CudaError(RuntimeError):
    """A CUDA driver call failed: ``.call`` (the function), ``.code`` (its
    CUresult) and ``.name`` (e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, call: str, code: int, name: str = "") -> None:
        self.call, self.code, self.name = call, int(code), name or f"CUresult {int(code)}"
        hint = _HINTS.get(self.code)
        super().__init__(f"{call} failed: {self.name} ({self.code})" + (f": {hint}" if hint else ""))


class Driver:
    """What the regions need of the CUDA driver (LibCuda; tests give a fake)."""

    def device_of(self, ptr: int) -> int:
        """The ordinal of the device holding `ptr`."""
        raise NotImplementedError

    def address_range(self, ptr: int, device: int) -> Tuple[int, int]:
        """(base, size) of the allocation holding `ptr` (cuMemGetAddressRange)."""
        raise NotImplementedError

    def ipc_handle(self, base: int, device: int) -> bytes:
        """The allocation's cudaIpcMemHandle_t (cuIpcGetMemHandle of its base)."""
        raise NotImplementedError

    def synchronize(self, device: int) -> None:
        """Waits for all work this process queued on `device` (every stream of its primary context)."""
        raise NotImplementedError


class LibCuda(Driver):
    """The CUDA driver API through ctypes. Each call runs in the device's
    primary context (the one the CUDA runtime, torch and CuPy use), retained
    once per device and kept for the process's life."""

    _FUNCTIONS = ("cuInit", "cuGetErrorName", "cuPointerGetAttribute", "cuMemGetAddressRange_v2",
                  "cuIpcGetMemHandle", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
                  "cuCtxPopCurrent_v2", "cuCtxSynchronize")

    def __init__(self, path: str = LIBCUDA) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise ImportError(f"CUDA IPC regions need the CUDA driver library {path}, which does not load here "
                              f"({e}): run on a host with an NVIDIA driver, or pass host arrays "
                              "(cuda_ipc=False copies CUDA operands through the host)") from e
        missing = [f for f in self._FUNCTIONS if not hasattr(lib, f)]
        if missing:
            raise ImportError(f"{path} lacks {', '.join(missing)}: the NVIDIA driver is too old for CUDA IPC regions")
        u64, p = ctypes.c_uint64, ctypes.c_void_p
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuPointerGetAttribute.argtypes = [p, ctypes.c_int, u64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, u64]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(p)]
        lib.cuCtxSynchronize.argtypes = []
        for f in self._FUNCTIONS:
            getattr(lib, f).restype = ctypes.c_int
        self._lib = lib
        self._lock = threading.Lock()
        self._contexts: Dict[int, ctypes.c_void_p] = {}
        self._check("cuInit", lib.cuInit(0))

    def _check(self, call: str, result: int) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            known = self._lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
            raise CudaError(call, result, name.value.decode() if known else "")

    def _context(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            if device not in self._contexts:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                self._check(f"cuDeviceGet({device})", self._lib.cuDeviceGet(ctypes.byref(dev), device))
                self._check(f"cuDevicePrimaryCtxRetain({device})",
                            self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value))
                self._contexts[device] = ctx
            return self._contexts[device]

    def _in_context(self, device: int, call: str, fn: Callable[[], int]) -> None:
        ctx = self._context(device)
        self._check("cuCtxPushCurrent", self._lib.cuCtxPushCurrent_v2(ctx))
        try:
            self._check(call, fn())
        finally:
            popped = ctypes.c_void_p()
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def device_of(self, ptr: int) -> int:
        ordinal = ctypes.c_int()
        query = lambda: self._lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                        ptr)
        call = f"cuPointerGetAttribute(DEVICE_ORDINAL, {ptr:#x})"
        result = query()
        if result == _CUDA_ERROR_INVALID_CONTEXT:  # no context on this thread: any device's will do for UVA
            self._in_context(0, call, query)
        else:
            self._check(call, result)
        return ordinal.value

    def address_range(self, ptr: int, device: int) -> Tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._in_context(device, f"cuMemGetAddressRange({ptr:#x})",
                         lambda: self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
        return base.value, size.value

    def ipc_handle(self, base: int, device: int) -> bytes:
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._in_context(device, f"cuIpcGetMemHandle({base:#x})", lambda: self._lib.cuIpcGetMemHandle(handle, base))
        return handle.raw

    def synchronize(self, device: int) -> None:
        self._in_context(device, f"cuCtxSynchronize(device {device})", self._lib.cuCtxSynchronize)


_driver: Optional[Driver] = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's LibCuda, loaded on first use (ImportError naming libcuda.so.1 where it is missing)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = LibCuda()
        return _driver


@dataclasses.dataclass(frozen=True)
class CudaArray:
    """A C-contiguous CUDA array's memory: its first byte, size, dtype and
    shape, its device (None: ask the driver) and what keeps it alive."""

    ptr: int
    nbytes: int
    dtype: np.dtype
    shape: Tuple[int, ...]
    device: Optional[int]
    readonly: bool = False
    keep: Tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)


def _row_major_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


def _check_contiguous(what: str, shape: Tuple[int, ...], byte_strides: Optional[Sequence[int]], itemsize: int) -> None:
    if byte_strides is None or int(np.prod(shape, dtype=np.int64)) <= 1:
        return
    want = _row_major_strides(shape, itemsize)
    if any(n > 1 and int(s) != w for n, s, w in zip(shape, byte_strides, want)):
        raise ValueError(f"{what}: a non-contiguous CUDA array (shape {shape}, byte strides {tuple(byte_strides)}); "
                         "the service reads a row-major byte range: pass a contiguous copy (.contiguous())")


def _dtype(what: str, d: Any) -> np.dtype:
    d = np.dtype(d)
    try:
        proto_dtype(d)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return d


def _torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a tensor means it already is
    return torch is not None and isinstance(x, torch.Tensor)


def is_cuda_array(x: Any) -> bool:
    """Whether `x` is an array in CUDA device memory (torch, CuPy, CUDA array interface, DLPack)."""
    if x is None or isinstance(x, (str, bytes, np.ndarray, SharedMemoryTensor)):
        return False
    if _torch_tensor(x):
        return x.device.type == "cuda"
    if hasattr(type(x), "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if callable(dev):
        try:
            return int(dev()[0]) in (_DL_CUDA, _DL_CUDA_MANAGED)
        except Exception:  # noqa: BLE001 - not an array we can use: the host path says why
            return False
    return False


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(what: str, x: Any) -> CudaArray:
    capsule = x.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # The capsule stays unconsumed (its name unchanged) and is kept: its destructor frees the producer's
    # reference when the region lets go of it.
    try:
        t = _DLTensor.from_address(get(capsule, b"dltensor"))
    except ValueError as e:  # a used or versioned capsule
        raise TypeError(f"{what}: {type(x).__name__}.__dlpack__() gave no unused 'dltensor' capsule ({e})") from None
    if t.device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"{what}: the DLPack tensor is on device type {t.device_type}, not CUDA")
    key = (int(t.code), int(t.bits))
    if t.lanes != 1 or key not in _DL_DTYPES:
        raise ValueError(f"{what}: DLPack dtype (code {t.code}, bits {t.bits}, lanes {t.lanes}) is not one the "
                         "service knows (float32, float16, bfloat16, int32, int64; FP8 from torch tensors)")
    dtype = _DL_DTYPES[key]
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else [int(t.strides[i]) * dtype.itemsize for i in range(t.ndim)]
    _check_contiguous(what, shape, strides, dtype.itemsize)
    return CudaArray(ptr=int(t.data or 0) + int(t.byte_offset), nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                     dtype=dtype, shape=shape, device=int(t.device_id), keep=(x, capsule))


def describe(x: Any, what: str = "array") -> CudaArray:
    """The memory of the CUDA array `x` (`what` names it in errors):
    TypeError for a host array, ValueError for a non-contiguous one or a
    dtype the service does not know."""
    if _torch_tensor(x):
        if x.device.type != "cuda":
            raise TypeError(f"{what}: a torch tensor on {x.device}, not a CUDA device")
        name = str(x.dtype).replace("torch.", "")
        if name not in _TORCH_DTYPES:
            raise ValueError(f"{what}: torch dtype {name} is not one the service knows "
                             f"({', '.join(_TORCH_DTYPES)})")
        dtype = np.dtype(_TORCH_DTYPES[name])
        shape = tuple(int(d) for d in x.shape)
        _check_contiguous(what, shape, [int(s) * dtype.itemsize for s in x.stride()], dtype.itemsize)
        device = x.device.index
        if device is None:
            device = sys.modules["torch"].cuda.current_device()
        return CudaArray(ptr=int(x.data_ptr()), nbytes=x.numel() * dtype.itemsize, dtype=dtype, shape=shape,
                         device=int(device), keep=(x,))
    if hasattr(type(x), "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        shape = tuple(int(d) for d in cai["shape"])
        dtype = _dtype(what, cai["typestr"])
        _check_contiguous(what, shape, cai.get("strides"), dtype.itemsize)
        ptr, readonly = cai["data"]
        dev = getattr(x, "device", None)  # CuPy's Device; others: the driver says
        device = getattr(dev, "id", None)
        return CudaArray(ptr=int(ptr or 0), nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=dtype,
                         shape=shape, device=int(device) if isinstance(device, int) else None,
                         readonly=bool(readonly), keep=(x,))
    if is_cuda_array(x):
        return _from_dlpack(what, x)
    raise TypeError(f"{what}: {type(x).__name__} is not a CUDA array (a CUDA torch tensor, a CuPy array, or an "
                    "object with __cuda_array_interface__ or a CUDA DLPack capsule)")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The cudaMalloc allocation (segment) holding an array: device, base, size, IPC handle."""

    device: int
    base: int
    size: int
    ipc_handle: bytes

    def holds(self, a: CudaArray) -> bool:
        return (a.device is None or a.device == self.device) and self.base <= a.ptr and \
            a.ptr + a.nbytes <= self.base + self.size


def allocation_of(drv: Driver, a: CudaArray, what: str = "array") -> Allocation:
    """The allocation holding `a`, by the driver, with its IPC handle."""
    if a.nbytes == 0 or a.ptr == 0:
        raise ValueError(f"{what}: an empty CUDA array has no memory to register")
    device = a.device if a.device is not None else drv.device_of(a.ptr)
    base, size = drv.address_range(a.ptr, device)
    if not (base <= a.ptr and a.ptr + a.nbytes <= base + size):
        raise RuntimeError(f"{what}: the driver says {a.ptr:#x} is in the allocation [{base:#x}, +{size}), "
                           f"which does not hold its {a.nbytes} bytes")
    handle = bytes(drv.ipc_handle(base, device))
    if len(handle) != IPC_HANDLE_BYTES:
        raise RuntimeError(f"{what}: an IPC handle of {len(handle)} bytes; a cudaIpcMemHandle_t has {IPC_HANDLE_BYTES}")
    return Allocation(device=device, base=base, size=size, ipc_handle=handle)


@dataclasses.dataclass(frozen=True)
class CudaMemoryTensor(SharedMemoryTensor):
    """A SharedMemoryTensor in a CUDA IPC region: `source` is the CUDA
    array it stands for (kept alive with the reference), `device` its
    device (synchronized before a request that names it)."""

    device: int = -1
    source: Any = dataclasses.field(default=None, compare=False, repr=False)


_names = itertools.count()


#: A registration that failed with one of these may have been made all the same
#: (the call ended on the client's side: its deadline, a cancel, a broken
#: connection after the request went): it is unregistered, a NotFound aside.
_MAYBE_MADE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


def maybe_registered(error: BaseException) -> bool:
    """Whether a registration that raised `error` may still have been made by
    the coordinator (not a refusal of its own: an ended or interrupted call)."""
    return not isinstance(error, ShardGemmError) or error.code in _MAYBE_MADE


def fresh_name() -> str:
    """A region name of this process's own (pid, a counter and random bits: unique among clients)."""
    return f"cuda-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}"


class _CudaRegion:
    """What the sync and asyncio CUDA regions share: the allocation, the
    array that keeps it alive, its tensors. Not registered yet."""

    def __init__(self, array: Any, name: Optional[str] = None, *, what: str = "array") -> None:
        self._array = describe(array, what)
        alloc = allocation_of(driver(), self._array, what)
        #: The allocation's device, base address, size (the registered bytes) and IPC handle.
        self.device, self.base, self.byte_size, self.ipc_handle = alloc.device, alloc.base, alloc.size, alloc.ipc_handle
        self._allocation = alloc
        #: Where the array given lies in the region.
        self.offset: int = self._array.ptr - alloc.base
        #: The name the region is registered under.
        self.name: str = name if name else fresh_name()
        self.registered = False
        self.closed = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("registered" if self.registered else "unregistered")
        return f"<{type(self).__name__} {self.name!r} cuda:{self.device} {self.byte_size} bytes, {state}>"

    def holds(self, a: CudaArray) -> bool:
        return not self.closed and self._allocation.holds(a)

    def reference(self, a: CudaArray, spec: str = "", what: str = "array") -> CudaMemoryTensor:
        if self.closed:
            raise ValueError(f"CUDA region {self.name!r} is closed")
        if not self._allocation.holds(a):
            raise ValueError(f"{what}: its {a.nbytes} bytes at {a.ptr:#x} are not in CUDA region {self.name!r} "
                             f"([{self.base:#x}, +{self.byte_size}) on cuda:{self.device})")
        source = a.keep[0] if a.keep else None
        return CudaMemoryTensor(region=self.name, dtype=a.dtype, shape=a.shape, offset=a.ptr - self.base, spec=spec,
                                device=self.device, source=source)

    def tensor(self, array: Any = None, spec: str = "") -> CudaMemoryTensor:
        """A reference to `array` (default: the one the region was made
        from), which must lie in this allocation: a GEMM operand (lhs, rhs,
        bias, scales; `spec` its partition spec unless the call gives one)
        or grouped_gemm's out=. Its dtype and shape are the array's."""
        if array is None:
            return self.reference(self._array, spec)
        return self.reference(describe(array, "tensor()"), spec, "tensor()")

    def _release(self) -> None:
        self.closed = True
        self._array = dataclasses.replace(self._array, keep=())  # the exporting array may go now


class CudaMemoryRegion(_CudaRegion):
    """The CUDA allocation holding `array` (a CUDA torch tensor, CuPy array,
    or anything with __cuda_array_interface__ or a CUDA DLPack capsule),
    registered with `client` by its IPC handle under `name` (default: one of
    this process's own). The region is the whole allocation (a caching
    allocator's segment); ``tensor(x)`` names any array in it. The array is
    kept alive while registered. The coordinator needs --shared_memory, the
    workers must be CUDA workers on this host (CPU workers refuse requests
    naming the region with FailedPreconditionError). ``close()`` (or leaving
    ``with``, or closing the client) unregisters it. For
    shardgemm.aio.Client use shardgemm.aio.CudaMemoryRegion."""

    def __init__(self, client: "Client", array: Any, name: Optional[str] = None, *,
                 timeout: Optional[float] = None) -> None:
        super().__init__(array, name)
        self.client = client
        try:
            client.register_cuda_memory(self.name, self.ipc_handle, self.byte_size, timeout=timeout)
        except BaseException as e:
            if maybe_registered(e):
                try:
                    client.unregister_shared_memory(self.name, timeout=timeout)
                except (ShardGemmError, grpc.RpcError):
                    pass  # NotFound: it was not made; else the error raised is the registration's
            self._release()
            raise
        self.registered = True
        client._cuda_regions.append(self)

    def __enter__(self) -> "CudaMemoryRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, *, timeout: Optional[float] = None) -> None:
        """Unregisters the region and lets go of the array (that even when
        unregistering fails; its error is raised after). Again: nothing."""
        try:
            if self.registered:
                self.registered = False
                self.client.unregister_shared_memory(self.name, timeout=timeout)
        finally:
            if self in self.client._cuda_regions:
                self.client._cuda_regions.remove(self)
            self._release()


class AsyncCudaMemoryRegion(_CudaRegion):
    """shardgemm.aio.CudaMemoryRegion: as shardgemm.CudaMemoryRegion for
    shardgemm.aio.Client; registering is awaited:

        async with shardgemm.aio.CudaMemoryRegion(client, x) as r:    # registers
            ...
        r = await shardgemm.aio.CudaMemoryRegion.create(client, x)    # or this
        await r.close()
    """

    def __init__(self, client: "aio.Client", array: Any, name: Optional[str] = None) -> None:
        super().__init__(array, name)
        self.client = client

    @classmethod
    async def create(cls, client: "aio.Client", array: Any, name: Optional[str] = None, *,
                     timeout: Optional[float] = None) -> "AsyncCudaMemoryRegion":
        """A region made and registered."""
        return await cls(client, array, name).register(timeout=timeout)

    async def register(self, *, timeout: Optional[float] = None) -> "AsyncCudaMemoryRegion":
        """Registers the region (once)."""
        if self.closed:
            raise ValueError(f"CUDA region {self.name!r} is closed")
        if not self.registered:
            try:
                await self.client.register_cuda_memory(self.name, self.ipc_handle, self.byte_size, timeout=timeout)
            except BaseException as e:
                if maybe_registered(e):
                    try:
                        await self.client.unregister_shared_memory(self.name, timeout=timeout)
                    except (ShardGemmError, grpc.RpcError):
                        pass  # NotFound: it was not made; else the error raised is the registration's
                raise
            self.registered = True
            self.client._cuda_regions.append(self)
        return self

    async def __aenter__(self) -> "AsyncCudaMemoryRegion":
        return await self.register()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self, *, timeout: Optional[float] = None) -> None:
        """As CudaMemoryRegion.close, awaited."""
        try:
            if self.registered:
                self.registered = False
                await self.client.unregister_shared_memory(self.name, timeout=timeout)
        finally:
            if self in self.client._cuda_regions:
                self.client._cuda_regions.remove(self)
            self._release()


#: grouped_gemm's arguments that may be CUDA arrays, by the field they fill.
GEMM_FIELDS = ("lhs", "rhs", "bias", "lhs_scale_inv", "rhs_scale_inv", "out")


@dataclasses.dataclass
class CallMemory:
    """A call's CUDA arguments as references: `fields` (the arguments,
    each CUDA array replaced), `new` (regions made for the call, one per
    allocation, to register before it and unregister after) and `devices`
    (to synchronize before the request)."""

    fields: Dict[str, Any]
    new: List[_CudaRegion]
    devices: Set[int]


def call_memory(fields: Dict[str, Any], registered: Iterable[_CudaRegion], make: Callable[[Any, str], _CudaRegion],
                enabled: bool) -> CallMemory:
    """Replaces each CUDA array among `fields` by a CudaMemoryTensor in a
    region of `registered` that holds it, else in a region `make(array,
    field)` makes for the call (arrays in one allocation share it). With
    `enabled` False (cuda_ipc=False) operands stay as they are (copied
    through the host) and a CUDA out= is a TypeError."""
    out: Dict[str, Any] = dict(fields)
    new: List[_CudaRegion] = []
    devices: Set[int] = set()
    regions = list(registered)
    for field, x in fields.items():
        if isinstance(x, CudaMemoryTensor):
            devices.add(x.device)
            continue
        if not is_cuda_array(x):
            continue
        if not enabled:
            if field == "out":
                raise TypeError("out=: a CUDA array is written through CUDA IPC, which cuda_ipc=False turns off")
            continue
        a = describe(x, field)
        if field == "out" and a.readonly:
            raise ValueError("out=: the CUDA array is read-only")
        region = next((r for r in regions if r.holds(a)), None)
        if region is None:
            region = make(x, field)
            regions.append(region)
            new.append(region)
        out[field] = region.reference(a, what=field)
        devices.add(region.device)
    return CallMemory(fields=out, new=new, devices=devices)


def synchronize(devices: Iterable[int]) -> None:
    """Waits for all work this process queued on each device (every stream:
    the producers' writes to the operands done, earlier reads and writes of
    the output too) before the request is sent."""
    devices = sorted(set(devices))
    if devices:
        drv = driver()
        for d in devices:
            drv.synchronize(d)


def gemm_fields(lhs: Any, rhs: Any, bias: Any, out: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """grouped_gemm's arguments that may be CUDA arrays, by field (those given)."""
    fields = {"lhs": lhs, "rhs": rhs, "bias": bias, "out": out,
              "lhs_scale_inv": kwargs.get("lhs_scale_inv"), "rhs_scale_inv": kwargs.get("rhs_scale_inv")}
    return {k: v for k, v in fields.items() if v is not None}


def gemm_arguments(fields: Dict[str, Any], kwargs: Dict[str, Any]) -> Tuple[Any, Any, Any, Any, Dict[str, Any]]:
    """(lhs, rhs, bias, out, kwargs) back from gemm_fields' dict."""
    kwargs = dict(kwargs)
    for k in ("lhs_scale_inv", "rhs_scale_inv"):
        if k in fields:
            kwargs[k] = fields[k]
    return fields.get("lhs"), fields.get("rhs"), fields.get("bias"), fields.get("out"), kwargs


def registration_hint(region: _CudaRegion, details: str) -> str:
    """A failed registration of a call's CUDA region, said with what the path needs."""
    return (f"registering CUDA region {region.name!r} (cuda:{region.device}, {region.byte_size} bytes) for a CUDA "
            "array argument: CUDA arrays travel by CUDA IPC, which needs the coordinator's --shared_memory and "
            f"CUDA workers on this host (cuda_ipc=False on the client copies them through the host): {details}")
