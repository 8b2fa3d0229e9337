"""Errors of a failed call: one ShardGemmError subclass per gRPC status code.

    try:
        c.get("no-such-tensor")
    except shardgemm.NotFoundError as e:
        print(e.code, e.details)       # StatusCode.NOT_FOUND, "... not found ..."

Every one carries .code (a grpc.StatusCode), .details (the server's message)
and .request_id (the x-request-id the coordinator gave the call, when it
answered with one). The grpc.RpcError it was made from is its __cause__.
Mistakes found before anything is sent (an unsupported dtype, an unknown
scaling mode) are ValueError / TypeError, not ShardGemmError.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

import grpc

REQUEST_ID_KEY = "x-request-id"


class ShardGemmError(Exception):
    """A call the service (or the channel to it) failed."""

    #: The status code this class stands for (the base class: any).
    grpc_code: Optional[grpc.StatusCode] = None

    def __init__(self, code: grpc.StatusCode, details: str = "", *, request_id: Optional[str] = None) -> None:
        super().__init__(code, details)
        self.code: grpc.StatusCode = code
        self.details: str = details
        self.request_id: Optional[str] = request_id

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.details}"
        return f"{text} (request {self.request_id})" if self.request_id else text

    def __reduce__(self):  # picklable, e.g. across multiprocessing
        return (_rebuild, (type(self), self.code.name, self.details, self.request_id))


def _rebuild(cls: Type[ShardGemmError], code_name: str, details: str, request_id: Optional[str]) -> ShardGemmError:
    return cls(grpc.StatusCode[code_name], details, request_id=request_id)


class CancelledError(ShardGemmError):
    grpc_code = grpc.StatusCode.CANCELLED


class UnknownError(ShardGemmError):
    grpc_code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(ShardGemmError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(ShardGemmError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(ShardGemmError):
    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ShardGemmError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(ShardGemmError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(ShardGemmError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(ShardGemmError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(ShardGemmError):
    grpc_code = grpc.StatusCode.ABORTED


class OutOfRangeError(ShardGemmError):
    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(ShardGemmError):
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(ShardGemmError):
    grpc_code = grpc.StatusCode.INTERNAL


class UnavailableError(ShardGemmError):
    grpc_code = grpc.StatusCode.UNAVAILABLE


class DataLossError(ShardGemmError):
    grpc_code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(ShardGemmError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


ERRORS: Dict[grpc.StatusCode, Type[ShardGemmError]] = {
    cls.grpc_code: cls for cls in ShardGemmError.__subclasses__() if cls.grpc_code is not None
}


def error_for(code: grpc.StatusCode, details: str = "", *, request_id: Optional[str] = None) -> ShardGemmError:
    """The ShardGemmError subclass instance for `code`."""
    return ERRORS.get(code, ShardGemmError)(code, details, request_id=request_id)


def _metadata_value(metadata, key: str) -> Optional[str]:
    for item in metadata or ():
        k, v = item[0], item[1]
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


def from_rpc_error(e: grpc.RpcError) -> ShardGemmError:
    """The ShardGemmError for a failed call (sync or grpc.aio)."""
    code = getattr(e, "code", None)
    code = code() if callable(code) else None
    details = getattr(e, "details", None)
    details = (details() if callable(details) else None) or ""
    request_id = None
    for name in ("initial_metadata", "trailing_metadata"):
        get = getattr(e, name, None)
        if request_id is None and callable(get):
            try:
                request_id = _metadata_value(get(), REQUEST_ID_KEY)
            except Exception:  # noqa: BLE001 - metadata is a bonus, never the error
                pass
    if not isinstance(code, grpc.StatusCode):
        code, details = grpc.StatusCode.UNKNOWN, details or str(e)
    return error_for(code, details, request_id=request_id)
