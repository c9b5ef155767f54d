#!/usr/bin/python3
"""The usual high-precision reference: attention with mpmath at 30 significant digits.

    /usr/bin/python3 bench/mpmath_ref.py CASE -o OUT [--dps 30]

Plain Python loops over mpmath numbers (Debian python3-mpmath), one row at a time: the inputs are
converted exactly to mpf once, then for each query row the scores s_j = scale * sum_d q_d k_jd,
their maximum m, e_j = exp(s_j - m), Z = sum_j e_j and out_c = (sum_j e_j v_jc) / Z, every
operation rounded to the working precision (30 digits, about 103 bits). `out` is written in the
case's output dtype, rounded once from the 30-digit value (to nearest-even), with `out.ref` (F64,
rounded once from the 30-digit value). Nothing is proven: 30 digits are simply many more than the
outputs keep. Standard library and mpmath only.

Kind sdpa without mask, bias, causal, window or softcap (what bench/make_case.py writes); GQA is
supported. Exit status 2 on anything else.
"""
import argparse
import array
import json
import os
import struct
import sys

import mpmath
from mpmath import mp, mpf

PRECISION = {"F64": 53, "F32": 24, "F16": 11, "BF16": 8}
EMIN = {"F64": -1022, "F32": -126, "F16": -14, "BF16": -126}  # exponent of the least normal


def load(path):
    """(tensors, metadata, dtypes) with the standard library; tensors hold Python floats, flat."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    tensors, dtypes, shapes = {}, {}, {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        data = raw[8 + n + begin:8 + n + end]
        dtype = t["dtype"]
        if dtype in ("F64", "F32"):
            a = array.array("d" if dtype == "F64" else "f")
            a.frombytes(data)
            if sys.byteorder != "little":
                a.byteswap()
            values = list(a)
        elif dtype == "F16":
            values = [v for (v,) in struct.iter_unpack("<e", data)]
        elif dtype == "BF16":
            values = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for (h,) in struct.iter_unpack("<H", data)]
        else:
            values = None  # BOOL and others: not used here
        tensors[name], dtypes[name], shapes[name] = values, dtype, t["shape"]
    return tensors, metadata, dtypes, shapes


def round_to(x, dtype):
    """x (mpf) rounded once to nearest-even into dtype, as a Python float (exact)."""
    p = PRECISION[dtype]
    if x == 0:
        return 0.0
    _, e = mpmath.frexp(x)                       # x = m 2^e, 1/2 <= |m| < 1
    if e - 1 < EMIN[dtype]:                      # subnormal range: a fixed quantum
        quantum = mpmath.ldexp(1, EMIN[dtype] - p + 1)
        return float(mpmath.nint(x / quantum) * quantum)   # exact scaling; nint: ties to even
    with mp.workprec(p):
        r = +x                                   # mpmath rounds to nearest, ties to even
    return float(r)                              # exact: p <= 53 (overflow is out of scope)


def pack(values, dtype):
    if dtype == "F64":
        return struct.pack(f"<{len(values)}d", *values)
    if dtype == "F32":
        return struct.pack(f"<{len(values)}f", *values)     # exact: values are F32 numbers
    if dtype == "F16":
        return struct.pack(f"<{len(values)}e", *values)     # exact
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0] >> 16)[:2]
                    for v in values)                       # BF16: exact, the upper half


def save(path, tensors, metadata):
    """tensors: name -> (dtype, shape, list of floats). Sorted by name, header padded, atomic."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, values = tensors[name]
        data = pack(values, dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def parse_scale(text):
    text = text.strip()
    if "x" in text.lower():
        return mpf(float.fromhex(text))          # a hex float is a binary value: exact
    return mpf(text)                             # decimal text, rounded to 30 digits


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--dps", type=int, default=30, help="significant decimal digits (default 30)")
    a = p.parse_args(argv)
    mp.dps = a.dps

    tensors, meta, dtypes, shapes = load(a.case)
    unsupported = [k for k in ("mask", "bias", "query_mask") if k in tensors]
    unsupported += [k for k, off in (("attn.kind", "sdpa"), ("attn.causal", "none"), ("attn.window", "none"),
                                     ("attn.softcap", "0")) if meta.get(k, off) != off]
    if unsupported or not all(t in tensors for t in ("q", "k", "v")):
        print(f"mpmath_ref: {a.case}: unsupported case ({', '.join(unsupported) or 'no q, k, v'})", file=sys.stderr)
        return 2
    B, Hq, Nq, Dk = shapes["q"]
    Hkv, Nk, Dv = shapes["k"][1], shapes["k"][2], shapes["v"][3]
    out_dtype = meta.get("attn.output_dtype") or dtypes["q"]
    scale = parse_scale(meta["attn.scale"]) if "attn.scale" in meta else 1 / mpmath.sqrt(Dk)
    group = Hq // Hkv

    # Exact conversions (every input is a double), one list of mpf per row.
    def rows(name, count, width):
        flat = tensors[name]
        return [[mpf(x) for x in flat[r * width:(r + 1) * width]] for r in range(count)]

    q = rows("q", B * Hq * Nq, Dk)
    k = rows("k", B * Hkv * Nk, Dk)
    v = rows("v", B * Hkv * Nk, Dv)

    out, out_ref = [], []
    for b in range(B):
        for h in range(Hq):
            kv0 = (b * Hkv + h // group) * Nk
            for i in range(Nq):
                qi = q[(b * Hq + h) * Nq + i]
                scores = []
                for j in range(Nk):
                    kj = k[kv0 + j]
                    dot = mpf(0)
                    for d in range(Dk):
                        dot += qi[d] * kj[d]
                    scores.append(dot * scale)
                m = max(scores)
                e = [mpmath.exp(s - m) for s in scores]
                z = mpf(0)
                for x in e:
                    z += x
                for c in range(Dv):
                    acc = mpf(0)
                    for j in range(Nk):
                        acc += e[j] * v[kv0 + j][c]
                    o = acc / z
                    out.append(round_to(o, out_dtype))
                    out_ref.append(round_to(o, "F64"))
    shape = [B, Hq, Nq, Dv]
    save(a.output, {"out": (out_dtype, shape, out), "out.ref": ("F64", shape, out_ref)},
         {"attn.format": "1",
          "bench.reference": f"mpmath {mpmath.__version__} dps={a.dps} backend={mpmath.libmp.BACKEND}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
