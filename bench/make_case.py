#!/usr/bin/python3
"""Writes a benchmark case file: attention (kind sdpa) on seeded normal data.

    /usr/bin/python3 bench/make_case.py -n 1024 -d 64 -o case.safetensors
    /usr/bin/python3 bench/make_case.py -n 256 -d 64 --heads 4 --output-dtype BF16 --weights -o c.safetensors

q [B, H, N, D], k [B, H, N, D], v [B, H, N, D] (Nq = Nk = N, Dk = Dv = D), drawn from the standard
normal distribution (NumPy's default_rng(seed)) and rounded to the input dtype (F32 by default).
Default scale 1/sqrt(D), no mask, no causal option. The case asks for `out` only, or for `out`
and `weights` with --weights. Standard library and NumPy only (/usr/bin/python3 on Debian).
"""
import argparse
import json
import os
import sys

import numpy as np

STORED = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # BF16 handled apart (upper half of an F32)


def bf16_bits(a32):
    """BF16 bit patterns of float32 values, rounded to nearest-even (inputs are finite)."""
    bits = np.ascontiguousarray(a32, np.float32).view(np.uint32).astype(np.uint64)
    half = bits >> np.uint64(16)
    return ((bits + np.uint64(0x7FFF) + (half & np.uint64(1))) >> np.uint64(16)).astype("<u2")


def encode(a, dtype):
    """The little-endian bytes of `a` (float64) stored as `dtype`."""
    if dtype == "BF16":
        # float64 -> float32 -> bf16 may round twice; harmless for benchmark data (the stored
        # value is what the case means, whatever way it was obtained).
        return bf16_bits(a.astype(np.float32)).tobytes()
    return np.ascontiguousarray(a, STORED[dtype]).tobytes()


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype name, shape, bytes). Written sorted by name, header padded to 8,
    to a temporary name and renamed into place."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def make_case(path, n, d, heads=1, batch=1, seed=1, input_dtype="F32", output_dtype="F32",
              weights=False, nk=None):
    nq, nk = n, (nk or n)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, rows in (("q", nq), ("k", nk), ("v", nk)):
        shape = (batch, heads, rows, d)
        a = rng.standard_normal(shape)
        tensors[name] = (input_dtype, shape, encode(a, input_dtype))
    metadata = {
        "attn.format": "1",
        "attn.kind": "sdpa",
        "attn.output_dtype": output_dtype,
        "attn.outputs": "out,weights" if weights else "out",
        "bench.generator": f"bench/make_case.py n={nq} nk={nk} d={d} heads={heads} batch={batch} "
                           f"seed={seed} normal",
    }
    write_safetensors(path, tensors, metadata)
    return os.path.getsize(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, required=True, help="Nq = Nk = N (see --nk)")
    p.add_argument("--nk", type=int, help="Nk when it differs from N")
    p.add_argument("-d", type=int, required=True, help="Dk = Dv = D")
    p.add_argument("--heads", type=int, default=1, help="H (query and key/value heads), default 1")
    p.add_argument("--batch", type=int, default=1, help="B, default 1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--input-dtype", default="F32", choices=["F64", "F32", "F16", "BF16"])
    p.add_argument("--output-dtype", default="F32", choices=["F64", "F32", "F16", "BF16"])
    p.add_argument("--weights", action="store_true", help="also request the weights tensor")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    for name in ("n", "d", "heads", "batch"):
        if getattr(a, name) < 1:
            p.error(f"{name} must be at least 1")
    size = make_case(a.output, a.n, a.d, a.heads, a.batch, a.seed, a.input_dtype, a.output_dtype,
                     a.weights, a.nk)
    print(f"{a.output}: {size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
