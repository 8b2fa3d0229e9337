"""Attacks on a TLS mesh (issue: security), one test each, on loopback.

A coordinator and two CPU workers with TLS (mutual inside the mesh) and
bearer tokens, certificates from tools/make_certs.sh. Each attack gets the
right status, and a checked request afterwards is still right."""
import ipaddress
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import BIN, ROOT
from shardgemm_client import Client
from shardgemm_pb import shardgemm_pb2 as pb
from shardgemm_pb import shardgemm_pb2_grpc as pb_grpc


@pytest.fixture
def tls_dir(tmp_path):
    """A fresh CA and certificates per test (tests that edit the tokens file edit their own)."""
    d = str(tmp_path / "tls")
    subprocess.run(["bash", os.path.join(ROOT, "tools", "make_certs.sh"), d], check=True, capture_output=True,
                   timeout=60)
    return d


@pytest.fixture
def secure(cluster_factory, tls_dir):
    return cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((4, 32, 16)).astype(np.float32),
            [10, 22, 20, 12])


def reference(lhs, rhs, sizes):
    """Per-shard grouped GEMM over ep=2: each half of the rows, its 2 experts."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    row = 0
    for shard in range(2):
        for g in range(2):
            n = sizes[shard * 2 + g]
            out[row:row + n] = lhs[row:row + n] @ rhs[shard * 2 + g]
            row += n
        row = (shard + 1) * lhs.shape[0] // 2
    return out


def still_right(cluster):
    lhs, rhs, sizes = inputs(9)
    out, _ = cluster.client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                         group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)


def channel(cluster, tls_dir, cert=None, ca=None, token=None):
    """A TLS channel to the coordinator presenting `cert` (a stem in tls_dir) and `token`."""
    creds = grpc.ssl_channel_credentials(root_certificates=read(ca or os.path.join(tls_dir, "ca.crt")),
                                         private_key=read(os.path.join(tls_dir, f"{cert}.key")) if cert else None,
                                         certificate_chain=read(os.path.join(tls_dir, f"{cert}.crt")) if cert else None)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(cluster.address, creds)


def code_of(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_the_secure_mesh_serves_a_client_with_its_token(secure):
    still_right(secure)
    info = secure.client.cluster_info()
    assert info.ready and len(info.workers) == 2


def test_a_plaintext_client_gets_nothing_from_a_tls_server(secure):
    c = Client(secure.address, timeout=5)  # no tls_dir: plaintext
    assert code_of(c.cluster_info) == grpc.StatusCode.UNAVAILABLE
    c.close()
    still_right(secure)


def test_a_missing_or_wrong_token_is_unauthenticated(secure, tls_dir):
    lhs, rhs, sizes = inputs()
    for token in (None, "not-the-token", read(os.path.join(tls_dir, "client.token")).decode().strip() + "x"):
        stub = pb_grpc.ShardGemmStub(channel(secure, tls_dir, token=token))
        assert code_of(lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: stub.ListTensors(pb.ListTensorsRequest(), timeout=5)) == \
            grpc.StatusCode.UNAUTHENTICATED
        req = secure.client.gemm_request(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)",
                                         group_sizes_spec="(ep,)")
        assert code_of(lambda: stub.GroupedGemm(req, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    still_right(secure)


def test_a_revoked_token_stops_working(secure, tls_dir):
    secure.client.put("w", inputs()[1], spec="(ep, None, None)")
    tokens = os.path.join(tls_dir, "tokens")
    kept = read(tokens)
    time.sleep(1.1)  # the coordinator checks the file at most once a second
    with open(tokens, "w") as f:
        f.write("# every token revoked\n")
    deadline = time.time() + 5
    code = None
    while time.time() < deadline:
        try:
            secure.client.list()
        except grpc.RpcError as e:
            code = e.code()
            break
        time.sleep(0.2)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(1.1)
    with open(tokens, "wb") as f:
        f.write(kept)
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            assert [t.name for t in secure.client.list()] == ["w"]  # nothing lost meanwhile
            break
        except grpc.RpcError:
            time.sleep(0.2)
    still_right(secure)


def other_ca(tmp_path):
    d = str(tmp_path / "other")
    subprocess.run(["bash", os.path.join(ROOT, "tools", "make_certs.sh"), d], check=True, capture_output=True,
                   timeout=60)
    return d


def test_a_client_trusting_another_ca_does_not_connect(secure, tls_dir, tmp_path):
    other = other_ca(tmp_path)
    stub = pb_grpc.ShardGemmStub(channel(secure, tls_dir, ca=os.path.join(other, "ca.crt"),
                                         token=read(os.path.join(tls_dir, "client.token")).decode().strip()))
    assert code_of(lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_of_another_ca_is_refused(secure, tls_dir, tmp_path):
    other = other_ca(tmp_path)
    creds = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")),
                                         private_key=read(os.path.join(other, "worker.key")),
                                         certificate_chain=read(os.path.join(other, "worker.crt")))
    stub = pb_grpc.CoordinationStub(grpc.secure_channel(secure.address, creds))
    req = pb.RegisterRequest(address="127.0.0.1:1", backend="cpu")
    assert code_of(lambda: stub.Register(req, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    still_right(secure)


def expired_certificate(tls_dir, tmp_path, stem):
    """`stem`.crt re-issued by the mesh CA, valid only in 2020."""
    work = tmp_path / "expired"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "serial").write_text("1000\n")
    (work / "ca.cnf").write_text(
        "[ca]\ndefault_ca=ca\n[ca]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\ndefault_md=sha256\n"
        "policy=any\ncopy_extensions=copy\nunique_subject=no\n[any]\ncommonName=supplied\norganizationName=optional\n")
    subprocess.run(["openssl", "req", "-new", "-key", os.path.join(tls_dir, f"{stem}.key"), "-out", "x.csr",
                    "-subj", f"/O=shardgemm/CN=shardgemm-{stem}", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], cwd=work, check=True, capture_output=True)
    subprocess.run(["openssl", "ca", "-batch", "-config", "ca.cnf", "-cert", os.path.join(tls_dir, "ca.crt"),
                    "-keyfile", os.path.join(tls_dir, "ca.key"), "-startdate", "20200101000000Z",
                    "-enddate", "20200102000000Z", "-in", "x.csr", "-out", "x.crt", "-notext"],
                   cwd=work, check=True, capture_output=True)
    return str(work / "x.crt")


def test_an_expired_worker_certificate_cannot_register(secure, tls_dir, tmp_path):
    expired = expired_certificate(tls_dir, tmp_path, "worker")
    creds = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")),
                                         private_key=read(os.path.join(tls_dir, "worker.key")),
                                         certificate_chain=read(expired))
    stub = pb_grpc.CoordinationStub(grpc.secure_channel(secure.address, creds))
    assert code_of(lambda: stub.Register(pb.RegisterRequest(address="127.0.0.1:1"), timeout=5)) == \
        grpc.StatusCode.UNAVAILABLE
    still_right(secure)


def test_a_rogue_without_a_worker_certificate_cannot_register_or_use_the_store(secure, tls_dir):
    token = read(os.path.join(tls_dir, "client.token")).decode().strip()
    for cert in (None, "client", "coordinator"):
        stub = pb_grpc.CoordinationStub(channel(secure, tls_dir, cert=cert, token=token))
        assert code_of(lambda: stub.Register(pb.RegisterRequest(address="127.0.0.1:1", backend="cpu"),
                                             timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: stub.StoreSet(pb.StoreSetRequest(key="k", value=b"v"), timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: stub.StoreGet(pb.StoreGetRequest(keys=["k"], timeout_ms=10), timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
    info = secure.client.cluster_info()
    assert info.ready and len(info.workers) == 2  # no rank taken
    still_right(secure)


def test_a_worker_certificate_is_no_client_credential(secure, tls_dir):
    stub = pb_grpc.ShardGemmStub(channel(secure, tls_dir, cert="worker"))  # a mesh cert, no token
    assert code_of(lambda: stub.ListTensors(pb.ListTensorsRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED


def worker_addresses(cluster):
    return [w.address for w in cluster.client.cluster_info().workers]


def test_only_the_coordinator_may_send_steps_or_read_shards(secure, tls_dir):
    secure.client.put("w", inputs()[1], spec="(ep, None, None)")
    for address in worker_addresses(secure):
        # No client certificate: the worker's TLS refuses the connection.
        plain = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")))
        stub = pb_grpc.WorkerStub(grpc.secure_channel(address, plain))
        assert code_of(lambda: stub.Execute(pb.Step(sequence=1), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        # A mesh CA certificate that is not the coordinator's (another worker's, a client's).
        for cert in ("worker", "client"):
            creds = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")),
                                                 private_key=read(os.path.join(tls_dir, f"{cert}.key")),
                                                 certificate_chain=read(os.path.join(tls_dir, f"{cert}.crt")))
            stub = pb_grpc.WorkerStub(grpc.secure_channel(address, creds))
            step = pb.Step(sequence=10**6, store=pb.StoreShardStep(name="w@1"))
            assert code_of(lambda: stub.Execute(step, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
            assert code_of(lambda: stub.GetShard(pb.GetShardRequest(name="w@1"), timeout=5)) == \
                grpc.StatusCode.PERMISSION_DENIED
    np.testing.assert_array_equal(secure.client.get("w"), inputs()[1])
    still_right(secure)


def local_sockets(cluster, workers=2, timeout_s=10):
    """The Unix sockets the workers said they serve their coordinator on.

    A worker may register before its "serving" line is written: the lines are
    waited for, within a bound."""
    deadline = time.time() + timeout_s
    while cluster.log_text().count(" worker: serving ") < workers and time.time() < deadline:
        time.sleep(0.05)
    return re.findall(r"local_socket=(\S+)", cluster.log_text())


def step_sockets(cluster, workers=2):
    """The step sockets the workers said they take steps on (after their serving lines)."""
    local_sockets(cluster, workers)
    return re.findall(r"step_socket=(\S+)", cluster.log_text())


def step_frame(message):
    """A step socket frame (proto/step_frame.h): "SGS1", version 1, the payload's length, the payload."""
    payload = message.SerializeToString()
    return struct.pack("<IIQ", 0x31534753, 1, len(payload)) + payload


