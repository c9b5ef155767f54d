#!/usr/bin/python3
"""Writes a benchmark case file: attention (kind sdpa) on seeded normal data.

    /usr/bin/python3 bench/make_case.py -n 1024 -d 64 -o case.safetensors
    /usr/bin/python3 bench/make_case.py -n 256 -d 64 --heads 4 --output-dtype BF16 --weights -o c.safetensors
    /usr/bin/python3 bench/make_case.py -n 256 -d 64 --backward -o grad.safetensors

q [B, H, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D] (Nq = Nk = N, Dk = Dv = D, Hkv = H unless --kv-heads), drawn from the standard
normal distribution (NumPy's default_rng(seed)) and rounded to the input dtype (F32 by default).
Default scale 1/sqrt(D), no mask, no causal option. The case asks for `out` only, or for `out`
and `weights` with --weights; with --backward, also a normal `dout` and the gradients dq, dk, dv.
Standard library and NumPy only (/usr/bin/python3 on Debian).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conformance",
                                "adapters", "numpy"))
import safetensors_np  # noqa: E402  (the adapter's writer)

def make_case(path, n, d, heads=1, batch=1, seed=1, input_dtype="F32", output_dtype="F32",
              weights=False, nk=None, kv_heads=None, backward=False):
    nq, nk, hkv = n, (nk or n), (kv_heads or heads)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, h, rows in (("q", heads, nq), ("k", hkv, nk), ("v", hkv, nk)):
        a = rng.standard_normal((batch, h, rows, d))
        # BF16 through float32 (two roundings; the stored value is what the case means)
        tensors[name] = a.astype(np.float32) if input_dtype == "BF16" else a
    if backward:
        a = rng.standard_normal((batch, heads, nq, d))
        tensors["dout"] = a.astype(np.float32) if input_dtype == "BF16" else a
    metadata = {
        "attn.format": "1",
        "attn.kind": "sdpa",
        "attn.output_dtype": output_dtype,
        "attn.outputs": ("out,weights" if weights else "out") + (",dq,dk,dv" if backward else ""),
        "bench.generator": f"bench/make_case.py n={nq} nk={nk} d={d} heads={heads} kv_heads={hkv} batch={batch} "
                           f"seed={seed} normal" + (" backward" if backward else ""),
    }
    safetensors_np.save(path, tensors, metadata, dtypes={n: input_dtype for n in tensors})
    return os.path.getsize(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, required=True, help="Nq = Nk = N (see --nk)")
    p.add_argument("--nk", type=int, help="Nk when it differs from N")
    p.add_argument("-d", type=int, required=True, help="Dk = Dv = D")
    p.add_argument("--heads", type=int, default=1, help="H (query and key/value heads), default 1")
    p.add_argument("--kv-heads", type=int, help="key/value heads when fewer than --heads (GQA; must divide it)")
    p.add_argument("--batch", type=int, default=1, help="B, default 1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--input-dtype", default="F32", choices=["F64", "F32", "F16", "BF16"])
    p.add_argument("--output-dtype", default="F32", choices=["F64", "F32", "F16", "BF16"])
    p.add_argument("--weights", action="store_true", help="also request the weights tensor")
    p.add_argument("--backward", action="store_true", help="also dout and the gradients dq, dk, dv")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    for name in ("n", "d", "heads", "batch"):
        if getattr(a, name) < 1:
            p.error(f"{name} must be at least 1")
    if a.kv_heads is not None and (a.kv_heads < 1 or a.heads % a.kv_heads):
        p.error("kv-heads must be at least 1 and divide heads")
    size = make_case(a.output, a.n, a.d, a.heads, a.batch, a.seed, a.input_dtype, a.output_dtype,
                     a.weights, a.nk, a.kv_heads, a.backward)
    print(f"{a.output}: {size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
