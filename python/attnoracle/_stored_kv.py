"""The stored forms of K and V (CONTRACT section 9: scaled I8 and FP8, mxfp8 and nvfp4 block
scales), FP8 outputs' o_scale and dropout (section 10) as case tensors and metadata. Nothing is
rounded: a value its dtype does not hold is refused, naming the tensor and the element."""

import numpy as np

SCALED_DTYPES = ("F8_E4M3", "F8_E5M2", "I8")
SCALARS = ("k_scale", "v_scale", "k_global_scale", "v_global_scale", "o_scale")  # F32
BLOCK_SCALE_TENSORS = ("k_block_scale", "v_block_scale")
STORED = ("k", "v", "k_cache", "v_cache")


def kv_dtype_of(arrays, kv_dtype, kv_block_scale, as_array, error, file):
    """The dtype of the stored k and v of a quantized case (None for a case without one): the
    block format's (mxfp8: F8_E4M3, nvfp4: U8), else kv_dtype, else that of a float8 tensor
    (PyTorch) or of an int8 array (I8)."""
    if kv_block_scale is not None:
        if kv_dtype is not None:
            raise error(file, "kv_dtype", "not given with kv_block_scale (its format fixes the elements' dtype)")
        return {"mxfp8": "F8_E4M3", "nvfp4": "U8"}.get(str(kv_block_scale))  # others: the reader refuses
    if kv_dtype is not None:
        t = str(kv_dtype).upper()
        if t not in SCALED_DTYPES:
            raise error(file, "kv_dtype", f"{kv_dtype!r} is not F8_E4M3, F8_E5M2 or I8")
        return t
    if arrays.get("k_scale") is None and arrays.get("v_scale") is None:
        return None
    name = "k" if arrays.get("k") is not None else "k_cache"
    if arrays.get(name) is None:
        return None  # the reader names what is missing
    a, bits_dtype = as_array(arrays[name], name, file)
    if bits_dtype in ("F8_E4M3", "F8_E5M2"):
        return bits_dtype
    if a.dtype == np.int8:
        return "I8"
    raise error(file, name, f"an array of {a.dtype} with k_scale: give kv_dtype (F8_E4M3, F8_E5M2 or I8); "
                            "uint8 arrays are read as bit patterns of that dtype")


def int_tensor(name, a, dtype, lo, hi, error, file):
    """An I8 or U8 tensor from integer arrays, or from float arrays of integers in [lo, hi]."""
    shape = [int(n) for n in a.shape]
    if a.dtype.kind not in "iufb":
        raise error(file, name, f"array of {a.dtype} is not numeric")
    flat = a.reshape(-1)
    with np.errstate(invalid="ignore"):
        ok = (flat >= lo) & (flat <= hi)
        if a.dtype.kind == "f":
            ok &= flat == np.floor(flat)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise error(file, name, f"element {i} (flat index), {flat[i]!r}, is not representable in {dtype}")
    np_dtype = "|i1" if dtype == "I8" else "|u1"
    return (name, dtype, shape, np.ascontiguousarray(a).astype(np_dtype).tobytes())


def stored_tensor(name, x, kv_dtype, float_tensor, as_array, error, file):
    """k, v, k_cache or v_cache in kv_dtype: I8 (int8 arrays or integer values), FP8 (uint8 bit
    patterns, float8 tensors, or values the format holds exactly), U8 (nvfp4's packed E2M1 pairs,
    uint8 only)."""
    if kv_dtype == "I8":
        a, bits_dtype = as_array(x, name, file)
        if bits_dtype:
            raise error(file, name, f"a {bits_dtype} tensor is not I8 (give int8 values)")
        if a.dtype == np.uint8:
            raise error(file, name, "uint8 is not I8 (give int8 arrays, or kv_dtype F8_E4M3 or F8_E5M2 for bit patterns)")
        return int_tensor(name, a, "I8", -128, 127, error, file)
    if kv_dtype == "U8":
        a, _ = as_array(x, name, file)
        if a.dtype != np.uint8:
            raise error(file, name, f"nvfp4 elements are uint8 bytes holding two E2M1 values (low nibble first), "
                                    f"not {a.dtype}")
        return (name, "U8", [int(n) for n in a.shape], np.ascontiguousarray(a).tobytes())
    return float_tensor(name, x, kv_dtype, False, file)


