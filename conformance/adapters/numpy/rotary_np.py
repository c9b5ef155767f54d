"""Rotary embedding from given tables (CONTRACT section 10) as a kernel applies it: the first R
features of q and k turned pair by pair at their positions, two products and a sum in float32
(float64 for F64 inputs), each rotated value then rounded to attn.rotary_round; the backward
takes dq and dk of the rotated q and k back through R^T (the rounding passed straight through).
Shared by the NumPy adapter and the FlashAttention-style one; the latter plants BUGS here.
"""
import numpy as np

import safetensors_np

BUGS = {
    "rotary_pairing_swapped": "rotary: interleaved pairs read as half pairs and half as interleaved",
    "rotary_decode_position": "rotary: query i turned at position i, not i + Lk - Lq (a decode query "
                              "at the start of the sequence instead of after the cache)",
    "rotary_sin_flipped": "rotary: the sine's sign flipped (each pair turned the other way)",
    "rotary_on_v": "rotary: v turned at the keys' positions too",
}


def positions(B, Nq, Nk, seqlens_q=None, seqlens_k=None, bug=None):
    """[B, Nq] query positions i + Lk - Lq and [B, Nk] key positions j."""
    lq = np.full(B, Nq) if seqlens_q is None else np.asarray(seqlens_q, np.int64).reshape(B)
    lk = np.full(B, Nk) if seqlens_k is None else np.asarray(seqlens_k, np.int64).reshape(B)
    offset = np.zeros(B, np.int64) if bug == "rotary_decode_position" else lk - lq  # BUG: no offset
    qpos = np.arange(Nq)[None, :] + offset[:, None]
    return qpos, np.broadcast_to(np.arange(Nk)[None, :], (B, Nk))


def pairs(R, pairing):
    """The feature indices (first, second) of each pair."""
    f = np.arange(R // 2)
    return (2 * f, 2 * f + 1) if pairing == "interleaved" else (f, f + R // 2)


def rotate(x, pos, cos, sin, pairing, inverse=False):
    """x [B, H, N, Dk] with its first R features turned at pos [B, N], in x's dtype; inverse: R^T.
    Positions outside the tables (padding rows and keys, never used) are left as they are."""
    nrot, half = cos.shape
    i1, i2 = pairs(2 * half, pairing)
    ok = ((pos >= 0) & (pos < nrot))[:, None, :, None]
    at = np.clip(pos, 0, nrot - 1)
    c = np.asarray(cos, x.dtype)[at][:, None]           # [B, 1, N, R/2]
    s = np.asarray(sin, x.dtype)[at][:, None]
    if inverse:
        s = -s
    x1, x2 = x[..., i1], x[..., i2]
    y = x.copy()
    with np.errstate(all="ignore"):
        y[..., i1] = np.where(ok, x1 * c - x2 * s, x1)
        y[..., i2] = np.where(ok, x1 * s + x2 * c, x2)
    return y


def round_to(a, dtype):
    """a rounded to nearest even into `dtype` (F64, F32, F16, BF16), as float64."""
    with np.errstate(over="ignore"):
        if dtype == "BF16":
            bits = safetensors_np.bf16_bits(np.asarray(a, np.float64)).astype(np.uint32)
            return (bits << 16).view(np.float32).astype(np.float64)
        return np.asarray(a).astype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[dtype]).astype(np.float64)


def apply(q, k, v, tensors, meta, in_dtype, seqlens_q=None, seqlens_k=None, bug=None):
    """(q, k, v) as the kernel's attention reads them, in their dtype, and `back`, which takes
    (dq, dk) of the rotated q and k to those of the given ones."""
    pairing = meta["attn.rotary"]
    if bug == "rotary_pairing_swapped":                 # BUG: the other pairing
        pairing = "half" if pairing == "interleaved" else "interleaved"
    cos, sin = np.asarray(tensors["rotary_cos"], np.float64), np.asarray(tensors["rotary_sin"], np.float64)
    if bug == "rotary_sin_flipped":                     # BUG: turned the other way
        sin = -sin
    B, _, Nq, _ = q.shape
    qpos, kpos = positions(B, Nq, k.shape[2], seqlens_q, seqlens_k, bug)
    arith = np.float64 if in_dtype == "F64" else np.float32
    rnd = meta.get("attn.rotary_round", "F64" if in_dtype == "F64" else "F32")
    turn = lambda x, pos: round_to(rotate(np.asarray(x, arith), pos, cos, sin, pairing), rnd).astype(x.dtype)
    if bug == "rotary_on_v" and v.shape[-1] >= 2 * cos.shape[1]:   # BUG: v turned as k
        v = turn(v, kpos)

    def back(dq, dk):
        return (None if dq is None else rotate(dq, qpos, cos, sin, pairing, inverse=True),
                None if dk is None else rotate(dk, kpos, cos, sin, pairing, inverse=True))
    return turn(q, qpos), turn(k, kpos), v, back
