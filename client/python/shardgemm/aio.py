"""The asyncio client, on grpc.aio: the methods of shardgemm.Client as coroutines.

    async with shardgemm.aio.Client("127.0.0.1:50051") as c:
        out, plan = await c.grouped_gemm(lhs, rhs, group_sizes)

shardgemm.aio.SharedMemoryRegion is shardgemm.SharedMemoryRegion for it
(registered by `async with` or `await SharedMemoryRegion.create(c, n)`), and
shardgemm.aio.CudaMemoryRegion is shardgemm.CudaMemoryRegion likewise.

Make it inside a running event loop (grpc.aio binds the channel to it).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from . import _common, _cuda, _direct, _frames, _lease, _wire
from ._convert import Array, SharedMemoryTensor, TensorLike, check_output, to_output
from ._progress import Meter, Progress
from ._proto import pb
from ._cuda import AsyncCudaMemoryRegion as CudaMemoryRegion
from ._shm import AsyncSharedMemoryRegion as SharedMemoryRegion
from .errors import ShardGemmError, error_for, from_rpc_error

__all__ = ["Client", "CudaMemoryRegion", "SharedMemoryRegion"]


class Client:
    """As shardgemm.Client (same arguments, same results, same errors), with
    every call a coroutine and ``close`` awaited. The direct path's blocks
    are staged and fetched by concurrent tasks."""

    def __init__(self, address: str, timeout: Optional[float] = _common.DEFAULT_TIMEOUT_S, *,
                 tls_dir: Optional[str] = None, token: Optional[str] = None, output: str = "numpy",
                 progress: Progress = False, options: Sequence[Tuple[str, Any]] = (), path: str = "auto", cuda_ipc: bool = True,
                 shared_memory_lease: Optional[float] = _lease.DEFAULT_LEASE_S,
                 call_socket: Optional[str] = None) -> None:
        self.output = check_output(output)
        self.cuda_ipc = bool(cuda_ipc)
        self._lease_ms = _lease.lease_ms(shared_memory_lease)
        self._leases = _lease.AsyncLeaseRenewer(self._renew_leases, self._lease_ms / 3000.0 or 1.0)
        # CudaMemoryRegions registered with this client: reused by calls, unregistered by close().
        self._cuda_regions: List[_cuda._CudaRegion] = []
        self.path = _direct.check_path(path)
        self.progress = progress
        self.timeout = timeout
        self.last_request_id: Optional[str] = None
        opts = [*_common.CHANNEL_OPTIONS, *options]
        creds = _common.credentials(tls_dir, token, address)
        if creds.coordinator is not None:
            self.channel = grpc.aio.secure_channel(address, creds.coordinator, options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=opts)
        self.stub, _ = _wire.stubs(self.channel)
        self._call_socket = (_frames.AsyncCallSocket(call_socket, _common.bearer_token(tls_dir, token),
                                                     _common.MAX_MESSAGE) if call_socket else None)
        self._creds, self._opts = creds.workers, opts
        self._workers_unavailable = creds.workers_unavailable
        self._staging_channels: Dict[str, Tuple[grpc.aio.Channel, Any]] = {}
        self._staging_info = _direct.StagingInfo()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Unregisters the CudaMemoryRegions made with this client (the
        first failure raised after the rest), then closes the channels."""
        try:
            failure: Optional[BaseException] = None
            for region in list(self._cuda_regions):
                try:
                    await region.close(timeout=self._timeout(None) or 10)
                except ShardGemmError as e:
                    failure = failure or e
            if failure is not None:
                raise failure
        finally:
            await self._leases.close()
            if self._call_socket is not None:
                await self._call_socket.close()
            await self._close_channels()

    async def _close_channels(self) -> None:
        channels, self._staging_channels = list(self._staging_channels.values()), {}
        for channel, _ in channels:
            await channel.close()
        await self.channel.close()

    def _staging_stub(self, address: str) -> Any:
        if address not in self._staging_channels:
            if self._workers_unavailable is not None:
                raise error_for(
                    grpc.StatusCode.FAILED_PRECONDITION, f"the direct path to {address}: {self._workers_unavailable}")
            if self._creds is not None:
                channel = grpc.aio.secure_channel(address, self._creds, options=self._opts)
            else:
                channel = grpc.aio.insecure_channel(address, options=self._opts)
            self._staging_channels[address] = (channel, _wire.stubs(channel)[1])
        return self._staging_channels[address][1]

    async def _offers_staging(self) -> bool:
        if self._workers_unavailable is not None:
            return False  # "auto" stays inline: this client cannot call the staging ports
        fresh = self._staging_info.fresh()
        if fresh is not None:
            return fresh
        try:
            info = await self.stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=self._timeout(None) or 10)
        except grpc.RpcError:
            return False  # the inline call says what is wrong
        return self._staging_info.note(info)

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
                           bias: Optional[TensorLike] = None, *, out: Optional[Any] = None,
                           request_id: Optional[str] = None, output: Optional[str] = None,
                           timeout: Optional[float] = None, path: Optional[str] = None,
                           **kwargs: Any) -> Tuple[Optional[Array], "pb.Plan"]:
        """See shardgemm.Client.grouped_gemm (out=, CUDA arrays and path= included)."""
        out_as = check_output(output or self.output)
        mem = _cuda.call_memory(_cuda.gemm_fields(lhs, rhs, bias, out, kwargs), self._cuda_regions,
                                lambda x, field: _cuda._CudaRegion(x, what=field), self.cuda_ipc)
        async with self._cuda_call(mem, timeout):
            lhs, rhs, bias, out, kwargs = _cuda.gemm_arguments(mem.fields, kwargs)
            return await self._grouped_gemm(lhs, rhs, group_sizes, bias, out, request_id, out_as, timeout, path,
                                            kwargs)

    @contextlib.asynccontextmanager
    async def _cuda_call(self, mem: _cuda.CallMemory, timeout: Optional[float]) -> AsyncIterator[None]:
        """As shardgemm.Client._cuda_call. The device synchronization blocks the event loop while it waits."""
        made: List[_cuda._CudaRegion] = []
        failed = False
        try:
            for region in mem.new:
                try:
                    await self.register_cuda_memory(region.name, region.ipc_handle, region.byte_size,
                                                    timeout=timeout)
                except BaseException as e:
                    if _cuda.maybe_registered(e):
                        made.append(region)  # the coordinator may have it: unregistered below
                    if not isinstance(e, ShardGemmError):
                        raise
                    raise error_for(e.code, _cuda.registration_hint(region, e.details),
                                    request_id=e.request_id) from e
                region.registered = True
                made.append(region)
            _cuda.synchronize(mem.devices)
            yield
        except BaseException:
            failed = True
            raise
        finally:
            for region in made:
                region.registered = False
                try:
                    await self.unregister_shared_memory(region.name, timeout=timeout)
                except ShardGemmError:
                    if not failed:
                        raise
                finally:
                    region._release()

    async def _grouped_gemm(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                            bias: Optional[TensorLike], out: Optional[SharedMemoryTensor], request_id: Optional[str],
                            out_as: str, timeout: Optional[float], path: Optional[str],
                            kwargs: Dict[str, Any]) -> Tuple[Optional[Array], "pb.Plan"]:
        chosen = _direct.check_path(path or self.path)
        offered = False
        if chosen == "auto" and _direct.worth_staging(lhs) and out is None and not kwargs.get("global_sorted", False):
            offered = await self._offers_staging()
        if _direct.wants_direct(chosen, lambda: offered, lhs, out, kwargs):
            return await self._grouped_gemm_direct(lhs, rhs, group_sizes, bias, request_id, out_as, timeout, kwargs)
        req = _common.gemm_wire(lhs, rhs, group_sizes, bias, out=out, **kwargs)
        if self._call_socket is not None:
            answered = await self._call_socket.grouped_gemm(req, request_id, self._timeout(timeout))
            if answered is not None:
                resp, self.last_request_id, out_data = answered
                return to_output(_common.gemm_output(resp, out, out_data), out_as), resp.plan
        resp, out_data = await self._unary(self.stub.GroupedGemmInline, req, timeout, request_id)
        return to_output(_common.gemm_output(resp, out, out_data), out_as), resp.plan

    async def _grouped_gemm_direct(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                                   bias: Optional[TensorLike], request_id: Optional[str], out_as: str,
                                   timeout: Optional[float], kwargs: Dict[str, Any]
                                   ) -> Tuple[Optional[Array], "pb.Plan"]:
        arrays, lhs, rhs, bias, kwargs = _direct.split_operands(lhs, rhs, bias, kwargs)
        req = _common.gemm_request(lhs, rhs, group_sizes, bias, **kwargs)
        t = self._timeout(timeout)
        keep = bool(kwargs.get("keep_output_as"))
        with self._errors():
            staging_id, md = await self._stage(pb.StagingPlanRequest(grouped_gemm=req), arrays, request_id, timeout)
            call = self.stub.GroupedGemm(_direct.submitted(req, staging_id, arrays, direct_output=not keep),
                                         timeout=t, metadata=md)
            resp = await self._submit(staging_id, md, call)
            await self._note_request_id(call)
            if keep:
                return None, resp.plan
            out = _direct.output_array(resp)

            async def fetch(block: "pb.StagedBlock") -> None:
                d = block.destinations[0]
                parts = [c.data async for c in self._staging_stub(d.address).Fetch(
                    pb.FetchRequest(ticket=d.ticket), timeout=t, metadata=md)]
                _direct.place_block(out, block, b"".join(parts))

            await _direct.gather_all(fetch(b) for b in resp.out_blocks)
        return to_output(out, out_as), resp.plan

    async def _stage(self, plan_request: "pb.StagingPlanRequest", arrays: Dict[str, Any],
                     request_id: Optional[str], timeout: Optional[float], progress: Progress = False,
                     what: str = "") -> Tuple[str, Any]:
        """See shardgemm.Client._stage: the blocks staged by concurrent tasks."""
        t = self._timeout(timeout)
        call = self.stub.PlanStaging(plan_request, timeout=t, metadata=_common.metadata(request_id))
        plan = await call
        await self._note_request_id(call)
        md = _common.metadata(request_id or _common.request_id_of(await call.initial_metadata()))
        try:
            uploads = _direct.uploads(plan, arrays)
            with Meter(progress, sum(u.block.nbytes for u in uploads), what) as meter:

                async def stage(u: _direct.Upload) -> None:
                    await self._staging_stub(u.address).Stage(_direct.stage_chunks(u), timeout=t, metadata=md)
                    meter.update(u.block.nbytes)

                await _direct.gather_all(stage(u) for u in uploads)
        except BaseException:
            # Shielded: a cancelled call still tells the coordinator, within the bound.
            await asyncio.shield(self._release(plan.staging_id, md))
            raise
        return plan.staging_id, md

    async def _submit(self, staging_id: str, md: Any, call: Any) -> Any:
        """See shardgemm.Client._submit."""
        try:
            return await call
        except BaseException:
            await asyncio.shield(self._release(staging_id, md))
            raise

    async def _release(self, staging_id: str, md: Any) -> None:
        """See shardgemm.Client._release."""
        try:
            await self.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=staging_id),
                                           timeout=_direct.RELEASE_SECONDS, metadata=md)
        except grpc.RpcError:
            pass

    async def plan(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                   bias: Optional[TensorLike] = None, *, request_id: Optional[str] = None,
                   timeout: Optional[float] = None, **kwargs: Any) -> "pb.Plan":
        # A dry run needs shapes, not bytes: the large tensors' are left out.
        req = _common.gemm_wire(lhs, rhs, group_sizes, bias, **kwargs).skeleton
        resp = await self._unary(self.stub.Plan, pb.PlanRequest(grouped_gemm=req), timeout, request_id)
        return resp.plan

    async def grouped_quantize(self, x: TensorLike, group_sizes: TensorLike, *, request_id: Optional[str] = None,
                               timeout: Optional[float] = None, path: Optional[str] = None,
                               **kwargs: Any) -> "pb.GroupedQuantizeResponse":
        """See shardgemm.Client.grouped_quantize (path= included)."""
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and _direct.worth_staging(x) and await self._offers_staging()):
            arrays, x = _direct.split_x(x)
            req = _common.quantize_request(x, group_sizes, **kwargs)
            with self._errors():
                staging_id, md = await self._stage(pb.StagingPlanRequest(grouped_quantize=req), arrays, request_id,
                                                   timeout)
                call = self.stub.GroupedQuantize(_direct.submitted(req, staging_id, arrays),
                                                 timeout=self._timeout(timeout), metadata=md)
                resp = await self._submit(staging_id, md, call)
                await self._note_request_id(call)
            return resp
        req = _common.quantize_wire(x, group_sizes, **kwargs)
        if self._call_socket is not None:
            answered = await self._call_socket.grouped_quantize(req, request_id, self._timeout(timeout))
            if answered is not None:
                resp, self.last_request_id, _ = answered
                return resp
        return await self._unary(self.stub.GroupedQuantize, req, timeout, request_id)

    async def put(self, name: str, array: TensorLike, spec: str = "", overwrite: bool = False,
                  request_id: Optional[str] = None, *, progress: Progress = None,
                  timeout: Optional[float] = None, path: Optional[str] = None) -> "pb.PutTensorResponse":
        """See shardgemm.Client.put (path= included)."""
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and _direct.worth_staging(array) and await self._offers_staging()):
            arrays, plan_request = _direct.put_plan(name, array, spec, overwrite)
            with self._errors():
                staging_id, md = await self._stage(plan_request, arrays, request_id, timeout,
                                                   self.progress if progress is None else progress, f"put {name}")
                call = self.stub.PutStaged(pb.PutStagedRequest(staging_id=staging_id),
                                           timeout=self._timeout(timeout), metadata=md)
                resp = await self._submit(staging_id, md, call)
                await self._note_request_id(call)
            return resp
        chunks = _common.put_chunks(name, array, spec, overwrite, self.progress if progress is None else progress)
        return await self._unary(self.stub.PutTensor, chunks, timeout, request_id)

    async def get(self, name: str, request_id: Optional[str] = None, *, output: Optional[str] = None,
                  progress: Progress = None, timeout: Optional[float] = None, path: Optional[str] = None) -> Array:
        """See shardgemm.Client.get (path= included)."""
        out_as = check_output(output or self.output)
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and await self._offers_staging()):
            t = self._timeout(timeout)
            with self._errors():
                call = self.stub.PlanFetch(pb.GetTensorRequest(name=name), timeout=t,
                                           metadata=_common.metadata(request_id))
                blocks = await call
                await self._note_request_id(call)
                md = _common.metadata(request_id or _common.request_id_of(await call.initial_metadata()))
                out = _direct.empty_array(blocks.dtype, blocks.shape)
                with Meter(self.progress if progress is None else progress, out.nbytes, f"get {name}") as meter:

                    async def fetch(block: "pb.StagedBlock") -> None:
                        d = block.destinations[0]
                        parts = [c.data async for c in self._staging_stub(d.address).Fetch(
                            pb.FetchRequest(ticket=d.ticket), timeout=t, metadata=md)]
                        data = b"".join(parts)
                        _direct.place_block(out, block, data)
                        meter.update(len(data))

                    await _direct.gather_all(fetch(b) for b in blocks.blocks)
            return to_output(out, out_as)
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
        req = pb.RegisterSharedMemoryRequest(name=name, key=key, byte_size=int(byte_size), lease_ms=self._lease_ms)
        await self._register(req, request_id, timeout)

    async def _register(self, req: "pb.RegisterSharedMemoryRequest", request_id: Optional[str],
                        timeout: Optional[float]) -> None:
        await self._unary(self.stub.RegisterSharedMemory, req, timeout, request_id)
        if req.lease_ms:
            self._leases.add(req.name)

    async def _renew_leases(self, names: List[str]) -> List[str]:
        resp = await self.stub.RenewSharedMemory(pb.RenewSharedMemoryRequest(names=names),
                                                 timeout=min(10.0, self._lease_ms / 3000.0))
        return list(resp.lapsed)

    async def register_cuda_memory(self, name: str, ipc_handle: bytes, byte_size: int, *,
                                   request_id: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """See shardgemm.Client.register_cuda_memory (and shardgemm.aio.CudaMemoryRegion)."""
        req = pb.RegisterSharedMemoryRequest(name=name, cuda=pb.CudaIpcMemory(ipc_handle=bytes(ipc_handle)),
                                             byte_size=int(byte_size), lease_ms=self._lease_ms)
        await self._register(req, request_id, timeout)

    async def unregister_shared_memory(self, name: str, *, request_id: Optional[str] = None,
                                       timeout: Optional[float] = None) -> None:
        """See shardgemm.Client.unregister_shared_memory."""
        self._leases.discard(name)
        await self._unary(self.stub.UnregisterSharedMemory, pb.UnregisterSharedMemoryRequest(name=name), timeout,
                          request_id)

    async def list(self, *, timeout: Optional[float] = None) -> List["pb.ResidentTensorInfo"]:
        with self._errors():
            resp = await self.stub.ListTensors(pb.ListTensorsRequest(), timeout=self._timeout(timeout))
        return list(resp.tensors)
