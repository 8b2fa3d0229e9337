"""POSIX shared memory for same-host clients (the coordinator's
--shared_memory): a region this process creates and registers, whose bytes
GEMM operands are read from and outputs written to by the workers
themselves, so a request carries no activation bytes.

    with shardgemm.Client(address) as c, shardgemm.SharedMemoryRegion(c, 2 << 20) as r:
        r.ndarray(np.float32, (64, 32))[:] = lhs
        out = r.tensor(np.float32, (64, 16), offset=64 * 32 * 4)
        view, _ = c.grouped_gemm(r.tensor(np.float32, (64, 32)), rhs, sizes, out=out)

Only for a service on this host, and only where the service trusts its
clients as itself (docs/security.md).
"""
from __future__ import annotations

import os
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from ._convert import SharedMemoryTensor, proto_dtype

if TYPE_CHECKING:
    from . import aio
    from .client import Client

Shape = Union[int, Sequence[int]]


class _Region:
    """What the sync and asyncio regions share: the object, its views, its
    tensors. Not registered yet."""

    def __init__(self, byte_size: int, name: Optional[str] = None) -> None:
        byte_size = int(byte_size)
        if byte_size <= 0:
            raise ValueError(f"a shared-memory region of {byte_size} bytes")
        self.shm = shared_memory.SharedMemory(create=True, size=byte_size)
        #: Bytes registered with the service (the object may be a page larger).
        self.byte_size: int = byte_size
        #: The shm_open name the service maps.
        self.key: str = "/" + self.shm.name
        #: The name the region is registered under (default: the object's own name).
        self.name: str = name if name else self.shm.name
        self.registered = False
        self.closed = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("registered" if self.registered else "unregistered")
        return f"<{type(self).__name__} {self.name!r} key={self.key!r} {self.byte_size} bytes, {state}>"

    def _check_span(self, dtype: Any, shape: Shape, offset: int) -> tuple:
        if self.closed:
            raise ValueError(f"shared-memory region {self.name!r} is closed")
        d = np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(x) for x in shape)
        offset = int(offset)
        nbytes = int(np.prod(dims, dtype=np.int64)) * d.itemsize
        if offset < 0 or any(x < 0 for x in dims) or offset + nbytes > self.byte_size:
            raise ValueError(f"{nbytes} bytes ({d}, shape {dims}) at offset {offset} do not fit region "
                             f"{self.name!r} ({self.byte_size} bytes)")
        return d, dims, offset

    def ndarray(self, dtype: Any, shape: Shape, offset: int = 0) -> np.ndarray:
        """A writable NumPy view of the region's bytes at `offset` (no copy):
        what is written to it is what the workers read, and what they write
        is seen in it. Any NumPy dtype (np.uint8 for the raw bytes). A view
        stays valid after close(): the mapping goes with the last view (the
        object is unlinked and unregistered all the same)."""
        d, dims, offset = self._check_span(dtype, shape, offset)
        # np.frombuffer holds a buffer export on the mapping (np.ndarray(buffer=) does not), so the
        # mapping cannot be unmapped under a live view.
        count = int(np.prod(dims, dtype=np.int64))
        return np.frombuffer(self.shm.buf, dtype=d, count=count, offset=offset).reshape(dims)

    def tensor(self, dtype: Any, shape: Shape, offset: int = 0, spec: str = "") -> SharedMemoryTensor:
        """A reference to the row-major tensor of `dtype` and `shape` at
        `offset`: a GEMM operand (lhs, rhs, bias, scales; `spec` its
        partition spec unless the call gives one) or grouped_gemm's out=.
        Its ``.array`` is the NumPy view of those bytes."""
        d, dims, offset = self._check_span(dtype, shape, offset)
        proto_dtype(d)  # one the service knows, or ValueError
        return SharedMemoryTensor(region=self.name, dtype=d, shape=dims, offset=offset, spec=spec,
                                  array=self.ndarray(d, dims, offset))

    def _release(self) -> None:
        """Unmaps (where no view is left) and unlinks the object."""
        if self.closed:
            return
        self.closed = True
        try:
            self.shm.close()
        except BufferError:
            # Views are still alive and hold the mapping: it is unmapped with
            # the last of them (the mmap object's own end). Close the object's
            # descriptor now and quiet SharedMemory.__del__'s second try.
            fd = getattr(self.shm, "_fd", -1)
            if isinstance(fd, int) and fd >= 0:
                os.close(fd)
                self.shm._fd = -1  # type: ignore[attr-defined]
            self.shm.close = lambda: None  # type: ignore[method-assign]
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass  # someone unlinked it already


class SharedMemoryRegion(_Region):
    """A POSIX shared-memory object of `byte_size` bytes (made with
    multiprocessing.shared_memory), registered with `client` under `name`
    (default: the object's name). The coordinator needs --shared_memory
    (else FailedPreconditionError) and must share this host.

    ``ndarray(dtype, shape, offset)`` views its bytes; ``tensor(dtype,
    shape, offset, spec)`` names them for grouped_gemm (operands, out=).
    ``close()`` (or leaving ``with``) unregisters it and unlinks the object.
    For shardgemm.aio.Client use shardgemm.aio.SharedMemoryRegion."""

    def __init__(self, client: "Client", byte_size: int, name: Optional[str] = None, *,
                 timeout: Optional[float] = None) -> None:
        super().__init__(byte_size, name)
        self.client = client
        try:
            client.register_shared_memory(self.name, self.key, self.byte_size, timeout=timeout)
        except BaseException:
            self._release()
            raise
        self.registered = True

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, *, timeout: Optional[float] = None) -> None:
        """Unregisters the region, then unmaps and unlinks the object (the
        latter even when unregistering fails; its error is raised after).
        Calling it again does nothing."""
        try:
            if self.registered:
                self.registered = False
                self.client.unregister_shared_memory(self.name, timeout=timeout)
        finally:
            self._release()


class AsyncSharedMemoryRegion(_Region):
    """shardgemm.aio.SharedMemoryRegion: as shardgemm.SharedMemoryRegion for
    shardgemm.aio.Client. The constructor makes the object; registering is
    awaited:

        async with shardgemm.aio.SharedMemoryRegion(client, n) as r:   # registers
            ...
        r = await shardgemm.aio.SharedMemoryRegion.create(client, n)   # or this
        await r.close()
    """

    def __init__(self, client: "aio.Client", byte_size: int, name: Optional[str] = None) -> None:
        super().__init__(byte_size, name)
        self.client = client

    @classmethod
    async def create(cls, client: "aio.Client", byte_size: int, name: Optional[str] = None, *,
                     timeout: Optional[float] = None) -> "AsyncSharedMemoryRegion":
        """A region made and registered."""
        return await cls(client, byte_size, name).register(timeout=timeout)

    async def register(self, *, timeout: Optional[float] = None) -> "AsyncSharedMemoryRegion":
        """Registers the region (once; a failure unlinks the object)."""
        if self.closed:
            raise ValueError(f"shared-memory region {self.name!r} is closed")
        if not self.registered:
            try:
                await self.client.register_shared_memory(self.name, self.key, self.byte_size, timeout=timeout)
            except BaseException:
                self._release()
                raise
            self.registered = True
        return self

    async def __aenter__(self) -> "AsyncSharedMemoryRegion":
        return await self.register()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self, *, timeout: Optional[float] = None) -> None:
        """As SharedMemoryRegion.close, awaited."""
        try:
            if self.registered:
                self.registered = False
                await self.client.unregister_shared_memory(self.name, timeout=timeout)
        finally:
            self._release()
