#!/usr/bin/env python3
"""Prints a summary of a case file: metadata, tensors, and the first golden output row."""
import json
import struct
import sys

FORMATS = {"F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "BOOL": ("?", 1), "I64": ("q", 8)}


def values(dtype, buf):
    if dtype == "BF16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0]
                for (h,) in struct.iter_unpack("<H", buf)]
    code, _ = FORMATS[dtype]
    return [v for (v,) in struct.iter_unpack("<" + code, buf)]


def main(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    print(path)
    for key in sorted(meta):
        print(f"  {key} = {meta[key]}")
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        t = header[name]
        print(f"  {name:14} {t['dtype']:5} {t['shape']}")
    if "out" in header:
        t = header["out"]
        b, e = t["data_offsets"]
        row = values(t["dtype"], data[b:e])[: t["shape"][-1]]
        print("  out, first row:", " ".join(f"{v:.6g}" for v in row))


if __name__ == "__main__":
    main(sys.argv[1])
