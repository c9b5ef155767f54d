"""AttnOracle from Python: certified golden values for attention on arrays, case files, vector
sets, and the conformance gate's verdict on one case.

    import attnoracle
    r = attnoracle.evaluate(q, k, v, causal="top_left")   # NumPy arrays, PyTorch tensors, ...
    r["out"], r["out.ref"], r["out.bound"], r.undecided

    for entry in attnoracle.Suite("vectors/core"):
        case = entry.load()
        verdict = case.check({"out": my_attention(**case.inputs)}, profile="fp32")

Everything goes through the C++ libraries the attnoracle command uses (the case checks, the
evaluator, the format, the comparison and the diagnosis), so that results are those of
`attnoracle eval` and `attnoracle check`, bit for bit. NumPy has no bfloat16 and no FP8: BF16
values are given and returned as float32 arrays holding them exactly, or as uint16 bit patterns;
F8_E4M3 and F8_E5M2 values likewise, or as uint8 bit patterns (python/README.md).
"""

import json
import os

import numpy as np

from . import _attnoracle as _native
from . import _stored_kv
from ._stored_kv import e4m3_bits, e8m0_bits, pack_e2m1

__version__ = _native.__version__

__all__ = ["evaluate", "assert_close", "Profile", "clear_cache", "load_case", "write_case", "Suite", "Case",
           "SuiteEntry", "Result", "Verdict", "InputError", "InvariantViolation", "Refused", "Unsupported",
           "parametrize_suite", "vector_set", "FEATURES", "pack_e2m1", "e4m3_bits", "e8m0_bits"]


class InputError(ValueError):
    """Bad input, with the command line's one-line message: `<file>: <field>: <what>`.

    `file` and `field` hold its first two parts (field may be empty)."""

    file = None
    field = None


class InvariantViolation(RuntimeError):
    """The oracle found an invariant of the definition violated by the reference's own enclosures
    (a bug in the reference: nothing is returned)."""


class Refused(Exception):
    """What an implementation raises to refuse a case (the adapter protocol's `.error`)."""


class Unsupported(Exception):
    """What an implementation raises for a feature it does not do (`.unsupported`)."""


_native.set_exception_types(InputError, InvariantViolation)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
INPUT_DTYPES = FLOAT_DTYPES + FP8_DTYPES
_NUMPY_OF = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "BOOL": "|u1", "I64": "<i8",
             "I32": "<i4"}
_DTYPE_OF_NUMPY = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
_INPUTS = ("q", "k", "v", "x_q", "x_kv", "w_q", "w_k", "w_v", "w_o", "o_partial")
_OPTIONAL = ("mask", "bias", "query_mask", "seqlens_q", "seqlens_k", "sinks", "dout", "dropout_mask", "k_scale",
             "v_scale", "k_block_scale", "v_block_scale", "k_global_scale", "v_global_scale", "o_scale")
_DESCALES = ("q_descale", "k_descale", "v_descale")
_CACHES = ("k_cache", "v_cache")  # a paged KV cache (CONTRACT section 8), with block_table
_ARRAYS = "<arrays>"  # the file name in messages about arrays given in memory


# ---------------------------------------------------------------------------------------------
# Arrays in, tensors out


def _as_array(x, name, file):
    """NumPy's view of `x` and, for a PyTorch bfloat16 or float8 tensor, its dtype name "BF16",
    "F8_E4M3" or "F8_E5M2" (the array then holds the bit patterns, as uint16 or uint8)."""
    if hasattr(x, "detach") and hasattr(x, "dtype"):  # a PyTorch tensor, on any device
        import torch

        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "BF16"
        # PyTorch 2.1 and later: float8_e4m3fn is OCP's E4M3FN, float8_e5m2 E5M2
        for attr, fp8 in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
            if t.dtype == getattr(torch, attr, None):
                return t.view(torch.uint8).numpy(), fp8
        return t.numpy(), None
    if not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x), None
    try:
        return np.asarray(x), None
    except Exception as e:  # noqa: BLE001 - any conversion failure is bad input
        raise _error(file, name, f"not an array ({e})")


def _error(file, field, what):
    e = InputError(f"{file}: {field}: {what}" if field else f"{file}: {what}")
    e.file, e.field = file, field
    return e


