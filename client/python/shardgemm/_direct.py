"""The direct path (what the sync and asyncio clients share): the
coordinator plans where a request's blocks go (PlanStaging), the client
streams each worker its blocks under the plan's tickets, submits the
request naming the plan, and reads each distinct output block from the
worker holding it (docs/architecture.md, "Data paths")."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any, Awaitable, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from . import _convert, _wire
from ._common import CHUNK  # a Stage stream's data bytes per message, as a put's
from ._convert import SharedMemoryTensor, TensorLike, ToStage
from ._proto import pb

PATHS = ("auto", "direct", "inline")
#: The operands a request may stage, by their keyword / field name.
STAGEABLE = ("lhs", "rhs", "bias", "lhs_scale_inv", "rhs_scale_inv")
FIELD_OF_ROLE = {pb.TENSOR_LHS: "lhs", pb.TENSOR_RHS: "rhs", pb.TENSOR_BIAS: "bias",
                 pb.TENSOR_LHS_SCALE_INV: "lhs_scale_inv", pb.TENSOR_RHS_SCALE_INV: "rhs_scale_inv",
                 pb.TENSOR_X: "x", pb.TENSOR_ROLE_UNSPECIFIED: "tensor"}  # a put's tensor has no role
#: How long a client trusts what ClusterInfo said about staging ("auto").
STAGING_INFO_SECONDS = 10.0
#: The bound on ReleaseStaging after a direct call failed before its submit.
RELEASE_SECONDS = 5.0


def run_all(pool: concurrent.futures.Executor, fn: Callable[[Any], None], items: Iterable[Any]) -> None:
    """fn over items on pool's threads. On the first failure the items not
    started are cancelled and the running ones waited for before it is
    raised: nothing of a failed call goes on staging or fetching after it."""
    futures = [pool.submit(fn, x) for x in items]
    try:
        for f in concurrent.futures.as_completed(futures):
            f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)
        raise


async def gather_all(aws: Iterable[Awaitable[None]]) -> None:
    """As run_all, for tasks: the others are cancelled (their streams with
    them) and awaited before the first failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_path(path: str) -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    return path


def is_array(x: Any) -> bool:
    """An operand whose bytes this process holds (not a resident name nor a shared-memory reference)."""
    return x is not None and not isinstance(x, (str, SharedMemoryTensor))


#: "auto" stages an operand directly from this many bytes up. Below it the
#: direct path's extra round trips (plan, stage, fetch) cost more than the
#: coordinator's copy: on the 2-core CPU machine a 256 KiB and a 1 MiB lhs
#: were 2.8x and 1.4x slower direct, a 16 MiB one 1.3-1.6x faster
#: (docs/performance/service.md).
DIRECT_MIN_BYTES = 4 << 20


def worth_staging(x: Any) -> bool:
    """An operand "auto" sends directly: this process holds its bytes, and
    there are at least DIRECT_MIN_BYTES of them."""
    if not is_array(x):
        return False
    nbytes = getattr(x, "nbytes", None)
    if not isinstance(nbytes, int):
        nbytes = _convert.as_numpy(x).nbytes
    return nbytes >= DIRECT_MIN_BYTES


def offers_staging(info: "pb.ClusterInfo") -> bool:
    return bool(info.workers) and all(w.staging_address for w in info.workers)


