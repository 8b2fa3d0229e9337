"""Requests whose large tensor bytes travel beside the message.

Python protobuf (upb) is slow with large bytes fields: a message built with a
fresh Tensor as a keyword argument, then serialized, costs many times a copy
of its bytes (52 ms for 8 MiB on the CI machine, against 1.3 ms for the
pieces below). A WireMessage holds the request without those bytes (its
`skeleton`) and, beside it, each large Tensor field's bytes as a buffer of the
caller's array. Serialized, it is the skeleton's bytes followed by each such
field again, holding only its `data`: protobuf parsers merge repeated
occurrences of a message field, so the receiver reads one request with every
tensor's bytes in place (the protobuf encoding spec, "Last One Wins" for
scalars, merged for embedded messages).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ._proto import pb, pb_grpc

# Tensors at least this large travel beside the message.
BLOB_MIN_BYTES = 64 << 10
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2


def varint(value: int) -> bytes:
    assert value >= 0, value
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def field_head(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field."""
    return varint(number << 3 | _LENGTH_DELIMITED) + varint(length)


class WireMessage:
    """A request as `skeleton` (its large tensors' bytes left out) plus those
    bytes, by the field that holds each tensor."""

    def __init__(self, skeleton: Any) -> None:
        self.skeleton = skeleton
        # (the field's number, the Tensor's data field number or 0 for a bytes field, the bytes)
        self._blobs: List[Tuple[int, int, memoryview]] = []

    def set_tensor(self, field: str, array: np.ndarray, tensor: "pb.Tensor") -> None:
        """skeleton.<field> = `tensor` (no data) with `array`'s bytes beside it."""
        getattr(self.skeleton, field).CopyFrom(tensor)
        number = self.skeleton.DESCRIPTOR.fields_by_name[field].number
        self._blobs.append((number, _TENSOR_DATA, memoryview(array.reshape(-1).view(np.uint8))))

    def set_bytes(self, field: str, data: Any) -> None:
        """skeleton.<field> (a bytes field, unset there) = `data`, a buffer."""
        number = self.skeleton.DESCRIPTOR.fields_by_name[field].number
        self._blobs.append((number, 0, memoryview(data).cast("B")))

    def parts(self) -> List[Any]:
        """The serialized request, in pieces to send one after another."""
        out: List[Any] = [self.skeleton.SerializeToString()]
        for number, inner_number, blob in self._blobs:
            if inner_number == 0:  # a bytes field of the message itself
                out += [field_head(number, blob.nbytes), blob]
                continue
            inner = field_head(inner_number, blob.nbytes)
            out += [field_head(number, len(inner) + blob.nbytes) + inner, blob]
        return out

    def serialize(self) -> bytes:
        return b"".join(self.parts())

    def message(self) -> Any:
        """The whole request as one message (a copy of every byte)."""
        if not self._blobs:
            return self.skeleton
        return type(self.skeleton).FromString(self.serialize())


# Where a GEMM's output bytes lie in a GroupedGemmResponse: out.data.
GEMM_RESPONSE_OUT_DATA = (pb.GroupedGemmResponse.DESCRIPTOR.fields_by_name["out"].number, _TENSOR_DATA)


def parse_gemm_response(raw: bytes) -> Tuple["pb.GroupedGemmResponse", Optional[memoryview]]:
    """A GroupedGemmResponse with its output's bytes left out of protobuf's
    parse: (the response, those bytes as a view of `raw`, or None)."""
    rest, out_data = take_bytes(raw, GEMM_RESPONSE_OUT_DATA)
    return pb.GroupedGemmResponse.FromString(rest), out_data


def stubs(channel: Any) -> Tuple[Any, Any]:
    """The ShardGemm and Staging stubs on `channel` (sync or asyncio), their
    calls that carry tensor bytes (GroupedGemm, GroupedQuantize, PutTensor,
    Stage) taking a WireMessage as well as a message. The ShardGemm stub's
    GroupedGemmInline is GroupedGemm answering parse_gemm_response's pair."""
    shardgemm, staging = pb_grpc.ShardGemmStub(channel), pb_grpc.StagingStub(channel)
    for stub, service_name, calls in (
            (shardgemm, "ShardGemm", (("GroupedGemm", "GroupedGemm", "unary_unary", pb.GroupedGemmResponse.FromString),
                                      ("GroupedGemmInline", "GroupedGemm", "unary_unary", parse_gemm_response),
                                      ("GroupedQuantize", "GroupedQuantize", "unary_unary",
                                       pb.GroupedQuantizeResponse.FromString),
                                      ("PutTensor", "PutTensor", "stream_unary", pb.PutTensorResponse.FromString))),
            (staging, "Staging", (("Stage", "Stage", "stream_unary", pb.StageResponse.FromString),))):
        service = pb.DESCRIPTOR.services_by_name[service_name].full_name
        for attribute, method, kind, deserialize in calls:
            setattr(stub, attribute, getattr(channel, kind)(f"/{service}/{method}", request_serializer=serialize,
                                                            response_deserializer=deserialize))
    return shardgemm, staging


