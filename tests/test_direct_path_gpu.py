"""The direct path on a CUDA worker (docs/architecture.md, "Data paths"):
staged BF16 GEMM operands go to device memory as their chunks arrive and
the GEMM reads them there, the output is held for fetch in pinned memory;
other blocks (F32 operands, a put's) stay on the host. Each must equal the
inline path bit for bit, and nothing may stay staged. Skipped without a
CUDA device.

The servers come from SERVER_BIN (default: this worktree's ./bin), e.g. on
the H200 with the bundle:
    LD_LIBRARY_PATH=.gpu_bundle/svc/lib SERVER_BIN=.gpu_bundle/svc/bin \\
        python3 -m pytest -q tests/test_direct_path_gpu.py"""
import os
import shutil
import subprocess

import grpc
import ml_dtypes
import numpy as np
import pytest

if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
    pytest.skip("no CUDA device", allow_module_level=True)

import shardgemm  # noqa: E402
from shardgemm_client import pb, pb_grpc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_BIN = os.environ.get("SERVER_BIN", os.path.join(ROOT, "bin"))
rng = np.random.default_rng(23)


def bf16(*shape):
    return rng.uniform(-1, 1, size=shape).astype(ml_dtypes.bfloat16)


def staged_bytes(cluster):
    held = []
    for w in cluster.client.cluster_info().workers:
        with grpc.insecure_channel(w.address) as ch:
            held.append(pb_grpc.WorkerStub(ch).Status(pb.WorkerStatusRequest(), timeout=10).staged_bytes)
    return held


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory):
    from conftest import Cluster
    c = Cluster(tmp_path_factory.mktemp("cuda"), mesh="dp=1", workers=1, backend="cuda", bin_dir=SERVER_BIN,
                worker_flags=["--staging_pinned_mb=64"])
    yield c
    c.stop()


@pytest.mark.parametrize("m,k,n,g", [(256, 128, 64, 4), (4096, 1024, 512, 8)])  # the second: blocks of MiBs
def test_staged_bf16_operands_and_a_fetched_output_equal_inline(cuda_cluster, m, k, n, g):
    lhs, rhs = bf16(m, k), bf16(g, k, n)
    cut = np.sort(rng.integers(0, m + 1, size=g - 1))
    sizes = np.diff(np.concatenate([[0], cut, [m]])).astype(np.int64)
    with shardgemm.Client(cuda_cluster.address, timeout=120) as c:
        assert [w.backend for w in c.cluster_info().workers] == ["cuda"]
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, path="inline")
        for _ in range(3):  # the pinned ring and output pool reused
            direct, _ = c.grouped_gemm(lhs, rhs, sizes, path="direct")
            assert direct.dtype == inline.dtype and direct.shape == inline.shape
            assert direct.tobytes() == inline.tobytes()
    assert staged_bytes(cuda_cluster) == [0]


def test_outputs_past_the_pinned_pool_are_still_right(cuda_cluster):
    """64 MiB of pinned outputs (--staging_pinned_mb): a 96 MiB output is held in pageable memory."""
    m, k, n = 8192, 256, 6144
    lhs, rhs, sizes = bf16(m, k), bf16(1, k, n), np.array([m], np.int64)
    with shardgemm.Client(cuda_cluster.address, timeout=120) as c:
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, path="inline")
        direct, _ = c.grouped_gemm(lhs, rhs, sizes, path="direct")
        assert direct.tobytes() == inline.tobytes()
    assert staged_bytes(cuda_cluster) == [0]


def test_f32_operands_and_a_direct_put_stay_on_the_host_and_equal_inline(cuda_cluster):
    lhs = rng.uniform(-1, 1, size=(128, 64)).astype(np.float32)
    rhs = rng.uniform(-1, 1, size=(2, 64, 32)).astype(np.float32)
    w = bf16(2, 64, 32)
    sizes = np.array([100, 28], np.int64)
    with shardgemm.Client(cuda_cluster.address, timeout=120) as c:
        inline, _ = c.grouped_gemm(lhs, rhs, sizes, path="inline")
        direct, _ = c.grouped_gemm(lhs, rhs, sizes, path="direct")
        assert direct.tobytes() == inline.tobytes()
        c.put("w_direct_gpu", w, path="direct", overwrite=True)
        assert c.get("w_direct_gpu").tobytes() == w.tobytes()
        x = bf16(128, 64)
        via_put, _ = c.grouped_gemm(x, "w_direct_gpu", sizes, path="direct")
        want, _ = c.grouped_gemm(x, w, sizes, path="inline")
        assert via_put.tobytes() == want.tobytes()
    assert staged_bytes(cuda_cluster) == [0]
