"""The Python client's requests with their large tensors' bytes beside the
message (shardgemm/_wire.py): the pieces parse to exactly the request
protobuf would have serialized, whatever mix of large, small, named and
non-contiguous operands it holds; the call socket's frame is one valid
CallSocketRequest; and a large inline call through both hops gives the
local result."""
import struct

import numpy as np
import pytest

from shardgemm import _common, _wire
from shardgemm._convert import to_tensor
from shardgemm_pb import shardgemm_pb2 as pb


def plain(wire, tensors):
    """The request as protobuf builds it: the skeleton with every tensor's
    bytes in the message."""
    req = type(wire.skeleton)()
    req.CopyFrom(wire.skeleton)
    for field, (value, spec) in tensors.items():
        getattr(req, field).CopyFrom(to_tensor(value, spec))
    return req


@pytest.mark.parametrize("rows", [8, 4096])
def test_the_pieces_parse_to_the_request_protobuf_would_send(rows):
    rng = np.random.default_rng(rows)
    lhs = rng.standard_normal((rows, 64)).astype(np.float32)  # large at 4096 rows (1 MiB)
    rhs = rng.standard_normal((4, 64, 128)).astype(np.float32)[:, :, ::2]  # not contiguous, 64 KiB
    bias = rng.standard_normal((4, 64)).astype(np.float32)  # small: in the message
    sizes = [rows // 4] * 4
    kwargs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)",
                  keep_output_as="y", include_plan=True)
    wire = _common.gemm_wire(lhs, rhs, sizes, bias, **kwargs)
    want = plain(wire, {"lhs": (lhs, "(ep, None)"), "rhs": (rhs, "(ep, None, None)"), "bias": (bias, "")})
    got = pb.GroupedGemmRequest.FromString(wire.serialize())
    assert got == want
    assert wire.message() == want
    assert _wire.byte_size(wire) == len(wire.serialize())
    # The large ones beside the message, by reference to the caller's bytes.
    assert not wire.skeleton.lhs.data if rows == 4096 else wire.skeleton.lhs.data
    assert not wire.skeleton.rhs.data and wire.skeleton.bias.data
    assert np.frombuffer(got.rhs.data, np.float32).reshape(4, 64, 64).tolist() == rhs.tolist()


def test_a_quantize_and_named_operands():
    x = np.arange(512 * 128, dtype=np.float32).reshape(512, 128)
    wire = _common.quantize_wire(x, [128] * 4, x_spec="(dp, None)", keep_rowwise_data_as="x8")
    got = pb.GroupedQuantizeRequest.FromString(wire.serialize())
    assert got.x.data == x.tobytes() and list(got.x.shape) == [512, 128] and got.x.spec == "(dp, None)"
    assert got.keep.rowwise_data == "x8" and list(np.frombuffer(got.group_sizes.data, np.int64)) == [128] * 4
    named = _common.gemm_wire("big_x", "big_w", [4, 4])
    assert named.serialize() == named.skeleton.SerializeToString()
    assert named.skeleton.lhs.resident == "big_x"
    big_endian = np.arange(1 << 15, dtype=">f4").reshape(-1, 8)  # the message's own conversion
    assert _wire.blob_array(big_endian) is None
    import ml_dtypes  # NumPy dtypes that a buffer cannot name: their bytes go as they are
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        y = np.arange(1 << 16).astype(dtype).reshape(-1, 64)
        w = _common.quantize_wire(y, [len(y)])
        assert pb.GroupedQuantizeRequest.FromString(w.serialize()).x.data == y.tobytes()


def test_the_call_frame_is_one_call_socket_request():
    from shardgemm import _frames
    x = np.random.default_rng(1).standard_normal((4096, 64)).astype(np.float32)
    wire = _common.quantize_wire(x, [1024] * 4)
    parts, request_bytes = _frames._call_frame("grouped_quantize", wire, "rid-1", 30.0, "tok", 7)
    frame = b"".join(bytes(memoryview(p)) for p in parts)
    magic, version, length = struct.unpack("<IIQ", frame[:16])
    assert (magic, version, length) == (_frames.MAGIC, _frames.VERSION, len(frame) - 16)
    request = pb.CallSocketRequest.FromString(frame[16:])
    assert (request.call_id, request.token, request.request_id) == (7, "tok", "rid-1")
    assert request.deadline_unix_us > 0 and request.WhichOneof("call") == "grouped_quantize"
    assert request.grouped_quantize == wire.message() and request_bytes == len(wire.serialize())