def _float_tensor(name, x, dtype, round_values, file):
    """The tensor (name, dtype, shape, bytes) of array x in `dtype`: uint16 arrays are bit
    patterns of BF16 or F16, uint8 arrays bit patterns of F8_E4M3 or F8_E5M2 when dtype is one;
    other arrays are values, encoded exactly (or rounded to nearest-even when round_values) by
    the C++ format library."""
    a, bits_dtype = _as_array(x, name, file)
    if bits_dtype and bits_dtype != dtype:  # a bfloat16 or float8 tensor given for another dtype: its values
        a = _decode(bits_dtype, a)
    shape = [int(n) for n in a.shape]
    if a.dtype == np.uint16:
        if dtype not in ("BF16", "F16"):
            raise _error(file, name, f"uint16 bit patterns are read only as BF16 or F16, not {dtype}")
        return (name, dtype, shape, np.ascontiguousarray(a, "<u2").tobytes())
    if a.dtype == np.uint8 and dtype in FP8_DTYPES:
        return (name, dtype, shape, np.ascontiguousarray(a).tobytes())
    if a.dtype.kind not in "fiub":
        raise _error(file, name, f"array of {a.dtype} is not numeric")
    if a.dtype.kind == "f" and _DTYPE_OF_NUMPY.get(a.dtype) == dtype:
        return (name, dtype, shape, np.ascontiguousarray(a, _NUMPY_OF[dtype]).tobytes())
    values = np.ascontiguousarray(a, "<f8")
    if a.dtype.kind in "iu" and not np.array_equal(values.astype(a.dtype), a):
        raise _error(file, name, "integer values beyond float64's exact range")
    return (name, dtype, shape, _native.encode(dtype, values.tobytes(), round_values, file, name))


def _decode(dtype, bits):
    """The values of BF16, F16 or FP8 bit patterns as a float32 array (exact: each embeds in F32)."""
    values = np.frombuffer(_native.decode(dtype, np.ascontiguousarray(bits).tobytes()), "<f8")
    return values.astype(np.float32).reshape(bits.shape)


def _side_dtype(a, bits_dtype, dtype):
    """The dtype of bias, sinks or dout given as array a: its own when the case accepts it (F64,
    F32 or the input dtype), else the input dtype for floats and bit patterns (F32 for floats
    with FP8 inputs: F16 and BF16 values are exact in F32), F64 for integers."""
    own = bits_dtype or _DTYPE_OF_NUMPY.get(a.dtype)
    if own in ("F64", "F32", dtype):
        return own
    if dtype in FP8_DTYPES and (a.dtype.kind == "f" or bits_dtype == "BF16"):
        return "F32"
    if a.dtype == np.uint16 or (a.dtype == np.uint8 and dtype in FP8_DTYPES) or a.dtype.kind == "f":
        return dtype
    return "F64"


def _bool_tensor(name, x, file):
    a, _ = _as_array(x, name, file)
    if a.dtype != np.bool_:
        if a.dtype.kind not in "iub" or not np.isin(a, (0, 1)).all():
            raise _error(file, name, f"a mask is boolean (or 0 and 1), not {a.dtype}")
    return (name, "BOOL", [int(n) for n in a.shape], np.ascontiguousarray(a, np.uint8).tobytes())


def _length_tensor(name, x, file):
    """seqlens_q, seqlens_k: integers, stored as I32 when given as int32, else I64 (the reader
    checks their range)."""
    a, _ = _as_array(x, name, file)
    if a.dtype.kind not in "iu":
        raise _error(file, name, f"sequence lengths are integers, not {a.dtype}")
    dtype = "I32" if a.dtype == np.int32 else "I64"
    return (name, dtype, [int(n) for n in a.shape], np.ascontiguousarray(a, _NUMPY_OF[dtype]).tobytes())


def _block_table_tensor(x, file):
    """block_table [B, Mpages]: page indices, stored as I32 (the reader checks the used ones)."""
    a, _ = _as_array(x, "block_table", file)
    if a.dtype.kind not in "iu":
        raise _error(file, "block_table", f"page indices are integers, not {a.dtype}")
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise _error(file, "block_table", "page indices beyond I32's range")
    return ("block_table", "I32", [int(n) for n in a.shape], np.ascontiguousarray(a, "<i4").tobytes())


def _number_text(x, field, file):
    """attn.scale and attn.softcap: a str is the exact value of its text ("0.1" is 1/10); a
    float is the exact value of that double, written as a C hex float."""
    if isinstance(x, str):
        return x
    try:
        return float(x).hex()
    except (TypeError, ValueError):
        raise _error(file, field, f"not a number: {x!r}")


def _input_dtype_of(x, file, name):
    a, bits_dtype = _as_array(x, name, file)
    if bits_dtype:
        return bits_dtype
    t = _DTYPE_OF_NUMPY.get(a.dtype)
    if t is None:
        raise _error(file, name, f"input_dtype is needed for an array of {a.dtype} "
                                 "(F64, F32, F16, BF16, F8_E4M3 or F8_E5M2)")
    return t


