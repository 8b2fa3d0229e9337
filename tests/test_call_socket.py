"""The coordinator's --call_socket: same-host clients' GroupedGemm calls as
frames (proto/step_frame.h: "SGS1", version 1, the payload's length, then a
CallSocketRequest) on a Unix socket instead of gRPC calls.

Checked: the CLI's call goes there (the coordinator's request line says so)
and its result matches the reference; the token is checked as on gRPC and
a request's errors name their field; a frame that is not a request ends its
connection without harm to the next; a socket that is not there leaves the
call on gRPC; the path is claimed as --client_socket's is (owner-only, a
directory no one else can write, one coordinator at a time, removed at stop)."""
import json
import os
import socket
import stat
import struct
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import BIN, free_port
from shardgemm import _common
from shardgemm._convert import from_tensor
from shardgemm_pb import shardgemm_pb2 as pb

MAGIC, VERSION = 0x31534753, 1
UNAUTHENTICATED, INVALID_ARGUMENT = 16, 3


@pytest.fixture
def sock():
    # Short: a Unix socket's path is at most 107 bytes, and pytest's tmp paths are long.
    d = subprocess.run(["mktemp", "-d", "/tmp/sgcall.XXXXXX"], check=True, capture_output=True,
                       text=True).stdout.strip()
    yield os.path.join(d, "calls.sock")
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((4, 32, 16)).astype(np.float32)
    sizes = [10, 22, 20, 12]
    want = np.zeros((64, 16), np.float32)
    for shard in range(2):  # ep=2: each half of the rows, its 2 experts
        row = shard * 32
        for g in range(2):
            n = sizes[shard * 2 + g]
            want[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
    return lhs, rhs, sizes, want


def token_of(tls_dir):
    with open(os.path.join(tls_dir, "client.token")) as f:
        return f.read().strip()


class Frames:
    """A raw call-socket connection: one call at a time."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(30)
        self.s.connect(path)
        self.next_id = 1

    def send_payload(self, payload):
        self.s.sendall(struct.pack("<IIQ", MAGIC, VERSION, len(payload)) + payload)

    def read_exact(self, n):
        data = b""
        while len(data) < n:
            try:
                chunk = self.s.recv(n - len(data))
            except ConnectionResetError:  # closed with bytes of ours unread
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def call(self, request):
        request.call_id = self.next_id
        self.next_id += 1
        self.send_payload(request.SerializeToString())
        header = self.read_exact(16)
        assert header is not None, "the coordinator closed the connection"
        magic, version, length = struct.unpack("<IIQ", header)
        assert (magic, version) == (MAGIC, VERSION)
        reply = pb.CallSocketReply()
        reply.ParseFromString(self.read_exact(length))
        assert reply.call_id == request.call_id
        return reply

    def close(self):
        self.s.close()


def gemm_call(cluster, token="", seed=0, **kwargs):
    lhs, rhs, sizes, want = inputs(seed)
    request = pb.CallSocketRequest(token=token)
    request.grouped_gemm.CopyFrom(cluster.client.gemm_request(
        lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)", **kwargs))
    return request, want


def request_lines(cluster, request_id):
    """The coordinator's request lines of `request_id` (its log is written
    behind the answers: waited for, up to 10 s)."""
    deadline = time.time() + 10
    while True:
        with open(os.path.join(cluster.logs, "coordinator.log")) as f:
            lines = [json.loads(line) for line in f if line.startswith("{")]
        found = [line for line in lines if line.get("event") == "request" and line.get("request_id") == request_id]
        if found or time.time() > deadline:
            return found
        time.sleep(0.05)


def test_the_cli_gemm_goes_on_the_call_socket_and_checks_out(cluster_factory, mesh_certs, sock):
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs,
                        coordinator_flags=[f"--call_socket={sock}", "--log_format=json"])
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "gemm", "--lhs=64x32@(ep, None)",
                        "--rhs=4x32x16@(ep, None, None)", "--group_sizes=10,22,20,12@(ep,)", "--check", f"--call_socket={sock}",
                        "--request_id=cli-on-the-socket", *c.cli_flags()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + c.log_text()
    assert "result matches reference" in r.stdout, r.stdout
    lines = request_lines(c, "cli-on-the-socket")
    assert len(lines) == 1, c.log_text()
    assert lines[0]["transport"] == "call_socket" and lines[0]["code"] == "OK", lines[0]
    assert lines[0]["tenant"] == "demo", lines[0]


def test_frames_are_served_with_the_token_and_errors_name_their_field(cluster_factory, mesh_certs, sock):
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs, coordinator_flags=[f"--call_socket={sock}"])
    frames = Frames(sock)
    try:
        for token in ("", "not-the-token"):
            request, _ = gemm_call(c, token=token)
            reply = frames.call(request)
            assert reply.code == UNAUTHENTICATED, (token, reply)
            assert not reply.HasField("grouped_gemm")
        request, want = gemm_call(c, token=token_of(mesh_certs), seed=1)
        request.request_id = "frames-1"
        reply = frames.call(request)
        assert reply.code == 0, reply.message
        assert reply.request_id == "frames-1"
        np.testing.assert_allclose(from_tensor(reply.grouped_gemm.out), want, rtol=1e-4, atol=1e-4)
        assert reply.grouped_gemm.server_seconds > 0
        # A request's own errors, as gRPC would give them.
        request, _ = gemm_call(c, token=token_of(mesh_certs), seed=2)
        request.grouped_gemm.lhs.shape[:] = [64, 31]
        reply = frames.call(request)
        assert reply.code == INVALID_ARGUMENT and "lhs" in reply.message, reply
        reply = frames.call(pb.CallSocketRequest(token=token_of(mesh_certs)))
        assert reply.code == INVALID_ARGUMENT and reply.message.startswith("call:"), reply
    finally:
        frames.close()
    # Still the same service on gRPC.
    lhs, rhs, sizes, want = inputs(3)
    out, _ = c.client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                   group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_a_frame_that_is_not_a_request_ends_only_its_connection(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}"])
    bad = Frames(sock)
    bad.send_payload(b"\xff\xff\xff\xff not a protobuf")
    assert bad.read_exact(1) is None  # closed by the coordinator
    bad.close()
    junk = Frames(sock)
    junk.s.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not even a frame header
    assert junk.read_exact(1) is None
    junk.close()
    frames = Frames(sock)
    try:
        request, want = gemm_call(c, seed=4)
        reply = frames.call(request)
        assert reply.code == 0, reply.message
        np.testing.assert_allclose(from_tensor(reply.grouped_gemm.out), want, rtol=1e-4, atol=1e-4)
    finally:
        frames.close()
    assert c.alive(), c.log_text()


def test_a_call_socket_that_is_not_there_leaves_the_call_on_grpc(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--log_format=json"])
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "gemm", "--lhs=64x32@(ep, None)",
                        "--rhs=4x32x16@(ep, None, None)", "--group_sizes=10,22,20,12@(ep,)", "--check", f"--call_socket={sock}",
                        "--request_id=cli-on-grpc", *c.cli_flags()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "result matches reference" in r.stdout, r.stdout
    lines = request_lines(c, "cli-on-grpc")
    assert len(lines) == 1 and "transport" not in lines[0], lines


def start_coordinator(flags):
    return subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), f"--listen=127.0.0.1:{free_port()}",
                           "--mesh=dp=1", "--insecure", *flags], capture_output=True, text=True, timeout=60)


def test_the_path_is_claimed_for_one_coordinator_and_removed_at_stop(cluster_factory, sock):
    for flags, why in ((["--call_socket=relative.sock"], "not an absolute path"),
                       (["--call_socket=/tmp/shardgemm-call-socket-test.sock"], "no one else can write")):
        r = start_coordinator(flags)
        assert r.returncode == 2 and why in r.stderr, (flags, r.stderr)
    with open(sock, "w") as f:
        f.write("not a socket")
    r = start_coordinator([f"--call_socket={sock}"])
    assert r.returncode == 2 and "exists and is not a socket" in r.stderr, r.stderr
    os.unlink(sock)
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}"])
    r = start_coordinator([f"--call_socket={sock}"])
    assert r.returncode == 2 and "another server holds" in r.stderr, r.stderr
    frames = Frames(sock)  # the first one still serves it
    request, _ = gemm_call(c, seed=5)
    assert frames.call(request).code == 0
    frames.close()
    c.stop()
    assert c.coordinator.returncode == 0, c.log_text()
    assert not os.path.exists(sock)


def test_the_python_client_sends_grouped_gemm_on_the_call_socket(cluster_factory, mesh_certs, sock):
    import shardgemm
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs,
                        coordinator_flags=[f"--call_socket={sock}", "--log_format=json"])
    lhs, rhs, sizes, want = inputs(6)
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    with shardgemm.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock, path="inline") as client:
        out, _ = client.grouped_gemm(lhs, rhs, sizes, request_id="py-on-the-socket", **specs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        assert client.last_request_id == "py-on-the-socket"
        with pytest.raises(shardgemm.InvalidArgumentError) as e:
            client.grouped_gemm(lhs[:, :31], rhs, sizes, **specs)
        assert "lhs" in str(e.value) or "rhs" in str(e.value), e.value
        out, _ = client.grouped_gemm(lhs, rhs, sizes, **specs)  # the connection still serves
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    lines = request_lines(c, "py-on-the-socket")
    assert len(lines) == 1 and lines[0]["transport"] == "call_socket", lines
    # A wrong token is refused there as on gRPC.
    with shardgemm.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock, path="inline",
                          token="not-the-token") as client:
        with pytest.raises(shardgemm.UnauthenticatedError):
            client.grouped_gemm(lhs, rhs, sizes, **specs)
    # No socket there: the call goes on gRPC.
    with shardgemm.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock + ".absent",
                          path="inline") as client:
        out, _ = client.grouped_gemm(lhs, rhs, sizes, request_id="py-on-grpc", **specs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    lines = request_lines(c, "py-on-grpc")
    assert len(lines) == 1 and "transport" not in lines[0], lines


RESOURCE_EXHAUSTED, UNAVAILABLE = 8, 14


def test_an_oversized_call_is_answered_and_its_connection_goes_on(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}", "--max_message_mb=1"])
    frames = Frames(sock)
    try:
        big = pb.CallSocketRequest(request_id="too-big")
        big.grouped_gemm.CopyFrom(c.client.gemm_request(
            np.zeros((1024, 512), np.float32), np.zeros((4, 512, 16), np.float32), [256] * 4,
            lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)"))
        assert big.ByteSize() > 1 << 20
        reply = frames.call(big)
        assert reply.code == RESOURCE_EXHAUSTED, reply
        assert "--max_message_mb" in reply.message and str(big.ByteSize()) in reply.message, reply.message
        request, want = gemm_call(c, seed=7)
        reply = frames.call(request)  # the same connection serves the next call
        assert reply.code == 0, reply.message
        np.testing.assert_allclose(from_tensor(reply.grouped_gemm.out), want, rtol=1e-4, atol=1e-4)
    finally:
        frames.close()
    # Its call id past the head the coordinator reads (the call written
    # first): no answer under id 0, which would read as a refusal; the
    # connection ends.
    frames = Frames(sock)
    try:
        call_only = pb.CallSocketRequest()
        call_only.grouped_gemm.CopyFrom(big.grouped_gemm)
        frames.send_payload(call_only.SerializeToString() + pb.CallSocketRequest(call_id=99).SerializeToString())
        assert frames.read_exact(1) is None
    finally:
        frames.close()
    assert c.alive(), c.log_text()


class FakeCallSocket:
    """A server at `path` that answers each connection as `mode` says:
    "refuse" (the refusal frame, then closed), "close" (closed unread),
    "silent" (read, never answered)."""

    def __init__(self, path, mode):
        self.mode = mode
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.held = []
        self.accepted = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            self.accepted += 1
            if self.mode == "refuse":
                refusal = pb.CallSocketReply(call_id=0, code=RESOURCE_EXHAUSTED, message="full").SerializeToString()
                conn.sendall(struct.pack("<IIQ", MAGIC, VERSION, len(refusal)) + refusal)
                conn.close()
            elif self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def stop(self):
        self.stopping.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()
        for conn in self.held:
            conn.close()
        self.listener.close()


@pytest.mark.parametrize("mode", ["refuse", "close"])
def test_the_python_client_takes_grpc_when_the_socket_does_not_run_the_call(cluster_factory, sock, mode):
    import shardgemm
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--log_format=json"])
    fake = FakeCallSocket(sock, mode)
    lhs, rhs, sizes, want = inputs(8)
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    try:
        with shardgemm.Client(c.address, timeout=30, call_socket=sock, path="inline") as client:
            out, _ = client.grouped_gemm(lhs, rhs, sizes, request_id=f"py-{mode}", **specs)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
            assert client.last_request_id == f"py-{mode}"
    finally:
        fake.stop()
    assert fake.accepted == 1
    lines = request_lines(c, f"py-{mode}")
    assert len(lines) == 1 and "transport" not in lines[0], lines


def test_an_unanswered_socket_call_ends_by_the_clients_timeout(cluster_factory, sock):
    import shardgemm
    c = cluster_factory(mesh="ep=2", workers=2)
    fake = FakeCallSocket(sock, "silent")
    lhs, rhs, sizes, _ = inputs(9)
    try:
        with shardgemm.Client(c.address, timeout=1.0, call_socket=sock, path="inline") as client:
            start = time.monotonic()
            with pytest.raises(shardgemm.DeadlineExceededError):
                client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                    group_sizes_spec="(ep,)")
            took = time.monotonic() - start
    finally:
        fake.stop()
    assert 0.9 <= took < 5, took


def test_a_coordinator_stopped_with_socket_calls_in_flight_answers_or_fails_each(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}"])
    outcomes = [[] for _ in range(4)]
    some_answered = threading.Event()

    def caller(slot):
        frames = Frames(sock)
        request, want = gemm_call(c, seed=10 + slot)
        try:
            while True:
                try:
                    reply = frames.call(request)
                except (AssertionError, OSError):  # closed by the stop, between or during calls
                    outcomes[slot].append("closed")
                    return
                if reply.code == 0:
                    np.testing.assert_allclose(from_tensor(reply.grouped_gemm.out), want, rtol=1e-4, atol=1e-4)
                    outcomes[slot].append("answered")
                    some_answered.set()
                else:
                    outcomes[slot].append(reply.code)
        finally:
            frames.close()

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    assert some_answered.wait(30)
    c.coordinator.send_signal(signal.SIGTERM)
    assert c.coordinator.wait(timeout=30) == 0, c.log_text()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    for calls in outcomes:
        assert calls and calls[-1] == "closed", calls
        assert all(o in ("answered", "closed", UNAVAILABLE) for o in calls), calls
    assert not os.path.exists(sock)


def test_the_async_client_sends_grouped_gemm_on_the_call_socket(cluster_factory, mesh_certs, sock):
    import asyncio
    import shardgemm
    import shardgemm.aio
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs,
                        coordinator_flags=[f"--call_socket={sock}", "--log_format=json"])
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    cases = [inputs(20 + i) for i in range(6)]

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock,
                                        path="inline") as client:
            # Concurrent calls, each on a connection of its own.
            outs = await asyncio.gather(*(client.grouped_gemm(lhs, rhs, sizes, request_id=f"aio-{i}", **specs)
                                          for i, (lhs, rhs, sizes, _) in enumerate(cases)))
            for (out, _), (_, _, _, want) in zip(outs, cases):
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
            lhs, rhs, sizes, _ = cases[0]
            with pytest.raises(shardgemm.InvalidArgumentError) as e:
                await client.grouped_gemm(lhs[:, :31], rhs, sizes, request_id="aio-bad", **specs)
            assert e.value.request_id == "aio-bad", e.value
            out, _ = await client.grouped_gemm(lhs, rhs, sizes, request_id="aio-again", **specs)
            np.testing.assert_allclose(out, cases[0][3], rtol=1e-4, atol=1e-4)
            assert client.last_request_id == "aio-again"

    asyncio.run(run())
    for i in range(6):
        lines = request_lines(c, f"aio-{i}")
        assert len(lines) == 1 and lines[0]["transport"] == "call_socket", lines
    bad = request_lines(c, "aio-bad")
    assert len(bad) == 1 and bad[0]["transport"] == "call_socket", bad


@pytest.mark.parametrize("mode", ["refuse", "silent"])
def test_the_async_client_falls_back_or_ends_by_its_timeout(cluster_factory, sock, mode):
    import asyncio
    import shardgemm
    import shardgemm.aio
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--log_format=json"])
    fake = FakeCallSocket(sock, mode)
    lhs, rhs, sizes, want = inputs(30)
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=1.0, call_socket=sock, path="inline") as client:
            if mode == "refuse":
                out, _ = await client.grouped_gemm(lhs, rhs, sizes, request_id="aio-refused", timeout=30, **specs)
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
                return None
            start = time.monotonic()
            with pytest.raises(shardgemm.DeadlineExceededError):
                await client.grouped_gemm(lhs, rhs, sizes, **specs)
            return time.monotonic() - start

    try:
        took = asyncio.run(run())
    finally:
        fake.stop()
    if mode == "refuse":
        lines = request_lines(c, "aio-refused")
        assert len(lines) == 1 and "transport" not in lines[0], lines
    else:
        assert 0.9 <= took < 5, took


QUANTIZE_SPECS = dict(x_spec="(ep, None)", group_sizes_spec="(ep,)")


def quantize_fields(resp):
    return {f: getattr(resp, f).data for f in ("rowwise_data", "scale_inv") if resp.HasField(f)}


def test_grouped_quantize_goes_on_the_call_socket_from_both_python_clients_and_the_cli(cluster_factory, mesh_certs,
                                                                                      sock):
    import asyncio
    import shardgemm
    import shardgemm.aio
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs,
                        coordinator_flags=[f"--call_socket={sock}", "--log_format=json"])
    lhs, _, sizes, _ = inputs(40)
    on_grpc = c.client.grouped_quantize(lhs, sizes, **QUANTIZE_SPECS)
    want = quantize_fields(on_grpc)
    assert set(want) == {"rowwise_data", "scale_inv"} and all(want.values()), on_grpc
    with shardgemm.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock, path="inline") as client:
        resp = client.grouped_quantize(lhs, sizes, request_id="q-sync", **QUANTIZE_SPECS)
        assert quantize_fields(resp) == want  # bit for bit the gRPC call's
        assert resp.server_seconds > 0
        assert client.last_request_id == "q-sync"
        with pytest.raises(shardgemm.InvalidArgumentError) as e:
            client.grouped_quantize(lhs, sizes, request_id="q-bad", x_spec="(ep, None)", group_sizes_spec="(tp,)")
        assert "group_sizes" in str(e.value), e.value
        assert e.value.request_id == "q-bad", e.value
        # Kept on the workers through the socket, then used by a GEMM.
        kept = client.grouped_quantize(lhs, sizes, keep_rowwise_data_as="x8", keep_scale_inv_as="x8_scale",
                                       overwrite=True, **QUANTIZE_SPECS)
        assert kept.rowwise_data.resident == "x8" and kept.scale_inv.resident == "x8_scale", kept
    assert {t.name for t in c.client.list()} >= {"x8", "x8_scale"}

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=30, tls_dir=mesh_certs, call_socket=sock,
                                        path="inline") as client:
            resps = await asyncio.gather(*(client.grouped_quantize(lhs, sizes, request_id=f"q-aio-{i}",
                                                                   **QUANTIZE_SPECS) for i in range(3)))
            return [quantize_fields(r) for r in resps]

    assert asyncio.run(run()) == [want] * 3
    for rid in ("q-sync", "q-bad", "q-aio-0", "q-aio-1", "q-aio-2"):
        lines = request_lines(c, rid)
        assert len(lines) == 1 and lines[0]["transport"] == "call_socket", (rid, lines)
        assert lines[0]["op"] == "grouped_quantize", lines[0]
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "quantize", "--x=64x32@(ep, None)",
                        "--group_sizes=10,22,20,12@(ep,)", "--check", f"--call_socket={sock}",
                        "--request_id=q-cli", *c.cli_flags()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + c.log_text()
    lines = request_lines(c, "q-cli")
    assert len(lines) == 1 and lines[0]["transport"] == "call_socket" and lines[0]["code"] == "OK", lines


def test_a_quantize_frame_needs_the_token_and_write_to_keep(cluster_factory, mesh_certs, sock):
    import hashlib
    import secrets
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=mesh_certs, coordinator_flags=[f"--call_socket={sock}"])
    compute_only = secrets.token_hex(32)
    with open(os.path.join(mesh_certs, "tokens"), "a") as f:
        f.write(f"sha256:{hashlib.sha256(compute_only.encode()).hexdigest()} demo read,compute\n")
    time.sleep(1.1)  # the coordinator reads the changed file within a second
    lhs, _, sizes, _ = inputs(41)
    request = _common.quantize_request(lhs, sizes, **QUANTIZE_SPECS)
    frames = Frames(sock)
    try:
        frame = pb.CallSocketRequest()
        frame.grouped_quantize.CopyFrom(request)
        assert frames.call(frame).code == UNAUTHENTICATED
        frame.token = compute_only
        reply = frames.call(frame)
        assert reply.code == 0 and reply.grouped_quantize.rowwise_data.data, reply.message
        frame.grouped_quantize.keep.rowwise_data = "x8"
        reply = frames.call(frame)
        assert reply.code == 7 and "write" in reply.message, reply  # PERMISSION_DENIED
    finally:
        frames.close()
    assert "x8" not in {t.name for t in c.client.list()}


def test_a_coordinator_stopped_with_a_quantize_waiting_on_a_frozen_worker_answers_it_at_once(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}", "--step_timeout=60s"])
    lhs, _, sizes, _ = inputs(42)
    frame = pb.CallSocketRequest()
    frame.grouped_quantize.CopyFrom(_common.quantize_request(lhs, sizes, **QUANTIZE_SPECS))
    frames = Frames(sock)
    assert frames.call(frame).code == 0
    worker = next(p for name, p in c.procs if name == "worker1")
    os.kill(worker.pid, signal.SIGSTOP)
    replies = []
    try:
        caller = threading.Thread(target=lambda: replies.append(frames.call(frame)), daemon=True)
        caller.start()
        time.sleep(1.0)  # the quantize is waiting on the frozen worker
        assert not replies
        start = time.monotonic()
        c.coordinator.send_signal(signal.SIGTERM)
        assert c.coordinator.wait(timeout=30) == 0, c.log_text()
        took = time.monotonic() - start
        caller.join(timeout=10)
        assert not caller.is_alive()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        frames.close()
    assert took < 5, took  # not the 10 s shutdown bound, nor the 60 s step timeout
    assert len(replies) == 1 and replies[0].code == UNAVAILABLE, replies
    assert "shutting down" in replies[0].message, replies[0]
