"""Attacks on a TLS mesh (issue: security), one test each, on loopback.

A coordinator and two CPU workers with TLS (mutual inside the mesh) and
bearer tokens, certificates from tools/make_certs.sh. Each attack gets the
right status, and a checked request afterwards is still right."""
import os
import shutil
import socket
import subprocess
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
                                         keep_output_as="y")):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "write" in e.value.details()
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