def _case_tensors(arrays, *, scale, causal, window, softcap, masked_rows, outputs, input_dtype, output_dtype,
                  round_values, file, metadata=None, output_dtypes=None, kv_layout=None, kv_split_size=None,
                  lse_posinf=None, kv_dtype=None, kv_block_scale=None, v_from_k=None, dropout_p=None):
    """The tensors and metadata of a case file from arrays and options."""
    arrays = {n: a for n, a in arrays.items() if a is not None}
    kind = "mha" if "x_q" in arrays else "merge" if "o_partial" in arrays else "sdpa"
    first = {"mha": "x_q", "merge": "o_partial"}.get(kind, "q")
    if first not in arrays:
        raise _error(file, "q", "missing (give q, k and v, or x_q, x_kv and w_q, w_k, w_v, w_o)")
    dtype = input_dtype.upper() if isinstance(input_dtype, str) else None
    if input_dtype is not None and dtype not in INPUT_DTYPES:
        raise _error(file, "input_dtype", f"{input_dtype!r} is not F64, F32, F16, BF16, F8_E4M3 or F8_E5M2")
    dtype = dtype or _input_dtype_of(arrays[first], file, first)
    stored = _stored_kv.kv_dtype_of(arrays, kv_dtype, kv_block_scale, _as_array, _error, file)
    tensors = []
    for name, a in arrays.items():
        if stored and name in _stored_kv.STORED:
            tensors.append(_stored_kv.stored_tensor(name, a, stored, _float_tensor, _as_array, _error, file))
        elif name in _stored_kv.SCALARS:  # F32, never rounded
            tensors.append(_float_tensor(name, a, "F32", False, file))
        elif name in _stored_kv.BLOCK_SCALE_TENSORS:
            tensors.append(_stored_kv.block_scale_tensor(name, a, kv_block_scale, _float_tensor, _as_array, _error,
                                                         file))
        elif name in ("mask", "query_mask", "dropout_mask"):
            tensors.append(_bool_tensor(name, a, file))
        elif name in ("bias", "sinks", "dout"):
            arr, bits_dtype = _as_array(a, name, file)
            tensors.append(_float_tensor(name, a, _side_dtype(arr, bits_dtype, dtype), round_values, file))
        elif name == "lse_partial":  # kind merge: F64 when given float64, else F32
            arr, _ = _as_array(a, name, file)
            tensors.append(_float_tensor(name, a, "F64" if arr.dtype == np.float64 else "F32", round_values, file))
        elif name in _DESCALES:  # F32, the only dtype of a descale
            tensors.append(_float_tensor(name, a, "F32", round_values, file))
        elif name in ("seqlens_q", "seqlens_k"):
            tensors.append(_length_tensor(name, a, file))
        elif name in _INPUTS or name in _CACHES:
            tensors.append(_float_tensor(name, a, dtype, round_values, file))
        elif name == "block_table":
            tensors.append(_block_table_tensor(a, file))
        else:
            raise _error(file, name, "unknown tensor (expected q, k, v, and optionally " + ", ".join(_OPTIONAL) + ")")
    meta = {"attn.format": "1"}
    if kind != "sdpa":
        meta["attn.kind"] = kind
    if kv_split_size is not None:
        meta["attn.kv_split_size"] = str(int(kv_split_size))
    if lse_posinf is not None:
        meta["attn.lse_posinf"] = str(lse_posinf)
    if scale is not None:
        meta["attn.scale"] = _number_text(scale, "attn.scale", file)
    if causal not in (None, False, "none"):
        meta["attn.causal"] = "top_left" if causal is True else str(causal)
    if window is not None and window != "none":
        meta["attn.window"] = window if isinstance(window, str) else f"{int(window[0])},{int(window[1])}"
    if softcap is not None:
        meta["attn.softcap"] = _number_text(softcap, "attn.softcap", file)
    if masked_rows is not None:
        meta["attn.masked_rows"] = str(masked_rows)
    if output_dtype is not None:
        meta["attn.output_dtype"] = str(output_dtype).upper()
    if output_dtypes is not None:  # {"lse": "F32"} or "lse:F32"
        meta["attn.output_dtypes"] = output_dtypes if isinstance(output_dtypes, str) else \
            ",".join(f"{name}:{str(t).upper()}" for name, t in dict(output_dtypes).items())
    if kv_layout is not None:
        meta["attn.kv_layout"] = str(kv_layout).upper()
    if outputs is not None:
        names = [outputs] if isinstance(outputs, str) else list(outputs)
        meta["attn.outputs"] = ",".join(names)
    _stored_kv.metadata(meta, kv_block_scale=kv_block_scale, v_from_k=v_from_k, dropout_p=dropout_p,
                        number_text=_number_text, error=_error, file=file)
    for key, value in (metadata or {}).items():
        meta[str(key)] = str(value)
    return tensors, meta


# ---------------------------------------------------------------------------------------------
# Tensors in, arrays out


