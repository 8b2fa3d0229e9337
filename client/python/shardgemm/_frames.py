"""The coordinator's --call_socket: a same-host client's GroupedGemm and
GroupedQuantize calls as frames on a Unix stream socket instead of gRPC calls (one socket round
trip instead of gRPC's thread hand-offs). A frame is a 16-byte header (the
magic "SGS1" and version 1, little-endian u32 each, then the payload's
length, u64) and a serialized CallSocketRequest; the coordinator answers
with a CallSocketReply frame of the same call_id. A reply of call_id 0 and
a code other than OK is the connection's refusal (the coordinator serves
that many connections already): none of its calls ran."""
from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from typing import Any, List, Optional, Tuple

import grpc
import numpy as np

from . import _wire
from ._proto import pb
from .errors import ShardGemmError, error_for

MAGIC, VERSION = 0x31534753, 1
HEADER = struct.Struct("<IIQ")
UCRED = struct.Struct("3i")  # pid, uid, gid: SO_PEERCRED
# The frame's own fields fit in this much beside the request.
FRAME_FIELDS_BYTES = 4096
# A connection that failed is tried again at most this often (the call goes on gRPC meanwhile).
RETRY_AFTER_S = 1.0
# The first bytes of a reply read to find where a GEMM's output starts.
ALIGN_PEEK_BYTES = 4096
# Threads calling at once each take a connection of their own, up to this
# many; a call past them goes on gRPC rather than wait for one.
MAX_CONNECTIONS = 8
CONNECT_TIMEOUT_S = 1.0


# The calls the socket serves: CallSocketRequest's and CallSocketReply's
# field of each, and its RPC's name (for errors).
OPS = {"grouped_gemm": "GroupedGemm", "grouped_quantize": "GroupedQuantize"}


class _NotRun(Exception):
    """The call did not reach the coordinator: it goes on gRPC."""


def _call_frame(op: str, request: Any, request_id: Optional[str], timeout: Optional[float],
                token: str, call_id: int) -> Tuple[List[Any], int]:
    """The frame of a call of `request` (a message or a _wire.WireMessage),
    in pieces to send one after another (a large tensor's bytes are the
    caller's buffer, not copied), and the request's size."""
    frame = pb.CallSocketRequest(token=token, request_id=request_id or "", call_id=call_id)
    if timeout is not None:
        frame.deadline_unix_us = int((time.time() + timeout) * 1e6)
    parts = _wire.parts(request)
    request_bytes = _wire.nbytes(parts)
    # The request as the frame's `op` field: the frame's own fields, then its tag and length, then its bytes.
    head = frame.SerializeToString() + _wire.field_head(pb.CallSocketRequest.DESCRIPTOR.fields_by_name[op].number,
                                                        request_bytes)
    return [HEADER.pack(MAGIC, VERSION, len(head) + request_bytes) + head, *parts], request_bytes


def _payload_length(header: bytes, path: str, max_bytes: int) -> int:
    magic, version, length = HEADER.unpack(header)
    if (magic, version) != (MAGIC, VERSION):
        raise error_for(grpc.StatusCode.DATA_LOSS, f"the call socket at {path} answered no frame")
    if length > max_bytes:  # checked before anything is allocated for it
        raise error_for(grpc.StatusCode.DATA_LOSS,
                        f"the call socket at {path} answered a frame of {length} bytes, more than the {max_bytes} taken")
    return length


def _checked(reply: "pb.CallSocketReply", call_id: int, path: str) -> "pb.CallSocketReply":
    if reply.call_id == 0 and reply.code != 0:
        raise _NotRun()  # the connection's refusal: the coordinator read none of its calls
    if reply.call_id != call_id:
        raise error_for(grpc.StatusCode.DATA_LOSS, f"the call socket at {path} answered call {reply.call_id}, not {call_id}")
    return reply


