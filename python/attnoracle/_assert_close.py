"""assert_close: a kernel's outputs on arrays in memory judged by the gate against the certified
reference, in place of a test's final comparison with an upcast reference and a fudge factor."""

import json
import os

import numpy as np

from . import _attnoracle as _native
from . import cache as _cache

_OUTPUTS = ("out", "weights", "lse", "scores")
_GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks", "dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o")
_BASES = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}
_DTYPE_ALIASES = {"fp64": "F64", "float64": "F64", "double": "F64", "fp32": "F32", "float32": "F32",
                  "float": "F32", "fp16": "F16", "float16": "F16", "half": "F16", "bf16": "BF16",
                  "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "fp8": "F8_E4M3", "e4m3": "F8_E4M3"}
_DTYPE_FIELDS = ("projection", "qk_accum", "softmax", "p", "pv_accum", "bias", "grad_dp", "grad_ds", "grad_accum")


def _dtype_name(d):
    """A dtype given as "F32", "fp32", "float32", a NumPy dtype or a PyTorch dtype, by its case-file name."""
    text = str(d).split(".")[-1].strip("'>").removeprefix("dtype(").strip("'")
    if text.upper() in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"):
        return text.upper()
    return _DTYPE_ALIASES.get(text.lower(), str(d))


class Profile:
    """A kernel's arithmetic, for assert_close's `profile`: the fields of a profile's JSON form
    (conformance/TOLERANCE.md) as keywords, over a built-in `base` (by default the one of the
    inputs' dtype: fp64, fp32, fp16, bf16 or fp8).

        attnoracle.Profile(accum="F32", p_dtype="BF16", key_block=128)   # flash-bf16 with 128-key blocks

    accum sets qk_accum and pv_accum, p_dtype sets p (the dtype P is rounded to before P V);
    other keywords are the JSON fields themselves (softmax, projection, bias, exp_ulps, key_block,
    safety, grad_dp, grad_ds, grad_accum, input_dtypes, ...), dtypes as names ("F32", "bf16") or
    NumPy and PyTorch dtypes. An unknown field is refused by the gate's own reader."""

    def __init__(self, base=None, *, name="custom", accum=None, p_dtype=None, **fields):
        self.base = base
        self.fields = {"name": name}
        if accum is not None:
            self.fields["qk_accum"] = self.fields["pv_accum"] = accum
        if p_dtype is not None:
            self.fields["p"] = p_dtype
        self.fields.update(fields)
        for f in _DTYPE_FIELDS:
            if f in self.fields:
                self.fields[f] = _dtype_name(self.fields[f])
        if "input_dtypes" in self.fields:
            self.fields["input_dtypes"] = [_dtype_name(d) for d in self.fields["input_dtypes"]]

    def json(self, input_dtype):
        """Its JSON text for inputs of `input_dtype`."""
        j = dict(self.fields)
        j["base"] = self.base or _BASES.get(input_dtype, "fp32")
        return json.dumps(j)

    def __repr__(self):
        return f"attnoracle.Profile(base={self.base!r}, {self.fields!r})"


def _own_dtype(x, name, file, pkg):
    """The dtype an array holds, by its case-file name (None for bit patterns and other arrays)."""
    a, bits = pkg._as_array(x, name, file)
    return a, bits or pkg._DTYPE_OF_NUMPY.get(a.dtype)


def _results(actual, output_dtype, output_dtypes, input_dtype, file, pkg):
    """(out's dtype, {name: dtype} of the outputs in another dtype, {name: array}) of what the
    kernel returned. Without output_dtype, each output is judged in the dtype it comes in
    (attn.output_dtypes for those other than out's: a BF16 out beside an F32 lse, say); with it,
    every output is in output_dtype but those output_dtypes names."""
    if not isinstance(actual, dict):
        actual = {"out": actual}
    actual = {str(n): a for n, a in actual.items() if a is not None}
    for n in actual:
        if n not in _OUTPUTS + _GRADIENTS:
            raise pkg._error(file, n, "unknown output (expected out, and optionally weights, lse, scores "
                                      "or the gradients " + ", ".join(_GRADIENTS) + ")")
    if "out" not in actual:
        raise pkg._error(file, "out", "missing: actual is the output, or a dict holding 'out'")
    dtypes = {}
    for n, a in actual.items():
        arr, own = _own_dtype(a, n, file, pkg)
        if own is None and arr.dtype == np.uint16 and (output_dtype or input_dtype) in ("BF16", "F16"):
            own = output_dtype or input_dtype  # bit patterns
        if own is None and output_dtype is None:
            raise pkg._error(file, n, f"an array of {arr.dtype} is not an output of attention "
                                      "(float64, float32, float16, bfloat16)")
        dtypes[n] = own
    named = {str(n): _dtype_name(d) for n, d in dict(output_dtypes or {}).items()}
    for n in named:
        if n not in actual:
            raise pkg._error(file, "output_dtypes", f"{n}: not an output the kernel returned")
    out_dtype = named.get("out") or (_dtype_name(output_dtype) if output_dtype is not None else dtypes["out"])
    if output_dtype is not None:
        dtypes = {n: _dtype_name(output_dtype) for n in dtypes}
    dtypes.update(named)
    others = {n: d for n, d in dtypes.items() if n != "out" and d != out_dtype}
    return out_dtype, others, actual


def assert_close(actual, q=None, k=None, v=None, *, profile, causal=False, window=None, softcap=None, scale=None,
                 bias=None, mask=None, query_mask=None, sinks=None, seqlens_q=None, seqlens_k=None, dout=None,
                 q_descale=None, k_descale=None, v_descale=None, masked_rows="zero", input_dtype=None,
                 output_dtype=None, output_dtypes=None, x_q=None, x_kv=None, w_q=None, w_k=None, w_v=None, w_o=None, cache=True,
                 threads=None, max_precision=2048):
    """Judges what an attention kernel returned for these inputs with the gate: raises
    AssertionError with the gate's verdict (the worst element, its value against the golden one
    and its limit, the diagnosis) when an element is beyond its limit or the statistical tier
    rejects the errors (the Verdict as its `verdict`); returns the Verdict otherwise.

    actual: the output (an array or tensor), or a dict of the outputs the kernel returns: out,
    weights, lse, scores, and the gradients dq, dk, dv, dbias, dsinks (dout given). The case asks
    for exactly those. Each is judged in the dtype it comes in (an F32 lse beside a BF16 out, as
    FlashAttention returns them, in F32: attn.output_dtypes); output_dtype, when given, is the
    dtype of every output but those that output_dtypes ({"lse": "F32"}) names.
    Inputs and options as for evaluate(); q, k and v in one dtype (a mix is refused,
    nothing is rounded). profile: a name or list as for `attnoracle check --profile` ("flash-bf16",
    "fp32,bf16", a JSON file), a Profile, or a dict of a profile's JSON fields. masked_rows: the
    kernel's convention for rows with no allowed key: "zero" (FlashAttention's), "nan", "mean",
    or "error" (such a case is refused). cache: the golden values from the golden cache
    (attnoracle.cache), evaluated once per case."""
    import attnoracle as pkg

    file = pkg._ARRAYS
    arrays = dict(q=q, k=k, v=v, x_q=x_q, x_kv=x_kv, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, mask=mask, bias=bias,
                  query_mask=query_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sinks=sinks, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, dout=dout)
    mains = ("x_q", "x_kv", "w_q", "w_k", "w_v", "w_o") if x_q is not None else ("q", "k", "v")
    if input_dtype is None:
        first = None
        for n in mains:
            if arrays[n] is None:
                continue
            _, own = _own_dtype(arrays[n], n, file, pkg)
            if first is None:
                first = (n, own)
            elif own != first[1]:
                raise pkg._error(file, n, f"dtype {own} differs from {first[0]}'s {first[1]}: the inputs share one "
                                          "dtype (give them in one, or input_dtype for bit patterns)")
        dtype = first[1] if first else None
    else:
        dtype = _dtype_name(input_dtype)
    out_dtype, other_dtypes, actual = _results(actual, output_dtype, output_dtypes, dtype, file, pkg)
    if masked_rows not in ("error", "zero", "nan", "mean"):
        raise pkg._error(file, "masked_rows", f"{masked_rows!r} is not error, zero, nan or mean")
    outputs = ["out"] + [n for n in actual if n != "out"]
    no_softcap = softcap is None or (not isinstance(softcap, str) and float(softcap) == 0)
    tensors, meta = pkg._case_tensors(
        arrays, scale=scale, causal=causal, window=window, softcap=None if no_softcap else softcap,
        masked_rows=None if masked_rows == "error" else "zero", outputs=outputs, input_dtype=input_dtype,
        output_dtype=out_dtype if out_dtype != dtype else None, round_values=False, file=file,
        output_dtypes=other_dtypes or None)

    def evaluate():
        return _native.evaluate(tensors, meta, file, pkg._threads(threads), int(max_precision))

    if cache:
        golden, golden_meta, _, _ = _cache.golden(tensors, meta, max_precision, evaluate)
    else:
        golden, golden_meta, _ = evaluate()
    result = [pkg._float_tensor(n, a, other_dtypes.get(n, out_dtype), False, "actual") for n, a in actual.items()]
    returns = ",".join(outputs[1:] + (["gradients"] if set(outputs) & set(_GRADIENTS) else [])) or "out"
    profile_json = ""
    if isinstance(profile, dict):
        profile = Profile(**profile)
    if isinstance(profile, Profile):
        profile_json = profile.json(dtype)
        spec = ""
    else:
        spec = os.fspath(profile)
    report, text = _native.check("assert_close", [], tensors + golden, golden_meta, "ok", "output", "", result, spec,
                                 masked_rows, returns, profile_json)
    verdict = pkg.Verdict(json.loads(report), text)
    if verdict.skipped:
        raise pkg._error("profile", "", verdict.reason)
    if verdict.failed:
        e = AssertionError(f"attnoracle: the kernel's outputs fail under profile {verdict.profile}:\n{verdict.text}")
        e.verdict = verdict
        raise e
    return verdict
