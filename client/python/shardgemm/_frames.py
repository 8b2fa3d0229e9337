"""The coordinator's --call_socket: a same-host client's GroupedGemm calls
as frames on a Unix stream socket instead of gRPC calls (one socket round
trip instead of gRPC's thread hand-offs). A frame is a 16-byte header (the
magic "SGS1" and version 1, little-endian u32 each, then the payload's
length, u64) and a serialized CallSocketRequest; the coordinator answers
with a CallSocketReply frame of the same call_id."""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional, Tuple

import grpc

from ._proto import pb
from .errors import ShardGemmError, error_for

MAGIC, VERSION = 0x31534753, 1
HEADER = struct.Struct("<IIQ")
# The frame's own fields fit in this much beside the request.
FRAME_FIELDS_BYTES = 4096
# A connection that failed is tried again at most this often (the call goes on gRPC meanwhile).
RETRY_AFTER_S = 1.0


class CallSocket:
    """One connection to a coordinator's --call_socket, one call at a time
    (calls from several threads wait for each other)."""

    def __init__(self, path: str, token: Optional[str], max_message_bytes: int) -> None:
        self.path = path
        self.token = token or ""
        self.max_request_bytes = max_message_bytes - FRAME_FIELDS_BYTES
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._retry_at = 0.0
        self._next_id = 1

    def close(self) -> None:
        with self._lock:
            self._drop()

    def grouped_gemm(self, request: "pb.GroupedGemmRequest", request_id: Optional[str],
                     timeout: Optional[float]) -> Optional[Tuple["pb.GroupedGemmResponse", str]]:
        """The response and the request's id; None when the socket cannot
        take the call now (not connected, larger than the message limit):
        the caller sends it on gRPC. A failure after the frame went raises
        (UNAVAILABLE, DEADLINE_EXCEEDED past `timeout`), as do the
        coordinator's own errors (ShardGemmError subclasses)."""
        if request.ByteSize() > self.max_request_bytes:
            return None
        frame = pb.CallSocketRequest(token=self.token, request_id=request_id or "")
        if timeout is not None:
            frame.deadline_unix_us = int((time.time() + timeout) * 1e6)
        frame.grouped_gemm.CopyFrom(request)
        with self._lock:
            sock = self._connected()
            if sock is None:
                return None
            frame.call_id = self._next_id
            self._next_id += 1
            payload = frame.SerializeToString()
            sock.settimeout(timeout)
            try:
                sock.sendall(HEADER.pack(MAGIC, VERSION, len(payload)) + payload)
                reply = self._read_reply(sock)
            except socket.timeout:
                self._drop()  # its answer would come later, out of turn
                raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"GroupedGemm on the call socket at {self.path}: no answer in {timeout} s") from None
            except (OSError, ShardGemmError) as e:
                self._drop()
                if isinstance(e, ShardGemmError):
                    raise
                raise error_for(grpc.StatusCode.UNAVAILABLE,
                                f"the call socket at {self.path} failed with the call in flight: {e}") from None
            if reply.call_id != frame.call_id:
                self._drop()
                raise error_for(grpc.StatusCode.DATA_LOSS,
                                f"the call socket at {self.path} answered call {reply.call_id}, not {frame.call_id}")
        if reply.code != 0:
            try:
                code = next(c for c in grpc.StatusCode if c.value[0] == reply.code)
            except StopIteration:
                code = grpc.StatusCode.UNKNOWN
            raise error_for(code, reply.message, request_id=reply.request_id or None)
        return reply.grouped_gemm, reply.request_id

    def _connected(self) -> Optional[socket.socket]:
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._retry_at:
            return None
        self._retry_at = time.monotonic() + RETRY_AFTER_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self._sock = sock
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _read_exact(self, sock: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the coordinator closed the connection")
            data += chunk
        return bytes(data)

    def _read_reply(self, sock: socket.socket) -> "pb.CallSocketReply":
        magic, version, length = HEADER.unpack(self._read_exact(sock, HEADER.size))
        if (magic, version) != (MAGIC, VERSION):
            raise error_for(grpc.StatusCode.DATA_LOSS, f"the call socket at {self.path} answered no frame")
        reply = pb.CallSocketReply()
        reply.ParseFromString(self._read_exact(sock, length))
        return reply
