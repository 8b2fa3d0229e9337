"""The coordinator's --client_socket: same-host clients on a Unix socket.

A coordinator serving clients on a Unix socket (gRPC's local credentials
under TLS, the bearer token still checked) beside its TCP port, CPU workers
on TCP. Checked: a client (Python, the CLI) is served there with its token,
the direct path keeps TLS to the workers, no token or a wrong one is
UNAUTHENTICATED, a worker cannot register there, the socket is owner-only,
a dead socket is replaced and anything else refused, and the socket goes
when the coordinator stops."""
import os
import socket
import stat
import subprocess

import grpc
import numpy as np
import pytest

from conftest import BIN, free_port
from shardgemm_client import Client
from shardgemm_pb import shardgemm_pb2 as pb
from shardgemm_pb import shardgemm_pb2_grpc as pb_grpc


@pytest.fixture
def tls_dir(mesh_certs):
    return mesh_certs


@pytest.fixture
def sock(tmp_path):
    # Short: a Unix socket's path is at most 107 bytes, and pytest's tmp paths are long.
    d = subprocess.run(["mktemp", "-d", "/tmp/sgsock.XXXXXX"], check=True, capture_output=True,
                       text=True).stdout.strip()
    yield os.path.join(d, "coordinator.sock")
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((4, 32, 16)).astype(np.float32)
    sizes = [10, 22, 20, 12]
    out = np.zeros((64, 16), np.float32)
    row = 0
    for shard in range(2):  # ep=2: each half of the rows, its 2 experts
        for g in range(2):
            n = sizes[shard * 2 + g]
            out[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
        row = (shard + 1) * 32
    return lhs, rhs, sizes, out


def gemm(client, seed=0, **kwargs):
    lhs, rhs, sizes, want = inputs(seed)
    out, _ = client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                 group_sizes_spec="(ep,)", **kwargs)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def local_stub(path, token=None, service=pb_grpc.ShardGemmStub):
    creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return service(grpc.secure_channel(f"unix:{path}", creds))


def token_of(tls_dir):
    with open(os.path.join(tls_dir, "client.token")) as f:
        return f.read().strip()


def code_of(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_a_client_on_the_socket_is_served_with_its_token(cluster_factory, tls_dir, sock):
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=[f"--client_socket={sock}"])
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    with Client(f"unix:{sock}", timeout=30, tls_dir=tls_dir) as client:
        assert client.cluster_info().ready
        gemm(client, seed=1)
        # The direct path: the coordinator on its socket, the workers' staging ports over TLS.
        gemm(client, seed=2, path="direct")
    gemm(c.client, seed=3)  # TCP clients as before


def test_the_socket_checks_tokens_and_refuses_workers(cluster_factory, tls_dir, sock):
    cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=[f"--client_socket={sock}"])
    for token in (None, "not-the-token", token_of(tls_dir) + "x"):
        stub = local_stub(sock, token)
        assert code_of(lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=10)) == \
            grpc.StatusCode.UNAUTHENTICATED, token
    assert local_stub(sock, token_of(tls_dir)).GetClusterInfo(pb.ClusterInfoRequest(), timeout=10).ready
    # The mesh-internal service needs a worker certificate, which a Unix-socket peer cannot show.
    coordination = local_stub(sock, token_of(tls_dir), pb_grpc.CoordinationStub)
    assert code_of(lambda: coordination.Register(pb.RegisterRequest(address="127.0.0.1:1"), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_the_cli_takes_a_unix_target(cluster_factory, tls_dir, sock):
    cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=[f"--client_socket={sock}"])
    r = subprocess.run([os.path.join(BIN, "shardgemm"), "cluster", f"--coordinator=unix:{sock}",
                        f"--tls_dir={tls_dir}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stdout.lower(), r.stdout


def test_a_token_without_certificates_reaches_the_coordinator_but_not_the_workers(cluster_factory, tls_dir, sock):
    cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=[f"--client_socket={sock}"])
    with Client(f"unix:{sock}", timeout=30, token=token_of(tls_dir)) as client:
        gemm(client, seed=4)  # inline: through the coordinator only
        with pytest.raises(Exception) as e:
            gemm(client, seed=5, path="direct")
        assert "tls_dir" in str(e.value), e.value
        assert "FAILED_PRECONDITION" in str(getattr(e.value, "code", "")) or \
            "FAILED_PRECONDITION" in repr(e.value), repr(e.value)
        # "auto" keeps a large call (over the direct path's 4 MiB threshold) inline: it still works.
        rng = np.random.default_rng(9)
        lhs = rng.standard_normal((2048, 1024)).astype(np.float32)
        rhs = rng.standard_normal((4, 1024, 16)).astype(np.float32)
        sizes = [512, 512, 512, 512]
        out, _ = client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                     group_sizes_spec="(ep,)", path="auto")
        want = np.concatenate([lhs[g * 512:(g + 1) * 512] @ rhs[g] for g in range(4)])
        np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)


def test_plaintext_meshes_serve_the_socket_too(cluster_factory, sock):
    cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--client_socket={sock}"])
    with Client(f"unix:{sock}", timeout=30) as client:
        gemm(client, seed=6)
        gemm(client, seed=7, path="direct")


def test_a_dead_socket_is_replaced_and_the_socket_goes_at_stop(cluster_factory, tls_dir, sock):
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock)  # bound, never listening: a killed coordinator's
    dead.close()
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=[f"--client_socket={sock}"])
    with Client(f"unix:{sock}", timeout=30, tls_dir=tls_dir) as client:
        gemm(client, seed=8)
    c.stop()
    assert c.coordinator.returncode == 0, c.log_text()
    assert not os.path.exists(sock)


def start_coordinator(flags):
    return subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), f"--listen=127.0.0.1:{free_port()}",
                           "--mesh=dp=1", "--insecure", *flags], capture_output=True, text=True, timeout=60)


def test_anything_else_at_the_path_is_refused(sock, tmp_path):
    with open(sock, "w") as f:
        f.write("not a socket")
    r = start_coordinator([f"--client_socket={sock}"])
    assert r.returncode == 2 and "exists and is not a socket" in r.stderr, r.stderr
    with open(sock) as f:
        assert f.read() == "not a socket"  # left alone
    os.unlink(sock)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(sock)
    live.listen(1)
    try:
        r = start_coordinator([f"--client_socket={sock}"])
        assert r.returncode == 2 and "another process serves" in r.stderr, r.stderr
        assert os.path.exists(sock)
    finally:
        live.close()
    for flags, why in (([f"--client_socket=relative.sock"], "not an absolute path"),
                       (["--client_socket=/tmp/shardgemm-client-socket-test.sock"], "no one else can write"),
                       ([f"--client_socket={sock}x", "--client_socket_mode=0400"], "--client_socket_mode"),
                       ([f"--client_socket={sock}x", "--client_socket_mode=rw"], "not an octal file mode")):
        r = start_coordinator(flags)
        assert r.returncode == 2 and why in r.stderr, (flags, r.stderr)


def test_a_second_coordinator_on_the_same_socket_is_refused(cluster_factory, sock):
    c = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--client_socket={sock}"])
    r = start_coordinator([f"--client_socket={sock}"])
    assert r.returncode == 2 and "another server holds" in r.stderr, r.stderr
    with Client(f"unix:{sock}", timeout=30) as client:
        gemm(client, seed=10)  # the first one still serves it
    c.stop()
    # Its lock goes with it: a successor may take the path.
    c2 = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=[f"--client_socket={sock}"])
    with Client(f"unix:{sock}", timeout=30) as client:
        gemm(client, seed=11)
    c2.stop()