# Where a GEMM reply's output bytes lie: CallSocketReply.grouped_gemm.out.data.
_GEMM_OUT_DATA = ((pb.CallSocketReply.DESCRIPTOR.fields_by_name["grouped_gemm"].number,)
                  + _wire.GEMM_RESPONSE_OUT_DATA)


def _parse_reply(raw: Any) -> Tuple["pb.CallSocketReply", Optional[memoryview]]:
    """The reply, a GEMM's output bytes left out of protobuf's parse and
    returned as a view of `raw` (writable when `raw` is: no copy)."""
    rest, out_data = _wire.take_bytes(raw, _GEMM_OUT_DATA)
    reply = pb.CallSocketReply.FromString(rest)
    if out_data is not None and reply.WhichOneof("answer") != "grouped_gemm":
        return pb.CallSocketReply.FromString(bytes(raw)), None  # a later answer wins: protobuf's parse decides
    return reply, out_data


def _result(reply: "pb.CallSocketReply", op: str,
            out_data: Optional[memoryview] = None) -> Tuple[Any, str, Optional[memoryview]]:
    if reply.code != 0:
        try:
            code = next(c for c in grpc.StatusCode if c.value[0] == reply.code)
        except StopIteration:
            code = grpc.StatusCode.UNKNOWN
        raise error_for(code, reply.message, request_id=reply.request_id or None)
    return getattr(reply, op), reply.request_id, out_data


def _own_user(sock: socket.socket) -> bool:
    """Only a coordinator of this user is sent the token and the tensors."""
    _, uid, _ = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
    return uid == os.geteuid()