def read_step_frame(sock):
    def exactly(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the step socket closed"
            data += chunk
        return data
    magic, version, length = struct.unpack("<IIQ", exactly(16))
    assert (magic, version) == (0x31534753, 1)
    reply = pb.StepSocketReply()
    reply.ParseFromString(exactly(length))
    return reply


def test_a_worker_on_this_host_is_called_on_a_unix_socket_only_its_user_can_reach(secure):
    workers = secure.client.cluster_info().workers
    assert [w.hop for w in workers] == [pb.WORKER_HOP_UNIX_SOCKET] * 2
    assert [w.step_socket for w in workers] == [True] * 2
    sockets = local_sockets(secure)
    assert len(sockets) == 2
    steps = step_sockets(secure)
    assert len(steps) == 2
    for path in steps:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()
        directory = os.stat(os.path.dirname(path))
        assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.geteuid()
        # This user's process may send a step there, but one not of the coordinator's session is refused.
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(step_frame(pb.StepSocketRequest(call_id=5, step=pb.Step(sequence=10**6, session="forged"))))
            reply = read_step_frame(s)
            assert reply.call_id == 5 and reply.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], reply
            # Bytes that are no frame end the connection, not the worker.
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:  # closed with the rest of the bytes unread
                pass
    for path in sockets + steps:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()
        directory = os.stat(os.path.dirname(path))
        assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.geteuid()
        if os.geteuid() == 0:
            # Another user cannot even reach the socket: the directory is closed to it.
            probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                     "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\nsys.exit(0)")
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                                probe, path], capture_output=True, timeout=30)
            assert r.returncode == 13, r.stderr
        if path in steps:
            continue  # its frames were tried above
        # A process of this user may call there (it could read the workers' keys too), but a
        # step that is not from the coordinator's session is refused like any stray step.
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
        stub = pb_grpc.WorkerStub(grpc.secure_channel(f"unix:{path}", local))
        assert code_of(lambda: stub.Execute(pb.Step(sequence=10**6, session="forged"), timeout=5)) == \
            grpc.StatusCode.FAILED_PRECONDITION
    secure.client.put("w", inputs()[1], spec="(ep, None, None)")
    np.testing.assert_array_equal(secure.client.get("w"), inputs()[1])
    still_right(secure)