def _tensor_arrays(tensors):
    """(values, bits): values of every tensor as arrays (F64, F32, F16 in their NumPy dtype; BF16,
    F8_E4M3 and F8_E5M2 as float32 holding the values exactly; BOOL as bool; integers as int64),
    and the raw bit patterns of the BF16 and F16 ones as uint16, of the FP8 ones as uint8."""
    values, bits = {}, {}
    for name, dtype, shape, data in tensors:
        shape = tuple(shape)
        if dtype in FP8_DTYPES:
            raw = np.frombuffer(data, np.uint8).reshape(shape)
            bits[name] = raw.copy()
            values[name] = _decode(dtype, raw)
        elif dtype == "BF16":
            raw = np.frombuffer(data, "<u2").reshape(shape)
            bits[name] = raw.copy()
            values[name] = (raw.astype(np.uint32).reshape(-1) << 16).view(np.float32).reshape(shape)
        elif dtype in ("F64", "F32", "F16"):
            values[name] = np.frombuffer(data, _NUMPY_OF[dtype]).reshape(shape).astype(_NUMPY_OF[dtype][1:])
            if dtype == "F16":
                bits[name] = np.frombuffer(data, "<u2").reshape(shape).copy()
        elif dtype == "BOOL":
            values[name] = np.frombuffer(data, np.uint8).reshape(shape) != 0
        elif dtype in ("I64", "I32"):
            values[name] = np.frombuffer(data, _NUMPY_OF[dtype]).reshape(shape).astype(np.int64)
        elif dtype in ("I8", "U8"):  # scaled I8 K/V; nvfp4's packed pairs, E8M0 block scales
            values[name] = np.frombuffer(data, "|i1" if dtype == "I8" else "|u1").reshape(shape).copy()
        else:
            values[name] = np.frombuffer(data, np.uint8).copy()
    return values, bits


class Result(dict):
    """Golden tensors by name: `out`, `out.ref` (F64), `out.bound`, `row.valid` (bool), and
    `weights`, `weights.ref`, `lse`, `lse.ref`, `scores`, `scores.ref` when asked, `out.ref_lo`
    for F64 outputs, and each gradient G asked (`dq`, `dk`, `dv`, `dbias`, `dsinks`) with `G.ref`,
    `G.bound`.

    undecided: {tensor: flat indices} of the elements whose rounding could not be proven (empty
    when every element is proven); alt: {tensor: the other candidate of each}; bits: raw uint16
    patterns of BF16 and F16 tensors; stats: counts and time of the evaluation; metadata: the
    golden file's metadata; tensors: the golden tensors as (name, dtype, shape, bytes)."""

    def __init__(self, tensors, metadata=None, stats=None):
        values, bits = _tensor_arrays(tensors)
        merge = (metadata or {}).get("attn.kind") == "merge"
        golden = [t for t in tensors if _is_golden(t[0], merge)]
        super().__init__({n: values[n] for n, *_ in golden if not n.endswith((".undecided", ".alt"))})
        self.bits = {n: b for n, b in bits.items() if n in self}
        self.undecided = {n[: -len(".undecided")]: values[n] for n, *_ in golden if n.endswith(".undecided")}
        self.alt = {n[: -len(".alt")]: values[n] for n, *_ in golden if n.endswith(".alt")}
        self.metadata = dict(metadata or {})
        self.stats = dict(stats or {})
        self.tensors = golden

    @property
    def out(self):
        return self["out"]


def _is_golden(name, merge=False):
    """A tensor the reference adds (CONTRACT section 3 and 7, their .undecided and .alt included),
    by the reader's own list; lse_partial, golden beside out_partial (an input only of kind merge,
    whose golden tensors never hold it)."""
    return _native.is_golden_tensor_name(name) or (name == "lse_partial" and not merge)


def _threads(threads):
    return int(threads) if threads else (os.cpu_count() or 1)


