"""Arrays to and from v1.Tensor: NumPy, anything with __dlpack__, PyTorch."""
from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

from ._proto import pb

if TYPE_CHECKING:
    import torch


class SupportsDLPack(Protocol):
    """An array from another library that NumPy can import (torch, JAX, CuPy
    host arrays, NumPy itself...)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


@dataclasses.dataclass(frozen=True)
class SharedMemoryTensor:
    """A row-major tensor in a registered shared-memory region: a GEMM
    operand (lhs, rhs, bias, FP8 scales) whose bytes the workers read from
    the region themselves, or a GEMM's ``out=`` (the workers write the
    output there). Made by :meth:`shardgemm.SharedMemoryRegion.tensor`, or
    by hand for a region registered with ``Client.register_shared_memory``.

    region: the name the region was registered under; offset: of the
    tensor's first byte in it; spec: its partition spec (a call's own
    ``*_spec`` argument, when given, is used instead). ``array`` is the
    NumPy view of the tensor's bytes where the region is mapped in this
    process (None for a reference made by hand)."""

    region: str
    dtype: np.dtype
    shape: Tuple[int, ...]
    offset: int = 0
    spec: str = ""
    array: Optional[np.ndarray] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "offset", int(self.offset))
        proto_dtype(self.dtype)  # a dtype the service knows, or ValueError now
        if not self.region:
            raise ValueError("a shared-memory tensor needs the region's registered name")
        if self.offset < 0 or any(d < 0 for d in self.shape):
            raise ValueError(f"offset {self.offset} and shape {self.shape} must not be negative")

    @property
    def nbytes(self) -> int:
        """prod(shape) * itemsize: the reference's byte_size."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def ref(self) -> "pb.SharedMemoryRef":
        """The v1.SharedMemoryRef (region, offset, byte_size)."""
        return pb.SharedMemoryRef(region=self.region, offset=self.offset, byte_size=self.nbytes)

    def to_proto(self, spec: str = "") -> "pb.Tensor":
        """The v1.Tensor naming these bytes: dtype, shape, spec (`spec` when
        given, else the reference's) and shared_memory."""
        return pb.Tensor(dtype=proto_dtype(self.dtype), shape=list(self.shape), spec=spec or self.spec,
                         shared_memory=self.ref())


@dataclasses.dataclass(frozen=True)
class ToStage:
    """An operand of the direct path, whose blocks the client streams to
    the workers itself: its request tensor carries dtype, shape and spec
    only (to_tensor)."""

    array: np.ndarray


#: An operand: a NumPy array (or anything np.asarray takes), an object with
#: __dlpack__ (a torch tensor, ...), a str naming a resident tensor, or a
#: SharedMemoryTensor (a GEMM operand's bytes in a registered region).
TensorLike = Union[np.ndarray, SupportsDLPack, str, SharedMemoryTensor, Any]
#: What calls return: a NumPy array, or a torch.Tensor with output="torch".
Array = Union[np.ndarray, "torch.Tensor"]

NUMPY_DTYPES: Dict["pb.DType", np.dtype] = {
    pb.F32: np.dtype(np.float32),
    pb.BF16: np.dtype(ml_dtypes.bfloat16),
    pb.F16: np.dtype(np.float16),
    pb.F8E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    pb.F8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    pb.E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    pb.I32: np.dtype(np.int32),
    pb.I64: np.dtype(np.int64),
}
PROTO_DTYPES: Dict[np.dtype, "pb.DType"] = {v: k for k, v in NUMPY_DTYPES.items()}
SCALING: Dict[str, "pb.ScalingMode"] = {"current": pb.CURRENT, "delayed": pb.DELAYED, "mxfp8": pb.MXFP8, "block": pb.BLOCK_FP8}
OUTPUTS = ("numpy", "torch")

# Types NumPy's DLPack import does not know (bfloat16, the FP8 formats):
# moved between torch and NumPy as integers of their width, then viewed.
_TORCH_VIEWS = {  # torch dtype name -> (torch integer dtype name, NumPy integer, NumPy dtype)
    "bfloat16": ("int16", np.int16, ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", np.uint8, ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", np.uint8, ml_dtypes.float8_e5m2),
    "float8_e8m0fnu": ("uint8", np.uint8, ml_dtypes.float8_e8m0fnu),
}


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a tensor means it already is
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_to_numpy(t: "torch.Tensor") -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # a copy to host: the request carries the bytes anyway
    name = str(t.dtype).replace("torch.", "")
    if name in _TORCH_VIEWS:
        int_name, _, np_dtype = _TORCH_VIEWS[name]
        return np.from_dlpack(t.view(getattr(torch, int_name))).view(np_dtype)
    return np.from_dlpack(t)