@pytest.mark.parametrize("off", ["coordinator", "worker"])
def test_without_the_unix_socket_the_worker_is_called_over_mutual_tls(cluster_factory, tls_dir, off):
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir,
                        coordinator_flags=["--worker_local_socket=false"] if off == "coordinator" else [],
                        worker_flags=["--local_socket=false"] if off == "worker" else [])
    assert [w.hop for w in c.client.cluster_info().workers] == [pb.WORKER_HOP_TCP] * 2
    assert [w.step_socket for w in c.client.cluster_info().workers] == [False] * 2
    assert (local_sockets(c) == []) == (off == "worker")
    still_right(c)


def test_with_the_step_socket_off_steps_go_on_the_workers_grpc_unix_socket(cluster_factory, tls_dir):
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, coordinator_flags=["--worker_step_socket=false"])
    workers = c.client.cluster_info().workers
    assert [w.hop for w in workers] == [pb.WORKER_HOP_UNIX_SOCKET] * 2
    assert [w.step_socket for w in workers] == [False] * 2
    still_right(c)
    # A worker told not to serve one is sent its steps on gRPC.
    c = cluster_factory(mesh="ep=2", workers=2, tls_dir=tls_dir, worker_flags=["--step_socket=false"])
    assert [w.step_socket for w in c.client.cluster_info().workers] == [False] * 2
    assert step_sockets(c) == []
    still_right(c)


