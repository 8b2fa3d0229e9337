#!/usr/bin/env python3
"""Writes the FP8 / E8M0 golden table into kernels/fp8_test.cc.

Goldens come from ml_dtypes (tools/requirements.txt pins 0.4.1):
float8_e4m3fn and float8_e5m2 conversions (round to nearest even, non-saturating);
the saturating goldens clip to +-max first (NaN stays NaN). ml_dtypes 0.4.1 has
no float8_e8m0fnu, so E8M0 goldens come from its definition in the OCP MX spec
v1.0 (2^(b-127), 0xff = NaN) through numpy's exact ldexp/frexp.

  python3 tools/gpu/quantize_goldens.py            # rewrites the table in place
  python3 tools/gpu/quantize_goldens.py --check    # exit 1 if it is stale
"""
import sys
import pathlib

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST = ROOT / "kernels" / "fp8_test.cc"
BEGIN = "// BEGIN GOLDEN (tools/gpu/quantize_goldens.py)\n"
END = "// END GOLDEN\n"

E4 = ml_dtypes.float8_e4m3fn
E5 = ml_dtypes.float8_e5m2


def codes(x, t, sat):
    x = np.asarray(x, np.float32)
    if sat:
        m = np.float32(ml_dtypes.finfo(t).max)
        x = np.where(np.isnan(x), x, np.clip(x, -m, m)).astype(np.float32)
    return x.astype(t).view(np.uint8)


def fnv1a(b):
    h = 0xcbf29ce484222325
    for v in bytes(b):
        h ^= v
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def inputs():
    v = [0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 449.0, 463.9, 464.0, 464.1, 479.0, 480.0, 500.0,
         57344.0, -57344.0, 57345.0, 61439.0, 61440.0, 61441.0, 65504.0, 1e10, -1e10, 3.4e38,
         np.inf, -np.inf, np.nan, -np.nan,
         # E4M3 subnormals: unit 2^-9, min normal 2^-6
         2.0**-9, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-10 * 0.9999, 3 * 2.0**-10, 5 * 2.0**-10,
         7 * 2.0**-10, 2.0**-6, 2.0**-6 - 2.0**-10, 15 * 2.0**-10, 2.0**-7, 2.0**-11, -2.0**-9,
         # E5M2 subnormals: unit 2^-16, min normal 2^-14
         2.0**-16, 2.0**-17, 3 * 2.0**-17, 5 * 2.0**-17, 2.0**-14, 2.0**-15, 2.0**-18,
         # RNE ties: E4M3 1.0625 between 1.0 and 1.125 -> 1.0; 1.1875 -> 1.25
         1.0625, 1.1875, 1.0625 * 2**4, 1.1875 * 2**-3, 1.125, 1.25 + 0.0625,
         # E5M2 ties: 1.125 between 1 and 1.25 -> 1; 1.375 -> 1.5
         1.375, 1.625, 1.875, 2.25, 2.75, 3.5, 240.0, 248.0, 232.0, 0.1, -0.1, 0.3, 1.0 / 3,
         2.0**-126, 1e-45, -1e-45, 2.0**-30, 1e-20]
    rng = np.random.default_rng(5)
    v += list(rng.standard_normal(96) * 100)
    v += list(np.exp2(rng.uniform(-20, 18, 96)) * rng.choice([-1, 1], 96))
    return np.array(v, np.float32)


def table():
    x = inputs()
    lines = [BEGIN, "struct Golden { uint32_t bits; uint8_t e4m3, e4m3_sat, e5m2, e5m2_sat; };\n",
             "const Golden kGoldens[] = {\n"]
    c = [codes(x, E4, False), codes(x, E4, True), codes(x, E5, False), codes(x, E5, True)]
    for i, xi in enumerate(x):
        lines.append("    {0x%08x, 0x%02x, 0x%02x, 0x%02x, 0x%02x},\n" % (
            int(xi.view(np.uint32)), c[0][i], c[1][i], c[2][i], c[3][i]))
    lines.append("};\n")
    # Decode of every code, as float bits (NaNs canonicalised by the test).
    allc = np.arange(256, dtype=np.uint8)
    for name, t in (("kE4M3Decode", E4), ("kE5M2Decode", E5)):
        f = allc.view(t).astype(np.float32).view(np.uint32)
        lines.append("const uint32_t %s[256] = {" % name + ", ".join("0x%08x" % v for v in f) + "};\n")
    e8 = np.where(allc == 255, np.float32(np.nan),
                  np.ldexp(np.float32(1), allc.astype(np.int32) - 127).astype(np.float32))
    lines.append("const uint32_t kE8M0Decode[256] = {" +
                 ", ".join("0x%08x" % v for v in e8.astype(np.float32).view(np.uint32)) + "};\n")
    # Digests of every bf16 and every f16 input converted to each format.
    bf = np.arange(65536, dtype=np.uint32).astype(np.uint32) << 16
    bf = bf.view(np.float32)
    f16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    for src_name, src in (("Bf16", bf), ("F16", f16)):
        for fmt_name, t in (("E4M3", E4), ("E5M2", E5)):
            for sat in (False, True):
                lines.append("const uint64_t kDigest%sTo%s%s = 0x%016xull;\n" % (
                    src_name, fmt_name, "Sat" if sat else "", fnv1a(codes(src, t, sat))))
    # OCP MX shared exponents: floor(log2(amax)) - emax_elem, clamped to [-127, 127].
    rng = np.random.default_rng(7)
    amax = np.concatenate([np.array([1.0, 448.0, 449.0, 511.9, 512.0, 57344.0, 65535.0, 2.0**-126,
                                     2.0**-140, 1e-45, 3.4e38, 0.75, 1.5, 2.0**-120], np.float32),
                           np.exp2(rng.uniform(-130, 127, 40)).astype(np.float32)])
    lines.append("struct MxGolden { uint32_t amax_bits; uint8_t e4m3_scale, e5m2_scale; };\n")
    lines.append("const MxGolden kMxGoldens[] = {\n")
    for a in amax:
        _, e = np.frexp(np.float64(a))  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
        fl = int(e) - 1
        s4 = min(max(fl - 8, -127), 127) + 127
        s5 = min(max(fl - 15, -127), 127) + 127
        lines.append("    {0x%08x, %d, %d},\n" % (int(np.float32(a).view(np.uint32)), s4, s5))
    lines.append("};\n")
    lines.append(END)
    return "".join(lines)


def main():
    np.seterr(all="ignore")  # NaN/Inf/overflow casts are the point of the table
    text = TEST.read_text()
    a, b = text.index(BEGIN), text.index(END) + len(END)
    new = text[:a] + table() + text[b:]
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    TEST.write_text(new)


if __name__ == "__main__":
    main()
