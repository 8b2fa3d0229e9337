"""The worker's test-only --fault_injection flag: refused when malformed or
on a backend it cannot fault, off by default. The faults themselves are CUDA
and NCCL errors: tools/gpu/run_fault_probe.sh makes them on the H200."""
import os
import subprocess

import numpy as np

from conftest import BIN

WORKER = os.path.join(BIN, "shardgemm-worker")


def run_worker(*flags):
    # Both refusals come before the worker looks for its coordinator (none runs here).
    return subprocess.run([WORKER, "--coordinator=127.0.0.1:1", "--insecure", "--register_timeout_s=1", *flags],
                          capture_output=True, text=True, timeout=30)


def test_malformed_values_are_refused_naming_the_flag():
    cases = {
        "bogus:1": "--fault_injection: 'bogus:1': unknown fault 'bogus' (kernel_launch, illegal_address or nccl)",
        "nccl:0": "--fault_injection: 'nccl:0': N must be a positive integer",
        "kernel_launch": "--fault_injection: 'kernel_launch': expected KIND:N",
        "nccl:1,nccl:3": "--fault_injection: 'nccl:3': 'nccl' is given twice",
    }
    for value, message in cases.items():
        p = run_worker("--backend=cpu", f"--fault_injection={value}")
        assert p.returncode == 2, (value, p.stderr)
        assert message in p.stderr, (value, p.stderr)


def test_faults_need_the_cuda_backend():
    p = run_worker("--backend=cpu", "--fault_injection=kernel_launch:2,nccl:1")
    assert p.returncode == 2, p.stderr
    assert "--fault_injection needs the CUDA backend" in p.stderr, p.stderr
    assert "runs the cpu backend" in p.stderr, p.stderr


def test_empty_value_is_off(cluster_factory):
    c = cluster_factory(worker_flags=["--fault_injection="])
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((6, 4)).astype(np.float32)
    rhs = rng.standard_normal((2, 4, 3)).astype(np.float32)
    out, _ = c.client.grouped_gemm(lhs, rhs, [2, 4])
    np.testing.assert_allclose(out[:2], lhs[:2] @ rhs[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[2:], lhs[2:] @ rhs[1], rtol=1e-5, atol=1e-5)
    assert "fault_injection" not in c.log_text()