def test_no_second_process_can_bind_a_servers_port(secure):
    ports = [int(secure.address.rpartition(":")[2])] + [int(a.rpartition(":")[2]) for a in worker_addresses(secure)]
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
        s.close()
    still_right(secure)


def test_servers_refuse_to_start_without_tls_or_insecure(tmp_path):
    for binary in ("shardgemm-coordinator", "shardgemm-worker"):
        p = subprocess.run([os.path.join(BIN, binary), "--listen=127.0.0.1:0"], capture_output=True, text=True,
                           timeout=20)
        assert p.returncode == 2 and "--tls_dir" in p.stderr and "--insecure" in p.stderr, p.stderr
    p = subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), "--listen=127.0.0.1:0",
                        f"--tls_dir={tmp_path}/missing"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and "ca.crt" in p.stderr


def test_insecure_says_so_in_the_log(cluster_factory):
    cl = cluster_factory(mesh="dp=1", workers=1)  # the fixture's default: --insecure
    log = open(os.path.join(cl.logs, "coordinator.log")).read()
    assert "--insecure: plaintext" in log


def test_the_health_port_answers_plaintext_probes(cluster_factory, tls_dir):
    from conftest import free_port
    port = free_port()
    cl = cluster_factory(mesh="dp=1", workers=1, tls_dir=tls_dir,
                         coordinator_flags=[f"--health_listen=127.0.0.1:{port}"])
    probe = os.path.join(BIN, "shardgemm-health-probe")
    if not os.path.exists(probe):
        pytest.skip("no shardgemm-health-probe in bin/")
    r = subprocess.run([probe, f"--addr=127.0.0.1:{port}"], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stdout + r.stderr
    # The TLS port does not speak plaintext.
    r = subprocess.run([probe, f"--addr={cl.address}", "--timeout_s=2"], capture_output=True, text=True, timeout=20)
    assert r.returncode != 0


def add_token(tls_dir, tenant):
    """A new bearer token for `tenant`, appended (hashed) to the coordinator's tokens file."""
    import hashlib
    import secrets
    token = secrets.token_hex(32)
    with open(os.path.join(tls_dir, "tokens"), "a") as f:
        f.write(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} {tenant}\n")
    return token


def tenants(cluster, tls_dir, *names):
    tokens = [add_token(tls_dir, n) for n in names]
    time.sleep(1.1)  # the coordinator reads the changed file within a second
    return [Client(cluster.address, timeout=30, tls_dir=tls_dir, token=t) for t in tokens]


def test_a_tenant_cannot_list_read_use_replace_or_delete_anothers_tensor(secure, tls_dir):
    alice, bob = tenants(secure, tls_dir, "alice", "bob")
    lhs, rhs, sizes = inputs(3)
    alice.put("experts", rhs, spec="(ep, None, None)")
    assert [t.name for t in bob.list()] == []
    assert code_of(lambda: bob.get("experts")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: bob.delete("experts")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: bob.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)",
                                            group_sizes_spec="(ep,)")) == grpc.StatusCode.NOT_FOUND
    # Bob keeping an output as "experts" (overwrite) makes his own.
    bob.grouped_gemm(lhs, rhs, sizes, lhs_spec="(ep, None)", rhs_spec="(ep, None, None)", group_sizes_spec="(ep,)",
                     keep_output_as="experts", overwrite_output=True)
    np.testing.assert_array_equal(alice.get("experts"), rhs)
    # Bob's own "experts", even with overwrite, is his: Alice's is untouched.
    mine = np.ones_like(rhs)
    bob.put("experts", mine, spec="(ep, None, None)", overwrite=True)
    np.testing.assert_array_equal(alice.get("experts"), rhs)
    np.testing.assert_array_equal(bob.get("experts"), mine)
    out, _ = alice.grouped_gemm(lhs, "experts", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)
    bob.delete("experts")
    assert [t.name for t in alice.list()] == ["experts"]
    np.testing.assert_array_equal(alice.get("experts"), rhs)
    # The demo token's tenant sees neither.
    assert [t.name for t in secure.client.list()] == []
    for c in (alice, bob):
        c.close()


