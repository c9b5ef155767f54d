#!/usr/bin/python3
"""The usual uncertified reference: attention in NumPy float64, as a whole process.

    /usr/bin/python3 bench/numpy_ref.py CASE -o OUT

Loads the case with the NumPy snippet of vectors/FORMAT.md, computes scaled dot-product attention
in float64 one (batch, head) at a time (scores Q K^T * scale, the row maximum subtracted before
exp, weights = e / sum e, out = weights V), and writes `out` in the case's output dtype (rounded
once from float64 with NumPy's casts), `out.ref` (the float64 result, like the reference's) and,
when the case asks for them, `weights` and `weights.ref`, to a safetensors file. The inputs are
not copied into OUT (attnoracle eval copies them), which can only favour this script.

Kind sdpa without mask, bias, causal, window or softcap: what bench/make_case.py writes.
GQA (Hq a multiple of Hkv) is supported. Exit status 2 on anything else.
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conformance",
                                "adapters", "numpy"))
import safetensors_np  # noqa: E402  (the adapter's reader and writer)


# ---- vectors/FORMAT.md, "Reading a case without AttnOracle", verbatim ----
def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    kinds = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "BOOL": "?", "I64": "<i8"}
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        a = np.frombuffer(raw[8 + n + begin:8 + n + end], kinds[t["dtype"]]).reshape(t["shape"])
        tensors[name] = (a.astype(np.uint32) << 16).view(np.float32) if t["dtype"] == "BF16" else a
    return tensors, metadata
# ---- end of the snippet ----


def save(path, tensors, metadata):
    """tensors: name -> (dtype, float64 array), written by the NumPy adapter's writer (BF16
    rounded once to nearest-even)."""
    safetensors_np.save(path, {n: a for n, (_, a) in tensors.items()}, metadata,
                        dtypes={n: d for n, (d, _) in tensors.items()})


def input_dtype(path):
    """The stored dtype of q (the default output dtype), which the snippet does not return."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))["q"]["dtype"]


def parse_scale(text):
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return float.fromhex(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)

    tensors, meta = load(a.case)
    unsupported = [k for k in ("mask", "bias", "query_mask") if k in tensors]
    unsupported += [k for k, off in (("attn.kind", "sdpa"), ("attn.causal", "none"), ("attn.window", "none"),
                                     ("attn.softcap", "0")) if meta.get(k, off) != off]
    if unsupported or not all(t in tensors for t in ("q", "k", "v")):
        print(f"numpy_ref: {a.case}: unsupported case ({', '.join(unsupported) or 'no q, k, v'})", file=sys.stderr)
        return 2
    q, k, v = (tensors[t].astype(np.float64) for t in ("q", "k", "v"))
    B, Hq, Nq, Dk = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = parse_scale(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
    outputs = meta.get("attn.outputs", "out").split(",")
    out_dtype = meta.get("attn.output_dtype") or input_dtype(a.case)

    out = np.empty((B, Hq, Nq, Dv))
    weights = np.empty((B, Hq, Nq, Nk)) if "weights" in outputs else None
    group = Hq // Hkv
    for b in range(B):
        for h in range(Hq):
            g = h // group
            s = (q[b, h] @ k[b, g].T) * scale                 # [Nq, Nk]
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)                 # the weights
            out[b, h] = s @ v[b, g]
            if weights is not None:
                weights[b, h] = s
    result = {"out": (out_dtype, out), "out.ref": ("F64", out)}
    if weights is not None:
        result["weights"] = (out_dtype, weights)
        result["weights.ref"] = ("F64", weights)
    save(a.output, result, {"attn.format": "1", "bench.reference": "numpy float64 " + np.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
