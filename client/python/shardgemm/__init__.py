"""shardgemm: the Python client of the shardgemm sharded grouped GEMM service.

    import numpy as np, shardgemm
    with shardgemm.Client("127.0.0.1:50051") as c:
        out, _ = c.grouped_gemm(lhs, rhs, group_sizes)   # NumPy in, NumPy out

shardgemm.Client (sync) and shardgemm.aio.Client (asyncio, grpc.aio) have the
same methods: cluster_info, grouped_gemm, plan, grouped_quantize, put, get,
delete, list, register_shared_memory, register_cuda_memory,
unregister_shared_memory. Operands:
NumPy arrays, objects with __dlpack__ (torch CPU tensors, ...), resident
tensor names, or SharedMemoryTensor references into a SharedMemoryRegion
(same-host clients of a coordinator run with --shared_memory; grouped_gemm's
out= writes the output there), or CUDA arrays (torch, CuPy, DLPack) that CUDA
workers on this host read and write in place through CUDA IPC
(CudaMemoryRegion, or registered per call); output="torch" returns torch tensors
(pip install 'shardgemm[torch]'); progress=True shows tqdm bars on put/get
(pip install 'shardgemm[progress]'). A failed call raises a ShardGemmError
subclass with .code (grpc.StatusCode) and .details.
"""
from . import aio, errors
from ._convert import NUMPY_DTYPES, PROTO_DTYPES, SCALING, Array, SharedMemoryTensor, SupportsDLPack, TensorLike, \
    as_numpy, from_tensor, to_tensor
from ._proto import pb, pb_grpc
from ._cuda import CudaError, CudaMemoryRegion, CudaMemoryTensor
from ._shm import SharedMemoryRegion
from ._version import __version__
from .client import Client
from .errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError, DeadlineExceededError,
                     FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError, OutOfRangeError,
                     PermissionDeniedError, ResourceExhaustedError, ShardGemmError, UnauthenticatedError,
                     UnavailableError, UnimplementedError, UnknownError)

__all__ = [
    "Client", "aio", "errors", "ShardGemmError", "SharedMemoryRegion", "SharedMemoryTensor",
    "CudaMemoryRegion", "CudaMemoryTensor", "CudaError",
    "AbortedError", "AlreadyExistsError", "CancelledError", "DataLossError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError",
    "UnimplementedError", "UnknownError",
    "Array", "TensorLike", "SupportsDLPack", "as_numpy", "to_tensor", "from_tensor",
    "NUMPY_DTYPES", "PROTO_DTYPES", "SCALING", "pb", "pb_grpc", "__version__",
]
