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