def evaluate(q=None, k=None, v=None, *, mask=None, bias=None, query_mask=None, seqlens_q=None, seqlens_k=None,
             sinks=None, q_descale=None, k_descale=None, v_descale=None, dout=None, scale=None, causal=None,
             window=None, softcap=None, masked_rows="error", outputs=("out",), input_dtype=None, output_dtype=None,
             output_dtypes=None, threads=None, max_precision=2048, x_q=None, x_kv=None, w_q=None, w_k=None, w_v=None,
             w_o=None, k_cache=None, v_cache=None, block_table=None, kv_layout=None, kv_split_size=None,
             o_partial=None, lse_partial=None, lse_posinf=None, kv_dtype=None, k_scale=None, v_scale=None,
             kv_block_scale=None, k_block_scale=None, v_block_scale=None, k_global_scale=None, v_global_scale=None,
             v_from_k=None, o_scale=None, dropout_mask=None, dropout_p=None):
    """Certified attention on arrays: the golden tensors `attnoracle eval` would write for the case
    file these arrays make, bit for bit (a Result).

    q [B, Hq, Nq, Dk], k [B, Hkv, Nk, Dk], v [B, Hkv, Nk, Dv] (or kind mha: x_q, x_kv, w_q, w_k,
    w_v, w_o); mask, query_mask boolean; seqlens_q, seqlens_k [B] integers (padded varlen); bias,
    sinks [Hq] and dout (the shape of out) F64, F32 or the input dtype; q_descale, k_descale,
    v_descale [B, Hkv] (F32) for FP8 inputs; causal "top_left", "bottom_right" (True: top_left);
    window (left, right); scale and softcap a float (its exact value) or a str (the exact value
    of the text); outputs among "out", "weights", "lse", "scores" and the gradients "dq", "dk",
    "dv", "dbias", "dsinks" (dout given; dsinks with sinks). input_dtype: by default the dtype of q (float64, float32,
    float16; a PyTorch bfloat16 tensor is BF16); "BF16" takes float arrays whose values BF16
    holds exactly (refused otherwise) or uint16 bit patterns, "F8_E4M3" and "F8_E5M2" float
    arrays of values they hold or uint8 bit patterns (output_dtype then required). output_dtypes
    gives outputs dtypes of their own ({"lse": "F32"} or "lse:F32", attn.output_dtypes). A paged
    KV cache replaces k and v: k_cache, v_cache [Npages, P, Hkv, D] (kv_layout "NHD", the default)
    or [Npages, Hkv, P, D] ("HND") and block_table [B, Mpages] integers, with seqlens_k. Every
    value must be exactly representable in its dtype: nothing is rounded silently. Raises
    InputError with the command line's message.

    Split-KV (CONTRACT section 8): kv_split_size n with outputs "out_partial", "lse_partial"
    gives the partial states of the splits of n keys. Kind merge: o_partial [S, B, H, Nq, Dv]
    and lse_partial [S, B, H, Nq] (float64: F64, else F32), sinks optional, instead of q, k, v;
    lse_posinf="empty" reads +inf in lse_partial as -inf.

    Quantized K/V (CONTRACT section 9), beside a float q: k, v (or k_cache, v_cache) stored in
    kv_dtype "F8_E4M3", "F8_E5M2" (uint8 bit patterns, float8 tensors, or float values the format
    holds exactly) or "I8" (int8 arrays, or integer values; the default for int8 arrays), with the
    F32 k_scale, v_scale (per tensor [], per head [1, Hkv, 1, 1], per token [B, Hkv, Nk, 1]; paged:
    [Npages, P, Hkv] NHD, [Npages, Hkv, P] HND). kv_block_scale "mxfp8": F8_E4M3 k, v and uint8
    E8M0 k_block_scale, v_block_scale, one per 32 along D; "nvfp4": uint8 k, v of packed E2M1
    pairs (low nibble first), F8_E4M3 block scales one per 16, F32 scalars k_global_scale,
    v_global_scale. output_dtype is then required. v_from_k=Dv: no v, v is k[..., :Dv]. An FP8
    output_dtype takes the F32 scalar o_scale (out is O / o_scale); outputs may add "amax".
    Dropout: the boolean keep mask dropout_mask (broadcastable to [B, Hq, Nq, Nk]) with dropout_p
    (a float: that exact double; a str: the exact value of its text). Stored elements and scales
    are never rounded: a value its dtype does not hold is refused, naming the element."""
    arrays = dict(q=q, k=k, v=v, x_q=x_q, x_kv=x_kv, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, mask=mask, bias=bias,
                  query_mask=query_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sinks=sinks, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, dout=dout, k_cache=k_cache, v_cache=v_cache,
                  block_table=block_table, o_partial=o_partial, lse_partial=lse_partial, k_scale=k_scale,
                  v_scale=v_scale, k_block_scale=k_block_scale, v_block_scale=v_block_scale,
                  k_global_scale=k_global_scale, v_global_scale=v_global_scale, o_scale=o_scale,
                  dropout_mask=dropout_mask)
    tensors, meta = _case_tensors(arrays, scale=scale, causal=causal, window=window, softcap=softcap,
                                  masked_rows=masked_rows if masked_rows != "error" else None, outputs=outputs,
                                  input_dtype=input_dtype, output_dtype=output_dtype, round_values=False,
                                  file=_ARRAYS, output_dtypes=output_dtypes, kv_layout=kv_layout,
                                  kv_split_size=kv_split_size, lse_posinf=lse_posinf, kv_dtype=kv_dtype,
                                  kv_block_scale=kv_block_scale, v_from_k=v_from_k, dropout_p=dropout_p)
    return _evaluate(tensors, meta, _ARRAYS, threads, max_precision)


def _evaluate(tensors, meta, path, threads, max_precision):
    golden, metadata, stats = _native.evaluate(tensors, meta, path, _threads(threads), int(max_precision))
    return Result(golden, metadata, stats)


