"""The synchronous client."""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc

from . import _common, _cuda, _direct, _frames, _lease, _wire
from ._convert import Array, SharedMemoryTensor, TensorLike, check_output, to_output
from ._progress import Meter, Progress
from ._proto import pb
from .errors import ShardGemmError, error_for, from_rpc_error


class Client:
    """A connection to a shardgemm coordinator.

        with shardgemm.Client("127.0.0.1:50051") as c:
            out, plan = c.grouped_gemm(lhs, rhs, group_sizes)

    Operands are NumPy arrays, objects with ``__dlpack__`` (torch CPU tensors,
    ...) or the names of resident tensors; results are NumPy arrays, or
    torch tensors with ``output="torch"`` (here or per call). A failed call
    raises a :class:`shardgemm.ShardGemmError` subclass carrying ``.code``
    and ``.details``.

    Every call takes an optional request_id (sent as x-request-id metadata;
    the coordinator's and every worker's log lines for the request carry it).
    Without one the coordinator makes one; either way the id of the last
    call that carried one is in ``last_request_id``. ``timeout`` (seconds,
    here or per call) bounds each call; None leaves it to the coordinator's
    --step_timeout_s.
    """

    # The repository's shardgemm_client.Client turns this off: failed calls
    # raise grpc.RpcError there, as they always did.
    _translate_errors = True
    # The repository's shardgemm_client.Client keeps the inline path by default.
    _default_path = "auto"

    def __init__(self, address: str, timeout: Optional[float] = _common.DEFAULT_TIMEOUT_S, *,
                 tls_dir: Optional[str] = None, token: Optional[str] = None, output: str = "numpy",
                 progress: Progress = False, options: Sequence[Tuple[str, Any]] = (), path: Optional[str] = None,
                 cuda_ipc: bool = True, shared_memory_lease: Optional[float] = _lease.DEFAULT_LEASE_S,
                 call_socket: Optional[str] = None) -> None:
        """address: the coordinator's HOST:PORT, or unix:PATH for its
        --client_socket (gRPC's local credentials with the token; tls_dir
        then only for the workers' staging ports). timeout: each call's
        bound in seconds unless the call names its own (default 300, as the
        C++ client's; None: unbounded, as a gRPC call without a deadline).
        tls_dir: the mesh's
        certificates (ca.crt verifies the coordinator; client.crt/client.key
        are sent when present); token: the bearer token (default:
        tls_dir/client.token). Without tls_dir the channel is plaintext, for
        a coordinator started with --insecure. output: "numpy" or "torch",
        the default of every call. progress: the default of put/get (True: a
        tqdm bar, when tqdm is installed; or a callable(done, total)).
        options: more gRPC channel options. path: grouped_gemm's default
        path ("auto", "direct" or "inline"; see grouped_gemm). cuda_ipc:
        whether grouped_gemm's CUDA arrays travel by CUDA IPC (the default;
        see grouped_gemm) or, False, are copied through the host (out= then
        cannot be a CUDA array). shared_memory_lease: the seconds a region
        this client registers is held on the service unless renewed; the
        client renews its regions in the background (a third of the lease
        apart) until it unregisters them or closes, so a client that dies
        loses them a lease later. None: held until unregistered.
        call_socket: the path of the coordinator's --call_socket (same host,
        same user): grouped_gemm's and grouped_quantize's inline calls go
        there as frames with the token, a socket round trip instead of a
        gRPC call's; a call the
        socket cannot take now (not connected, over the message limit) goes
        on gRPC, and every other call stays there. Its errors are
        ShardGemmError subclasses."""
        self.output = check_output(output)
        self.path = _direct.check_path(path or self._default_path)
        self.progress = progress
        self.timeout = timeout
        self.last_request_id: Optional[str] = None
        self.cuda_ipc = bool(cuda_ipc)
        self._lease_ms = _lease.lease_ms(shared_memory_lease)
        self._leases = _lease.LeaseRenewer(self._renew_leases, self._lease_ms / 3000.0 or 1.0)
        # CudaMemoryRegions registered with this client: reused by calls, unregistered by close().
        self._cuda_regions: List[_cuda._CudaRegion] = []
        opts = [*_common.CHANNEL_OPTIONS, *options]
        creds = _common.credentials(tls_dir, token, address)
        if creds.coordinator is not None:
            self.channel = grpc.secure_channel(address, creds.coordinator, options=opts)
        else:
            self.channel = grpc.insecure_channel(address, options=opts)
        self.stub, _ = _wire.stubs(self.channel)
        self._call_socket = (_frames.CallSocket(call_socket, _common.bearer_token(tls_dir, token), _common.MAX_MESSAGE)
                             if call_socket else None)
        self._creds, self._opts = creds.workers, opts
        self._workers_unavailable = creds.workers_unavailable
        # The direct path's: channels to the workers' staging services, the
        # threads that stream blocks in parallel, what ClusterInfo said.
        self._staging_lock = threading.Lock()
        self._staging_channels: Dict[str, Tuple[grpc.Channel, Any]] = {}
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._staging_info = _direct.StagingInfo()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Unregisters the CudaMemoryRegions made with this client (the
        first failure raised after the rest), then closes the channels."""
        try:
            failure: Optional[BaseException] = None
            for region in list(self._cuda_regions):
                try:
                    region.close(timeout=self._timeout(None) or 10)
                except (ShardGemmError, grpc.RpcError) as e:
                    failure = failure or e
            if failure is not None:
                raise failure
        finally:
            self._leases.close()
            if self._call_socket is not None:
                self._call_socket.close()
            self._close_channels()

    def _close_channels(self) -> None:
        with self._staging_lock:
            channels, self._staging_channels = list(self._staging_channels.values()), {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for channel, _ in channels:
            channel.close()
        self.channel.close()

    def _staging_stub(self, address: str) -> Any:
        with self._staging_lock:
            if address not in self._staging_channels:
                if self._workers_unavailable is not None:
                    raise error_for(
                        grpc.StatusCode.FAILED_PRECONDITION, f"the direct path to {address}: {self._workers_unavailable}")
                if self._creds is not None:
                    channel = grpc.secure_channel(address, self._creds, options=self._opts)
                else:
                    channel = grpc.insecure_channel(address, options=self._opts)
                self._staging_channels[address] = (channel, _wire.stubs(channel)[1])
            return self._staging_channels[address][1]

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._staging_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                                   thread_name_prefix="shardgemm-direct")
            return self._pool

    def _offers_staging(self) -> bool:
        if self._workers_unavailable is not None:
            return False  # "auto" stays inline: this client cannot call the staging ports
        fresh = self._staging_info.fresh()
        if fresh is not None:
            return fresh
        try:
            info = self.stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=self._timeout(None) or 10)
        except grpc.RpcError:
            return False  # the inline call says what is wrong
        return self._staging_info.note(info)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except grpc.RpcError as e:
            if not self._translate_errors:
                raise
            raise from_rpc_error(e) from e

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _note_request_id(self, call: Any) -> None:
        rid = _common.request_id_of(call.initial_metadata())
        if rid is not None:
            self.last_request_id = rid

    def cluster_info(self, *, timeout: Optional[float] = None) -> "pb.ClusterInfo":
        """The mesh, its workers (rank, address, backend, memory, down or
        not) and whether every rank has registered (``.ready``)."""
        with self._errors():
            return self.stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=self._timeout(timeout))

    def gemm_request(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                     bias: Optional[TensorLike] = None, **kwargs: Any) -> "pb.GroupedGemmRequest":
        """The v1.GroupedGemmRequest that grouped_gemm sends (same arguments)."""
        return _common.gemm_request(lhs, rhs, group_sizes, bias, **kwargs)

    def grouped_gemm(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                     bias: Optional[TensorLike] = None, *, out: Optional[Any] = None,
                     request_id: Optional[str] = None, output: Optional[str] = None,
                     timeout: Optional[float] = None, path: Optional[str] = None,
                     **kwargs: Any) -> Tuple[Optional[Array], "pb.Plan"]:
        """The grouped GEMM out[m] = lhs[m] @ rhs[g(m)] (+ bias) over the mesh.

        lhs [M, K], rhs [G, K, N] (or [G, N, K] with rhs_transposed=True),
        group_sizes [G] (rows of lhs per group, in order); each may be a
        resident tensor's name. *_spec give partition specs over the mesh
        ("(ep, None)"); out_dtype, out_spec, ragged_k, global_sorted,
        compat ("default" / "te"), keep_output_as (keep the output resident
        under that name instead of returning it), overwrite_output,
        include_plan. FP8: lhs/rhs FP8 arrays (or resident names) with
        lhs_scale_inv and rhs_scale_inv in the layouts of the proto's
        GroupedGemmRequest, under `scaling` ("current", "delayed", "block",
        "mxfp8"); quantize_lhs (an FP8 dtype) quantizes a float lhs on the
        workers instead.

        Shared memory (coordinator --shared_memory, same host): lhs, rhs,
        bias and the scales may be SharedMemoryTensor references
        (SharedMemoryRegion.tensor(...); their spec unless *_spec is
        given), which the workers read from the region themselves; group_sizes
        is always sent inline (a reference's values are read here). out=
        a SharedMemoryTensor has the workers write the output into the
        region instead of returning it (its dtype is the out_dtype unless
        one is given; its byte size must be the output's; not with
        keep_output_as).

        CUDA arrays (coordinator --shared_memory, CUDA workers on this
        host): lhs, rhs, bias, the scales and out= may be C-contiguous CUDA
        arrays (torch tensors, CuPy arrays, __cuda_array_interface__ or
        CUDA DLPack objects), which the workers read and write in place
        through CUDA IPC. Each is named as an offset in the allocation
        holding it: a CudaMemoryRegion of this client's that holds it, else
        one registered for the call and unregistered after (one per
        allocation). Before the request the client synchronizes every
        device those arrays are on (cuCtxSynchronize of its primary
        context: all of this process's streams there), so the producers'
        writes, and earlier work on out=, are done; when the call returns,
        the output has been written (returned is out= itself, output=
        aside). A CUDA lhs without out= gets its output back in the
        response, on the host. cuda_ipc=False on the client copies CUDA
        operands through the host instead.

        path: how the operands' and the output's bytes travel. "direct":
        the coordinator plans where each block goes, this client streams
        every worker its blocks itself, in parallel (the workers' staging
        ports, under the plan's tickets), submits the request naming them,
        and reads each distinct output block from the worker holding it, in
        parallel; the coordinator touches none of those bytes (resident
        names and group_sizes travel as usual). "inline": the bytes are in
        the request and the response. "auto" (the default): direct for
        NumPy / DLPack operands when every worker serves staging and
        neither out= nor global_sorted is given, else inline.

        Returns (out, plan): out is the output (NumPy, or torch with
        output="torch"), None when kept resident; with out=, the view of the
        region holding it (out.array, shaped as the response says; sharing
        the region's memory, not a copy), or None when out= was made by hand
        and has no view. plan is empty unless include_plan."""
        out_as = check_output(output or self.output)
        mem = _cuda.call_memory(_cuda.gemm_fields(lhs, rhs, bias, out, kwargs), self._cuda_regions,
                                lambda x, field: _cuda._CudaRegion(x, what=field), self.cuda_ipc)
        with self._cuda_call(mem, timeout):
            lhs, rhs, bias, out, kwargs = _cuda.gemm_arguments(mem.fields, kwargs)
            if _direct.wants_direct(_direct.check_path(path or self.path), self._offers_staging, lhs, out, kwargs):
                return self._grouped_gemm_direct(lhs, rhs, group_sizes, bias, request_id, out_as, timeout, kwargs)
            req = _common.gemm_wire(lhs, rhs, group_sizes, bias, out=out, **kwargs)
            if self._call_socket is not None:
                answered = self._call_socket.grouped_gemm(req, request_id, self._timeout(timeout))
                if answered is not None:
                    resp, self.last_request_id, out_data = answered
                    return to_output(_common.gemm_output(resp, out, out_data), out_as), resp.plan
            with self._errors():
                (resp, out_data), call = self.stub.GroupedGemmInline.with_call(
                    req, timeout=self._timeout(timeout), metadata=_common.metadata(request_id))
            self._note_request_id(call)
            return to_output(_common.gemm_output(resp, out, out_data), out_as), resp.plan

    @contextlib.contextmanager
    def _cuda_call(self, mem: _cuda.CallMemory, timeout: Optional[float]) -> Iterator[None]:
        """Registers the call's own CUDA regions, synchronizes the devices,
        and unregisters the regions after the call (a failure to do that
        is raised only when the call itself succeeded)."""
        made: List[_cuda._CudaRegion] = []
        failed = False
        try:
            for region in mem.new:
                try:
                    self.register_cuda_memory(region.name, region.ipc_handle, region.byte_size, timeout=timeout)
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
                    self.unregister_shared_memory(region.name, timeout=timeout)
                except (ShardGemmError, grpc.RpcError):
                    if not failed:
                        raise
                finally:
                    region._release()

    def _grouped_gemm_direct(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike,
                             bias: Optional[TensorLike], request_id: Optional[str], out_as: str,
                             timeout: Optional[float], kwargs: Dict[str, Any]) -> Tuple[Optional[Array], "pb.Plan"]:
        arrays, lhs, rhs, bias, kwargs = _direct.split_operands(lhs, rhs, bias, kwargs)
        req = _common.gemm_request(lhs, rhs, group_sizes, bias, **kwargs)
        t = self._timeout(timeout)
        keep = bool(kwargs.get("keep_output_as"))
        with self._errors():
            staging_id, md = self._stage(pb.StagingPlanRequest(grouped_gemm=req), arrays, request_id, timeout)
            resp, call = self._submit(staging_id, md, lambda: self.stub.GroupedGemm.with_call(
                _direct.submitted(req, staging_id, arrays, direct_output=not keep), timeout=t, metadata=md))
            self._note_request_id(call)
            if keep:
                return None, resp.plan
            out = _direct.output_array(resp)

            def fetch(block: "pb.StagedBlock") -> None:
                d = block.destinations[0]
                chunks = self._staging_stub(d.address).Fetch(pb.FetchRequest(ticket=d.ticket), timeout=t,
                                                             metadata=md)
                _direct.place_block(out, block, b"".join(c.data for c in chunks))

            _direct.run_all(self._threads(), fetch, resp.out_blocks)
        return to_output(out, out_as), resp.plan

    def _stage(self, plan_request: "pb.StagingPlanRequest", arrays: Dict[str, Any], request_id: Optional[str],
               timeout: Optional[float], progress: Progress = False, what: str = "") -> Tuple[str, Any]:
        """Asks for the transfer plan and streams every block of it, in
        parallel: the plan's staging id, and the metadata the request's
        later calls carry (the plan's request id)."""
        t = self._timeout(timeout)
        plan, call = self.stub.PlanStaging.with_call(plan_request, timeout=t, metadata=_common.metadata(request_id))
        self._note_request_id(call)
        # The request's calls share the plan's id (the coordinator made one if the caller did not).
        md = _common.metadata(request_id or _common.request_id_of(call.initial_metadata()))

        try:
            uploads = _direct.uploads(plan, arrays)
            lock = threading.Lock()
            with Meter(progress, sum(u.block.nbytes for u in uploads), what) as meter:

                def stage(u: _direct.Upload) -> None:
                    self._staging_stub(u.address).Stage(_direct.stage_chunks(u), timeout=t, metadata=md)
                    with lock:
                        meter.update(u.block.nbytes)

                _direct.run_all(self._threads(), stage, uploads)
        except BaseException:
            self._release(plan.staging_id, md)
            raise
        return plan.staging_id, md

    def _submit(self, staging_id: str, md: Any, call: Any) -> Any:
        """The request naming the plan; if it fails the plan is released (a
        request refused before its steps leaves its plan unused, and this
        client does not submit it again)."""
        try:
            return call()
        except BaseException:
            self._release(staging_id, md)
            raise

    def _release(self, staging_id: str, md: Any) -> None:
        """A plan this call will not submit: the workers drop its staged
        blocks now rather than at their TTL. Best effort: the error that
        ended the call is what the caller hears."""
        try:
            self.stub.ReleaseStaging(pb.ReleaseStagingRequest(staging_id=staging_id),
                                     timeout=_direct.RELEASE_SECONDS, metadata=md)
        except grpc.RpcError:
            pass

    def plan(self, lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike, bias: Optional[TensorLike] = None,
             *, request_id: Optional[str] = None, timeout: Optional[float] = None, **kwargs: Any) -> "pb.Plan":
        """The plan grouped_gemm would run with these arguments, without running it
        (nor sending the large tensors' bytes: a dry run needs their shapes)."""
        req = _common.gemm_wire(lhs, rhs, group_sizes, bias, **kwargs).skeleton
        with self._errors():
            resp, call = self.stub.Plan.with_call(pb.PlanRequest(grouped_gemm=req), timeout=self._timeout(timeout),
                                                  metadata=_common.metadata(request_id))
        self._note_request_id(call)
        return resp.plan

    def grouped_quantize(self, x: TensorLike, group_sizes: TensorLike, *, request_id: Optional[str] = None,
                         timeout: Optional[float] = None, path: Optional[str] = None,
                         **kwargs: Any) -> "pb.GroupedQuantizeResponse":
        """Grouped FP8 quantize of x [M, ...] (x_spec, group_sizes_spec, out_dtype,
        scaling, rowwise, colwise, block_2d, flatten_axis, shared_scales, scales,
        keep_rowwise_data_as, keep_scale_inv_as, overwrite, include_plan).
        Returns the GroupedQuantizeResponse (kept outputs name their resident
        tensors; shardgemm.from_tensor reads the others). path: as
        grouped_gemm's for x (staged on the workers directly); the outputs
        come back in the response either way."""
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and _direct.worth_staging(x) and self._offers_staging()):
            arrays, x = _direct.split_x(x)
            req = _common.quantize_request(x, group_sizes, **kwargs)
            with self._errors():
                staging_id, md = self._stage(pb.StagingPlanRequest(grouped_quantize=req), arrays, request_id, timeout)
                resp, call = self._submit(staging_id, md, lambda: self.stub.GroupedQuantize.with_call(
                    _direct.submitted(req, staging_id, arrays), timeout=self._timeout(timeout), metadata=md))
            self._note_request_id(call)
            return resp
        req = _common.quantize_wire(x, group_sizes, **kwargs)
        if self._call_socket is not None:
            answered = self._call_socket.grouped_quantize(req, request_id, self._timeout(timeout))
            if answered is not None:
                resp, self.last_request_id, _ = answered
                return resp
        with self._errors():
            resp, call = self.stub.GroupedQuantize.with_call(req, timeout=self._timeout(timeout),
                                                             metadata=_common.metadata(request_id))
        self._note_request_id(call)
        return resp

    def put(self, name: str, array: TensorLike, spec: str = "", overwrite: bool = False,
            request_id: Optional[str] = None, *, progress: Progress = None,
            timeout: Optional[float] = None, path: Optional[str] = None) -> "pb.PutTensorResponse":
        """Makes `array` a resident tensor `name`, sharded by `spec` over the
        workers (streamed in 1 MiB chunks). Refused (AlreadyExistsError) when
        `name` exists, unless overwrite. path: as grouped_gemm's; direct, each
        worker's block (and its standby copies) is streamed to it by this
        client, in parallel, and progress counts the bytes sent to all."""
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and _direct.worth_staging(array) and self._offers_staging()):
            arrays, plan_request = _direct.put_plan(name, array, spec, overwrite)
            with self._errors():
                staging_id, md = self._stage(plan_request, arrays, request_id, timeout,
                                             self.progress if progress is None else progress, f"put {name}")
                resp, call = self._submit(staging_id, md, lambda: self.stub.PutStaged.with_call(
                    pb.PutStagedRequest(staging_id=staging_id), timeout=self._timeout(timeout), metadata=md))
            self._note_request_id(call)
            return resp
        chunks = _common.put_chunks(name, array, spec, overwrite, self.progress if progress is None else progress)
        with self._errors():
            resp, call = self.stub.PutTensor.with_call(chunks, timeout=self._timeout(timeout),
                                                       metadata=_common.metadata(request_id))
        self._note_request_id(call)
        return resp

    def get(self, name: str, request_id: Optional[str] = None, *, output: Optional[str] = None,
            progress: Progress = None, timeout: Optional[float] = None, path: Optional[str] = None) -> Array:
        """The resident tensor `name`, assembled from its shards. path: as
        grouped_gemm's; direct (the default where every worker serves
        staging), each distinct block is read from a worker holding it, in
        parallel."""
        out_as = check_output(output or self.output)
        chosen = _direct.check_path(path or self.path)
        if chosen == "direct" or (chosen == "auto" and self._offers_staging()):
            t = self._timeout(timeout)
            with self._errors():
                blocks, call = self.stub.PlanFetch.with_call(pb.GetTensorRequest(name=name), timeout=t,
                                                             metadata=_common.metadata(request_id))
                self._note_request_id(call)
                md = _common.metadata(request_id or _common.request_id_of(call.initial_metadata()))
                out = _direct.empty_array(blocks.dtype, blocks.shape)
                lock = threading.Lock()
                with Meter(self.progress if progress is None else progress, out.nbytes, f"get {name}") as meter:

                    def fetch(block: "pb.StagedBlock") -> None:
                        d = block.destinations[0]
                        chunks = self._staging_stub(d.address).Fetch(pb.FetchRequest(ticket=d.ticket), timeout=t,
                                                                     metadata=md)
                        data = b"".join(c.data for c in chunks)
                        _direct.place_block(out, block, data)
                        with lock:
                            meter.update(len(data))

                    _direct.run_all(self._threads(), fetch, blocks.blocks)
            return to_output(out, out_as)
        assembler = _common.Assembler(name, self.progress if progress is None else progress)
        try:
            with self._errors():
                call = self.stub.GetTensor(pb.GetTensorRequest(name=name), timeout=self._timeout(timeout),
                                           metadata=_common.metadata(request_id))
                for chunk in call:
                    assembler.add(chunk)
                self._note_request_id(call)
        finally:
            assembler.close()
        return to_output(assembler.array(), out_as)

    def delete(self, name: str, request_id: Optional[str] = None, *, timeout: Optional[float] = None) -> None:
        """Deletes the resident tensor `name` (NotFoundError when there is none)."""
        with self._errors():
            _, call = self.stub.DeleteTensor.with_call(pb.DeleteTensorRequest(name=name),
                                                       timeout=self._timeout(timeout),
                                                       metadata=_common.metadata(request_id))
        self._note_request_id(call)

    def register_shared_memory(self, name: str, key: str, byte_size: int, *, request_id: Optional[str] = None,
                               timeout: Optional[float] = None) -> None:
        """Registers the POSIX shared-memory object `key` (its shm_open
        name: "/" then a name without "/") under `name`, of which the service
        may use the first `byte_size` bytes: SharedMemoryTensor(name, ...)
        then names bytes in it. The coordinator needs --shared_memory
        (FailedPreconditionError otherwise) and its workers must share this
        host. AlreadyExistsError when `name` is registered, NotFoundError
        when there is no object `key`, InvalidArgumentError when it is
        smaller than byte_size. shardgemm.SharedMemoryRegion does all this
        for an object it makes."""
        req = pb.RegisterSharedMemoryRequest(name=name, key=key, byte_size=int(byte_size), lease_ms=self._lease_ms)
        self._register(req, request_id, timeout)

    def _register(self, req: "pb.RegisterSharedMemoryRequest", request_id: Optional[str],
                  timeout: Optional[float]) -> None:
        with self._errors():
            _, call = self.stub.RegisterSharedMemory.with_call(req, timeout=self._timeout(timeout),
                                                               metadata=_common.metadata(request_id))
        self._note_request_id(call)
        if req.lease_ms:
            self._leases.add(req.name)

    def _renew_leases(self, names: List[str]) -> List[str]:
        resp = self.stub.RenewSharedMemory(pb.RenewSharedMemoryRequest(names=names),
                                           timeout=min(10.0, self._lease_ms / 3000.0))
        return list(resp.lapsed)

    def register_cuda_memory(self, name: str, ipc_handle: bytes, byte_size: int, *,
                             request_id: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Registers a CUDA allocation of this process by its IPC handle
        (the 64-byte cudaIpcMemHandle_t of the allocation's base) under
        `name`, of which the service may use the first `byte_size` bytes.
        The coordinator needs --shared_memory and CUDA workers on this host
        (CPU workers refuse requests naming it: FailedPreconditionError);
        InvalidArgumentError for a handle of another size, AlreadyExistsError
        when `name` is registered. The allocation must stay alive while it
        is registered. shardgemm.CudaMemoryRegion does all this for an
        array."""
        req = pb.RegisterSharedMemoryRequest(name=name, cuda=pb.CudaIpcMemory(ipc_handle=bytes(ipc_handle)),
                                             byte_size=int(byte_size), lease_ms=self._lease_ms)
        self._register(req, request_id, timeout)

    def unregister_shared_memory(self, name: str, *, request_id: Optional[str] = None,
                                 timeout: Optional[float] = None) -> None:
        """Forgets the region `name` (NotFoundError when none is
        registered): later requests naming it are NotFoundError. The object
        itself is the caller's to unlink."""
        req = pb.UnregisterSharedMemoryRequest(name=name)
        self._leases.discard(name)
        with self._errors():
            _, call = self.stub.UnregisterSharedMemory.with_call(req, timeout=self._timeout(timeout),
                                                                 metadata=_common.metadata(request_id))
        self._note_request_id(call)

    def list(self, *, timeout: Optional[float] = None) -> List["pb.ResidentTensorInfo"]:
        """The resident tensors this caller may see: name, dtype, shape, spec, lost."""
        with self._errors():
            return list(self.stub.ListTensors(pb.ListTensorsRequest(), timeout=self._timeout(timeout)).tensors)
