#!/usr/bin/env python3
"""Attention in plain NumPy, as an AttnOracle adapter (CONTRACT section 5).

    /usr/bin/python3 attention.py [--dtype float32|float64] [--bug NAME] JOBS.jsonl

Each line of JOBS.jsonl is {"id": ..., "input": path, "output": path}. For each job it writes
exactly one of `output` (out, plus weights, lse and scores when asked), `output.error` (refused: a fully
masked row under attn.masked_rows=error) or `output.unsupported`. Exit status 0 after the list.

--bug NAME plants a known mistake, to check that the oracle catches it (see BUGS).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_np  # noqa: E402
import stored_kv_np  # noqa: E402
import rotary_np  # noqa: E402

# A kernel's mistakes in reading stored K/V and writing FP8 outputs (the FlashAttention-style
# kernel sets it to its --bug: those stored_kv_np.py names, "e5m2_saturate" and
# "paged_tail_page_read", the last page of each row gathered whole).
KV_BUG = None

BUGS = {
    "causal_leak": "the causal mask also allows the next key (j <= i + 1)",
    "no_max_subtraction": "exp(s) without subtracting the row maximum",
    "unnormalised": "weights divided by 1.01 times their sum",
    "mask_ignored": "the boolean mask tensor is ignored",
    "heads_swapped": "query head h reads the kv head of query head (h + 1) mod Hq",
    "shift_one_key": "adds 1.0 to the score of key 0",
    "padding_key_leak": "masked keys get weight exp(-20) (before normalising) instead of 0",
    "transposed_gqa": "query head h reads kv head h % Hkv instead of h // (Hq / Hkv)",
    "no_scaling": "the scores are not scaled (scale 1, whatever attn.scale says)",
    "scale_by_dk": "the default scale is 1/Dk instead of 1/sqrt(Dk)",
    "no_max_subtraction_f16": "F16 inputs: the softmax in float16 without subtracting the row maximum "
                              "(exp overflows past scores of about 11)",
    "mask_after_softmax": "softmax over every key, then the masked weights zeroed without renormalising",
    "causal_off_by_one": "the causal mask allows j < i instead of j <= i (a row left with no key is "
                         "handled as a fully masked row)",
    "other_alignment": "causal top_left and bottom_right swapped (the window follows)",
    "gqa_tiled": "the kv heads tiled (torch .repeat) instead of repeated (repeat_interleave): "
                 "query head h reads kv head h % Hkv",
    "softcap_after_bias": "the softcap applied after the bias is added",
    "pv_f16_accumulation": "F16 inputs: P V accumulated in float16, key by key",
    "truncate_output": "computed in float64, then rounded toward zero (not to nearest) into the output dtype",
    "nan_from_masked": "masked scores set to NaN instead of -inf; the row maximum (np.max) spreads it "
                       "over every row with a masked key",
    "masked_row_nan": "a fully masked row gives NaN (0/0) where attn.masked_rows=zero declares zeros",
    "drop_last_key": "the last key is ignored (a loop over range(Nk - 1))",
    # caught by the relations of `attnoracle invariants` that change a parameter
    "meta_head_bias_ignored": "query head 0 ignores the finite values of the bias (-inf still masks)",
    "meta_window_off_by_one": "the window's left edge excludes key i - left (i - left < j)",
    "meta_softcap_ignored": "attn.softcap is ignored",
    # backward (gradients)
    "bwd_dbias_not_reduced": "dbias takes index 0 of dS along the bias's broadcast dimensions "
                             "instead of summing over them",
    "bwd_padding_rows": "padding rows (query_mask false, past seqlens_q) are differentiated like the "
                        "others: their dout enters dk and dv, and their dq is not zeroed",
    "bwd_gqa_sum_tiled": "dk and dv summed over the query heads h with h % Hkv = g (a tiled "
                         "reshape) instead of those with h // (Hq / Hkv) = g",
    "bwd_dsinks_sign": "dsinks = + sum P_sink D instead of - sum P_sink D",
    "bwd_sinks_ignored": "the backward recomputes P without the sink (each row's weights summing to "
                         "1), so dq, dk, dv, dbias are those of a case without sinks",
    "mha_bwd_dwo_transposed": "kind mha: dw_o computed as dout^T O (a [Dout, H*Dv] array) and "
                              "reshaped to w_o's shape",
    "mha_bwd_dxkv_no_dv": "kind mha: dx_kv (and in self-attention dx_q) misses the term of dv",
}
BUGS.update({
    # split-KV partial states and kind merge (CONTRACT section 8)
    "merge_nan_empty": "kind merge: a split of lse -inf still weighs its O by exp(-inf) = 0, and "
                       "0 times the NaN such a split may hold is NaN",
    "split_with_sink": "the partial states include the sink's term (it belongs to the merge only)",
})
MHA_GRADIENTS = ("dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o")
GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks") + MHA_GRADIENTS

KEYS = {"attn.format", "attn.kind", "attn.scale", "attn.causal", "attn.window", "attn.softcap",
        "attn.masked_rows", "attn.output_dtype", "attn.output_dtypes", "attn.outputs", "attn.kv_layout",
        "attn.kv_split_size", "attn.lse_posinf", "attn.kv_block_scale", "attn.v_from_k",
        "attn.rotary", "attn.rotary_round", "attn.dropout_p"}
ROTARY_BUG = None                       # a rotary_np.BUGS name, set by an adapter built on this one
PARTIALS = ("out_partial", "lse_partial")
FLOATS = {"F64", "F32", "F16", "BF16"}
FP8 = {"F8_E4M3", "F8_E5M2"}
DESCALES = ("q_descale", "k_descale", "v_descale")
DRAW = None   # --draw-dropout: the generator of this adapter's own keep masks


class Refused(Exception):
    """The case is refused (written as output.error)."""


class Unsupported(Exception):
    """The case uses something this adapter does not do (written as output.unsupported)."""


def number(text):
    """A decimal or C hex float ("0x1.6a09e667f3bcdp-3")."""
    try:
        return float(text)
    except ValueError:
        return float.fromhex(text)


def apply_descales(q, k, v, descales):
    """FP8: the real q[b, h] is the stored value times q_descale[b, h // (Hq / Hkv)], k and v
    likewise at [b, g]; one rounding each in the compute dtype."""
    group = q.shape[1] // k.shape[1]
    d = {n: descales[n][:, :, None, None] for n in descales}
    if "q_descale" in d:
        q = q * np.repeat(d["q_descale"], group, axis=1)
    if "k_descale" in d:
        k = k * d["k_descale"]
    if "v_descale" in d:
        v = v * d["v_descale"]
    return q, k, v


def attention(q, k, v, meta, bug, mask=None, bias=None, query_mask=None, in_dtype=None,
              seqlens_q=None, seqlens_k=None, descales=None, sinks=None, stored_kv=False,
              dropout=None):
    """q [B,Hq,Nq,Dk], k [B,Hkv,Nk,Dk], v [B,Hkv,Nk,Dv], sinks [Hq] -> out, weights, lse,
    scores (compute dtype).

    seqlens_q, seqlens_k [B]: valid query and key counts per batch (padded varlen).
    in_dtype (the case's input dtype name) matters only to the bugs of F16 kernels; descales
    (FP8 inputs) maps q_descale, k_descale, v_descale to [B, Hkv] arrays; stored_kv (K/V stored
    scaled, given here as their real values) matters only to other kernels. dropout: (keep, p),
    the boolean keep mask and p: out = (weights * keep / (1 - p)) v, the weights returned as they
    are (CONTRACT section 10)."""
    if descales:
        q, k, v = apply_descales(q, k, v, descales)
    B, Hq, Nq, Dk = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    lq = np.full(B, Nq) if seqlens_q is None else seqlens_q.astype(np.int64)
    lk = np.full(B, Nk) if seqlens_k is None else seqlens_k.astype(np.int64)
    if seqlens_q is not None:           # queries past seqlens_q are padding, like query_mask false
        valid = np.arange(Nq)[None, :] < lq[:, None]
        query_mask = valid if query_mask is None else query_mask & valid
    dt = q.dtype

    # GQA / MQA: query head h reads kv head h // (Hq / Hkv).
    g = np.arange(Hq) // (Hq // Hkv)
    if bug == "heads_swapped":          # BUG: the mapping of the next query head
        g = g[(np.arange(Hq) + 1) % Hq]
    if bug == "transposed_gqa":         # BUG: interleaved instead of grouped
        g = np.arange(Hq) % Hkv
    if bug == "gqa_tiled":              # BUG: np.tile (torch .repeat) instead of np.repeat
        k, v = (np.tile(a, (1, Hq // Hkv, 1, 1)) for a in (k, v))
    else:
        k, v = k[:, g], v[:, g]

    # Scores: scale * Q K^T, then softcap, then bias.
    scale = number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
    if bug == "scale_by_dk" and "attn.scale" not in meta:     # BUG: 1/Dk
        scale = 1.0 / Dk
    if bug == "no_scaling":             # BUG: the scale forgotten
        scale = 1.0
    s = dt.type(scale) * (q @ np.swapaxes(k, -1, -2))
    cap = number(meta.get("attn.softcap", "0"))
    if bug == "meta_softcap_ignored":   # BUG: no softcap
        cap = 0
    if cap != 0 and bug != "softcap_after_bias":   # BUG softcap_after_bias: moved below the bias
        s = dt.type(cap) * np.tanh(s / dt.type(cap))
    if bug == "shift_one_key":          # BUG: key 0 gets a bonus
        s[..., 0] += 1
    allowed = np.ones((B, Hq, Nq, Nk), dtype=bool)
    if bias is not None:
        bias = np.broadcast_to(bias.astype(dt), s.shape)
        if bug == "meta_head_bias_ignored":   # BUG: head 0 without its bias
            bias = bias.copy()
            bias[:, 0] = np.where(bias[:, 0] == -np.inf, -np.inf, 0)
        allowed &= bias != -np.inf
        s = s + np.where(allowed, bias, 0)
    if cap != 0 and bug == "softcap_after_bias":    # BUG: softcap(T + bias)
        s = dt.type(cap) * np.tanh(s / dt.type(cap))
    if mask is not None and bug != "mask_ignored":      # BUG mask_ignored skips this
        allowed &= np.broadcast_to(mask, allowed.shape)

    # Causal and window masks, 0-based; i' = i (top_left) or i + Lk - Lq (bottom_right), with
    # Lk, Lq the batch's lengths (Nk, Nq without seqlens); keys j >= Lk are not allowed.
    causal = meta.get("attn.causal", "none")
    if bug == "other_alignment":        # BUG: the alignments swapped
        causal = {"top_left": "bottom_right", "bottom_right": "top_left"}.get(causal, causal)
    shift = (lk - lq)[:, None, None, None] if causal == "bottom_right" else 0
    i = np.arange(Nq)[None, None, :, None] + shift      # [B,1,Nq,1]
    j = np.arange(Nk)[None, None, None, :]
    allowed &= j < lk[:, None, None, None]
    if causal != "none":
        allowed &= j <= i + (1 if bug == "causal_leak" else 0)   # BUG causal_leak: + 1
        if bug == "causal_off_by_one":  # BUG: j < i
            allowed &= j < i
    window = meta.get("attn.window", "none")
    if window != "none":
        left, right = (int(x) for x in window.split(","))
        allowed &= (i - left <= j) & (j <= i + right)
        if bug == "meta_window_off_by_one":   # BUG: i - left < j
            allowed &= i - left < j
    if bug == "drop_last_key":          # BUG: the loop over keys stops one short
        allowed[..., -1] = False

    # Fully masked rows: refused under policy error (padding rows excepted), else zeros. With
    # sinks a row without an allowed key still has its sink: not fully masked.
    live = allowed.any(axis=-1)                          # [B,Hq,Nq]
    if meta.get("attn.masked_rows", "error") == "error" and sinks is None:
        is_query = np.ones((B, Nq), bool) if query_mask is None else query_mask
        bad = np.argwhere(~live & is_query[:, None, :])
        if len(bad):
            b, h, row = bad[0]
            raise Refused(f"fully masked row: b={b}, h={h}, i={row} has no allowed key "
                          f"(attn.masked_rows=error)")

    mask_late = None
    if bug == "mask_after_softmax":     # BUG: the softmax sees every key (-inf biases aside) ...
        mask_late = allowed
        allowed = np.ones_like(allowed) if bias is None else bias != -np.inf
        live = allowed.any(axis=-1)
    f16_softmax = bug == "no_max_subtraction_f16" and in_dtype == "F16"

    # Softmax over the allowed keys, with the row maximum subtracted.
    s = np.where(allowed, s, -np.inf)
    scores = s
    if bug == "nan_from_masked":        # BUG: masked scores NaN, and np.max propagates NaN
        s = np.where(allowed, s, np.nan)
    m = np.where(live, s.max(axis=-1, initial=-np.inf), 0).astype(dt)[..., None]   # Nk = 0: no key
    if sinks is not None:               # the sink is one more term of the denominator (and of m)
        sink = np.broadcast_to(sinks.astype(dt)[None, :, None, None], m.shape)
        m = np.where(live[..., None], np.maximum(m, sink), sink)
    if bug == "no_max_subtraction" or f16_softmax:      # BUG: exp of the raw scores
        m = np.zeros_like(m)
    with np.errstate(over="ignore", invalid="ignore"):
        if f16_softmax:                 # BUG: ... in float16 (exp, sum, division)
            s, m = s.astype(np.float16), m.astype(np.float16)
        p = np.exp(s - m)                                # exp(-inf) = 0 where not allowed
        if bug == "padding_key_leak":   # BUG: masked keys are not quite 0
            p = np.where(allowed, p, dt.type(math.exp(-20)))
        z = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            z = z + np.exp(sink - m)
            live = np.ones_like(live)   # every row has its sink: lse finite, weights p / z
        if bug == "unnormalised":       # BUG: the wrong denominator
            z = z + dt.type(0.01) * z
        w = np.where(live[..., None], p / np.where(z == 0, 1, z), 0).astype(dt)
        if bug == "masked_row_nan":     # BUG: 0 / 0 on a fully masked row
            w = (p / z).astype(dt)
        lse = np.where(live, (m + np.log(z))[..., 0], -np.inf).astype(dt)
    if mask_late is not None:           # BUG mask_after_softmax: ... then the mask, no renormalising
        w = np.where(mask_late, w, 0).astype(dt)
    # Unused positions may hold NaN or infinities: a value row no query other than padding
    # attends (the contract refuses any other). As 0, it keeps 0 * NaN out of the other rows.
    out = dropped(w, dropout) @ np.where(np.isfinite(v), v, 0).astype(dt)
    if bug == "pv_f16_accumulation" and in_dtype == "F16":   # BUG: a float16 accumulator
        acc = np.zeros(out.shape, np.float16)
        for key in range(Nk):
            acc = (acc + w[..., key, None] * v[..., key, None, :]).astype(np.float16)
        out = acc.astype(dt)
    return out, w, lse, scores


numpy_attention = attention   # the backward's forward, whatever kernel replaces `attention`


def dropped(w, dropout):
    """w * keep / (1 - p) (dropout = (keep, p)), the scale formed in w's dtype; w without dropout."""
    if dropout is None:
        return w
    keep, p = dropout
    dt = w.dtype.type
    return (w * np.broadcast_to(keep, w.shape) * (dt(1) / (dt(1) - dt(p)))).astype(w.dtype)


def draw_keep(rng, shape, p):
    """A keep mask of its own: each element kept with probability 1 - p, independently."""
    return rng.random(shape) >= p


def query_rows(B, Nq, query_mask=None, seqlens_q=None):
    """Bool [B, Nq]: the rows that are not padding (query_mask true and i < seqlens_q[b])."""
    rows = np.ones((B, Nq), bool) if query_mask is None else query_mask.astype(bool)
    if seqlens_q is not None:
        rows = rows & (np.arange(Nq)[None, :] < seqlens_q.astype(np.int64)[:, None])
    return rows


def reduce_to(g, shape, bug=None):
    """g [B,H,Nq,Nk] summed over the dimensions along which an array of `shape` was broadcast
    (NumPy's rules), then given that shape."""
    padded = (1,) * (g.ndim - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(g.ndim) if padded[a] == 1 and g.shape[a] != 1)
    if bug == "bwd_dbias_not_reduced":  # BUG: one slice where the sum belongs
        return g[tuple(slice(0, 1) if a in axes else slice(None) for a in range(g.ndim))].reshape(shape)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def gradients(q, k, v, dout, meta, bug, names, mask=None, bias=None, query_mask=None, in_dtype=None,
              seqlens_q=None, seqlens_k=None, out_dtype=None, sinks=None, dropout=None):
    """dq, dk, dv, dbias, dsinks (those in `names`) of kind sdpa, in float64 whatever --dtype: the forward
    again in float64 (this adapter's arithmetic: scale times Q K^T, c tanh(t / c), + bias, the
    softmax with the row maximum subtracted), then dS = P (dP - D) with dP = dout V^T and
    D_i = dout_i . out_i, dT = dS (1 - tanh^2(T / c)), dq = scale dT K, dk = scale dT^T Q,
    dv = P^T dout, dbias = dS reduced over the bias's broadcast dimensions, and with sinks
    dsinks[h] = - sum over b, i of P_sink D_i, P_sink = exp(sink - lse). Padding rows get 0
    and add nothing; so do fully masked rows (P = 0), rows with only their sink (out = 0, so
    D = 0) and unused positions. Dropout (keep, p): dP and dv's weights times keep / (1 - p)."""
    f64 = np.float64
    B, Hq, Nq, Dk = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    rows = query_rows(B, Nq, query_mask, seqlens_q)
    if bug == "bwd_padding_rows":       # BUG: every row counted as a query
        rows = np.ones_like(rows)
    finite = lambda a: np.where(np.isfinite(a), a, 0).astype(f64)   # unused positions read as 0
    q, k, v = finite(q), finite(k), finite(v)
    dout = np.where(rows[:, None, :, None], finite(dout), 0)
    out, p, lse, _ = numpy_attention(q, k, v, meta, None, mask=mask, bias=bias, query_mask=query_mask,
                                     in_dtype=in_dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                     sinks=sinks, dropout=dropout)
    if sinks is not None:               # P_sink = exp(sink - lse), lse holding the sink's term
        lse = np.where(rows[:, None, :], lse.reshape(B, Hq, Nq), 0)   # padding rows: -inf there
        p_sink = np.where(rows[:, None, :], np.exp(sinks.astype(f64)[None, :, None] - lse), 0)
    if sinks is not None and bug == "bwd_sinks_ignored":   # BUG: the backward's P without the sink
        zero = dict(meta, **{"attn.masked_rows": "zero"})  # rows with only their sink: no key left
        out, p, _, _ = numpy_attention(q, k, v, zero, None, mask=mask, bias=bias, query_mask=query_mask,
                                       in_dtype=in_dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    p = np.where(rows[:, None, :, None], p, 0)          # padding rows: no weight, no gradient
    out = np.where(rows[:, None, :, None], out, 0)
    g = np.arange(Hq) // group
    kg, vg = k[:, g], v[:, g]
    scale = number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
    dp = dropped(dout @ np.swapaxes(vg, -1, -2), dropout)
    delta = np.sum(dout * out, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    cap = number(meta.get("attn.softcap", "0"))
    dt = ds
    if cap != 0:
        t = scale * (q @ np.swapaxes(kg, -1, -2))
        dt = ds * (1 - np.tanh(t / cap) ** 2)
    result = {}
    if "dq" in names:
        result["dq"] = scale * (dt @ kg)
    def per_kv_head(a):                 # [B,Hq,...] -> [B,Hkv,...]: the group's query heads summed
        if bug == "bwd_gqa_sum_tiled":  # BUG: heads g, g + Hkv, ... summed
            return a.reshape((B, group, Hkv) + a.shape[2:]).sum(axis=1)
        return a.reshape((B, Hkv, group) + a.shape[2:]).sum(axis=2)
    if "dk" in names:
        result["dk"] = per_kv_head(scale * (np.swapaxes(dt, -1, -2) @ q))
    if "dv" in names:
        result["dv"] = per_kv_head(np.swapaxes(dropped(p, dropout), -1, -2) @ dout)
    if "dbias" in names:
        padded = (1,) * (4 - bias.ndim) + bias.shape
        # broadcast along the keys: each row of dS sums to 0 (with a sink, to P_sink D_i)
        if padded[3] == 1 and sinks is None and bug != "bwd_dbias_not_reduced":
            result["dbias"] = np.zeros(bias.shape, f64)
        else:
            result["dbias"] = reduce_to(ds, bias.shape, bug)
    if "dsinks" in names:
        sign = 1 if bug == "bwd_dsinks_sign" else -1    # BUG bwd_dsinks_sign: the sign flipped
        result["dsinks"] = sign * np.sum(p_sink * delta[..., 0], axis=(0, 2))
    return result


def self_attention(x_q, x_kv):
    """Kind mha: x_q and x_kv of one shape and equal values (then dx_q is the gradient of x)."""
    return x_q.shape == x_kv.shape and np.array_equal(x_q, x_kv)


def mha_gradients(x, dout, meta, bug, names, mask=None, bias=None, query_mask=None, in_dtype=None,
                  seqlens_q=None, seqlens_k=None, out_dtype=None, sinks=None):
    """dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, dbias, dsinks (those in `names`) of kind mha, in
    float64: Q_h = X_q W_q[h], K_h, V_h likewise (exact in float64 for small cases), O_h the
    forward of head h, dO_h = dout W_o[h Dv:(h+1) Dv]^T, then head h's backward (`gradients`
    with dout -> dO_h) and the chain rule through the projections: dx_q = sum_h dq_h W_q[h]^T,
    dw_q[h] = X_q^T dq_h, dx_kv = sum_h dk_h W_k[h]^T + dv_h W_v[h]^T, dw_k[h] = X_kv^T dk_h,
    dw_v[h] = X_kv^T dv_h, dw_o = concat_h(O_h)^T dout over the rows that are not padding and
    not fully masked. In self-attention dx_q holds both sums."""
    x_q, x_kv, w_q, w_k, w_v, w_o = (x[n] for n in ("x_q", "x_kv", "w_q", "w_k", "w_v", "w_o"))
    B, Nq, _ = x_q.shape
    H, _, Dv = w_v.shape
    proj = lambda a, wt: np.einsum("bnd,hde->bhne", a, wt)
    q, k, v = proj(x_q, w_q), proj(x_kv, w_k), proj(x_kv, w_v)
    rows = query_rows(B, Nq, query_mask, seqlens_q)
    if bug == "bwd_padding_rows":       # BUG: every row counted as a query
        rows = np.ones_like(rows)
    dout = np.where(rows[:, :, None], dout, 0)
    w_oh = w_o.reshape(H, Dv, -1)                        # row h Dv + c of w_o is [h, c]
    d_o = np.einsum("bie,hce->bhic", dout, w_oh)         # dO_h
    head = [n for n in ("dbias", "dsinks") if n in names]
    g = gradients(q, k, v, d_o, meta, bug, ["dq", "dk", "dv"] + head, mask=mask, bias=bias,
                  query_mask=query_mask, in_dtype=in_dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                  out_dtype=out_dtype, sinks=sinks)
    result = {n: g[n] for n in head}
    dq, dk, dv = g["dq"], g["dk"], g["dv"]
    if "dx_q" in names or "dx_kv" in names:
        dx_q = np.einsum("bhic,hdc->bid", dq, w_q)
        dx_kv = np.einsum("bhjc,hdc->bjd", dk, w_k)
        if bug != "mha_bwd_dxkv_no_dv":     # BUG mha_bwd_dxkv_no_dv: the dv term left out
            dx_kv = dx_kv + np.einsum("bhjc,hdc->bjd", dv, w_v)
        result["dx_q"] = dx_q + dx_kv if self_attention(x_q, x_kv) else dx_q
        result["dx_kv"] = dx_kv
    result["dw_q"] = np.einsum("bid,bhic->hdc", x_q, dq)
    result["dw_k"] = np.einsum("bjd,bhjc->hdc", x_kv, dk)
    result["dw_v"] = np.einsum("bjd,bhjc->hdc", x_kv, dv)
    if "dw_o" in names:
        o = numpy_attention(q, k, v, meta, None, mask=mask, bias=bias, query_mask=query_mask,
                            in_dtype=in_dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sinks=sinks)[0]
        o = np.where(rows[:, None, :, None], o, 0)       # padding rows add nothing
        if bug == "mha_bwd_dwo_transposed":  # BUG: dout^T O, [Dout, H Dv], put in w_o's shape
            result["dw_o"] = np.einsum("bhic,bie->ehc", o, dout).reshape(w_o.shape)
        else:
            result["dw_o"] = np.einsum("bhic,bie->hce", o, dout).reshape(w_o.shape)
    return {n: result[n] for n in names}


def split_states(q, k, v, meta, bug, n, mask=None, sinks=None, **extra):
    """out_partial [S,B,Hq,Nq,Dv], lse_partial [S,B,Hq,Nq] (attn.kv_split_size n): per split, the
    attention over its keys alone (the others masked out), without the sink, a row with no key in
    the split 0 with lse -inf."""
    Nk = k.shape[2]
    meta_s = dict(meta, **{"attn.masked_rows": "zero", "attn.outputs": "out,lse"})
    outs, lses = [], []
    for s in range(-(-Nk // n)):
        keys = (np.arange(Nk) >= s * n) & (np.arange(Nk) < (s + 1) * n)
        o, _, lse, _ = attention(q, k, v, meta_s, bug, mask=keys if mask is None else np.logical_and(mask, keys),
                                 sinks=sinks if bug == "split_with_sink" else None, **extra)   # BUG: the sink kept
        outs.append(o)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def merge_states(o, lse, meta, bug, sinks=None):
    """Kind merge: out [B,H,Nq,Dv], lse [B,H,Nq] of the partial states o [S,B,H,Nq,Dv], lse
    [S,B,H,Nq] (CONTRACT section 8), in the dtype of o: the weights exp(lse_s - lse)."""
    live = lse != -np.inf
    if bug != "merge_nan_empty":        # BUG merge_nan_empty skips this: 0 * NaN = NaN
        o = np.where(live[..., None], o, 0)
    m = lse.max(axis=0)
    if sinks is not None:
        m = np.maximum(m, sinks.astype(o.dtype)[None, :, None])
    row = m != -np.inf
    if meta.get("attn.masked_rows", "error") == "error" and not row.all():
        b, h, i = np.argwhere(~row)[0]
        raise Refused(f"fully masked row: b={b}, h={h}, i={i} has no split (every lse_partial -inf) and no sink")
    m = np.where(row, m, 0).astype(o.dtype)
    with np.errstate(invalid="ignore"):
        w = np.exp(lse - m)                                  # 0 where lse_s = -inf
        z = w.sum(axis=0)
        if sinks is not None:
            z = z + np.exp(sinks.astype(o.dtype)[None, :, None] - m)
        z = np.where(row, z, 1)
        out = (w[..., None] * o).sum(axis=0) / z[..., None]
    return out, np.where(row, m + np.log(z), -np.inf).astype(o.dtype)


def run_merge(path, tensors, meta, dtypes, compute, bug):
    """Kind merge: o_partial, lse_partial, optional sinks -> out, lse."""
    if dtypes.get("o_partial") not in FLOATS or dtypes.get("lse_partial") not in ("F32", "F64"):
        raise Unsupported(f"kind merge with o_partial {dtypes.get('o_partial')}, lse_partial {dtypes.get('lse_partial')}")
    lse = tensors["lse_partial"].astype(np.float64)
    if meta.get("attn.lse_posinf") == "empty":
        lse = np.where(lse == np.inf, -np.inf, lse)
    bad = np.argwhere(np.isnan(lse) | (lse == np.inf))
    if len(bad):
        raise Refused(f"{path}: lse_partial: element {np.ravel_multi_index(tuple(bad[0]), lse.shape)} is not finite or -inf")
    out_dtype = meta.get("attn.output_dtype", dtypes["o_partial"])
    outputs = meta.get("attn.outputs", "out").split(",")
    dtype_of = output_dtypes(meta, outputs + ["out"], out_dtype)
    sinks = tensors["sinks"].astype(compute) if "sinks" in tensors else None
    out, lse_out = merge_states(tensors["o_partial"].astype(compute), lse.astype(compute), meta, bug, sinks=sinks)
    result = {"out": out, "lse": lse_out}
    result = {name: result[name] for name in outputs + ["out"] * ("out" not in outputs)}
    numpy_type = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
    with np.errstate(over="ignore"):
        result = {name: a.astype(numpy_type[dtype_of[name]]) if dtype_of[name] != "BF16" else a
                  for name, a in result.items()}
    return result, {name: dtype_of[name] for name in result}


def truncate(a, dtype):
    """float64 `a` rounded toward zero to the precision and range of `dtype` (bug truncate_output)."""
    precision, emin, top = {"F64": (53, -1022, 1024), "F32": (24, -126, 128), "F16": (11, -14, 16),
                            "BF16": (8, -126, 128)}[dtype]
    a = np.asarray(a, np.float64)
    finite = np.isfinite(a)
    e = np.frexp(np.where(finite, a, 0))[1] - 1           # binade: 2^e <= |a| < 2^(e+1)
    shift = np.maximum(e, emin) - precision + 1           # exponent of the last kept bit
    t = np.ldexp(np.trunc(np.ldexp(a, -shift)), shift)    # exact: only bits are dropped
    big = np.ldexp(2.0 - 2.0 ** (1 - precision), top - 1)  # the largest finite value
    return np.where(finite, np.clip(t, -big, big), a)


def output_dtypes(meta, outputs, out_dtype):
    """{output: its dtype}: attn.output_dtypes (name:DTYPE,...) over attn.output_dtype (out's
    alone when that is FP8: the others are then F32, amax always)."""
    own = {"amax": "F32"}
    if out_dtype in FP8:
        own.update({name: "F32" for name in outputs if name != "out"})
    for entry in meta["attn.output_dtypes"].split(",") if "attn.output_dtypes" in meta else []:
        name, _, dtype = entry.partition(":")
        if dtype not in FLOATS:
            raise Unsupported(f"attn.output_dtypes: dtype {dtype!r} of {name!r}")
        own[name] = dtype
    return {name: own.get(name, out_dtype) for name in outputs}


def gather_paged(path, tensors, dtypes, meta):
    """A paged KV cache (CONTRACT section 8) read into contiguous k and v [B, Hkv, Nk, D] in place
    of k_cache, v_cache and block_table: key j of batch b is slot j % P of page
    block_table[b, j // P] for j < seqlens_k[b], 0 past it (unused entries and slots never read)."""
    if "k" in tensors or "v" in tensors:
        raise Refused(f"{path}: k: given beside a paged KV cache")
    for name in ("k_cache", "v_cache", "block_table", "seqlens_k"):
        if name not in tensors:
            raise Refused(f"{path}: {name}: missing (a paged KV cache needs k_cache, v_cache, block_table, seqlens_k)")
    layout = meta.get("attn.kv_layout", "NHD")
    if layout not in ("NHD", "HND"):
        raise Refused(f"{path}: attn.kv_layout: {layout!r} is not NHD or HND")
    table = tensors.pop("block_table").astype(np.int64)
    lk = tensors["seqlens_k"].astype(np.int64)
    for name in ("k", "v"):
        cache = tensors.pop(name + "_cache")
        if layout == "HND":                              # [Npages, Hkv, P, D] -> [Npages, P, Hkv, D]
            cache = np.swapaxes(cache, 1, 2)
        pages, P, Hkv, D = cache.shape
        j = np.arange(table.shape[1] * P)
        used = j[None, :] < lk[:, None]                  # [B, Nk]
        page = table[:, j // P]
        if ((page < 0) | (page >= pages))[used].any():
            b, m = np.argwhere(used & ((page < 0) | (page >= pages)))[0]
            raise Refused(f"{path}: block_table: entry [{b}, {m // P}] is outside [0, {pages})")
        read = used
        if KV_BUG == "paged_tail_page_read":           # BUG: each row's last page read whole
            read = j[None, :] < (lk[:, None] + P - 1) // P * P
        if pages == 0:
            gathered = np.zeros((len(lk), len(j), Hkv, D), cache.dtype)
        else:
            gathered = cache[np.where(read, page, 0), j % P]             # [B, Nk, Hkv, D]
            gathered = np.where(read[:, :, None, None], gathered, 0).astype(cache.dtype)
        tensors[name] = np.ascontiguousarray(np.swapaxes(gathered, 1, 2))
        dtypes[name] = dtypes.pop(name + "_cache")


def run_case(path, compute, bug=None):
    """Evaluates one case file -> (tensors, dtypes) to write."""
    try:
        tensors, meta, dtypes = safetensors_np.read(path)
    except safetensors_np.UnsupportedDtype as e:
        raise Unsupported(str(e))
    for key in meta:
        # attn.reference and attn.undecided come with golden files: not options of the case
        if key.startswith("attn.") and key not in KEYS and key not in ("attn.reference", "attn.undecided"):
            raise Unsupported(f"metadata key {key}")
    if meta.get("attn.format") != "1":
        raise Unsupported(f"attn.format {meta.get('attn.format')!r}")
    kind = meta.get("attn.kind", "sdpa")
    if kind == "merge":
        return run_merge(path, tensors, meta, dtypes, compute, bug)
    if kind not in ("sdpa", "mha"):
        raise Unsupported(f"attn.kind {kind}")
    if meta.get("attn.causal", "none") not in ("none", "top_left", "bottom_right"):
        raise Unsupported(f"attn.causal {meta['attn.causal']}")
    if meta.get("attn.masked_rows", "error") not in ("error", "zero"):
        raise Unsupported(f"attn.masked_rows {meta['attn.masked_rows']}")
    paged = "k_cache" in tensors
    if paged:
        if kind != "sdpa":
            raise Refused(f"{path}: k_cache: a paged KV cache is for attn.kind sdpa")
    elif "attn.kv_layout" in meta:
        raise Refused(f"{path}: attn.kv_layout: given, but the case has no paged KV cache")
    in_dtype = dtypes["q" if kind == "sdpa" else "x_q"]
    out_dtype = meta.get("attn.output_dtype", in_dtype)
    if (in_dtype not in FLOATS and (in_dtype not in FP8 or kind != "sdpa")) or \
            (out_dtype not in FLOATS and (out_dtype not in FP8 or kind != "sdpa" or "o_scale" not in tensors)):
        raise Unsupported(f"dtype {in_dtype} -> {out_dtype}")
    stored = kind == "sdpa" and in_dtype in FLOATS and stored_kv_np.uses_stored_kv(tensors, meta)
    if stored:                          # K/V: element x scale in the compute dtype
        stored_kv_np.real_kv(tensors, dtypes, meta, compute.type, KV_BUG)
    if paged:
        gather_paged(path, tensors, dtypes, meta)
    outputs = meta.get("attn.outputs", "out").split(",")
    dtype_of = output_dtypes(meta, outputs + ["out"], out_dtype)

    if bug == "truncate_output":        # BUG (with the truncation below): computed in float64
        compute = np.dtype(np.float64)
    x = {name: a.astype(compute) for name, a in tensors.items()
         if dtypes[name] in FLOATS or dtypes[name] in FP8}
    descales = {name: x.pop(name) for name in DESCALES if name in x}
    o_scale = x.pop("o_scale", None)
    extra = dict(mask=tensors.get("mask"), bias=x.get("bias"), query_mask=tensors.get("query_mask"),
                 in_dtype=in_dtype, seqlens_q=tensors.get("seqlens_q"), seqlens_k=tensors.get("seqlens_k"),
                 sinks=x.get("sinks"))
    if descales:
        extra["descales"] = descales
    if stored:
        extra["stored_kv"] = True
    if "dropout_mask" in tensors:       # the keep mask given (CONTRACT section 10), or drawn here
        p = number(meta["attn.dropout_p"])
        keep = tensors["dropout_mask"].astype(bool)
        if DRAW is not None:            # --draw-dropout: a mask of its own, returned with the outputs
            keep = draw_keep(DRAW, (x["q"].shape[0], x["q"].shape[1], x["q"].shape[2], x["k"].shape[2]), p)
        extra["dropout"] = (keep, p)
    grads = [name for name in outputs if name in GRADIENTS]
    if grads:
        if paged:
            raise Refused(f"{path}: attn.outputs: gradients are not defined for a paged KV cache")
        if in_dtype in FP8:
            raise Unsupported(f"attn.outputs {','.join(grads)}: gradients of {in_dtype} inputs are not supported")
        other = [name for name in grads if name not in GRADIENTS[:5] and kind == "sdpa" or
                 name in ("dq", "dk", "dv") and kind == "mha"]
        if other:
            raise Refused(f"{path}: attn.outputs: {other[0]} is not a gradient of kind {kind}")
        if "dout" not in tensors:
            raise Refused(f"{path}: dout: missing (attn.outputs asks for {','.join(grads)})")
        if "dbias" in grads and "bias" not in tensors:
            raise Refused(f"{path}: attn.outputs: dbias asked for, but the case has no bias")
        if "dsinks" in grads and "sinks" not in tensors:
            raise Refused(f"{path}: attn.outputs: dsinks asked for, but the case has no sinks")
    rotary = "rotary_cos" in tensors or "rotary_sin" in tensors or "attn.rotary" in meta
    if rotary:                          # CONTRACT section 10: q and k turned before attention
        if kind != "sdpa" or paged or "rotary_sin" not in tensors or "attn.rotary" not in meta:
            raise Unsupported("rotary: kind sdpa with both tables and attn.rotary only, K/V not paged")
        turn = lambda q, k, v: rotary_np.apply(q, k, v, tensors, meta, in_dtype, tensors.get("seqlens_q"),
                                               tensors.get("seqlens_k"), ROTARY_BUG)
        x["q"], x["k"], x["v"], _ = turn(x["q"], x["k"], x["v"])
    if kind == "sdpa":
        out, w, lse, scores = attention(x["q"], x["k"], x["v"], meta, bug, **extra)
    else:
        # Per head r: Q_r = X_q W_q[r] etc.; [B,N,D] @ [H,D,Dk] -> [B,H,N,Dk].
        proj = lambda a, wt: np.einsum("bnd,hde->bhne", a, wt)
        o, w, lse, scores = attention(proj(x["x_q"], x["w_q"]), proj(x["x_kv"], x["w_k"]),
                              proj(x["x_kv"], x["w_v"]), meta, bug, **extra)
        B, H, Nq, Dv = o.shape
        out = np.swapaxes(o, 1, 2).reshape(B, Nq, H * Dv) @ x["w_o"]   # concat heads, head 0 first

    result = {"out": out, "weights": w, "lse": lse, "scores": scores}
    if any(name in PARTIALS for name in outputs):
        if kind != "sdpa" or "attn.kv_split_size" not in meta or grads:
            raise Refused(f"{path}: attn.outputs: out_partial and lse_partial need kind sdpa, attn.kv_split_size "
                          "and no gradients")
        result["out_partial"], result["lse_partial"] = split_states(x["q"], x["k"], x["v"], meta, bug,
                                                                    int(meta["attn.kv_split_size"]), **extra)
    if grads:                           # from the stored inputs, exact in float64
        f64 = {name: tensors[name].astype(np.float64) for name in tensors if dtypes[name] in FLOATS}
        extra64 = dict(extra, bias=f64.get("bias"), sinks=f64.get("sinks"), out_dtype=dtype_of["out"])
        if kind == "sdpa":
            q, k, v, back = turn(f64["q"], f64["k"], f64["v"]) if rotary else (f64["q"], f64["k"], f64["v"], None)
            g = gradients(q, k, v, f64["dout"], meta, bug, grads, **extra64)
            if back:                    # dq and dk of the given q and k: R^T
                g["dq"], g["dk"] = back(g.get("dq"), g.get("dk"))
                g = {name: a for name, a in g.items() if a is not None}
            result.update(g)
        else:
            result.update(mha_gradients(f64, f64["dout"], meta, bug, grads, **extra64))
    if out_dtype in FP8:                # O / o_scale in the compute dtype, then rounded to FP8
        result["amax"] = np.float32(np.max(np.abs(out), initial=0))
        result["out"] = fp8_out(out, o_scale, out_dtype)
    result = {name: result[name] for name in outputs + ["out"] * ("out" not in outputs)}  # out always
    if "dropout" in extra and DRAW is not None:
        result["dropout_mask"], dtype_of["dropout_mask"] = np.broadcast_to(extra["dropout"][0], out.shape[:3] + (x["k"].shape[2],)), "BOOL"
    if bug == "truncate_output":        # BUG: rounded toward zero into the output dtype
        result = {name: truncate(a, dtype_of[name]) for name, a in result.items()}
    numpy_type = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
    numpy_type["BOOL"] = np.bool_
    with np.errstate(over="ignore"):    # each output into its dtype; BF16 and FP8 by the writer
        result = {name: a.astype(numpy_type[dtype_of[name]]) if dtype_of[name] in numpy_type else a
                  for name, a in result.items()}
    return result, {name: dtype_of[name] for name in result}


def fp8_out(out, o_scale, out_dtype):
    """out / o_scale in out's dtype (the writer rounds it to FP8: E4M3 saturating, E5M2 to
    infinity; under KV_BUG e5m2_saturate E5M2 saturates at 57344 as well)."""
    with np.errstate(over="ignore"):
        y = out / np.asarray(o_scale, out.dtype).reshape(())
    if KV_BUG == "e5m2_saturate" and out_dtype == "F8_E5M2":
        y = np.clip(y, -57344, 57344)
    return y


def write_text(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text.rstrip("\n") + "\n")
    os.replace(tmp, path)


def run_job(job, compute, bug=None):
    output = job["output"]
    try:
        tensors, dtypes = run_case(job["input"], compute, bug)
        safetensors_np.save(output, tensors, {}, dtypes)
    except Refused as e:
        write_text(output + ".error", str(e))
    except Unsupported as e:
        write_text(output + ".unsupported", str(e))
    except Exception as e:             # one bad job must not stop the others
        write_text(output + ".error", f"{type(e).__name__}: {e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="compute dtype (default float32)")
    parser.add_argument("--bug", choices=sorted(BUGS), default=None,
                        help="plant a known bug: " + "; ".join(f"{k}: {v}" for k, v in BUGS.items()).replace("%", "%%"))
    parser.add_argument("--draw-dropout", type=int, metavar="SEED", default=None,
                        help="draw each dropout case's keep mask (keep probability 1 - p) from a "
                             "generator seeded with SEED instead of taking the given one, and return "
                             "it as the output dropout_mask")
    parser.add_argument("jobs", help="jobs file, one JSON object a line")
    args = parser.parse_args(argv)
    global DRAW
    DRAW = None if args.draw_dropout is None else np.random.default_rng(args.draw_dropout)
    with open(args.jobs, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                job = json.loads(line)
                try:
                    run_job(job, np.dtype(args.dtype), args.bug)
                except Exception as e:  # cannot even write the .error file: say so, go on
                    print(f"attention.py: job {job.get('id')}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