def write_case(path, q=None, k=None, v=None, *, mask=None, bias=None, query_mask=None, seqlens_q=None,
               seqlens_k=None, sinks=None, q_descale=None, k_descale=None, v_descale=None, dout=None, scale=None,
               causal=None, window=None, softcap=None, masked_rows=None, outputs=None, input_dtype=None,
               output_dtype=None, round_inputs=True, metadata=None, x_q=None, x_kv=None, w_q=None, w_k=None, w_v=None,
               w_o=None, output_dtypes=None, k_cache=None, v_cache=None, block_table=None, kv_layout=None,
               kv_split_size=None, o_partial=None, lse_partial=None, lse_posinf=None, kv_dtype=None, k_scale=None,
               v_scale=None, kv_block_scale=None, k_block_scale=None, v_block_scale=None, k_global_scale=None,
               v_global_scale=None, v_from_k=None, o_scale=None, dropout_mask=None, dropout_p=None):
    """Writes a case file (safetensors, CONTRACT section 2) from arrays, checked as `attnoracle
    eval` checks it, written atomically. Arguments as for evaluate(); the float values are
    rounded to nearest-even into their dtype (F8_E4M3 saturating at +-448; round_inputs=False:
    refused unless exact; quantized K/V's stored elements and scales are never rounded); `metadata`
    adds keys (e.g. "gen.note"). Returns the path."""
    arrays = dict(q=q, k=k, v=v, x_q=x_q, x_kv=x_kv, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, mask=mask, bias=bias,
                  query_mask=query_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sinks=sinks, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, dout=dout, k_cache=k_cache, v_cache=v_cache,
                  block_table=block_table, o_partial=o_partial, lse_partial=lse_partial, k_scale=k_scale,
                  v_scale=v_scale, k_block_scale=k_block_scale, v_block_scale=v_block_scale,
                  k_global_scale=k_global_scale, v_global_scale=v_global_scale, o_scale=o_scale,
                  dropout_mask=dropout_mask)
    path = os.fspath(path)
    tensors, meta = _case_tensors(arrays, scale=scale, causal=causal, window=window, softcap=softcap,
                                  masked_rows=masked_rows, outputs=outputs, input_dtype=input_dtype,
                                  output_dtype=output_dtype, round_values=round_inputs, file=path, metadata=metadata,
                                  output_dtypes=output_dtypes, kv_layout=kv_layout, kv_split_size=kv_split_size,
                                  lse_posinf=lse_posinf, kv_dtype=kv_dtype, kv_block_scale=kv_block_scale,
                                  v_from_k=v_from_k, dropout_p=dropout_p)
    _native.write_case(path, tensors, meta)
    return path


# ---------------------------------------------------------------------------------------------
# Cases, suites, verdicts

# Features a case can use, as the pytest plugin's `unsupported` names them: "fp8" is either FP8
# input dtype, as "causal" is either alignment; "gradients" any of dq, dk, dv, dbias, dsinks asked,
# "dsinks" that one; "kv_scale" scaled I8 or FP8 K/V, "kv_block_scale" mxfp8 or nvfp4, "fp8_out" an
# FP8 output dtype with o_scale.
FEATURES = ("mha", "gqa", "mask", "bias", "query_mask", "causal", "causal_top_left", "causal_bottom_right",
            "window", "softcap", "scale", "masked_rows_zero", "weights", "lse", "output_dtype", "F64", "F32",
            "F16", "BF16", "expect_error", "seqlens", "sinks", "fp8", "F8_E4M3", "F8_E5M2", "descales", "scores",
            "gradients", "dsinks", "kv_scale", "kv_block_scale", "v_from_k", "fp8_out", "amax", "dropout")
_GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks")


