"""The asyncio client, on grpc.aio: the methods of shardgemm.Client as coroutines.

    async with shardgemm.aio.Client("127.0.0.1:50051") as c:
        out, plan = await c.grouped_gemm(lhs, rhs, group_sizes)

shardgemm.aio.SharedMemoryRegion is shardgemm.SharedMemoryRegion for it
(registered by `async with` or `await SharedMemoryRegion.create(c, n)`).

Make it inside a running event loop (grpc.aio binds the channel to it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from . import _common
from ._convert import Array, SharedMemoryTensor, TensorLike, check_output, to_output
from ._progress import Progress
from ._proto import pb, pb_grpc
from ._shm import AsyncSharedMemoryRegion as SharedMemoryRegion
from .errors import from_rpc_error

__all__ = ["Client", "SharedMemoryRegion"]


class Client:
    """As shardgemm.Client (same arguments, same results, same errors), with
    every call a coroutine and ``close`` awaited."""

    def __init__(self, address: str, timeout: Optional[float] = None, *, tls_dir: Optional[str] = None,
                 token: Optional[str] = None, output: str = "numpy", progress: Progress = False,
                 options: Sequence[Tuple[str, Any]] = ()) -> None:
        self.output = check_output(output)
        self.progress = progress
        self.timeout = timeout
        self.last_request_id: Optional[str] = None
        opts = [*_common.CHANNEL_OPTIONS, *options]
        creds = _common.credentials(tls_dir, token)
        if creds is not None:
            self.channel = grpc.aio.secure_channel(address, creds, options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=opts)
        self.stub = pb_grpc.ShardGemmStub(self.channel)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    @staticmethod
    @contextlib.contextmanager
    def _errors() -> Iterator[None]:
        try:
            yield
        except grpc.RpcError as e:  # grpc.aio.AioRpcError included
            raise from_rpc_error(e) from e

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    async def _note_request_id(self, call: Any) -> None:
        rid = _common.request_id_of(await call.initial_metadata())
        if rid is not None:
            self.last_request_id = rid

    async def _unary(self, method: Any, req: Any, timeout: Optional[float], request_id: Optional[str]) -> Any:
        with self._errors():
            call = method(req, timeout=self._timeout(timeout), metadata=_common.metadata(request_id))
            resp = await call
            await self._note_request_id(call)
        return resp

    async def cluster_info(self, *, timeout: Optional[float] = None) -> "pb.ClusterInfo":
        with self._errors():
            return await self.stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=self._timeout(timeout))

    def gemm_request(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                     bias: Optional[TensorLike] = None, **kwargs: Any) -> "pb.GroupedGemmRequest":
        return _common.gemm_request(lhs, rhs, group_sizes, bias, **kwargs)

    async def grouped_gemm(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                           bias: Optional[TensorLike] = None, *, out: Optional[SharedMemoryTensor] = None,
                           request_id: Optional[str] = None, output: Optional[str] = None,
                           timeout: Optional[float] = None, **kwargs: Any) -> Tuple[Optional[Array], "pb.Plan"]:
        """See shardgemm.Client.grouped_gemm (out= included)."""
        req = _common.gemm_request(lhs, rhs, group_sizes, bias, out=out, **kwargs)
        out_as = check_output(output or self.output)
        resp = await self._unary(self.stub.GroupedGemm, req, timeout, request_id)
        return to_output(_common.gemm_output(resp, out), out_as), resp.plan

    async def plan(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                   bias: Optional[TensorLike] = None, *, request_id: Optional[str] = None,
                   timeout: Optional[float] = None, **kwargs: Any) -> "pb.Plan":
        req = _common.gemm_request(lhs, rhs, group_sizes, bias, **kwargs)
        resp = await self._unary(self.stub.Plan, pb.PlanRequest(grouped_gemm=req), timeout, request_id)
        return resp.plan

    async def grouped_quantize(self, x: TensorLike, group_sizes: TensorLike, *, request_id: Optional[str] = None,
                               timeout: Optional[float] = None, **kwargs: Any) -> "pb.GroupedQuantizeResponse":
        req = _common.quantize_request(x, group_sizes, **kwargs)
        return await self._unary(self.stub.GroupedQuantize, req, timeout, request_id)

    async def put(self, name: str, array: TensorLike, spec: str = "", overwrite: bool = False,
                  request_id: Optional[str] = None, *, progress: Progress = None,
                  timeout: Optional[float] = None) -> "pb.PutTensorResponse":
        chunks = _common.put_chunks(name, array, spec, overwrite, self.progress if progress is None else progress)
        return await self._unary(self.stub.PutTensor, chunks, timeout, request_id)

    async def get(self, name: str, request_id: Optional[str] = None, *, output: Optional[str] = None,
                  progress: Progress = None, timeout: Optional[float] = None) -> Array:
        out_as = check_output(output or self.output)
        assembler = _common.Assembler(name, self.progress if progress is None else progress)
        try:
            with self._errors():
                call = self.stub.GetTensor(pb.GetTensorRequest(name=name), timeout=self._timeout(timeout),
                                           metadata=_common.metadata(request_id))
                async for chunk in call:
                    assembler.add(chunk)
                await self._note_request_id(call)
        finally:
            assembler.close()
        return to_output(assembler.array(), out_as)

    async def delete(self, name: str, request_id: Optional[str] = None, *,
                     timeout: Optional[float] = None) -> None:
        await self._unary(self.stub.DeleteTensor, pb.DeleteTensorRequest(name=name), timeout, request_id)

    async def register_shared_memory(self, name: str, key: str, byte_size: int, *,
                                     request_id: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """See shardgemm.Client.register_shared_memory (and
        shardgemm.aio.SharedMemoryRegion)."""
        req = pb.RegisterSharedMemoryRequest(name=name, key=key, byte_size=int(byte_size))
        await self._unary(self.stub.RegisterSharedMemory, req, timeout, request_id)

    async def unregister_shared_memory(self, name: str, *, request_id: Optional[str] = None,
                                       timeout: Optional[float] = None) -> None:
        """See shardgemm.Client.unregister_shared_memory."""
        await self._unary(self.stub.UnregisterSharedMemory, pb.UnregisterSharedMemoryRequest(name=name), timeout,
                          request_id)

    async def list(self, *, timeout: Optional[float] = None) -> List["pb.ResidentTensorInfo"]:
        with self._errors():
            resp = await self.stub.ListTensors(pb.ListTensorsRequest(), timeout=self._timeout(timeout))
        return list(resp.tensors)
