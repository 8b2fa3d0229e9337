"""FP8 grouped GEMM through the service (CPU workers, Gloo): FP8 operands with
their scales (inline and resident), quantized resident weights, the fused
quantize + GEMM, sharded, against a NumPy reference of the op (dequantize,
accumulate), and the requests it must refuse."""
import grpc
import ml_dtypes
import numpy as np
import pytest

from reference import assert_close
from shardgemm_client import pb
from test_sharded import per_shard_reference, uneven_sizes

rng = np.random.default_rng(23)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def rand(*shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def cast(v, fmt):
    """FP8 bytes of v (already scaled into range), saturating."""
    return np.clip(np.asarray(v, np.float32), -FP8_MAX[fmt], FP8_MAX[fmt]).astype(fmt)


def scale_of(amax, fmt):
    """scale = fp8_max / amax (1 for amax 0), as the kernels compute it."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(divide="ignore"):
        scale = np.where(amax > 0, np.float32(FP8_MAX[fmt]) / amax, np.float32(1)).astype(np.float32)
    return np.minimum(scale, np.finfo(np.float32).max).astype(np.float32)


def quantize_rows_by_entry(x, sizes, shards, fmt=E4M3):
    """Per-group tensor scaling of lhs rows, one scale per group_sizes entry
    (each row shard its own ragged array): (data, scale_inv, per-row scale_inv)."""
    rows = x.shape[0] // shards
    per_shard = len(sizes) // shards
    row_scale = np.zeros(x.shape[0], np.float32)  # 0: padding rows
    scale_inv = np.ones(len(sizes), np.float32)
    data = np.zeros(x.shape, fmt)
    for s in range(shards):
        row = s * rows
        for j in range(per_shard):
            i = s * per_shard + j
            block = x[row:row + sizes[i]]
            scale = scale_of(np.abs(block).max(initial=0), fmt)
            scale_inv[i] = np.float32(1) / scale
            data[row:row + sizes[i]] = cast(block * scale, fmt)
            row_scale[row:row + sizes[i]] = scale_inv[i]
            row += sizes[i]
    return data, scale_inv, row_scale


def quantize_experts(w, fmt=E4M3):
    """One scale per expert (dim 0)."""
    scale = scale_of(np.abs(w).max(axis=(1, 2)), fmt)
    return cast(w * scale[:, None, None], fmt), (np.float32(1) / scale).astype(np.float32)


def expand_blocks(scales, block):
    for d, b in enumerate(block):
        scales = np.repeat(scales, b, axis=d)
    return scales


def quantize_blocks(x, block, fmt=E4M3):
    """Block scales over x, `block` a tuple per dim (1 = no blocking):
    (data, scale_inv of shape dims / block)."""
    sshape = tuple(d // b for d, b in zip(x.shape, block))
    view = x.reshape(sum(((s, b) for s, b in zip(sshape, block)), ()))
    amax = np.abs(view).max(axis=tuple(range(1, 2 * x.ndim, 2))).reshape(sshape)
    scale = scale_of(amax, fmt)
    return cast(x * expand_blocks(scale, block), fmt), (np.float32(1) / scale).astype(np.float32)


def deq(data, scale):
    return data.astype(np.float32) * np.asarray(scale, np.float32)


def fp8_error(got, exact):
    """Relative Frobenius error against the unquantized product."""
    return float(np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact))


# (name, mesh, workers, lhs_spec, rhs_spec, gs_spec, lhs_scale_spec, rhs_scale_spec, out_spec, shards, gps)
TENSOR_CASES = [
    ("one_worker", "dp=1", 1, "", "", "", "", "", "", 1, 4),
    ("dp", "dp=2", 2, "(dp, None)", "", "(dp,)", "(dp,)", "", "", 2, 4),
    ("fsdp_gathers_fp8_weights", "fsdp=2", 2, "(fsdp, None)", "(None, fsdp, None)", "(fsdp,)", "(fsdp,)", "", "",
     2, 4),
    ("ep", "ep=2", 2, "(ep, None)", "(ep, None, None)", "(ep,)", "(ep,)", "(ep,)", "", 2, 2),
    ("tp_row_allreduce", "tp=2", 2, "(None, tp)", "(None, None, tp)", "", "", "", "", 1, 4),
    ("tp_column", "tp=2", 2, "", "(None, tp, None)", "", "", "", "", 1, 4),
    ("tp_row_reduce_scatter", "tp=2", 2, "(None, tp)", "(None, None, tp)", "", "", "", "(None, tp)", 1, 4),
]


@pytest.mark.parametrize("case", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_tensor_scaled_fp8_gemm_sharded_equals_reference(cluster_factory, case):
    name, mesh, workers, lhs_spec, rhs_spec, gs_spec, ls_spec, rs_spec, out_spec, shards, gps = case
    c = cluster_factory(mesh=mesh, workers=workers).client
    m, k, n, g = 64, 64, 32, 4
    sizes = uneven_sizes(shards, gps, m // shards)
    x, w = rand(m, k), rand(g, n, k)  # rhs transposed: [G, N, K], as Hopper's FP8 GEMM takes it
    x8, xs, row_scale = quantize_rows_by_entry(x, sizes, shards)
    w8, ws = quantize_experts(w)
    out, plan = c.grouped_gemm(x8, w8, sizes, rhs_transposed=True, lhs_spec=lhs_spec, rhs_spec=rhs_spec,
                               group_sizes_spec=gs_spec, lhs_scale_inv=xs, rhs_scale_inv=ws,
                               lhs_scale_spec=ls_spec, rhs_scale_spec=rs_spec, out_spec=out_spec,
                               out_dtype=np.float32, include_plan=True)
    ref = per_shard_reference(deq(x8, row_scale[:, None]), deq(w8, ws[:, None, None]), sizes, plan,
                              rhs_transposed=True)
    assert out.dtype == np.float32
    assert_close(out, ref, k)
    exact = per_shard_reference(x, w, sizes, plan, rhs_transposed=True)
    assert fp8_error(out, exact) < 0.08, "FP8 E4M3 x E4M3 within a few percent of the exact product"
    kinds = [c.kind for c in plan.collectives]
    names = [c.tensor for c in plan.collectives]
    if name == "fsdp_gathers_fp8_weights":
        assert 1 in kinds  # COLLECTIVE_ALL_GATHER of the FP8 weights
    if name == "ep":
        assert [w.first_group for w in plan.workers] == [0, 2]
    if name == "tp_row_reduce_scatter":
        assert plan.out_spec.replace(" ", "") == "(None,tp)"
    del names


def test_block_scaled_fp8_gemm_tp_row_and_ep(cluster_factory):
    """1x128 activations x 128x128 weights: a K split over tp keeps whole
    blocks (the weight scales are sliced with K), EP slices expert scales,
    FSDP gathers the weights' K shards with their scales' shards."""
    m, k, n, g = 64, 256, 128, 2
    x, w = rand(m, k), rand(g, k, n)  # [G, K, N]
    x8, xs = quantize_blocks(x, (1, 128))
    w8, ws = quantize_blocks(w, (1, 128, 128))
    xd, wd = deq(x8, expand_blocks(xs, (1, 128))), deq(w8, expand_blocks(ws, (1, 128, 128)))
    # fsdp: the K-sharded FP8 weights are gathered with their 128x128 scales.
    for mesh, lhs_spec, rhs_spec, gs_spec, shards in [("tp=2", "(None, tp)", "(None, tp, None)", "", 1),
                                                       ("ep=2", "(ep, None)", "(ep, None, None)", "(ep,)", 2),
                                                       ("fsdp=2", "(fsdp, None)", "(None, fsdp, None)", "(fsdp,)", 2)]:
        c = cluster_factory(mesh=mesh, workers=2).client
        sizes = uneven_sizes(shards, g // shards if mesh == "ep=2" else g, m // shards)
        out, plan = c.grouped_gemm(x8, w8, sizes, lhs_spec=lhs_spec, rhs_spec=rhs_spec, group_sizes_spec=gs_spec,
                                   lhs_scale_inv=xs, rhs_scale_inv=ws, lhs_scale_spec=lhs_spec,
                                   rhs_scale_spec=rhs_spec, scaling="block", out_dtype=np.float32,
                                   include_plan=True)
        assert_close(out, per_shard_reference(xd, wd, sizes, plan), k)
        assert fp8_error(out, per_shard_reference(x, w, sizes, plan)) < 0.08
        if mesh == "fsdp=2":
            gathered = {c.tensor for c in plan.collectives if c.kind == pb.COLLECTIVE_ALL_GATHER}
            assert gathered == {pb.TENSOR_RHS, pb.TENSOR_RHS_SCALE_INV}, plan.collectives


def test_wgrad_fp8_reduce_scattered_onto_fsdp(cluster_factory):
    """Ragged K (wgrad) from FP8 activations and E5M2 gradients, per-group
    scales, partial sums reduce-scattered onto fsdp."""
    c = cluster_factory(mesh="fsdp=2", workers=2).client
    m, k, n, g = 64, 32, 16, 4
    sizes = uneven_sizes(2, g, m // 2)
    x, dy = rand(m, k), rand(m, n)
    x8, xs, xrow = quantize_rows_by_entry(x, sizes, 2)
    dy8, dys, dyrow = quantize_rows_by_entry(dy, sizes, 2, fmt=E5M2)
    out, plan = c.grouped_gemm(x8, dy8, sizes, ragged_k=True, lhs_spec="(fsdp, None)", rhs_spec="(fsdp, None)",
                               group_sizes_spec="(fsdp,)", lhs_scale_inv=xs, rhs_scale_inv=dys,
                               lhs_scale_spec="(fsdp,)", rhs_scale_spec="(fsdp,)", out_spec="(None, fsdp, None)",
                               out_dtype=np.float32, include_plan=True)
    ref = per_shard_reference(deq(x8, xrow[:, None]), deq(dy8, dyrow[:, None]), sizes, plan, ragged_k=True)
    assert_close(out, ref, m)
    assert any(cc.kind == 4 for cc in plan.collectives)  # COLLECTIVE_REDUCE_SCATTER


def test_quantized_resident_weights_and_fused_quantize_gemm(cluster_factory):
    """BF16 weights put once and quantized on the workers (kept FP8 with
    their scales); the forward then quantizes lhs in the step. It equals
    quantize-then-GEMM by the client bit for bit, and the kept pair reads
    back as the quantize returns it."""
    cl = cluster_factory(mesh="ep=2", workers=2)
    c = cl.client
    m, k, n, g = 64, 64, 32, 4
    w = rand(g, n, k).astype(ml_dtypes.bfloat16)
    c.put("w", w, spec="(ep, None, None)")
    wsizes = [n] * g
    resp = c.grouped_quantize("w", wsizes, group_sizes_spec="(ep,)", flatten_axis=2,
                              keep_rowwise_data_as="w8", keep_scale_inv_as="w8_scale")
    assert resp.rowwise_data.resident == "w8" and resp.scale_inv.resident == "w8_scale"
    assert resp.rowwise_data.spec.replace(" ", "") == "(ep,None,None)"
    listed = {t.name: t for t in c.list()}
    assert list(listed["w8"].shape) == [g, n, k] and list(listed["w8_scale"].shape) == [g]
    returned = c.grouped_quantize("w", wsizes, group_sizes_spec="(ep,)", flatten_axis=2)
    from shardgemm_client import from_tensor
    assert np.array_equal(c.get("w8").view(np.uint8), from_tensor(returned.rowwise_data).view(np.uint8))
    assert np.array_equal(c.get("w8_scale"), from_tensor(returned.scale_inv))

    sizes = uneven_sizes(2, 2, m // 2)
    x = rand(m, k).astype(ml_dtypes.bfloat16)
    fused, plan = c.grouped_gemm(x, "w8", sizes, rhs_transposed=True, lhs_spec="(ep, None)",
                                 group_sizes_spec="(ep,)", rhs_scale_inv="w8_scale", quantize_lhs=E4M3,
                                 include_plan=True)
    assert fused.dtype == ml_dtypes.bfloat16
    q = c.grouped_quantize(x, sizes, x_spec="(ep, None)", group_sizes_spec="(ep,)")
    two_step, _ = c.grouped_gemm(from_tensor(q.rowwise_data), "w8", sizes, rhs_transposed=True,
                                 lhs_spec="(ep, None)", group_sizes_spec="(ep,)",
                                 lhs_scale_inv=from_tensor(q.scale_inv), lhs_scale_spec="(ep,)",
                                 rhs_scale_inv="w8_scale")
    assert np.array_equal(fused.view(np.uint16), two_step.view(np.uint16))
    exact = per_shard_reference(x.astype(np.float32), w.astype(np.float32), sizes, plan, rhs_transposed=True)
    assert fp8_error(fused, exact) < 0.08


def test_block_scaled_weights_kept_and_fused_forward(cluster_factory):
    """128x128 weight scales kept in the GEMM's [G, N/128, K/128] layout and
    the 1x128 fused quantize of lhs, against the reference."""
    c = cluster_factory(mesh="dp=1", workers=1).client
    m, k, n, g = 48, 256, 128, 2
    w = rand(g, n, k)
    c.put("w", w)
    c.grouped_quantize("w", [n] * g, flatten_axis=2, scaling="block", block_2d=True,
                       keep_rowwise_data_as="w8", keep_scale_inv_as="w8_scale")
    ws = c.get("w8_scale")
    assert ws.shape == (g, n // 128, k // 128)
    w8, ws_ref = quantize_blocks(w, (1, 128, 128))
    assert np.array_equal(c.get("w8").view(np.uint8), w8.view(np.uint8))
    np.testing.assert_array_equal(ws, ws_ref)
    x = rand(m, k)
    sizes = [20, 28]
    out, plan = c.grouped_gemm(x, "w8", sizes, rhs_transposed=True, rhs_scale_inv="w8_scale", scaling="block",
                               quantize_lhs=E4M3, out_dtype=np.float32, include_plan=True)
    x8, xs = quantize_blocks(x, (1, 128))
    ref = per_shard_reference(deq(x8, expand_blocks(xs, (1, 128))), deq(w8, expand_blocks(ws_ref, (1, 128, 128))),
                              sizes, plan, rhs_transposed=True)
    assert_close(out, ref, k)


def expect_error(fn, code, *words):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    for w in words:
        assert w in e.value.details(), e.value.details()


def test_bad_fp8_requests_are_refused_and_nothing_resident_is_lost(cluster_factory):
    c = cluster_factory(mesh="dp=1", workers=1).client
    m, k, n, g = 32, 64, 16, 2
    sizes = [10, 22]
    x8, xs, _ = quantize_rows_by_entry(rand(m, k), sizes, 1)
    w8, ws = quantize_experts(rand(g, n, k))
    c.put("w8", w8)
    c.put("w8_scale", ws)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    gemm = c.grouped_gemm
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True), invalid, "lhs_scale_inv")
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xs), invalid, "rhs_scale_inv")
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xs[:1], rhs_scale_inv="w8_scale"),
                 invalid, "lhs_scale_inv", "shape")
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xs.astype(np.float16),
                              rhs_scale_inv="w8_scale"), invalid, "lhs_scale_inv")
    expect_error(lambda: gemm(x8.astype(np.float32).astype(E5M2), cast(w8.astype(np.float32), E5M2), sizes,
                              rhs_transposed=True, lhs_scale_inv=xs, rhs_scale_inv=ws), invalid, "rhs:", "e5m2")
    expect_error(lambda: gemm(rand(m, k), "w8", sizes, rhs_transposed=True, rhs_scale_inv="w8_scale"), invalid,
                 "FP8")
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xs, rhs_scale_inv="w8_scale",
                              scaling="block"), invalid, "lhs dim 1", "128")
    expect_error(lambda: gemm(rand(m, k), rand(g, n, k), sizes, rhs_transposed=True, lhs_scale_inv=xs,
                              rhs_scale_inv=ws), invalid, "not FP8")
    expect_error(lambda: gemm(rand(m, k), "w8", sizes, rhs_transposed=True, rhs_scale_inv="w8_scale",
                              quantize_lhs=E4M3, scaling="mxfp8"), invalid, "quantize_lhs")
    # Scales whose dtype is not the scaling mode's: E8M0 belongs to MXFP8, F32 to the others.
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, rhs_scale_inv="w8_scale",
                              lhs_scale_inv=np.full(xs.shape, 127, np.uint8).view(e8m0)),
                 invalid, "lhs_scale_inv", "e8m0")
    xe = np.full((m, k // 32), 127, np.uint8).view(e8m0)
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xe,
                              rhs_scale_inv=np.ones((g, n, k // 32), np.float32), scaling="mxfp8"),
                 invalid, "rhs_scale_inv", "f32")
    expect_error(lambda: gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=np.ones((m, k // 32), np.float32),
                              rhs_scale_inv=np.full((g, n, k // 32), 127, np.uint8).view(e8m0), scaling="mxfp8"),
                 invalid, "lhs_scale_inv", "f32")
    # Nothing resident lost: the weights still serve a good request.
    assert {t.name for t in c.list()} == {"w8", "w8_scale"}
    out, _ = gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xs, rhs_scale_inv="w8_scale")
    assert out.shape == (m, n) and np.isfinite(out.astype(np.float32)).all()


def test_mxfp8_runs_on_cpu_workers(cluster_factory):
    """MXFP8 (E8M0 scales, 32-blocks) is a CPU-worker reference; Hopper
    workers refuse it (UNIMPLEMENTED, checked before dispatch)."""
    c = cluster_factory(mesh="dp=1", workers=1).client
    m, k, n, g = 32, 64, 16, 2
    sizes = [12, 20]
    x, w = rand(m, k), rand(g, n, k)
    xe = rng.integers(120, 130, size=(m, k // 32)).astype(np.uint8)
    we = rng.integers(120, 130, size=(g, n, k // 32)).astype(np.uint8)
    x8, w8 = cast(x * 4, E4M3), cast(w * 4, E4M3)
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
    out, plan = c.grouped_gemm(x8, w8, sizes, rhs_transposed=True, lhs_scale_inv=xe.view(e8m0),
                               rhs_scale_inv=we.view(e8m0), scaling="mxfp8", out_dtype=np.float32,
                               include_plan=True)
    xs = np.exp2(xe.astype(np.float64) - 127)
    ws = np.exp2(we.astype(np.float64) - 127)
    ref = per_shard_reference(x8.astype(np.float64) * np.repeat(xs, 32, axis=1),
                              w8.astype(np.float64) * np.repeat(ws, 32, axis=2), sizes, plan, rhs_transposed=True)
    assert_close(out, ref, k)


def test_mxfp8_kept_weight_scales_are_a_gemm_rhs_operand(cluster_factory):
    """The kept pair is a GEMM operand as it stands: MXFP8 weights
    [G, N, K] keep their scales as [G, N, K/32], the transposed rhs layout."""
    c = cluster_factory(mesh="dp=1", workers=1).client
    m, k, n, g = 32, 64, 16, 2
    w = rand(g, n, k)
    c.put("w", w)
    c.grouped_quantize("w", [n] * g, flatten_axis=2, scaling="mxfp8",
                       keep_rowwise_data_as="w8", keep_scale_inv_as="w8_scale")
    listed = {t.name: list(t.shape) for t in c.list()}
    assert listed["w8"] == [g, n, k]
    # The shape the GEMM takes for an MXFP8 rhs_transposed operand.
    assert listed["w8_scale"] == [g, n, k // 32], listed
    sizes = [12, 20]
    xe = np.full((m, k // 32), 127, np.uint8).view(np.dtype(ml_dtypes.float8_e8m0fnu))
    x8 = cast(rand(m, k), E4M3)
    out, _ = c.grouped_gemm(x8, "w8", sizes, rhs_transposed=True, lhs_scale_inv=xe, rhs_scale_inv="w8_scale",
                            scaling="mxfp8", out_dtype=np.float32)
    assert out.shape == (m, n)


def test_block_kept_weights_ep_sharded_fused_forward(cluster_factory):
    """128x128 weight scales kept over ep=2 and the fused 1x128 forward."""
    c = cluster_factory(mesh="ep=2", workers=2).client
    m, k, n, g = 64, 256, 128, 4
    w = rand(g, n, k)
    c.put("w", w, spec="(ep, None, None)")
    c.grouped_quantize("w", [n] * g, group_sizes_spec="(ep,)", flatten_axis=2, scaling="block", block_2d=True,
                       keep_rowwise_data_as="w8", keep_scale_inv_as="w8_scale")
    w8, ws = quantize_blocks(w, (1, 128, 128))
    np.testing.assert_array_equal(c.get("w8_scale"), ws)
    x = rand(m, k)
    sizes = uneven_sizes(2, 2, m // 2)
    out, plan = c.grouped_gemm(x, "w8", sizes, rhs_transposed=True, lhs_spec="(ep, None)", group_sizes_spec="(ep,)",
                               rhs_scale_inv="w8_scale", scaling="block", quantize_lhs=E4M3, out_dtype=np.float32,
                               include_plan=True)
    x8, xs = quantize_blocks(x, (1, 128))
    ref = per_shard_reference(deq(x8, expand_blocks(xs, (1, 128))), deq(w8, expand_blocks(ws, (1, 128, 128))),
                              sizes, plan, rhs_transposed=True)
    assert_close(out, ref, k)


def test_cli_quantizes_weights_once_and_runs_the_fused_fp8_gemm(cluster_factory):
    """The README's FP8 lines: put BF16 weights, keep their FP8 form and
    scales, run the fused forward; its result equals the Python client's."""
    import os
    import subprocess
    from conftest import BIN
    cl = cluster_factory(mesh="ep=2", workers=2)

    def cli(*args):
        r = subprocess.run([os.path.join(BIN, "shardgemm"), *args, *cl.cli_flags(), "--show_plan=false"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    w = rand(8, 128, 256).astype(ml_dtypes.bfloat16)
    cl.client.put("w", w, spec="(ep, None, None)")
    out = cli("quantize", "--x=resident:w", "--group-sizes=" + ",".join(["128"] * 8) + "@(ep,)",
              "--flatten_axis=2", "--keep_data_as=w8", "--keep_scale_as=w8_scale")
    assert "kept 'w8': 8x128x256 f8e4m3 @(ep, None, None)" in out and "kept 'w8_scale': 8 f32 @(ep,)" in out
    x = rand(1024, 256).astype(ml_dtypes.bfloat16)
    cl.client.put("x", x, spec="(ep, None)")
    sizes = [100, 0, 60, 96, 30, 30, 30, 30]
    cli("gemm", "--lhs=resident:x", "--rhs=resident:w8", "--rhs_transposed", "--rhs_scale_inv=resident:w8_scale",
        "--quantize_lhs=e4m3", "--group-sizes=" + ",".join(map(str, sizes)) + "@(ep,)", "--keep_as=y")
    want, _ = cl.client.grouped_gemm("x", "w8", sizes, rhs_transposed=True, group_sizes_spec="(ep,)",
                                     rhs_scale_inv="w8_scale", quantize_lhs=E4M3)
    assert np.array_equal(cl.client.get("y").view(np.uint16), want.view(np.uint16))