class Case:
    """A case file: inputs as arrays, options, golden tensors when present.

    inputs: {name: array} of the tensors an implementation reads (q, k, v or the mha ones, mask,
    bias, query_mask, seqlens_q, seqlens_k, sinks, the descales, dout); BF16 and FP8 inputs are
    float32 arrays holding the values exactly, and `bits` holds the raw patterns of the BF16 and
    F16 ones (uint16) and of the FP8 ones (uint8). golden: a Result (empty for a case
    without golden tensors). expect: "ok", or "error" for a case that must be refused."""

    def __init__(self, path, tensors, metadata, *, id=None, tags=(), expect="ok"):
        self.path = os.fspath(path)
        self.id = id or os.path.basename(self.path).removesuffix(".safetensors")
        self.tags = tuple(tags)
        self.expect = expect
        self.metadata = dict(metadata)
        self._tensors = tensors
        merge = dict(metadata).get("attn.kind") == "merge"
        values, bits = _tensor_arrays([t for t in tensors if not _is_golden(t[0], merge)])
        self.inputs = values
        self.bits = bits
        self.dtypes = {n: d for n, d, *_ in tensors}
        self.golden = Result(tensors, metadata)
        m = self.metadata
        self.kind = m.get("attn.kind", "sdpa")
        self.input_dtype = self.dtypes[{"mha": "x_q", "merge": "o_partial"}.get(self.kind, "q")]
        self.output_dtype = m.get("attn.output_dtype", self.input_dtype)
        self.scale = m.get("attn.scale")
        self.softcap = m.get("attn.softcap")
        self.causal = m.get("attn.causal", "none")
        w = m.get("attn.window", "none")
        self.window = None if w == "none" else tuple(int(x) for x in w.split(","))
        self.masked_rows = m.get("attn.masked_rows", "error")
        self.outputs = tuple(m.get("attn.outputs", "out").split(","))

    def __repr__(self):
        return f"<attnoracle.Case {self.id} {self.kind} {self.input_dtype}>"

    @property
    def softcap_value(self):
        """attn.softcap as a float (0.0 when absent); its text is exact, this may round."""
        return _number(self.softcap) if self.softcap else 0.0

    @property
    def scale_value(self):
        """attn.scale as a float, or 1/sqrt(Dk) when absent (this may round; the text is exact)."""
        if self.scale is not None:
            return _number(self.scale)
        dk = (self.inputs["q"].shape[-1] if self.kind == "sdpa" else self.inputs["w_q"].shape[-1])
        return 1.0 / float(np.sqrt(dk))

    def _kv_heads(self):
        """Hkv, from k or from a paged k_cache ([Npages, P, Hkv, D] or, HND, [Npages, Hkv, P, D])."""
        if "k" in self.inputs:
            return self.inputs["k"].shape[1]
        return self.inputs["k_cache"].shape[1 if self.metadata.get("attn.kv_layout") == "HND" else 2]

    @property
    def features(self):
        """The features this case uses, among FEATURES."""
        f = {self.input_dtype}
        if self.kind == "mha":
            f.add("mha")
        elif self.kind == "sdpa" and self._kv_heads() != self.inputs["q"].shape[1]:
            f.add("gqa")
        f.update(n for n in ("mask", "bias", "query_mask", "sinks") if n in self.inputs)
        if self.input_dtype in FP8_DTYPES:
            f.add("fp8")
        if any(n in self.inputs for n in _DESCALES):
            f.add("descales")
        if "seqlens_q" in self.inputs or "seqlens_k" in self.inputs:
            f.add("seqlens")
        if self.causal != "none":
            f.update(("causal", "causal_" + self.causal))
        if self.window:
            f.add("window")
        if self.softcap and _number(self.softcap) != 0:
            f.add("softcap")
        if self.scale is not None:
            f.add("scale")
        if self.masked_rows == "zero":
            f.add("masked_rows_zero")
        f.update(n for n in ("weights", "lse", "scores") if n in self.outputs)
        if any(n in self.outputs for n in _GRADIENTS):
            f.add("gradients")
        if "dsinks" in self.outputs:
            f.add("dsinks")
        if "k_scale" in self.inputs or "v_scale" in self.inputs:
            f.add("kv_scale")
        f.update(n for n in ("kv_block_scale", "v_from_k") if "attn." + n in self.metadata)
        if "o_scale" in self.inputs:
            f.add("fp8_out")
        if "amax" in self.outputs:
            f.add("amax")
        if "dropout_mask" in self.inputs:
            f.add("dropout")
        if self.output_dtype != self.input_dtype:
            f.add("output_dtype")
        if self.expect == "error":
            f.add("expect_error")
        return frozenset(f)

    def torch(self):
        """The inputs as PyTorch tensors, floats in their dtype (BF16 as torch.bfloat16, FP8 as
        torch.float8_e4m3fn or float8_e5m2, exactly; FP8 as float32 values where PyTorch has no
        float8), masks as bool."""
        import torch

        out = {}
        for name, a in self.inputs.items():
            fp8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(self.dtypes[name])
            if self.dtypes[name] == "BF16":
                out[name] = torch.from_numpy(self.bits[name].view(np.int16).copy()).view(torch.bfloat16)
            elif fp8 and hasattr(torch, fp8):
                out[name] = torch.from_numpy(self.bits[name].copy()).view(getattr(torch, fp8))
            else:
                out[name] = torch.from_numpy(np.array(a))
        return out

    def evaluate(self, threads=None, max_precision=2048):
        """The golden tensors of this case's inputs, as `attnoracle eval` computes them."""
        inputs = [t for t in self._tensors if not _is_golden(t[0], self.kind == "merge")]
        meta = {k: v for k, v in self.metadata.items() if k not in ("attn.reference", "attn.undecided")}
        return _evaluate(inputs, meta, self.path, threads, max_precision)

    def check(self, outputs, profile="fp32", *, masked_rows=None, returns=None):
        """The gate's verdict on what an implementation returned for this case, computed by the
        conformance library as `attnoracle check` computes it (a Verdict).

        outputs: {"out": array, "weights": ..., "lse": ..., "scores": ...} (each converted to its
        dtype: attn.output_dtypes, a profile's lse dtype (flash profiles: F32), else the case's
        output dtype; rounded to nearest-even like a final cast; uint16 arrays are bit
        patterns of a BF16 or F16 output; the gradients a case asks for are judged too), or a Refused
        or Unsupported exception (any other exception counts as a refusal). profile as for `attnoracle check --profile` (fp32, fp16, a list, a
        family, a JSON file); masked_rows and returns as its --masked-rows and --returns."""
        outcome, reason, result = "output", "", []
        # each output's dtype in the case as the profile's implementation is given it (a flash
        # profile's lse in F32, say)
        given = _native.declared_metadata(self._tensors, self.metadata, str(profile))
        own = dict(e.split(":", 1) for e in given["attn.output_dtypes"].split(",")) \
            if "attn.output_dtypes" in given else {}
        if isinstance(outputs, Unsupported):
            outcome, reason = "unsupported", str(outputs)
        elif isinstance(outputs, BaseException):
            outcome, reason = "refused", str(outputs) or type(outputs).__name__
        else:
            for name, a in dict(outputs).items():
                if a is None:
                    continue
                if name == "dropout_mask":      # the keep mask the implementation drew (CONTRACT section 5)
                    m = np.asarray(a)
                    if m.dtype == np.bool_:
                        result.append((name, "BOOL", [int(n) for n in m.shape], np.ascontiguousarray(m).tobytes()))
                    else:                       # values: the gate refuses the dtype, naming it
                        result.append(_float_tensor(name, m, "F32", True, self.id + " (result)"))
                    continue
                result.append(_float_tensor(name, a, own.get(name, self.output_dtype), True, self.id + " (result)"))
        if returns is not None and not isinstance(returns, str):
            returns = ",".join(returns)
        report, text = _native.check(self.id, list(self.tags), self._tensors, self.metadata, self.expect, outcome,
                                     reason, result, str(profile), masked_rows or "", returns or "")
        return Verdict(json.loads(report), text)


