"""What the sync and asyncio clients share: channel set-up, request building,
the chunking of a put and the assembly of a get."""
from __future__ import annotations

import os
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple

import grpc
import numpy as np

from . import _convert, _wire
from ._convert import SharedMemoryTensor, TensorLike, ToStage, proto_dtype, to_tensor
from ._progress import Meter, Progress
from ._proto import pb
from .errors import REQUEST_ID_KEY, error_for

MAX_MESSAGE = 2047 * 1024 * 1024
CHUNK = (1 << 20) - 4096  # data bytes of a put's / get's stream message: with its header within 1 MiB
# A client's bound on each call unless it names another, as the C++ client's
# (5 minutes): a service that stops answering fails the call, never hangs it.
DEFAULT_TIMEOUT_S = 300.0

CHANNEL_OPTIONS: List[Tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Credentials(NamedTuple):
    """A client's credentials per hop; None: plaintext."""
    coordinator: Optional[grpc.ChannelCredentials]
    workers: Optional[grpc.ChannelCredentials]
    #: Why the workers' staging ports cannot be called (a unix: client with a
    #: token but no tls_dir), or None.
    workers_unavailable: Optional[str] = None


def is_unix_target(address: str) -> bool:
    """Whether `address` names a Unix socket (a coordinator's --client_socket)."""
    return address.startswith("unix:")


def bearer_token(tls_dir: Optional[str], token: Optional[str]) -> Optional[str]:
    """The token given, or else tls_dir/client.token when there is one."""
    if token is not None or not tls_dir:
        return token
    path = os.path.join(tls_dir, "client.token")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read().decode().strip()


def credentials(tls_dir: Optional[str], token: Optional[str], address: str = "") -> Credentials:
    """TLS credentials from the mesh's certificates (ca.crt verifies the
    coordinator; client.crt / client.key are sent when present) with the
    bearer token (default: tls_dir/client.token); plaintext without tls_dir
    and token. A unix:PATH coordinator is called with gRPC's local
    credentials and the token (tls_dir then only for the workers' staging
    ports)."""
    unix = is_unix_target(address)
    if not tls_dir:
        if token and not unix:
            raise ValueError("a token is sent only over TLS or a Unix socket: give tls_dir too")
        if not token:
            return Credentials(None, None)
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
        return Credentials(grpc.composite_channel_credentials(local, grpc.access_token_call_credentials(token)),
                           None, "the workers' staging ports need TLS: give tls_dir too")

    def read(name: str) -> Optional[bytes]:
        path = os.path.join(tls_dir, name)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    tls = grpc.ssl_channel_credentials(root_certificates=read("ca.crt"), private_key=read("client.key"),
                                       certificate_chain=read("client.crt"))
    coordinator = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS) if unix else tls
    token = bearer_token(tls_dir, token)
    if token:
        bearer = grpc.access_token_call_credentials(token)
        tls = grpc.composite_channel_credentials(tls, bearer)
        coordinator = grpc.composite_channel_credentials(coordinator, bearer)
    return Credentials(coordinator, tls)


def metadata(request_id: Optional[str]) -> Optional[List[Tuple[str, str]]]:
    return [(REQUEST_ID_KEY, request_id)] if request_id else None


def request_id_of(md) -> Optional[str]:
    for item in md or ():
        if item[0] == REQUEST_ID_KEY:
            return item[1]
    return None


def _scaling(name: str) -> "pb.ScalingMode":
    if name not in _convert.SCALING:
        raise ValueError(f"scaling must be one of {tuple(_convert.SCALING)}, not {name!r}")
    return _convert.SCALING[name]


def _sizes(group_sizes: TensorLike, spec: str) -> "pb.Tensor":
    # The coordinator reads group_sizes to plan: sent inline, a shared-memory
    # tensor's values included (read from this process's view of them).
    if isinstance(group_sizes, str):
        return to_tensor(group_sizes, spec)
    return to_tensor(np.asarray(_convert.as_numpy(group_sizes), dtype=np.int64), spec)


def _put_tensor(wire: _wire.WireMessage, field: str, array: TensorLike, spec: str) -> None:
    """wire.skeleton.<field> from `array`: a large array's bytes beside the
    message, anything else (small, a name, a region's tensor) in it."""
    if not isinstance(array, (str, SharedMemoryTensor, ToStage)):
        array = _convert.as_numpy(array)  # once: a device tensor is brought to the host once
        blob = _wire.blob_array(array)
        if blob is not None:
            wire.set_tensor(field, blob, pb.Tensor(dtype=proto_dtype(blob.dtype), shape=list(blob.shape), spec=spec))
            return
    getattr(wire.skeleton, field).CopyFrom(to_tensor(array, spec))


