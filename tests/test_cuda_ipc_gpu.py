"""CUDA IPC regions end to end on a GPU: torch CUDA tensors as grouped_gemm
operands and out= for CUDA workers (coordinator --shared_memory), checked
against torch's own BF16 result. Skipped without torch and a CUDA device.

The servers come from SERVER_BIN (default: this worktree's ./bin), e.g. on
the H200 with the bundle:
    LD_LIBRARY_PATH=.gpu_bundle/svc/lib SERVER_BIN=.gpu_bundle/svc/bin \\
        python3 -m pytest -q tests/test_cuda_ipc_gpu.py
The two-worker cases (column-sliced blocks) need two CUDA devices."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import shardgemm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_BIN = os.environ.get("SERVER_BIN", os.path.join(ROOT, "bin"))
G, K, N = 4, 256, 128
SIZES = [64, 0, 100, 92]  # M = 256; an empty group included
M = sum(SIZES)


def _cuda_cluster(cluster_factory, mesh="dp=1", workers=1):
    return cluster_factory(mesh=mesh, workers=workers, backend="cuda", bin_dir=SERVER_BIN,
                           coordinator_flags=["--shared_memory"],
                           per_worker_flags=[[f"--device={i}"] for i in range(workers)])


def _torch_grouped(lhs, rhs, sizes):
    """torch's own BF16 grouped GEMM: out[rows of g] = lhs[rows of g] @ rhs[g]."""
    out, row = [], 0
    for g, n in enumerate(sizes):
        out.append(lhs[row:row + n] @ rhs[g])
        row += n
    return torch.cat(out)


def _assert_bf16_close(got, want):
    # BF16 keeps 8 bits: a K=256 dot product of unit normals (|x| ~ 16) rounds by up to ~0.06.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1.5e-1)


def _weights():
    gen = torch.Generator().manual_seed(11)
    return (torch.randn(G, K, N, generator=gen) / 4).to(torch.bfloat16)


def test_torch_cuda_lhs_at_an_offset_and_cuda_output_match_torch(cluster_factory):
    c = _cuda_cluster(cluster_factory)
    rhs = _weights()
    with shardgemm.Client(c.address, timeout=60) as client:
        info = client.cluster_info()
        assert [w.backend for w in info.workers] == ["cuda"], info
        client.put("w", rhs)
        rhs_dev = rhs.cuda()
        # lhs: rows 37.. of a bigger tensor (a nonzero offset in its allocation), written on a side stream
        # right before the call: the client's device synchronization must make the write land first.
        big = torch.zeros(M + 37, K, device="cuda", dtype=torch.bfloat16)
        lhs = big[37:]
        assert lhs.is_contiguous() and lhs.data_ptr() != big.data_ptr()
        src = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keeps the side stream busy so an unsynchronized read sees zeros
            lhs.copy_(src)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got, _ = client.grouped_gemm(lhs, "w", SIZES, out=out)
        assert got is out
        want = _torch_grouped(src, rhs_dev, SIZES)
        assert not torch.isnan(out).any()
        _assert_bf16_close(out, want)

        # Weights as a CUDA operand too, and an output at an offset of a bigger tensor.
        big_out = torch.full((M + 5, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got, _ = client.grouped_gemm(lhs, rhs_dev, SIZES, out=big_out[5:])
        _assert_bf16_close(got, want)
        assert torch.isnan(big_out[:5]).all()  # nothing written before the output's offset

        # Registered once, then named: the region is lhs's whole allocation.
        with shardgemm.CudaMemoryRegion(client, big) as region:
            assert region.byte_size >= big.numel() * 2 and region.tensor(lhs).offset == region.offset + 37 * K * 2
            out2 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            got, _ = client.grouped_gemm(region.tensor(lhs), "w", SIZES, out=out2)
            _assert_bf16_close(got, want)

        # Without out=: a CUDA lhs, the output back in the response.
        host, _ = client.grouped_gemm(lhs, "w", SIZES, output="torch")
        _assert_bf16_close(host.cuda(), want)

        with pytest.raises(ValueError, match="lhs: a non-contiguous CUDA array"):
            client.grouped_gemm(big.t(), "w", SIZES)
        with pytest.raises(ValueError, match="out_dtype"):
            client.grouped_gemm(lhs, "w", SIZES, out=torch.empty(M, N, device="cuda"), out_dtype=np.float16)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two CUDA workers need two CUDA devices")
@pytest.mark.parametrize("name,lhs_spec,rhs_spec", [
    ("out_column_blocks", "", "(None, None, tp)"),     # each worker writes its columns of out (strided)
    ("lhs_column_blocks", "(None, tp)", "(None, tp, None)"),  # each worker reads its columns of lhs (strided)
])
def test_column_sliced_blocks_of_cuda_tensors_match_torch(cluster_factory, name, lhs_spec, rhs_spec):
    c = _cuda_cluster(cluster_factory, mesh="tp=2", workers=2)
    rhs = _weights()
    with shardgemm.Client(c.address, timeout=60) as client:
        client.put("w", rhs, spec=rhs_spec)
        lhs = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got, _ = client.grouped_gemm(lhs, "w", SIZES, out=out, lhs_spec=lhs_spec)
        assert got is out and not torch.isnan(out).any()
        _assert_bf16_close(out, _torch_grouped(lhs, rhs.cuda(), SIZES))
