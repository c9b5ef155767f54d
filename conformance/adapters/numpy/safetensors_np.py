"""Reads and writes safetensors files with NumPy alone.

    tensors, metadata = load("case.safetensors")      # name -> np.ndarray, str -> str
    save("out.safetensors", {"out": out}, {"k": "v"}, dtypes={"out": "BF16"})

Dtypes: F64, F32, F16, BF16, BOOL, I64, I32, I8, U8, F8_E4M3, F8_E5M2. NumPy has no
bfloat16: BF16 is read as uint16 and widened to float32 (the bits go in the upper half), and
written by rounding to nearest-even. FP8 is read as uint8 and decoded exactly into float32
through a table of its 256 values: F8_E4M3 is OCP's E4M3FN (bias 7, no infinities, largest
448, NaN 0x7F and 0xFF), F8_E5M2 IEEE-style (bias 15, infinities). FP8 is written by rounding
to nearest-even (fp8_bits): E4M3 saturates at +-448, E5M2 overflows to infinity.
"""
import json
import os

import numpy as np

# safetensors dtype name -> NumPy dtype of the stored bytes (little-endian).
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "BOOL": "?", "I64": "<i8",
          "I32": "<i4", "I8": "i1", "U8": "u1", "F8_E4M3": "u1", "F8_E5M2": "u1"}


def _fp8_table(ebits, mbits, ieee):
    """The 256 values of an FP8 format, from its definition, as float32 (exact)."""
    bias = (1 << (ebits - 1)) - 1
    emask, mmask = (1 << ebits) - 1, (1 << mbits) - 1
    out = np.empty(256, np.float32)
    for b in range(256):
        e, f = (b >> mbits) & emask, b & mmask
        sign = -1.0 if b & 0x80 else 1.0
        if ieee and e == emask:
            v = np.nan if f else sign * np.inf
        elif not ieee and e == emask and f == mmask:
            v = np.nan
        elif e == 0:
            v = sign * np.ldexp(f / (1 << mbits), 1 - bias)
        else:
            v = sign * np.ldexp(1 + f / (1 << mbits), e - bias)
        out[b] = v
    return out


FP8_TABLES = {"F8_E4M3": _fp8_table(4, 3, False), "F8_E5M2": _fp8_table(5, 2, True)}


def fp8_bits(a, dtype):
    """The bit patterns (uint8) of `a` rounded to nearest-even in F8_E4M3 (saturating at 448) or
    F8_E5M2 (past 57344 + half its ulp: infinity); NaN to NaN. One rounding of float32 or float64."""
    table = FP8_TABLES[dtype]
    top = 0x7E if dtype == "F8_E4M3" else 0x7B             # the largest finite pattern
    grid = table[:top + 1].astype(np.float64)               # 0 .. largest, increasing
    a = np.asarray(a, np.float64)
    x = np.abs(np.where(np.isnan(a), 0, a))
    hi = np.clip(np.searchsorted(grid, np.minimum(x, grid[-1])), 1, top)
    lo = hi - 1
    dlo, dhi = x - grid[lo], grid[hi] - x
    bits = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    if dtype == "F8_E5M2":                                  # halfway past 57344 (ties to even: 0x7C)
        bits = np.where(x >= 57344 + 4096, 0x7C, bits)
    else:
        bits = np.where(x >= grid[-1], top, bits)
    bits = (bits | np.where(np.signbit(a), 0x80, 0)).astype(np.uint8)
    return np.where(np.isnan(a), np.uint8(0x7F), bits).astype(np.uint8)


class UnsupportedDtype(ValueError):
    """A tensor's dtype is none of DTYPES (U16, say)."""


def read(path):
    """Returns (tensors, metadata, dtypes); dtypes maps each tensor name to its stored dtype name."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")               # header length, then the JSON header
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, t in header.items():
        if t["dtype"] not in DTYPES:
            raise UnsupportedDtype(f"{path}: tensor {name}: dtype {t['dtype']} is not supported")
        begin, end = t["data_offsets"]
        a = np.frombuffer(raw[8 + n + begin:8 + n + end], DTYPES[t["dtype"]]).reshape(t["shape"])
        if t["dtype"] == "BF16":                        # bfloat16 = upper half of a float32
            bits = a.reshape(-1).astype(np.uint32) << np.uint32(16)   # 1-d: a 0-d tensor too
            a = bits.view(np.float32).reshape(a.shape)
        elif t["dtype"] in FP8_TABLES:
            a = FP8_TABLES[t["dtype"]][a]
        tensors[name] = a
    return tensors, metadata, {name: t["dtype"] for name, t in header.items()}


def load(path):
    """Returns (tensors, metadata): name -> np.ndarray (BF16 widened to float32), key -> str."""
    tensors, metadata, _ = read(path)
    return tensors, metadata


def bf16_bits(a):
    """The BF16 bit patterns (uint16) of `a` rounded to nearest-even; NaN stays NaN.

    float64 goes through float32 rounded to odd (truncate, then set the last bit when inexact),
    which makes the second rounding to nearest-even exact: no double rounding.
    """
    a = np.asarray(a)
    flat = a.reshape(-1)                                # 1-d: no scalar casting surprises
    if a.dtype == np.float64:
        with np.errstate(over="ignore"):
            f = flat.astype(np.float32)
        too_far = np.abs(f.astype(np.float64)) > np.abs(flat)      # rounded away from zero
        f = np.where(too_far, np.nextafter(f, np.float32(0)), f)
        bits = f.view(np.uint32) | (f.astype(np.float64) != flat).astype(np.uint32)
    else:
        bits = np.ascontiguousarray(flat, np.float32).view(np.uint32)
    bits = bits.astype(np.uint64)
    half = bits >> np.uint64(16)
    rounded = (bits + np.uint64(0x7FFF) + (half & np.uint64(1))) >> np.uint64(16)   # ties to even
    nan = (bits & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    return np.where(nan, half | np.uint64(0x0040), rounded).astype(np.uint16).reshape(a.shape)


_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(np.bool_): "BOOL", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
          np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}


def save(path, tensors, metadata=None, dtypes=None):
    """Writes `tensors` (name -> array) sorted by name, with string `metadata`.

    `dtypes` (name -> dtype name) overrides the dtype an array is stored as; "BF16" needs it.
    Written to a temporary name, then renamed into place.
    """
    dtypes = dtypes or {}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dtype = dtypes.get(name) or _NAMES.get(a.dtype)
        if dtype not in DTYPES:
            raise UnsupportedDtype(f"tensor {name}: cannot store {a.dtype} as {dtype}")
        if dtype == "BF16":
            data = bf16_bits(a).tobytes()
        elif dtype in FP8_TABLES and a.dtype.kind == "f":
            data = fp8_bits(a, dtype).tobytes()
        else:
            data = np.ascontiguousarray(a, DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        if not all(isinstance(v, str) for v in metadata.values()):
            raise TypeError("safetensors metadata values must be strings")
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                     # pad the header to 8 bytes
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