def gemm_wire(lhs: TensorLike, rhs: TensorLike, group_sizes: TensorLike, bias: Optional[TensorLike] = None, *,
                 rhs_transposed: bool = False, ragged_k: bool = False, lhs_spec: str = "", rhs_spec: str = "",
                 group_sizes_spec: str = "", bias_spec: str = "", out_dtype: Any = None, out_spec: str = "",
                 compat: str = "default", keep_output_as: str = "", overwrite_output: bool = False,
                 include_plan: bool = False, global_sorted: bool = False,
                 lhs_scale_inv: Optional[TensorLike] = None, rhs_scale_inv: Optional[TensorLike] = None,
                 lhs_scale_spec: str = "", rhs_scale_spec: str = "", scaling: str = "current",
                 quantize_lhs: Any = None, out: Optional[SharedMemoryTensor] = None) -> _wire.WireMessage:
    """A v1.GroupedGemmRequest (see Client.grouped_gemm), its large tensors'
    bytes beside it (_wire)."""
    if out is not None and not isinstance(out, SharedMemoryTensor):
        raise TypeError("out= is a SharedMemoryTensor (SharedMemoryRegion.tensor(...)) or a CUDA array, "
                        f"not {type(out).__name__}")
    if out is not None and keep_output_as:
        raise ValueError("an output is kept resident (keep_output_as) or written to shared memory (out=), not both")
    if compat not in ("default", "te"):
        raise ValueError(f"compat must be 'default' or 'te', not {compat!r}")
    req = pb.GroupedGemmRequest(
        ragged=pb.GroupedGemmRequest.RAGGED_K if ragged_k else pb.GroupedGemmRequest.RAGGED_M,
        rhs_transposed=rhs_transposed, out_spec=out_spec,
        compat=pb.COMPAT_TE if compat == "te" else pb.COMPAT_DEFAULT,
        keep_output_as=keep_output_as, overwrite_output=overwrite_output, include_plan=include_plan,
        layout=pb.GroupedGemmRequest.GLOBAL_SORTED if global_sorted else pb.GroupedGemmRequest.PER_SHARD)
    wire = _wire.WireMessage(req)
    _put_tensor(wire, "lhs", lhs, lhs_spec)
    _put_tensor(wire, "rhs", rhs, rhs_spec)
    req.group_sizes.CopyFrom(_sizes(group_sizes, group_sizes_spec))
    if bias is not None:
        _put_tensor(wire, "bias", bias, bias_spec)
    if out_dtype is not None:
        req.out_dtype = proto_dtype(out_dtype)
    if out is not None:
        if out_dtype is None:
            req.out_dtype = proto_dtype(out.dtype)  # the region's tensor says what the output is
        elif proto_dtype(out_dtype) != proto_dtype(out.dtype):
            raise ValueError(f"out_dtype {np.dtype(out_dtype)} but out= is a {out.dtype} tensor")
        req.out_shared_memory.CopyFrom(out.ref())
    req.scaling = _scaling(scaling)
    if lhs_scale_inv is not None:
        _put_tensor(wire, "lhs_scale_inv", lhs_scale_inv, lhs_scale_spec)
    if rhs_scale_inv is not None:
        _put_tensor(wire, "rhs_scale_inv", rhs_scale_inv, rhs_scale_spec)
    if quantize_lhs is not None:
        req.quantize_lhs.dtype = proto_dtype(quantize_lhs)
    return wire


def gemm_request(*args: Any, **kwargs: Any) -> "pb.GroupedGemmRequest":
    """A v1.GroupedGemmRequest (see Client.grouped_gemm), as one message."""
    return gemm_wire(*args, **kwargs).message()


def gemm_output(resp: "pb.GroupedGemmResponse", out: Optional[SharedMemoryTensor],
                out_data: Optional[memoryview] = None) -> Any:
    """A GroupedGemmResponse's output as NumPy: the bytes it carries (or
    `out_data`, the bytes the call socket left out of the parse: used in
    place when writable); None when kept resident; with out=, the view of
    the region it was written to (shaped as the response says), the CUDA
    array itself for a CUDA region's tensor, or None where out= has no view
    here."""
    kind = resp.out.WhichOneof("source")
    if out_data is not None and kind is None:  # (a later source in the reply wins, as protobuf's parse says)
        return _convert.array_from_buffer(out_data, resp.out.dtype, resp.out.shape)
    if kind == "resident":
        return None
    if kind == "shared_memory":
        source = getattr(out, "source", None)  # a CUDA region's tensor: the array it stands for
        if source is not None:
            return source
        if out is None or out.array is None:
            return None
        dtype, shape = _convert.numpy_dtype(resp.out.dtype), tuple(resp.out.shape)
        view = out.array
        if view.dtype != dtype or view.shape != shape:
            view = view.reshape(-1).view(np.uint8).view(dtype).reshape(shape)  # the same bytes (the service checked)
        return view
    return _convert.from_tensor(resp.out)