def test_a_large_inline_call_checks_out_on_both_hops(cluster_factory, tmp_path):
    import os
    import subprocess
    import shardgemm
    d = subprocess.run(["mktemp", "-d", "/tmp/sgwire.XXXXXX"], check=True, capture_output=True,
                       text=True).stdout.strip()
    sock = os.path.join(d, "calls.sock")
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--call_socket={sock}"])
    rng = np.random.default_rng(3)
    lhs = rng.standard_normal((2048, 64)).astype(np.float32)  # 512 KiB
    rhs = rng.standard_normal((4, 64, 32)).astype(np.float32)
    sizes = [300, 724, 600, 424]
    want = np.zeros((2048, 32), np.float32)
    for shard in range(2):
        row = shard * 1024
        for g in range(2):
            n = sizes[shard * 2 + g]
            want[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    try:
        for call_socket in (None, sock):
            with shardgemm.Client(c.address, timeout=30, call_socket=call_socket, path="inline") as client:
                out, _ = client.grouped_gemm(lhs, rhs, sizes, **specs)
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
                assert out.flags.writeable and out.flags.aligned
                out[0, 0] = 1.0  # the caller's own array
                q = client.grouped_quantize(lhs, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)")
                plain = c.client.stub.GroupedQuantize(_common.quantize_request(lhs, sizes, x_spec="(ep, None)",
                                                                               group_sizes_spec="(ep,)"), timeout=30)
                assert q.rowwise_data.data == plain.rowwise_data.data and q.scale_inv.data == plain.scale_inv.data
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def test_a_plan_sends_shapes_not_the_bytes(cluster_factory):
    import asyncio
    import shardgemm
    import shardgemm.aio
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--max_message_mb=1"])
    lhs = np.zeros((16384, 64), np.float32)  # 4 MiB: over the coordinator's message limit
    rhs = np.zeros((4, 64, 32), np.float32)
    specs = dict(lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)")
    with shardgemm.Client(c.address, timeout=30) as client:
        plan = client.plan(lhs, rhs, [4096] * 4, **specs)
        assert plan.workers, plan

    async def run():
        async with shardgemm.aio.Client(c.address, timeout=30) as client:
            return await client.plan(lhs, rhs, [4096] * 4, **specs)

    assert asyncio.run(run()) == plan


def test_take_bytes_leaves_out_exactly_the_field_it_names():
    from shardgemm import _frames
    rng = np.random.default_rng(5)
    for case in range(40):
        reply = pb.CallSocketReply(call_id=case + 1, code=0, request_id=f"r{case}")
        gemm = reply.grouped_gemm
        if case % 4:
            gemm.out.dtype = pb.F32
            gemm.out.shape[:] = [int(rng.integers(1, 64)), 8]
            gemm.out.data = rng.standard_normal(int(np.prod(gemm.out.shape))).astype(np.float32).tobytes()
            gemm.out.spec = "(ep, None)" if case % 3 else ""
        else:
            gemm.out.resident = "kept"
        gemm.server_seconds = float(case)
        gemm.plan_summary = "x" * int(rng.integers(0, 300))
        raw = bytearray(reply.SerializeToString())
        parsed, data = _frames._parse_reply(raw)
        if case % 4:
            assert data is not None and bytes(data) == reply.grouped_gemm.out.data and not data.readonly
            whole = pb.CallSocketReply()
            whole.CopyFrom(parsed)
            whole.grouped_gemm.out.data = bytes(data)
            assert whole == reply
        else:
            assert data is None and parsed == reply
    # What does not scan is parsed whole, by protobuf, which says what is wrong.
    rest, data = _wire.take_bytes(b"\xff\xff", (10, 1, 3))
    assert data is None and rest == b"\xff\xff"


def test_a_reply_whose_later_fields_override_the_output_is_parsed_as_protobuf_says():
    from shardgemm import _frames
    reply = pb.CallSocketReply(call_id=1)
    reply.grouped_gemm.out.dtype = pb.F32
    reply.grouped_gemm.out.shape[:] = [4, 4]
    reply.grouped_gemm.out.data = np.zeros(16, np.float32).tobytes()
    # The same Tensor again naming a resident tensor: the oneof's last member wins.
    later = pb.CallSocketReply()
    later.grouped_gemm.out.resident = "kept"
    raw = bytearray(reply.SerializeToString() + later.SerializeToString())
    parsed, data = _frames._parse_reply(raw)
    assert _common.gemm_output(parsed.grouped_gemm, None, data) is None  # resident, as protobuf parses it
    # A later answer of another kind wins over the GEMM's.
    other = pb.CallSocketReply()
    other.grouped_quantize.server_seconds = 1.0
    parsed, data = _frames._parse_reply(bytearray(reply.SerializeToString() + other.SerializeToString()))
    assert data is None and parsed.WhichOneof("answer") == "grouped_quantize"


def test_value_offset_finds_where_the_output_starts():
    from shardgemm import _frames
    reply = pb.CallSocketReply(call_id=9, request_id="r" * 100, message="")
    reply.grouped_gemm.out.dtype = pb.F32
    reply.grouped_gemm.out.shape[:] = [64, 64]
    reply.grouped_gemm.out.data = np.arange(4096, dtype=np.float32).tobytes()
    raw = reply.SerializeToString()
    offset = _wire.value_offset(raw[:512], _frames._GEMM_OUT_DATA)
    assert offset is not None and raw[offset:offset + 16] == np.arange(4, dtype=np.float32).tobytes()
    assert _wire.value_offset(raw[:5], _frames._GEMM_OUT_DATA) is None  # cut before it
    assert _wire.value_offset(b"\xff" * 8, _frames._GEMM_OUT_DATA) is None


@pytest.mark.parametrize("op", ["quantize", "gemm", "put"])
def test_the_python_hop_bench_runs_and_counts_no_wrong_answers(op):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "bench", "python_hop.py"), "--op", op,
                        "--rows", "256", "--cols", "64", "--groups", "4", "--rounds", "1", "--iters", "3",
                        "--warmup", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines() if not line.startswith("#")]
    assert [line[1] for line in lines] == ["grpc", "frames"], r.stdout
    for line in lines:
        assert float(line[2]) > 0 and float(line[3]) >= float(line[2]) * 0.5, line  # p50, p90 in µs
        assert line[5] == "0", line  # wrong answers