def test_a_tenant_holds_at_most_its_limit_of_tensors(cluster_factory, tls_dir):
    cl = cluster_factory(mesh="dp=1", workers=1, tls_dir=tls_dir, coordinator_flags=["--max_tensors_per_tenant=2"])
    alice, bob = tenants(cl, tls_dir, "alice", "bob")
    w = np.zeros((2, 2), np.float32)
    alice.put("a", w)
    alice.put("b", w)
    with pytest.raises(grpc.RpcError) as e:
        alice.put("c", w)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tensors_per_tenant" in e.value.details()
    alice.put("a", w + 1, overwrite=True)  # replacing one of its own is fine
    bob.put("c", w)  # another tenant's room is its own
    alice.delete("b")
    alice.put("c", w)
    assert sorted(t.name for t in alice.list()) == ["a", "c"]


def test_a_token_does_only_what_it_is_granted(secure, tls_dir):
    import hashlib
    import secrets
    token = secrets.token_hex(32)
    with open(os.path.join(tls_dir, "tokens"), "a") as f:
        f.write(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} demo read,compute\n")
    time.sleep(1.1)
    lhs, rhs, sizes = inputs(4)
    secure.client.put("w", rhs, spec="(ep, None, None)")  # the full demo token
    ro = Client(secure.address, timeout=30, tls_dir=tls_dir, token=token)
    np.testing.assert_array_equal(ro.get("w"), rhs)  # the same tenant's tensor: read is granted
    out, _ = ro.grouped_gemm(lhs, "w", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)
    for call in (lambda: ro.put("v", rhs, spec="(ep, None, None)"), lambda: ro.delete("w"),
                 lambda: ro.grouped_gemm(lhs, "w", sizes, lhs_spec="(ep, None)", group_sizes_spec="(ep,)",
                                         keep_output_as="y"),
                 lambda: ro.grouped_quantize(lhs, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)",
                                             keep_rowwise_data_as="lhs8"),
                 lambda: ro.grouped_quantize(lhs, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)",
                                             keep_scale_inv_as="lhs8_scale")):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "write" in e.value.details()
    ro.grouped_quantize(lhs, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)")  # compute, nothing kept
    assert [t.name for t in secure.client.list()] == ["w"]
    ro.close()