def _read_varint(buf: memoryview, at: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("a truncated varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(buf: memoryview) -> List[Tuple[int, int, int, int, int]]:
    """The top-level fields of a serialized message: (number, wire type,
    start of the field, start of its value, end)."""
    out: List[Tuple[int, int, int, int, int]] = []
    at = 0
    while at < len(buf):
        start = at
        tag, at = _read_varint(buf, at)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            _, end = _read_varint(buf, at)
        elif kind == 1:
            end = at + 8
        elif kind == 2:
            length, at = _read_varint(buf, at)
            end = at + length
        elif kind == 5:
            end = at + 4
        else:
            raise ValueError(f"wire type {kind}")
        if end > len(buf):
            raise ValueError("a truncated field")
        out.append((number, kind, start, at, end))
        at = end
    return out


def take_bytes(raw: Any, path: Tuple[int, ...]) -> Tuple[bytes, Optional[memoryview]]:
    """The serialized message `raw` without the bytes field at `path` (field
    numbers, outermost first), and that field's bytes as a view of `raw`
    (writable when `raw` is): the large bytes are not parsed or copied by
    protobuf. (bytes(raw), None) when the field is not there exactly once at
    each level, or the bytes do not scan."""
    buf = memoryview(raw).cast("B")
    try:
        return _take(buf, path)
    except ValueError:
        return bytes(buf), None


def _take(buf: memoryview, path: Tuple[int, ...]) -> Tuple[bytes, Optional[memoryview]]:
    fields = _fields(buf)
    found = [f for f in fields if f[0] == path[0] and f[1] == _LENGTH_DELIMITED]
    if len(found) != 1:
        return bytes(buf), None
    _, _, start, value_start, end = found[0]
    if len(path) == 1:
        return bytes(buf[:start]) + bytes(buf[end:]), buf[value_start:end]
    inner, view = _take(buf[value_start:end], path[1:])
    if view is None:
        return bytes(buf), None
    return bytes(buf[:start]) + field_head(path[0], len(inner)) + inner + bytes(buf[end:]), view


def value_offset(head: Any, path: Tuple[int, ...]) -> Optional[int]:
    """Where the value of the length-delimited field at `path` starts in a
    serialized message of which `head` holds the first bytes: found when
    every field before it, at each level, lies within `head`; else None.
    A hint (where to align a receive buffer), not a parse: take_bytes
    finds the bytes themselves."""
    buf = memoryview(head).cast("B")
    at, level = 0, 0
    try:
        while at < len(buf):
            tag, at = _read_varint(buf, at)
            number, kind = tag >> 3, tag & 7
            if kind == _LENGTH_DELIMITED:
                length, at = _read_varint(buf, at)
                if number == path[level]:
                    level += 1
                    if level == len(path):
                        return at
                    continue  # into the field's value
                at += length
            elif kind == 0:
                _, at = _read_varint(buf, at)
            elif kind == 1:
                at += 8
            elif kind == 5:
                at += 4
            else:
                return None
    except ValueError:
        return None
    return None


def parts(request: Any) -> List[Any]:
    """A WireMessage's or a plain message's serialized pieces."""
    return request.parts() if isinstance(request, WireMessage) else [request.SerializeToString()]


def serialize(request: Any) -> bytes:
    """gRPC's request_serializer for a WireMessage or a plain message."""
    return b"".join(parts(request))


def nbytes(pieces: List[Any]) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def byte_size(request: Any) -> int:
    return nbytes(parts(request))


def blob_array(array: Any) -> Optional[np.ndarray]:
    """`array` as the contiguous NumPy array whose bytes go beside the
    message, or None when it goes in the message (small, or not an array)."""
    if not isinstance(array, np.ndarray) or array.nbytes < BLOB_MIN_BYTES:
        return None
    if array.dtype.byteorder == ">":
        return None  # the message's own path converts it
    return np.ascontiguousarray(array)