class CallSocket:
    """Connections to a coordinator's --call_socket, one call at a time on
    each; a connection is taken by one call and given back after it."""

    def __init__(self, path: str, token: Optional[str], max_message_bytes: int) -> None:
        self.path = path
        self.token = token or ""
        self.max_request_bytes = max_message_bytes - FRAME_FIELDS_BYTES
        self.max_reply_bytes = max_message_bytes + FRAME_FIELDS_BYTES
        self._lock = threading.Lock()  # guards the fields below, never held across a call
        self._idle: List[socket.socket] = []
        self._open = 0  # idle and taken
        self._retry_at = 0.0
        self._next_id = 1
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for sock in idle:
            sock.close()

    def grouped_gemm(self, request: Any, request_id: Optional[str],
                     timeout: Optional[float]) -> Optional[Tuple["pb.GroupedGemmResponse", str, Optional[memoryview]]]:
        return self.call("grouped_gemm", request, request_id, timeout)

    def grouped_quantize(self, request: Any, request_id: Optional[str],
                         timeout: Optional[float]) -> Optional[Tuple["pb.GroupedQuantizeResponse", str, Optional[memoryview]]]:
        return self.call("grouped_quantize", request, request_id, timeout)

    def call(self, op: str, request: Any, request_id: Optional[str],
             timeout: Optional[float]) -> Optional[Tuple[Any, str, Optional[memoryview]]]:
        """`op` (an OPS key) with `request`: the response, the request's id
        and, for a GEMM whose output came back in the reply, its bytes (a
        view of the received buffer: the response's `out` has no data);
        None when the socket cannot
        take the call now (not connected, every connection busy, refused,
        larger than the message limit, a connection the coordinator had
        closed): the caller sends it on gRPC. A failure after the frame went
        raises (UNAVAILABLE, DEADLINE_EXCEEDED past `timeout`), as do the
        coordinator's own errors (ShardGemmError subclasses, with the
        request's id)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            call_id = self._next_id
            self._next_id += 1
        frame, request_bytes = _call_frame(op, request, request_id, timeout, self.token, call_id)
        if request_bytes > self.max_request_bytes:
            return None
        sock, fresh = self._take()
        if sock is None:
            return None
        keep = False
        try:
            reply, out_data = self._call(sock, frame, deadline, fresh)
            reply = _checked(reply, call_id, self.path)
            keep = True
        except _NotRun:
            return None
        except socket.timeout:  # its answer would come later, out of turn: the connection goes
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{OPS[op]} on the call socket at {self.path}: no answer in {timeout} s",
                            request_id=request_id) from None
        except ShardGemmError:
            raise
        except OSError as e:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"the call socket at {self.path} failed with the call in flight: {e}",
                            request_id=request_id) from None
        finally:
            self._give_back(sock, keep)
        return _result(reply, op, out_data)

    def _call(self, sock: socket.socket, frame: List[Any], deadline: Optional[float],
              fresh: bool) -> Tuple["pb.CallSocketReply", Optional[memoryview]]:
        try:
            for part in frame:
                self._settimeout(sock, deadline)
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError) as e:
            # The coordinator had closed this connection (it restarted, or
            # refused a fresh one): it read none of the frame.
            raise _NotRun() from e
        try:
            reply = self._read_reply(sock, deadline)
        except ConnectionResetError as e:
            if fresh:
                raise _NotRun() from e  # refused before the call was read
            raise
        return reply

    def _take(self) -> Tuple[Optional[socket.socket], bool]:
        """An idle connection, or a new one; (None, False) when none can be had now."""
        with self._lock:
            if self._closed:
                return None, False
            if self._idle:
                return self._idle.pop(), False
            if self._open >= MAX_CONNECTIONS or time.monotonic() < self._retry_at:
                return None, False
            self._open += 1
        sock = self._connect()
        if sock is None:
            with self._lock:
                self._open -= 1
                self._retry_at = time.monotonic() + RETRY_AFTER_S
        return sock, sock is not None

    def _give_back(self, sock: socket.socket, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed:
                self._idle.append(sock)
                return
            self._open -= 1
        sock.close()

    def _connect(self) -> Optional[socket.socket]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(self.path)
            if not _own_user(sock):
                sock.close()
                return None
        except OSError:
            sock.close()
            return None
        return sock

    @staticmethod
    def _settimeout(sock: socket.socket, deadline: Optional[float]) -> None:
        if deadline is None:
            sock.settimeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)

    def _read_exact(self, sock: socket.socket, n: int, deadline: Optional[float]) -> bytearray:
        data = bytearray(n)  # received in place: no copies as it grows
        self._read_into(sock, memoryview(data), deadline)
        return data

    def _read_into(self, sock: socket.socket, view: memoryview, deadline: Optional[float]) -> None:
        got, n = 0, view.nbytes
        while got < n:
            self._settimeout(sock, deadline)  # the whole call is bounded, not each recv
            received = sock.recv_into(view[got:], min(n - got, 1 << 22))
            if not received:
                raise ConnectionError("the coordinator closed the connection")
            got += received

    def _read_reply(self, sock: socket.socket,
                    deadline: Optional[float]) -> Tuple["pb.CallSocketReply", Optional[memoryview]]:
        length = _payload_length(bytes(self._read_exact(sock, HEADER.size, deadline)), self.path,
                                 self.max_reply_bytes)
        # The reply's first bytes say where a GEMM's output starts: the rest
        # is received so that it lands on a 64-byte boundary, and becomes
        # the returned array in place.
        head = self._read_exact(sock, min(length, ALIGN_PEEK_BYTES), deadline)
        if length == len(head):
            return _parse_reply(head)
        offset = _wire.value_offset(head, _GEMM_OUT_DATA)
        storage = bytearray(length + (64 if offset is not None else 0))
        pad = 0 if offset is None else -(np.frombuffer(storage, np.uint8).ctypes.data + offset) % 64
        payload = memoryview(storage)[pad:pad + length]
        payload[:len(head)] = head
        self._read_into(sock, payload[len(head):], deadline)
        return _parse_reply(payload)


class AsyncCallSocket:
    """CallSocket for asyncio: the same frames and fallbacks, each call on a
    connection of its own (up to MAX_CONNECTIONS), its whole wait bounded by
    its timeout."""

    _Connection = Tuple[asyncio.StreamReader, asyncio.StreamWriter]

    def __init__(self, path: str, token: Optional[str], max_message_bytes: int) -> None:
        self.path = path
        self.token = token or ""
        self.max_request_bytes = max_message_bytes - FRAME_FIELDS_BYTES
        self.max_reply_bytes = max_message_bytes + FRAME_FIELDS_BYTES
        self._idle: List["AsyncCallSocket._Connection"] = []
        self._open = 0
        self._retry_at = 0.0
        self._next_id = 1
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        self._open -= len(idle)
        for _, writer in idle:
            writer.close()

    async def grouped_gemm(self, request: Any, request_id: Optional[str],
                           timeout: Optional[float]) -> Optional[Tuple["pb.GroupedGemmResponse", str, Optional[memoryview]]]:
        return await self.call("grouped_gemm", request, request_id, timeout)

    async def grouped_quantize(self, request: Any, request_id: Optional[str],
                               timeout: Optional[float]) -> Optional[Tuple["pb.GroupedQuantizeResponse", str, Optional[memoryview]]]:
        return await self.call("grouped_quantize", request, request_id, timeout)

    async def call(self, op: str, request: Any, request_id: Optional[str],
                   timeout: Optional[float]) -> Optional[Tuple[Any, str, Optional[memoryview]]]:
        """As CallSocket.call."""
        call_id, self._next_id = self._next_id, self._next_id + 1
        frame, request_bytes = _call_frame(op, request, request_id, timeout, self.token, call_id)
        if request_bytes > self.max_request_bytes:
            return None
        connection, fresh = await self._take()
        if connection is None:
            return None
        keep = False
        try:
            reply, out_data = await asyncio.wait_for(self._call(connection, frame, fresh), timeout)
            reply = _checked(reply, call_id, self.path)
            keep = True
        except _NotRun:
            return None
        except asyncio.TimeoutError:  # its answer would come later, out of turn: the connection goes
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{OPS[op]} on the call socket at {self.path}: no answer in {timeout} s",
                            request_id=request_id) from None
        except ShardGemmError:
            raise
        except (OSError, asyncio.IncompleteReadError) as e:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"the call socket at {self.path} failed with the call in flight: {e}",
                            request_id=request_id) from None
        finally:
            self._give_back(connection, keep)
        return _result(reply, op, out_data)

    async def _call(self, connection: "AsyncCallSocket._Connection", frame: List[Any],
                    fresh: bool) -> Tuple["pb.CallSocketReply", Optional[memoryview]]:
        reader, writer = connection
        try:
            # One copy: since Python 3.12 the transport keeps views of what it
            # is given, and may still send them after a call that failed.
            writer.write(b"".join(frame))
            await writer.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _NotRun() from e  # the coordinator had closed this connection: it read none of the frame
        try:
            length = _payload_length(await reader.readexactly(HEADER.size), self.path, self.max_reply_bytes)
            answer = _parse_reply(await reader.readexactly(length))
        except (ConnectionResetError, asyncio.IncompleteReadError) as e:
            if fresh and not isinstance(e, asyncio.IncompleteReadError):
                raise _NotRun() from e  # refused before the call was read
            raise
        return answer

    async def _take(self) -> Tuple[Optional["AsyncCallSocket._Connection"], bool]:
        if self._closed:
            return None, False
        if self._idle:
            return self._idle.pop(), False
        if self._open >= MAX_CONNECTIONS or time.monotonic() < self._retry_at:
            return None, False
        self._open += 1
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path, limit=1 << 22), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            self._open -= 1
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            return None, False
        if not _own_user(writer.get_extra_info("socket")):
            writer.close()
            self._open -= 1
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            return None, False
        return (reader, writer), True

    def _give_back(self, connection: "AsyncCallSocket._Connection", keep: bool) -> None:
        if keep and not self._closed:
            self._idle.append(connection)
            return
        self._open -= 1
        connection[1].close()