def block_scale_tensor(name, x, kv_block_scale, float_tensor, as_array, error, file):
    """mxfp8: U8 E8M0 exponents (integers 0 to 255); nvfp4: F8_E4M3 (bit patterns or exact values)."""
    if kv_block_scale == "nvfp4":
        return float_tensor(name, x, "F8_E4M3", False, file)
    a, bits_dtype = as_array(x, name, file)
    if bits_dtype:
        raise error(file, name, f"a {bits_dtype} tensor is not an E8M0 exponent (give uint8 integers)")
    return int_tensor(name, a, "U8", 0, 255, error, file)


def metadata(meta, *, kv_block_scale, v_from_k, dropout_p, number_text, error, file):
    """attn.kv_block_scale, attn.v_from_k and attn.dropout_p (a float: its exact double as a C hex
    float; a str: the exact value of its text)."""
    if kv_block_scale is not None:
        meta["attn.kv_block_scale"] = str(kv_block_scale)
    if v_from_k is not None:
        if isinstance(v_from_k, bool) or not isinstance(v_from_k, (int, np.integer)):
            raise error(file, "attn.v_from_k", f"not an integer: {v_from_k!r}")
        meta["attn.v_from_k"] = str(int(v_from_k))
    if dropout_p is not None:
        meta["attn.dropout_p"] = number_text(dropout_p, "attn.dropout_p", file)


# The bit patterns of stored elements and scales from the values they stand for. Each value must
# be one the format holds exactly: nothing is rounded, a value it does not hold is refused.

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of nibbles 0 to 7


def _values(x, what):
    a = np.asarray(x)
    if a.dtype.kind not in "iuf":
        raise ValueError(f"{what}: an array of {a.dtype} is not numeric")
    return a.astype(np.float64)


def _refuse(flat, ok, what, holds):
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"{what}: element {i} (flat index), {flat[i]!r}, is not {holds}")


def pack_e2m1(values):
    """nvfp4 elements: an array of E2M1 values [..., D] (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4,
    +-6; D even) packed two per uint8 byte along the last axis, low nibble first: [..., D / 2].
    The nibble is s ee m; -0.0 keeps its sign bit. ValueError names the first value E2M1 does not
    hold."""
    a = _values(values, "pack_e2m1")
    if a.ndim == 0 or a.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last axis must have an even length (two nibbles a byte), not shape "
                         f"{list(a.shape)}")
    flat = a.reshape(-1)
    mag = np.abs(flat)
    code = np.searchsorted(np.array(E2M1_VALUES), mag)
    ok = np.isfinite(mag) & (code < 8)
    ok[ok] &= np.array(E2M1_VALUES)[code[ok]] == mag[ok]
    _refuse(flat, ok, "pack_e2m1", "an E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)")
    nibbles = (code | (np.signbit(flat) << 3)).astype(np.uint8).reshape(a.shape)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _e4m3_table():
    """The 127 non-negative finite F8_E4M3 values, ascending, indexed by their bit pattern."""
    bits = np.arange(0x7F)
    e, m = bits >> 3, bits & 7
    return np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


def e4m3_bits(values):
    """F8_E4M3 (OCP E4M3FN) bit patterns, uint8, of values it holds exactly: nvfp4 block scales
    (0 to 448; -0.0 keeps its sign bit). ValueError names the first value it does not hold."""
    a = _values(values, "e4m3_bits")
    flat = a.reshape(-1)
    table = _e4m3_table()
    mag = np.abs(flat)
    idx = np.minimum(np.searchsorted(table, mag), len(table) - 1)
    ok = np.isfinite(mag) & (table[idx] == mag)
    _refuse(flat, ok, "e4m3_bits", "an F8_E4M3 value (exactly; largest finite 448)")
    return (idx | (np.signbit(flat) << 7)).astype(np.uint8).reshape(a.shape)


def e8m0_bits(values):
    """E8M0 bit patterns, uint8, of mxfp8 block scales: each a power of two 2^k, k from -127 to
    127, is the byte k + 127. ValueError names the first value that is not one."""
    a = _values(values, "e8m0_bits")
    flat = a.reshape(-1)
    with np.errstate(invalid="ignore"):
        m, e = np.frexp(flat)  # flat = m 2^e, 1/2 <= m < 1: 2^(e - 1) when m is 1/2
    ok = np.isfinite(flat) & (m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)
    _refuse(flat, ok, "e8m0_bits", "a power of two 2^k with k from -127 to 127 (an E8M0 scale)")
    return (e - 1 + 127).astype(np.uint8).reshape(a.shape)