def as_numpy(x: Any) -> np.ndarray:
    """The array an operand holds, without a copy where it can be had.

    NumPy arrays as they are; torch tensors detached (and brought to the host)
    with BF16 / FP8 kept; a SharedMemoryTensor's view of its region; any
    other object with __dlpack__ through np.from_dlpack; anything else
    through np.asarray."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, SharedMemoryTensor):
        if x.array is None:
            raise TypeError(f"the shared-memory tensor in region {x.region!r} is not mapped in this process: "
                            "its bytes can be a GEMM operand, not an array here")
        return x.array
    if _is_torch_tensor(x):
        return _torch_to_numpy(x)
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise TypeError(f"{type(x).__name__} has __dlpack__ but NumPy cannot import it ({e}); "
                            "pass a host (CPU) array") from e
    return np.asarray(x)


def proto_dtype(dtype: Any) -> "pb.DType":
    d = np.dtype(dtype)
    if d not in PROTO_DTYPES:
        raise ValueError(f"unsupported dtype {d} (supported: {', '.join(str(t) for t in PROTO_DTYPES)})")
    return PROTO_DTYPES[d]


def to_tensor(array: TensorLike, spec: str = "") -> "pb.Tensor":
    """A v1.Tensor with the array's bytes (row-major, little-endian), a
    reference to a resident tensor when `array` is its name, or to bytes in
    a registered shared-memory region when it is a SharedMemoryTensor (its
    own spec unless `spec` is given)."""
    if isinstance(array, str):
        return pb.Tensor(resident=array, spec=spec)
    if isinstance(array, SharedMemoryTensor):
        return array.to_proto(spec)
    if isinstance(array, ToStage):
        return pb.Tensor(dtype=proto_dtype(array.array.dtype), shape=list(array.array.shape), spec=spec)
    a = np.ascontiguousarray(as_numpy(array))
    return pb.Tensor(dtype=proto_dtype(a.dtype), shape=list(a.shape), data=a.tobytes(), spec=spec)


def numpy_dtype(proto: "pb.DType") -> np.dtype:
    if proto not in NUMPY_DTYPES:
        raise ValueError(f"the service answered with dtype {proto}, unknown to this client")
    return NUMPY_DTYPES[proto]


def array_from_bytes(data: bytes, proto_dtype_: "pb.DType", shape: Sequence[int]) -> np.ndarray:
    """A writable array of the bytes (a copy: protobuf's bytes are immutable)."""
    dtype = numpy_dtype(proto_dtype_)
    shape = tuple(shape)
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != want:
        raise ValueError(f"{len(data)} bytes for a {dtype} tensor of shape {shape} ({want} expected)")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def array_from_buffer(data: memoryview, proto_dtype_: "pb.DType", shape: Sequence[int]) -> np.ndarray:
    """A writable array over `data` itself when it is writable, else over
    one copy of it."""
    dtype = numpy_dtype(proto_dtype_)
    shape = tuple(shape)
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if data.nbytes != want:
        raise ValueError(f"{data.nbytes} bytes for a {dtype} tensor of shape {shape} ({want} expected)")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    # A view only of writable, aligned bytes (NumPy and torch expect the
    # element alignment; the call socket receives so that they are).
    return array if not data.readonly and array.flags.aligned else array.copy()


def from_tensor(t: "pb.Tensor") -> np.ndarray:
    """The NumPy array of a v1.Tensor that carries its data."""
    return array_from_bytes(t.data, t.dtype, t.shape)


def check_output(output: str) -> str:
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, not {output!r}")
    return output


def to_output(a: Optional[np.ndarray], output: str) -> Optional[Array]:
    """`a` as NumPy (as it is) or as a torch.Tensor sharing its memory.
    Anything else (a CUDA out= array) is returned as it is."""
    if a is None or check_output(output) == "numpy" or not isinstance(a, np.ndarray):
        return a
    try:
        import torch
    except ImportError as e:
        raise ImportError("output='torch' needs PyTorch: pip install 'shardgemm[torch]'") from e
    for name, (int_name, np_int, np_dtype) in _TORCH_VIEWS.items():
        if a.dtype == np.dtype(np_dtype):
            if not hasattr(torch, name):
                raise TypeError(f"this PyTorch has no {name} for a {a.dtype} result")
            return torch.from_numpy(a.view(np_int)).view(getattr(torch, name))
    return torch.from_numpy(a)
