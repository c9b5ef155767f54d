"""Reads and writes safetensors files with NumPy alone.

    tensors, metadata = load("case.safetensors")      # name -> np.ndarray, str -> str
    save("out.safetensors", {"out": out}, {"k": "v"}, dtypes={"out": "BF16"})

Dtypes: F64, F32, F16, BF16, BOOL, I64, I32. NumPy has no bfloat16: BF16 is read as uint16 and
widened to float32 (the bits go in the upper half), and written by rounding to nearest-even.
"""
import json
import os

import numpy as np

# safetensors dtype name -> NumPy dtype of the stored bytes (little-endian).
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "BOOL": "?", "I64": "<i8", "I32": "<i4"}


class UnsupportedDtype(ValueError):
    """A tensor's dtype is none of DTYPES (F8_E4M3, say)."""


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
            a = (a.astype(np.uint32) << 16).view(np.float32)
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
          np.dtype(np.bool_): "BOOL", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}


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