def wants_direct(path: str, offered: Any, lhs: TensorLike, out: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether a grouped_gemm call takes the direct path. "auto": a NumPy (or
    DLPack) lhs of DIRECT_MIN_BYTES or more, no out= region, the PER_SHARD
    layout, and every worker serving staging (`offered()`, asked only then)."""
    if path == "inline":
        return False
    usable = out is None and not kwargs.get("global_sorted", False)
    if path == "direct":
        if not usable:
            raise ValueError("path='direct' stages operands and fetches the output itself: not with out= (shared "
                             "memory) or global_sorted")
        return True
    return usable and worth_staging(lhs) and offered()


class StagingInfo:
    """Whether the cluster offers staging, as the last ClusterInfo said (for a few seconds)."""

    def __init__(self) -> None:
        self.offered: Optional[bool] = None
        self.at = 0.0

    def fresh(self) -> Optional[bool]:
        if self.offered is None or time.monotonic() - self.at > STAGING_INFO_SECONDS:
            return None
        return self.offered

    def note(self, info: "pb.ClusterInfo") -> bool:
        self.offered, self.at = offers_staging(info), time.monotonic()
        return self.offered


def split_operands(lhs: TensorLike, rhs: TensorLike, bias: Optional[TensorLike], kwargs: Dict[str, Any]
                   ) -> Tuple[Dict[str, np.ndarray], TensorLike, TensorLike, Optional[TensorLike], Dict[str, Any]]:
    """The arrays to stage, by field, and the call's arguments with each
    replaced by its ToStage marker (resident names and shared-memory
    references are left as they are)."""
    arrays: Dict[str, np.ndarray] = {}

    def mark(field: str, x: Any) -> Any:
        if not is_array(x):
            return x
        a = np.ascontiguousarray(_convert.as_numpy(x))
        arrays[field] = a
        return ToStage(a)

    kwargs = dict(kwargs)
    for field in ("lhs_scale_inv", "rhs_scale_inv"):
        if kwargs.get(field) is not None:
            kwargs[field] = mark(field, kwargs[field])
    return arrays, mark("lhs", lhs), mark("rhs", rhs), mark("bias", bias), kwargs


@dataclasses.dataclass
class Upload:
    """One copy of one block, for one worker."""

    address: str
    ticket: str
    block: np.ndarray  # contiguous
    field: str


def uploads(plan: "pb.StagingPlan", arrays: Dict[str, np.ndarray]) -> List[Upload]:
    """Every block the plan asks for: each distinct block sliced (and made
    contiguous) once, sent to every rank whose block it is."""
    out: List[Upload] = []
    for operand in plan.operands:
        field = FIELD_OF_ROLE.get(operand.role)
        if field is None or field not in arrays:
            raise ValueError(f"the transfer plan names operand {operand.role}, which this call did not stage")
        a = arrays[field]
        for b in operand.blocks:
            index = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.shape))
            block = np.ascontiguousarray(a[index])
            for d in b.destinations:
                out.append(Upload(d.address, d.ticket, block, field))
    return out


def stage_chunks(upload: Upload) -> Iterator[_wire.WireMessage]:
    """A Stage stream: the ticket with the first piece, then 1 MiB pieces,
    each sent from the block's own bytes (_wire)."""
    raw = np.ascontiguousarray(upload.block).reshape(-1).view(np.uint8)
    offset = 0
    while True:
        piece = raw[offset:offset + CHUNK]
        chunk = _wire.WireMessage(pb.StageChunk(ticket=upload.ticket) if offset == 0 else pb.StageChunk())
        chunk.set_bytes("data", piece)
        yield chunk
        offset += piece.nbytes
        if offset >= raw.nbytes:
            return


def submitted(req: Any, staging_id: str, arrays: Dict[str, np.ndarray], direct_output: Optional[bool] = None) -> Any:
    """The request naming the staged blocks (a GEMM's leaving its output on
    the workers with direct_output)."""
    for field in arrays:
        getattr(req, field).staged = staging_id
    if direct_output is not None:
        req.direct_output = direct_output
    return req


def put_plan(name: str, array: TensorLike, spec: str, overwrite: bool
             ) -> Tuple[Dict[str, np.ndarray], "pb.StagingPlanRequest"]:
    """A direct put's array, and the transfer plan to ask for."""
    a = np.ascontiguousarray(_convert.as_numpy(array))
    req = pb.StagingPlanRequest(put=pb.PutStagingRequest(name=name, dtype=_convert.proto_dtype(a.dtype),
                                                         shape=list(a.shape), spec=spec, overwrite=overwrite))
    return {"tensor": a}, req


def split_x(x: TensorLike) -> Tuple[Dict[str, np.ndarray], Any]:
    """A quantize's x to stage (its ToStage marker), or as it is (a resident name)."""
    if not is_array(x):
        return {}, x
    a = np.ascontiguousarray(_convert.as_numpy(x))
    return {"x": a}, ToStage(a)


def output_array(resp: "pb.GroupedGemmResponse") -> np.ndarray:
    """An empty array of the response's output dtype and shape, for its blocks."""
    return empty_array(resp.out.dtype, resp.out.shape)


def empty_array(dtype: "pb.DType", shape: Any) -> np.ndarray:
    return np.empty(tuple(shape), dtype=_convert.numpy_dtype(dtype))


def place_block(out: np.ndarray, block: "pb.StagedBlock", data: bytes) -> None:
    shape = tuple(block.shape)
    want = int(np.prod(shape, dtype=np.int64)) * out.dtype.itemsize
    if len(data) != want:
        raise ValueError(f"an output block of shape {shape} came with {len(data)} bytes ({want} expected)")
    index = tuple(slice(o, o + s) for o, s in zip(block.offsets, shape))
    out[index] = np.frombuffer(data, dtype=out.dtype).reshape(shape)
