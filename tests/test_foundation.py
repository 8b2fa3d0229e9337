"""End to end through gRPC: one coordinator, one CPU worker (mesh of size 1)."""
import json
import os
import subprocess

import grpc
import ml_dtypes
import numpy as np
import pytest

from conftest import BIN, ROOT
from reference import assert_close, grouped_gemm_ragged_k, grouped_gemm_ragged_m
from shardgemm_client import pb, to_tensor

rng = np.random.default_rng(7)


def rand(*shape, dtype=np.float32):
    return rng.uniform(-1, 1, size=shape).astype(dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_ragged_m_matches_reference_with_padding_and_empty_groups(cluster, transposed, with_bias):
    m, k, n = 96, 40, 24
    sizes = [30, 0, 17, 41]  # 8 padding rows, one empty group
    lhs = rand(m, k)
    rhs = rand(4, n, k) if transposed else rand(4, k, n)
    bias = rand(4, n) if with_bias else None
    out, plan = cluster.client.grouped_gemm(lhs, rhs, sizes, bias, rhs_transposed=transposed,
                                            include_plan=True)
    assert out.shape == (m, n) and out.dtype == np.float32
    assert_close(out, grouped_gemm_ragged_m(lhs, rhs, sizes, bias, transposed), k)
    assert np.all(out[88:] == 0), "padding rows must be zero"
    rhs_rule = "g n k" if transposed else "g k n"
    assert plan.rule == f"m k, {rhs_rule}, g{', g n' if with_bias else ''} -> m n"


def test_ragged_k_wgrad(cluster):
    lhs, rhs, sizes = rand(64, 16), rand(64, 12), [10, 0, 50]
    out, _ = cluster.client.grouped_gemm(lhs, rhs, sizes, ragged_k=True)
    assert out.shape == (3, 16, 12)
    assert_close(out, grouped_gemm_ragged_k(lhs, rhs, sizes), 64)
    assert np.all(out[1] == 0)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_inputs_and_outputs(cluster, dtype):
    lhs, rhs, sizes = rand(32, 64, dtype=dtype), rand(2, 64, 16, dtype=dtype), [20, 12]
    out, _ = cluster.client.grouped_gemm(lhs, rhs, sizes)
    assert out.dtype == np.dtype(dtype)
    assert_close(out, grouped_gemm_ragged_m(lhs.astype(np.float32), rhs.astype(np.float32), sizes), 64)
    out32, _ = cluster.client.grouped_gemm(lhs, rhs, sizes, out_dtype=np.float32)
    assert out32.dtype == np.float32


def test_resident_tensors_put_get_delete_and_use(cluster):
    c = cluster.client
    w = rand(4, 32, 16)
    c.put("experts", w)
    assert np.array_equal(c.get("experts"), w)
    assert [t.name for t in c.list()] == ["experts"]
    lhs, sizes = rand(40, 32), [10, 10, 10, 10]
    out, _ = c.grouped_gemm(lhs, "experts", sizes)
    assert_close(out, grouped_gemm_ragged_m(lhs, w, sizes), 32)
    with pytest.raises(grpc.RpcError) as e:
        c.put("experts", w)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    c.put("experts", 2 * w, overwrite=True)
    assert np.array_equal(c.get("experts"), 2 * w)
    c.delete("experts")
    with pytest.raises(grpc.RpcError) as e:
        c.get("experts")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_large_tensor_streams_past_the_message_limit(cluster):
    big = rand(3, 1024, 1024)  # 12 MiB, over gRPC's 4 MiB default
    cluster.client.put("big", big)
    assert np.array_equal(cluster.client.get("big"), big)


def test_output_kept_resident(cluster):
    c = cluster.client
    lhs, rhs, sizes = rand(16, 8), rand(2, 8, 4), [8, 8]
    out, _ = c.grouped_gemm(lhs, rhs, sizes, keep_output_as="y")
    assert out is None
    assert_close(c.get("y"), grouped_gemm_ragged_m(lhs, rhs, sizes), 8)


def invalid(cluster, req):
    with pytest.raises(grpc.RpcError) as e:
        cluster.client.stub.GroupedGemm(req, timeout=30)
    return e.value


def good_request(c):
    return c.gemm_request(rand(16, 8), rand(2, 8, 4), [8, 8])


@pytest.mark.parametrize("mutate, code, words", [
    (lambda r: setattr(r.lhs, "data", r.lhs.data[:-1]), "INVALID_ARGUMENT", "lhs.data has 511 bytes"),
    (lambda r: r.lhs.shape.__setitem__(0, -16), "INVALID_ARGUMENT", "lhs.shape[0] is negative"),
    (lambda r: r.rhs.shape.extend([1 << 40, 1 << 40]), "INVALID_ARGUMENT", "rhs.shape"),
    (lambda r: setattr(r.group_sizes, "data", np.array([9, 8], np.int64).tobytes()), "INVALID_ARGUMENT", "group_sizes"),
    (lambda r: setattr(r.group_sizes, "data", np.array([-1, 8], np.int64).tobytes()), "INVALID_ARGUMENT", "group_sizes[0] is negative"),
    (lambda r: r.lhs.shape.append(1), "INVALID_ARGUMENT", "lhs"),
    (lambda r: setattr(r.rhs, "dtype", 99), "INVALID_ARGUMENT", "rhs.dtype is unknown"),
    (lambda r: setattr(r.lhs, "dtype", pb.I32), "INVALID_ARGUMENT", "lhs"),
    (lambda r: r.rhs.CopyFrom(pb.Tensor(resident="nope")), "NOT_FOUND", "nope"),
    (lambda r: setattr(r.lhs, "spec", "(tp, None)"), "INVALID_ARGUMENT", "tp"),
    (lambda r: setattr(r.lhs, "spec", "((dp,"), "INVALID_ARGUMENT", "spec"),
])
def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(cluster, mutate, code, words):
    req = good_request(cluster.client)
    mutate(req)
    err = invalid(cluster, req)
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    assert words in err.details(), err.details()
    # The same server still answers a good request.
    out, _ = cluster.client.grouped_gemm(rand(16, 8), rand(2, 8, 4), [8, 8])
    assert out.shape == (16, 4)
    assert cluster.alive()


def test_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    health = health_pb2_grpc.HealthStub(cluster.client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(cluster.client.channel)
    responses = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "shardgemm.v1.ShardGemm" in names
    assert "grpc.health.v1.Health" in names


def test_worker_serves_health_and_reflection_too(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    address = cluster.client.cluster_info().workers[0].address
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_cluster_info(cluster):
    info = cluster.client.cluster_info()
    assert info.ready and info.workers_expected == 1
    assert info.workers[0].backend == "cpu"


def run_cli(cluster, *args):
    return subprocess.run([os.path.join(BIN, "shardgemm"), *args, *cluster.cli_flags()],
                          capture_output=True, text=True, timeout=120)


def test_cli_gemm_from_npy_with_check_and_output(cluster, tmp_path):
    lhs, rhs = rand(48, 32), rand(3, 32, 8)
    np.save(tmp_path / "lhs.npy", lhs)
    np.save(tmp_path / "rhs.npy", rhs)
    r = run_cli(cluster, "gemm", f"--lhs={tmp_path}/lhs.npy", f"--rhs={tmp_path}/rhs.npy",
                "--group-sizes=20,0,20", "--check", f"--out={tmp_path}/out.npy")
    assert r.returncode == 0, r.stderr
    assert "result matches reference" in r.stdout
    out = np.load(tmp_path / "out.npy")
    assert_close(out, grouped_gemm_ragged_m(lhs, rhs, [20, 0, 20]), 32)


def test_cli_generated_bf16_and_json_request(cluster, tmp_path):
    r = run_cli(cluster, "gemm", "--lhs=64x32", "--rhs=4x32x16", "--dtype=bf16", "--groups=4", "--check")
    assert r.returncode == 0, r.stderr
    assert "result matches reference" in r.stdout
    from google.protobuf import json_format
    req = cluster.client.gemm_request(rand(8, 4), rand(2, 4, 4), [4, 4])
    (tmp_path / "req.json").write_text(json_format.MessageToJson(req))
    r = run_cli(cluster, "gemm", f"--request={tmp_path}/req.json", "--check")
    assert r.returncode == 0, r.stderr
    assert "result matches reference" in r.stdout


def test_cli_put_get_delete(cluster, tmp_path):
    w = rand(2, 3, 4)
    np.save(tmp_path / "w.npy", w)
    assert run_cli(cluster, "put", "w", f"--data={tmp_path}/w.npy").returncode == 0
    assert "w  2x3x4 f32" in run_cli(cluster, "ls").stdout
    assert run_cli(cluster, "get", "w", f"--out={tmp_path}/back.npy").returncode == 0
    assert np.array_equal(np.load(tmp_path / "back.npy"), w)
    assert run_cli(cluster, "delete", "w").returncode == 0
    r = run_cli(cluster, "get", "w")
    assert r.returncode != 0 and "NOT_FOUND" in r.stderr


def test_cli_bad_flags_say_what_is_wrong(cluster):
    r = run_cli(cluster, "gemm", "--lhs=64xq", "--rhs=4x32x16")
    assert r.returncode != 0 and "--lhs: bad shape" in r.stderr


def test_requests_refused_until_the_mesh_is_complete(cluster_factory, tmp_path):
    c = cluster_factory()  # complete, for contrast
    assert c.client.cluster_info().ready
    import conftest
    port = conftest.free_port()
    proc = subprocess.Popen([os.path.join(BIN, "shardgemm-coordinator"), f"--listen=127.0.0.1:{port}",
                             "--mesh=dp=2", "--insecure"], stderr=subprocess.DEVNULL)
    try:
        from shardgemm_client import Client
        conftest.wait_for_port(port)
        client = Client(f"127.0.0.1:{port}", timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            client.grouped_gemm(rand(8, 4), rand(2, 4, 4), [4, 4])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "2 of 2 workers have not registered" in e.value.details()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_plan_offline_text_and_json():
    base = [os.path.join(BIN, "shardgemm"), "plan", "--mesh=dp=2,fsdp=2,ep=2",
            "--lhs=4096x7168@((dp,fsdp,ep),None)", "--rhs=8x7168x2048@(ep,fsdp,None)",
            "--group-sizes=32@((dp,fsdp,ep),)"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "all_gather" in r.stdout and "rhs is all-gathered along fsdp" in r.stdout
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=60)
    plan = json.loads(r.stdout)
    assert plan["out_spec"] == "((dp, fsdp, ep), None)"
    assert [(c["kind"], c["tensor"], c["axes"]) for c in plan["collectives"]] == [
        ("COLLECTIVE_ALL_GATHER", "TENSOR_RHS", ["fsdp"])]
    assert int(plan["collectives"][0]["bytes_per_worker"]) > 0
    # te mode drops tp with a warning; the default mode uses it.
    tp = [os.path.join(BIN, "shardgemm"), "plan", "--mesh=dp=2,tp=2", "--lhs=64x32@(dp,None)",
          "--rhs=4x32x16@(None,None,tp)", "--group-sizes=8@(dp,)", "--json"]
    te = json.loads(subprocess.run(tp + ["--compat=te"], capture_output=True, text=True).stdout)
    default = json.loads(subprocess.run(tp, capture_output=True, text=True).stdout)
    assert any("'tp' dropped" in w for w in te["warnings"])
    assert default["out_spec"].replace(" ", "") == "(dp,tp)"


def test_cli_plan_through_the_rpc_rejects_bad_specs(cluster):
    r = run_cli(cluster, "plan", "--lhs=64x32@(dp,dp)", "--rhs=4x32x16", "--group-sizes=4")
    assert r.returncode != 0 and "INVALID_ARGUMENT" in r.stderr
    r = run_cli(cluster, "plan", "--lhs=64x32@(dp,None)", "--rhs=4x32x16", "--group-sizes=4@(dp,)")
    assert r.returncode == 0, r.stderr
    assert "m k, g k n, g -> m n" in r.stdout


@pytest.mark.parametrize("sizes", [[2**63 - 1, 2], [1, 2**63 - 1, 5], [-(2**63), 8]])
def test_group_sizes_that_would_overflow_are_rejected(cluster, sizes):
    c = cluster.client
    for kwargs in [{}, {"global_sorted": True}, {"ragged_k": True}]:
        rhs = rand(16, 4) if kwargs.get("ragged_k") else rand(len(sizes), 8, 4)
        with pytest.raises(grpc.RpcError) as e:
            c.grouped_gemm(rand(16, 8), rhs, sizes, **kwargs)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "group_sizes" in e.value.details()
    assert cluster.alive()


def test_put_with_more_data_than_the_shape_is_refused(cluster):
    c = cluster.client
    def chunks():
        yield pb.TensorChunk(name="t", dtype=pb.F32, shape=[4], data=b"\0" * 16)
        yield pb.TensorChunk(data=b"\0" * 4)
    with pytest.raises(grpc.RpcError) as e:
        c.stub.PutTensor(chunks(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.list() == []
