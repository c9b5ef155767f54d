#!/usr/bin/env python3
"""Writes the bundled example case: GQA (4 query heads over 2 kv heads), bottom-right causal
with Nq < Nk, a padding mask, F32 inputs, outputs out, weights and lse. Standard library only."""
import json
import random
import struct
import sys


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def tensor(dtype, shape, values, fmt):
    return dtype, shape, b"".join(struct.pack(fmt, v) for v in values)


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main(path):
    rng = random.Random(20261130)
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 5, 7, 8
    normal = lambda n: [f32(rng.gauss(0.0, 1.0)) for _ in range(n)]
    tensors = {
        "q": tensor("F32", [B, Hq, Nq, D], normal(B * Hq * Nq * D), "<f"),
        "k": tensor("F32", [B, Hkv, Nk, D], normal(B * Hkv * Nk * D), "<f"),
        "v": tensor("F32", [B, Hkv, Nk, D], normal(B * Hkv * Nk * D), "<f"),
        # key 1 is padding for every query
        "mask": tensor("BOOL", [B, 1, Nq, Nk], [0 if j == 1 else 1 for _ in range(Nq) for j in range(Nk)], "<B"),
    }
    metadata = {"attn.format": "1", "attn.causal": "bottom_right", "attn.outputs": "out,weights,lse"}
    write_safetensors(path, tensors, metadata)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vectors/examples/example.safetensors")