def _number(text):
    try:
        return float(text)
    except ValueError:
        return float.fromhex(text)


class Verdict:
    """The gate's verdict on one case: status ("pass", "fail", "skip"), reason, worst (the
    element of largest error relative to its limit: tensor, index, expected, actual, error,
    limit, ulp, limit_ratio), findings (the diagnosis, one line each), text (the lines
    `attnoracle check --all` prints for this case), report (the case's entry of --json)."""

    def __init__(self, report, text):
        self.report = report["cases"][0]
        c = self.report
        self.id = c.get("id")
        self.status = c.get("status")
        self.reason = c.get("reason", "")
        self.profile = c.get("profile", "")
        self.worst = c.get("worst")
        diag = c.get("diagnosis") or {}
        self.findings = [f.get("text", "") for f in diag.get("findings", [])]
        lines = text.splitlines()
        # The report's heading and its tail (suite-wide figures) are not this case's.
        self.text = "\n".join(l for l in lines[1:] if not l.startswith(("statistical tier:", "1 cases in ")))

    @property
    def passed(self):
        return self.status == "pass"

    @property
    def failed(self):
        return self.status == "fail"

    @property
    def skipped(self):
        return self.status == "skip"

    def __bool__(self):
        return self.passed

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"<attnoracle.Verdict {self.id} {self.status}>"


def load_case(path):
    """Reads a case file (checked as `attnoracle eval` checks it) as a Case."""
    path = os.fspath(path)
    tensors, metadata = _native.read_case(path)
    return Case(path, tensors, metadata)


class SuiteEntry:
    """One case of a vector set's manifest: id, tags, expect, file (path); load() reads it,
    checked against the manifest's sha256 as the gate checks it."""

    def __init__(self, suite, id, file, sha256, expect, tags):
        self.suite, self.id, self.sha256, self.expect, self.tags = suite, id, sha256, expect, tuple(tags)
        self._file = file
        self.file = os.path.join(suite.path, file)

    def load(self):
        tensors, metadata = _native.read_set_case(self.suite.path, self._file, self.sha256)
        return Case(self.file, tensors, metadata, id=self.id, tags=self.tags, expect=self.expect)

    def __repr__(self):
        return f"<attnoracle.SuiteEntry {self.id}>"


class Suite:
    """A vector set (manifest.json and cases/): iterating gives its SuiteEntry objects in the
    manifest's order; suite[id] one of them; name is the manifest's suite."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.name, cases = _native.read_manifest(self.path)
        self.entries = [SuiteEntry(self, *c) for c in cases]
        self._by_id = {e.id: e for e in self.entries}

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, id):
        return self._by_id[id]

    def select(self, tags=None, ids=None):
        """The entries with one of `tags` (all when None) and among `ids` (all when None)."""
        return [e for e in self.entries if (tags is None or set(tags) & set(e.tags)) and (ids is None or e.id in ids)]


def parametrize_suite(path, profile="fp32", *, tags=None, ids=None, unsupported=(), masked_rows=None, returns=None):
    """A decorator giving a test one item per case of the vector set at `path` (ids: the case
    ids), through the `attnoracle_case` fixture of the pytest plugin (-p attnoracle.pytest_plugin):
    cases using a feature listed in `unsupported` (see FEATURES) are skipped with the reason;
    masked_rows and returns are the implementation's declarations, as in Case.check."""
    from .pytest_plugin import parametrize_suite as p

    return p(path, profile=profile, tags=tags, ids=ids, unsupported=unsupported, masked_rows=masked_rows,
             returns=returns)


def clear_cache():
    """Removes every entry of the golden cache (attnoracle.cache); returns (entries, bytes) removed."""
    return cache.clear()


def vector_set(name="core"):
    """The path of a vector set installed with the package (`pip install`: core), or of the source
    tree's vectors/<name> beside a build; InputError when there is none."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "vectors", name),):
        if os.path.isfile(os.path.join(d, "manifest.json")):
            return d
    raise _error(name, "", "no vector set of this name is installed with the package (pip install puts core there)")


from . import cache  # noqa: E402 - after the definitions it uses
from ._assert_close import Profile, assert_close  # noqa: E402