def test_a_mesh_member_flooding_the_store_is_bounded(secure, tls_dir):
    creds = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")),
                                         private_key=read(os.path.join(tls_dir, "worker.key")),
                                         certificate_chain=read(os.path.join(tls_dir, "worker.crt")))
    stub = pb_grpc.CoordinationStub(grpc.secure_channel(secure.address, creds))
    assert code_of(lambda: stub.StoreSet(pb.StoreSetRequest(key="k", value=b"v" * (2 << 20)), timeout=10)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.StoreSet(pb.StoreSetRequest(key="k" * 1000, value=b"v"), timeout=10)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    big = b"v" * (1 << 20)
    code = None
    for i in range(300):  # 300 MiB asked for; the store holds at most 256 MiB
        try:
            stub.StoreSet(pb.StoreSetRequest(key=f"flood/{i}", value=big), timeout=10)
        except grpc.RpcError as e:
            code = e.code()
            break
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_right(secure)


def test_a_replayed_or_duplicated_step_is_refused(secure, tls_dir):
    """Even with the coordinator's own certificate: a step of another session,
    one already run, and one far ahead are refused, and the order holds."""
    secure.client.put("w", inputs()[1], spec="(ep, None, None)")
    creds = grpc.ssl_channel_credentials(root_certificates=read(os.path.join(tls_dir, "ca.crt")),
                                         private_key=read(os.path.join(tls_dir, "coordinator.key")),
                                         certificate_chain=read(os.path.join(tls_dir, "coordinator.crt")))
    for address in worker_addresses(secure):
        stub = pb_grpc.WorkerStub(grpc.secure_channel(address, creds))
        forged = pb.Step(sequence=1, session="not-the-session", store=pb.StoreShardStep(name="evil@1"))
        assert code_of(lambda: stub.Execute(forged, timeout=5)) in (grpc.StatusCode.FAILED_PRECONDITION,
                                                                    grpc.StatusCode.UNAVAILABLE)
        replayed = pb.Step(sequence=1, store=pb.StoreShardStep(name="evil@1"))  # step 1 ran long ago
        assert code_of(lambda: stub.Execute(replayed, timeout=5)) in (grpc.StatusCode.FAILED_PRECONDITION,
                                                                      grpc.StatusCode.UNAVAILABLE)
        ahead = pb.Step(sequence=10**9, store=pb.StoreShardStep(name="evil@1"))
        assert code_of(lambda: stub.Execute(ahead, timeout=5)) in (grpc.StatusCode.FAILED_PRECONDITION,
                                                                   grpc.StatusCode.INVALID_ARGUMENT)
    np.testing.assert_array_equal(secure.client.get("w"), inputs()[1])
    still_right(secure)


def listening_addresses(pid):
    """(address, port) of every TCP socket process `pid` listens on: its socket
    inodes (/proc/PID/fd) found in /proc/PID/net/tcp and tcp6 in state LISTEN;
    an IPv4-mapped IPv6 address as its IPv4 one."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw)
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            found.add((str(address), int(hex_port, 16)))
    return found


def ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_collectives_listen_only_on_the_workers_mesh_address(cluster_factory, tls_dir, host):
    """A CPU mesh of two on `host` runs a request whose plan all-gathers the
    weight, which builds the group's Gloo context. Gloo listens only while a
    pair connects (milliseconds), so one worker runs in slow motion (SIGCONT
    for half a millisecond, then SIGSTOP while both workers' sockets are
    read): every socket either listens on beside its gRPC port is on the mesh
    address, none on a wildcard, and the request is right."""
    if host == "::1" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    listen = "127.0.0.1:0" if host == "127.0.0.1" else "[::1]:0"
    cl = cluster_factory(mesh="fsdp=2", workers=2, tls_dir=tls_dir,
                         coordinator_flags=["--heartbeat_misses=60"],  # the slowed worker is not marked down
                         worker_flags=[f"--listen={listen}", "--collective_timeout_s=60"])
    rng = np.random.default_rng(5)
    lhs = rng.standard_normal((32, 16)).astype(np.float32)
    rhs = rng.standard_normal((2, 16, 8)).astype(np.float32)
    sizes = [10, 6, 8, 8]
    cl.client.put("x", lhs, spec="(fsdp, None)")
    cl.client.put("w", rhs, spec="(None, fsdp, None)")  # K split over fsdp: the plan gathers it
    workers = [p for _, p in cl.procs[1:]]
    slowed = workers[1]
    serving = {p.pid: listening_addresses(p.pid) for p in workers}  # the gRPC ports
    assert all(serving.values()), serving
    result = {}

    def request():
        try:
            result["out"], result["plan"] = cl.client.grouped_gemm("x", "w", sizes, group_sizes_spec="(fsdp,)",
                                                                   include_plan=True)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    caller = threading.Thread(target=request, daemon=True)
    seen = {p.pid: set() for p in workers}
    slowed.send_signal(signal.SIGSTOP)
    try:
        caller.start()
        # The other worker may be in the step already, listening for its
        # stopped peer: then it is seen here, without the slow motion's luck.
        first = time.time() + 1
        while time.time() < first and not any(seen[p.pid] - serving[p.pid] for p in workers):
            for p in workers:
                seen[p.pid] |= listening_addresses(p.pid)
            time.sleep(0.01)
        deadline = time.time() + 60
        while caller.is_alive() and time.time() < deadline:
            slowed.send_signal(signal.SIGCONT)
            time.sleep(0.0005)
            slowed.send_signal(signal.SIGSTOP)
            for p in workers:
                seen[p.pid] |= listening_addresses(p.pid)
    finally:
        slowed.send_signal(signal.SIGCONT)
    caller.join(60)
    assert not caller.is_alive(), "the request did not finish"
    assert "error" not in result, f"{result.get('error')}\n{cl.log_text()}"
    assert [(c.kind, list(c.axes)) for c in result["plan"].collectives] == [(pb.COLLECTIVE_ALL_GATHER, ["fsdp"])]
    want = np.zeros((32, 8), np.float32)
    for shard in range(2):
        row = shard * 16
        for g in range(2):
            n = sizes[shard * 2 + g]
            want[row:row + n] = lhs[row:row + n] @ rhs[g]
            row += n
    np.testing.assert_allclose(result["out"], want, rtol=1e-4, atol=1e-4)
    collective = {pid: seen[pid] - serving[pid] for pid in seen}
    assert any(collective.values()), f"no collective socket seen listening: {seen}"
    assert {address for pid in seen for address, _ in seen[pid] | serving[pid]} == {host}, seen


def test_a_worker_whose_mesh_address_is_no_interfaces_refuses_to_start(tls_dir):
    """A mesh host that is, or resolves to, a wildcard (\"0\" is 0.0.0.0 to the
    resolver), or that names no address of this host, is refused at start:
    the collectives would bind every interface, or none."""
    for host, says in (("0", "wildcard"), ("0.0.0.0", "wildcard"), ("[::]", "wildcard"),
                       ("192.0.2.123", "no address of this host")):
        started = time.time()
        p = subprocess.run([os.path.join(BIN, "shardgemm-worker"), "--coordinator=127.0.0.1:9", "--backend=cpu",
                            f"--tls_dir={tls_dir}", f"--advertise_host={host}", "--register_timeout_s=5"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 1 and says in p.stderr, (host, p.stderr)
        assert time.time() - started < 5, host  # at once, not after trying to register