def quantize_wire(x: TensorLike, group_sizes: TensorLike, *, x_spec: str = "", group_sizes_spec: str = "",
                     out_dtype: Any = None, scaling: str = "current", rowwise: bool = True, colwise: bool = False,
                     block_2d: bool = False, flatten_axis: int = 0, shared_scales: bool = False,
                     scales: Optional[TensorLike] = None, keep_rowwise_data_as: str = "",
                     keep_scale_inv_as: str = "", overwrite: bool = False,
                     include_plan: bool = False) -> _wire.WireMessage:
    """A v1.GroupedQuantizeRequest (see Client.grouped_quantize), x's bytes
    beside it when large (_wire)."""
    req = pb.GroupedQuantizeRequest(
        scaling=_scaling(scaling), rowwise=rowwise, colwise=colwise, block_2d=block_2d,
        flatten_axis=flatten_axis, shared_scales=shared_scales, include_plan=include_plan,
        keep=pb.QuantizeKeep(rowwise_data=keep_rowwise_data_as, scale_inv=keep_scale_inv_as, overwrite=overwrite))
    if out_dtype is not None:
        req.out_dtype = proto_dtype(out_dtype)
    if scales is not None:  # sent inline (a shared-memory tensor's values too)
        req.scales.CopyFrom(to_tensor(np.asarray(_convert.as_numpy(scales), dtype=np.float32)))
    wire = _wire.WireMessage(req)
    _put_tensor(wire, "x", x, x_spec)
    req.group_sizes.CopyFrom(_sizes(group_sizes, group_sizes_spec))
    return wire


def quantize_request(*args: Any, **kwargs: Any) -> "pb.GroupedQuantizeRequest":
    """A v1.GroupedQuantizeRequest (see Client.grouped_quantize), as one message."""
    return quantize_wire(*args, **kwargs).message()


def put_chunks(name: str, array: TensorLike, spec: str, overwrite: bool, progress: Progress
               ) -> Iterator[_wire.WireMessage]:
    """The PutTensor stream: the header with the first piece, then 1 MiB
    pieces sliced from the array's bytes as gRPC asks for them. The array is
    checked here, before the call: a bad one raises at once, not in gRPC's
    request thread."""
    a = np.ascontiguousarray(_convert.as_numpy(array))
    dtype = proto_dtype(a.dtype)
    raw = a.reshape(-1).view(np.uint8)

    def chunks() -> Iterator[_wire.WireMessage]:
        with Meter(progress, raw.nbytes, f"put {name}") as meter:
            offset = 0
            while True:
                piece = raw[offset:offset + CHUNK]  # sent from the array's own bytes (_wire)
                if offset == 0:
                    chunk = _wire.WireMessage(pb.TensorChunk(name=name, dtype=dtype, shape=list(a.shape), spec=spec,
                                                             overwrite=overwrite))
                else:
                    chunk = _wire.WireMessage(pb.TensorChunk())
                chunk.set_bytes("data", piece)
                yield chunk
                offset += piece.nbytes
                meter.update(piece.nbytes)
                if offset >= raw.nbytes:
                    return

    return chunks()


class Assembler:
    """A GetTensor stream's chunks into one array."""

    def __init__(self, name: str, progress: Progress) -> None:
        self.name, self.progress = name, progress
        self.header: Optional["pb.TensorChunk"] = None
        self.parts: List[bytes] = []
        self.meter: Optional[Meter] = None

    def add(self, chunk: "pb.TensorChunk") -> None:
        if self.header is None:
            self.header = chunk
            dtype = _convert.numpy_dtype(chunk.dtype)
            total = int(np.prod(tuple(chunk.shape), dtype=np.int64)) * dtype.itemsize
            self.meter = Meter(self.progress, total, f"get {self.name}")
        self.parts.append(chunk.data)
        assert self.meter is not None
        self.meter.update(len(chunk.data))

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()

    def array(self) -> np.ndarray:
        self.close()
        if self.header is None:
            raise error_for(grpc.StatusCode.DATA_LOSS, f"GetTensor {self.name!r}: the stream ended empty")
        try:
            return _convert.array_from_bytes(b"".join(self.parts), self.header.dtype, self.header.shape)
        except ValueError as e:
            raise error_for(grpc.StatusCode.DATA_LOSS, f"GetTensor {self.name!r}: {e}") from e

