"""Message limits are flags on both sides (--max_message_mb on the
coordinator and on the command-line client): an inline request or response
over the limit is refused with RESOURCE_EXHAUSTED, chunked puts and gets of
larger tensors still pass, and nothing held is lost."""
import os
import subprocess

import grpc
import numpy as np
import pytest

from conftest import BIN
from reference import assert_close

rng = np.random.default_rng(23)


def test_coordinator_refuses_an_inline_request_over_its_limit_and_keeps_serving(cluster_factory):
    c = cluster_factory(coordinator_flags=["--max_message_mb=1"])
    weights = rng.standard_normal((4, 512, 256)).astype(np.float32)  # 2 MiB: over the limit inline
    c.client.put("w", weights)  # streamed in chunks
    lhs = rng.standard_normal((1024, 512)).astype(np.float32)  # 2 MiB inline
    with pytest.raises(grpc.RpcError) as e:
        c.client.grouped_gemm(lhs, "w", [256] * 4)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    small = lhs[:128]
    out, _ = c.client.grouped_gemm(small, "w", [32] * 4)
    want = np.concatenate([small[g * 32:(g + 1) * 32] @ weights[g] for g in range(4)])
    assert_close(out, want, 512)
    np.testing.assert_array_equal(c.client.get("w"), weights)  # streamed back in chunks


def _cli(cluster, *args):
    return subprocess.run([os.path.join(BIN, "shardgemm"), *args, *cluster.cli_flags()], capture_output=True,
                          text=True, timeout=120)


def test_cli_limit_refuses_a_large_response_and_checks_its_range(cluster_factory):
    c = cluster_factory()
    # A 1024x512 F32 output: 2 MiB, over a 1 MiB client limit.
    gemm = ["gemm", "--lhs=1024x64", "--rhs=4x64x512", "--dtype=f32", "--groups=4"]
    r = _cli(c, *gemm, "--max_message_mb=1")
    assert r.returncode != 0
    assert "RESOURCE_EXHAUSTED" in r.stderr or "larger than max" in r.stderr, r.stderr
    r = _cli(c, *gemm, "--check")
    assert r.returncode == 0, r.stderr
    assert "result matches reference" in r.stdout
    r = _cli(c, "cluster", "--max_message_mb=0")
    assert r.returncode == 2 and "--max_message_mb=0: a message limit is 1 to 2047 MiB" in r.stderr, r.stderr


def test_coordinator_refuses_a_limit_out_of_range():
    r = subprocess.run([os.path.join(BIN, "shardgemm-coordinator"), "--insecure", "--max_message_mb=4096"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "--max_message_mb=4096: a message limit is 1 to 2047 MiB" in r.stderr, r.stderr
