"""NumPy references for the grouped ops under the per-shard semantics."""
import numpy as np


def grouped_gemm_ragged_m(lhs, rhs, group_sizes, bias=None, rhs_transposed=False):
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if rhs_transposed:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    row = 0
    for g, size in enumerate(group_sizes):
        out[row:row + size] = lhs[row:row + size] @ rhs[g]
        if bias is not None:
            out[row:row + size] += np.asarray(bias, np.float64)[g]
        row += size
    return out


def grouped_gemm_ragged_k(lhs, rhs, group_sizes):
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    out = np.zeros((len(group_sizes), lhs.shape[1], rhs.shape[1]))
    row = 0
    for g, size in enumerate(group_sizes):
        out[g] = lhs[row:row + size].T @ rhs[row:row + size]
        row += size
    return out


def tolerance(out_dtype, contracting, ref):
    """One rounding of the output dtype plus FP32 accumulation error."""
    eps = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[np.dtype(out_dtype).name]
    return (eps + 2 * contracting * 2.0 ** -24) * max(1.0, float(np.abs(ref).max(initial=0)))


def assert_close(got, ref, contracting):
    tol = tolerance(got.dtype, contracting, ref)
    err = float(np.abs(np.asarray(got, np.float64) - ref).max(initial=0))
    assert err <= tol, f"max error {err} > tolerance {tol}"
    return err


# --- grouped quantize with block scales (docs/quantization.md), in NumPy ---
# An independent statement of the kernels' MXFP8 (OCP MX v1.0 §6.3) and FP8
# block-scaling definitions and padded scale layouts, to check the service's
# bytes against.

def _fp8(fmt):
    import ml_dtypes
    return {"e4m3": (ml_dtypes.float8_e4m3fn, np.float32(448.0), 8),
            "e5m2": (ml_dtypes.float8_e5m2, np.float32(57344.0), 15)}[fmt]


def _round_up(a, b):
    return -(-a // b) * b


def _cast(v, fmt):
    """Saturating round-to-nearest-even cast of float32 values to FP8 bytes."""
    dtype, fmax, _ = _fp8(fmt)
    return np.clip(np.asarray(v, np.float32), -fmax, fmax).astype(dtype).view(np.uint8)


def _mx_block(v, fmt):
    """One MXFP8 block: (E8M0 code, FP8 bytes). shared_exp = floor(log2 amax) - emax."""
    amax = np.float32(np.abs(v).max(initial=0))
    if amax == 0:
        return 0, _cast(v, fmt)
    e = int(np.frexp(amax)[1]) - 1 - _fp8(fmt)[2]
    e = max(-127, min(127, e))
    return e + 127, _cast(np.ldexp(v.astype(np.float64), -e).astype(np.float32), fmt)


def _fp32_block(v, fmt):
    """One FP32-scaled block: (scale_inv, FP8 bytes); scale = fp8_max / amax."""
    fmax = _fp8(fmt)[1]
    amax = np.float32(np.abs(v).max(initial=0))
    with np.errstate(over="ignore"):
        scale = fmax / amax if amax > 0 else np.float32(1)
    if np.isinf(scale):
        scale = np.finfo(np.float32).max
    scale = np.float32(scale)
    return np.float32(1) / scale, _cast(v * scale, fmt)


def quantize_current(x, sizes, fmt):
    """Current per-group scaling of x [M, K] rows grouped by `sizes`: amax ->
    scale = fp8_max / amax (1 for amax 0), saturating RNE cast. Returns
    (data [M, K] uint8, scale_inv [G] float32, amax [G] float32)."""
    x = np.asarray(x, np.float32)
    data = np.zeros(x.shape, np.uint8)
    scale_inv, amax = [], []
    row = 0
    for s in sizes:
        g = x[row:row + s]
        si, data[row:row + s] = _fp32_block(g, fmt)
        scale_inv.append(si)
        amax.append(np.float32(np.abs(g).max(initial=0)))
        row += s
    return data, np.array(scale_inv, np.float32), np.array(amax, np.float32)


def quantize_blocks(x, sizes, mode, fmt, rowwise=True, colwise=False):
    """Grouped quantize of x [M, K] (any float dtype, as float32) with mode
    'mxfp8', 'block' (1x128) or 'block2d' (128x128). Returns a dict with
    data, colwise_data ([M, K] uint8) and scale_inv, colwise_scale_inv (flat,
    the kernels' padded per-group layout; uint8 E8M0 or float32)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    sdt = np.uint8 if mode == "mxfp8" else np.float32
    out = {"data": np.zeros((m, k), np.uint8), "colwise_data": np.zeros((m, k), np.uint8)}
    row_scales, col_scales = [], []
    off = 0
    for mg in sizes:
        g = x[off:off + mg]
        if mode == "mxfp8":
            rs = np.zeros((_round_up(mg, 128), _round_up(k // 32, 4)), sdt)
            cs = np.zeros((_round_up(-(-mg // 32), 4), _round_up(k, 128)), sdt)
            for r in range(mg):
                for b in range(k // 32):
                    rs[r, b], out["data"][off + r, 32 * b:32 * b + 32] = _mx_block(g[r, 32 * b:32 * b + 32], fmt)
            for rb in range(-(-mg // 32)):
                for c in range(k):
                    cs[rb, c], out["colwise_data"][off + 32 * rb:off + min(mg, 32 * rb + 32), c] = \
                        _mx_block(g[32 * rb:32 * rb + 32, c], fmt)
        elif mode == "block":
            kb, mb = -(-k // 128), -(-mg // 128)
            rs = np.zeros((kb, _round_up(mg, 4)), sdt)
            cs = np.zeros((mb, _round_up(k, 4)), sdt)
            for r in range(mg):
                for b in range(kb):
                    rs[b, r], out["data"][off + r, 128 * b:128 * b + 128] = _fp32_block(g[r, 128 * b:128 * b + 128], fmt)
            t = np.zeros((k, mg), np.uint8)
            for rb in range(mb):
                for c in range(k):
                    cs[rb, c], t[c, 128 * rb:128 * rb + 128] = _fp32_block(g[128 * rb:128 * rb + 128, c], fmt)
            out["colwise_data"].reshape(-1)[off * k:(off + mg) * k] = t.reshape(-1)
        else:  # block2d
            kb, mb = -(-k // 128), -(-mg // 128)
            rs = np.zeros((mb, _round_up(kb, 4)), sdt)
            cs = np.zeros((kb, _round_up(mb, 4)), sdt)
            q = np.zeros((mg, k), np.uint8)
            for rb in range(mb):
                for b in range(kb):
                    s, q[128 * rb:128 * rb + 128, 128 * b:128 * b + 128] = \
                        _fp32_block(g[128 * rb:128 * rb + 128, 128 * b:128 * b + 128], fmt)
                    rs[rb, b] = cs[b, rb] = s
            out["data"][off:off + mg] = q
            out["colwise_data"].reshape(-1)[off * k:(off + mg) * k] = q.T.reshape(-1)
        row_scales.append(rs.reshape(-1))
        col_scales.append(cs.reshape(-1))
        off += mg
    out["scale_inv"] = np.concatenate(row_scales) if row_scales else np.zeros(0, sdt)
    out["colwise_scale_inv"] = np.concatenate(col_scales) if col_scales else np.zeros(0, sdt)
    if not rowwise:
        del out["data"], out["scale_inv"]
    if not colwise:
        del out["colwise_data"], out["colwise_scale_inv"]
    return out