def test_a_client_bounds_its_calls_by_default():
    """Left at its default a client's calls carry a deadline (300 s, as the C++
    client's), on gRPC and on the call socket; timeout=None leaves them
    unbounded, as a gRPC call without one."""
    import socket
    import tempfile
    import threading
    import time
    from concurrent import futures

    import grpc
    import shardgemm

    remaining = []

    def answer(request, context):
        remaining.append(context.time_remaining())
        context.abort(grpc.StatusCode.UNAVAILABLE, "the test's server")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("shardgemm.v1.ShardGemm", {
        "GetClusterInfo": grpc.unary_unary_rpc_method_handler(answer, request_deserializer=lambda b: b,
                                                              response_serializer=lambda b: b)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for timeout, low, high in [((), 290, 300), ((None,), None, None), ((7,), 5, 7)]:
            with shardgemm.Client(f"127.0.0.1:{port}", *timeout) as c:
                with pytest.raises(shardgemm.errors.ShardGemmError):
                    c.cluster_info()
            left = remaining.pop()
            if low is None:
                assert left is None or left > 1e6, left
            else:
                assert low <= left <= high + 1.5, (timeout, left)  # gRPC rounds the deadline up
    finally:
        server.stop(0)

    # The call socket: the frame's deadline, read by a server that answers nothing.
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/calls.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        frames = []

        def read_one():
            conn, _ = listener.accept()
            with conn:
                head = conn.recv(16)
                _, _, length = struct.unpack("<IIQ", head)
                body = b""
                while len(body) < length:
                    body += conn.recv(length - len(body))
                frames.append(pb.CallSocketRequest.FromString(body))

        reader = threading.Thread(target=read_one)
        reader.start()
        with shardgemm.Client("127.0.0.1:1", call_socket=path) as c:
            x = np.ones((64, 16), np.float32)
            with pytest.raises(shardgemm.errors.ShardGemmError):
                c.grouped_quantize(x, [64])
        reader.join(10)
        assert not reader.is_alive()
        listener.close()
        assert 290e6 <= frames[0].deadline_unix_us - time.time() * 1e6 <= 300e6, frames[0].deadline_unix_us
