#!/usr/bin/env python3
"""A FlashAttention-style kernel in NumPy, as an AttnOracle adapter (CONTRACT section 5).

    /usr/bin/python3 attention.py [--block N] [--arith fp32|fp16|bf16] [--bug NAME] JOBS.jsonl

Keys are visited in blocks of N with an online softmax: a running maximum m, a running sum l and
an accumulator O, rescaled by exp(m_old - m_new) whenever a block raises the maximum; a sink
joins after the last block as one more term of l (with no value vector); out = O / l and lse =
m + log l at the end. The case files, the job loop and the .error / .unsupported files
are those of the NumPy adapter (../numpy/attention.py), loaded by path; only the kernel differs.
"""
import argparse
import importlib.util
import math
import os
import random
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load_numpy_adapter(name):
    """A private instance of ../numpy/attention.py (its job loop, case reader and exceptions)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", "numpy", "attention.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nx = load_numpy_adapter("attnoracle_numpy_adapter_for_flash")

BUGS = {
    # Split-KV combine (kind merge)
    "merge_nan_empty": "kind merge: a split of lse -inf still adds p O with p = 0, and 0 times the "
                       "NaN such a split may hold is NaN",
    # Online softmax
    "no_rescale": "each block's maximum is subtracted, but the earlier blocks' sum and "
                  "accumulator are not rescaled by exp(m_old - m_new)",
    "no_rescale_acc": "the running sum l is rescaled by exp(m_old - m_new), the accumulator O is not",
    "max_init_zero": "the running maximum starts at 0 instead of -inf (rows whose scores are all "
                     "below about -88 underflow to l = 0)",
    "exp2_no_log2e": "exp2 for exp, without folding log2(e) into the scale (the softmax of s ln 2)",
    "lse_without_max": "lse = log l, without adding the running maximum m",
    "lse_log2": "lse returned in base 2 (m log2(e) + log2 l), as an exp2-based kernel keeps it",
    "lse_bf16_rounded": "the returned lse rounded through BF16 (a BF16 buffer; the backward keeps its "
                        "own) before it is written in the dtype asked (F32 under attn.output_dtypes "
                        "lse:F32): within a BF16 ulp, many F32 ulps off",
    "weights_stale": "the weights of each block written from the running m and l of that block, "
                     "not from the final lse",
    "weights_no_softcap": "the second pass (weights) forgets the softcap",
    # Arithmetic
    "tf32_matmul": "F32 inputs of Q K^T and P V rounded to TF32 (10-bit mantissa) first",
    "flush_subnormals": "subnormals flushed to zero (FTZ/DAZ): float32 inputs, bias, P and out, and "
                        "with --arith fp16 P's F16 subnormals (weights below 2^-14 become 0)",
    "qk_in_input_dtype": "with --arith fp16/bf16, the scores rounded to F16/BF16 before the softmax",
    # Arithmetic a few times coarser than declared: each error is within the worst-case limit of
    # most elements, and shows in the distribution of the errors (TOLERANCE.md, the statistical tier)
    "stat_exp_1e3": "exp with a relative error of up to 1e-3",
    "stat_f16_denominator": "the softmax denominator l summed and kept in F16",
    "stat_pv_bf16": "P V accumulated in BF16, rounded after every product and every addition",
    "stat_round_up": "the output rounded toward +inf instead of to nearest",
    "p_truncate": "with --arith fp16/bf16, P converted to F16/BF16 by truncation toward zero "
                  "(low bits cleared) instead of to nearest before P V",
    # Scores, masks and bias
    "scale_dv": "the default scale is 1/sqrt(Dv) instead of 1/sqrt(Dk) (differs only when Dv != Dk)",
    "scale_twice": "the scale applied to Q and again to Q K^T",
    "softcap_scale_swapped": "the softcap applied before the scale: scale c tanh(Q K^T / c)",
    "bias_scaled": "the bias multiplied by the scale along with Q K^T",
    "bias_head0": "the bias of head 0 used for every head",
    "mask_batch0": "the boolean mask of batch 0 used for every batch",
    "masked_fill_min": "masked scores set to the most negative finite float instead of -inf: a fully "
                       "masked row gets the mean of V (and is never refused)",
    "tail_unmasked": "the last partial block padded with zero keys that are not masked (score 0)",
    "keys_limited_to_nq": "only the first min(Nq, Nk) keys visited (a loop written for self-attention)",
    "gqa_pack2": "at most two query heads per kv head: query head h reads kv head "
                 "(h // min(Hq / Hkv, 2)) % Hkv (wrong only at ratios above 2)",
    "causal_top_left": "causal masks always aligned top-left (bottom_right read as top_left; the "
                       "window follows)",
    "bottom_right_off_by_one": "bottom_right causal aligned at i + Nk - Nq + 1 (one key too many)",
    "window_off_by_one": "the window's left edge one key short (j > i - left instead of j >= i - left)",
    "window_right_ignored": "the window's right edge ignored (only the left one applied)",
    # Sequence lengths and unused positions
    "seqlens_align_nk_nq": "bottom_right causal aligned at i + Nk - Nq, the padded sizes, instead of "
                           "i + Lk - Lq, the lengths of the batch's sequences (keys past seqlens_k "
                           "still skipped)",
    "nan_from_padded_key": "P V multiplies the zero weights of masked and padded keys by their value "
                           "rows instead of skipping them: a NaN or infinity there gives NaN",
    "paged_tail_page_read": "paged KV cache: each row's last page read whole, its slots past seqlens_k "
                            "masked but their value rows (element x scale) multiplied by their zero "
                            "weights: a NaN or infinity there gives NaN",
    # Stored K/V and FP8 outputs (the reading is the NumPy adapter's, with these mistakes)
    "kv_descale_dropped": "stored K/V: the scales ignored (the stored elements used as they are)",
    "kv_scale_head0": "stored K/V: kv head 0's scale used for every kv head",
    "kv_scale_wrong_token": "stored K/V: a per-token scale read for the next token (paged: the next "
                            "slot of the page)",
    "e8m0_bias_off_by_one": "mxfp8: the E8M0 block scale read as 2^(e - 126) instead of 2^(e - 127)",
    "nvfp4_nibbles_swapped": "nvfp4: the high nibble of each byte read as the first element",
    "e5m2_saturate": "an F8_E5M2 out saturated at +-57344 where it overflows (the contract: infinity)",
    "p_e4m3_stale_max": "with --arith fp8, each block's P rounded to E4M3 against the running maximum "
                        "before the block's correction, then rescaled: a score jump above ln 448 "
                        "within a row saturates P at 448",
    "descales_dropped": "FP8: q_descale, k_descale and v_descale ignored (the stored values used as they are)",
    "descales_kv_head0": "FP8: every head's descales taken from kv head 0 (descale[b, 0])",
    # Sinks
    "sinks_ignored": "the sinks are ignored (the softmax over the keys alone)",
    "sink_in_numerator": "the sink's term exp(sink - m) added to the numerator of every allowed "
                         "weight as well as to the denominator",
    # Backward (gradients)
    "bwd_no_delta": "dS = P dP: the term D_i = rowsum(dout * out) dropped",
    "bwd_mask_ignored": "P recomputed from the scores without the mask, causal and window "
                        "(masked keys get exp(S - lse)), so dS is not masked",
    "bwd_dk_no_scale": "dk = dS^T Q without the scale",
    "bwd_gqa_no_sum": "dk and dv of a kv head written by each query head of its group in turn, not "
                      "summed: the last head's contribution is kept",
    "bwd_no_softcap_grad": "the softcap's derivative 1 - tanh^2(T / c) omitted (dT = dS)",
    "bwd_stale_lse": "P recomputed from the lse of the first key block (m + log l after it), not "
                     "renormalised over the later blocks",
    "bwd_dv_unnormalised": "dv = exp(S - m)^T dout with m the row maximum: the weights not divided by l",
    "bwd_dk_f16_accumulation": "dk of a key block accumulated in float16 over the query blocks",
    "bwd_masked_row_nan": "P = exp(S - lse) on fully masked rows too: exp(-inf - -inf) = NaN in dq",
    "bwd_dq_other_alignment": "dq from a dS masked with the other causal alignment (top_left and "
                              "bottom_right swapped; dk and dv right)",
    "bwd_lse_rounded": "the saved lse rounded to F16 (a half-precision lse buffer) before P is "
                       "recomputed from it",
    "bwd_lse_batch0": "the backward reads the saved lse of batch 0 for every batch (an lse offset "
                      "that forgets the batch stride): wrong P in batches 1 and on",
    "bwd_tail_block_skipped": "the backward skips the last key block when it is partial (Nk not a "
                              "multiple of --block): those keys get dk = dv = 0 and give dq nothing",
    # Determinism and batch invariance (attnoracle invariants --reruns, --batch-invariant)
    "dq_block_order_random": "the backward visits the key blocks in an order drawn afresh in every "
                                 "run (os.urandom), so dq's sum over them rounds differently from run to run",
    "block_from_batch": "keys per block --block divided by the batch size (a split chosen to fill the "
                        "machine): a row's rounding depends on how many rows share the batch",
    # Dropout (the keep mask given, or drawn with --draw-dropout)
    "dropout_no_scale": "dropout: the kept weights not scaled by 1 / (1 - p)",
    "dropout_on_output": "dropout: the keep mask and 1 / (1 - p) applied after P V, to the output "
                         "(column c takes keep[..., c mod Nk]), not to P",
    "dropout_transposed": "dropout: the keep mask read transposed (keep[j, i] for query i, key j)",
    "dropout_head0": "dropout: head 0's keep mask used for every head",
    "dropout_keep_p": "dropout: p taken as the keep probability: scaled by 1 / p (and, drawing its own "
                      "mask, each weight kept with probability p)",
}
BUGS.update(nx.rotary_np.BUGS)          # rotary (../numpy/rotary_np.py): planted through nx.ROTARY_BUG


# ---- Dropout: the keep mask and 1 / (1 - p) as this kernel applies them, with its bugs.
def dropout_keep(bug, keep, full):
    """The keep mask as the kernel reads it, broadcast to [B, Hq, Nq, Nk]."""
    keep = np.broadcast_to(keep, full)
    if bug == "dropout_transposed":          # BUG: keep[j, i], cropped, True past its edges
        t = np.swapaxes(keep, -1, -2)[..., :full[2], :full[3]]
        keep = np.ones(full, bool)
        keep[..., :t.shape[2], :t.shape[3]] = t
    if bug == "dropout_head0":               # BUG: head 0's mask for every head
        keep = np.broadcast_to(keep[:, :1], full)
    return keep


def draw_keep(bug, rng, shape, p):
    """A keep mask of the kernel's own (--draw-dropout): kept with probability 1 - p."""
    if bug == "dropout_head0":               # BUG: one draw for head 0, reused by every head
        return np.broadcast_to(rng.random(shape[:1] + (1,) + shape[2:]) >= p, shape)
    return rng.random(shape) < (p if bug == "dropout_keep_p" else 1 - p)   # BUG: kept with probability p


def dropout_scale(bug, p, acc):
    """1 / (1 - p) formed in the accumulation dtype (float32: fl(1 / fl(1 - fl(p))))."""
    if bug == "dropout_no_scale":            # BUG: no scaling
        return acc(1)
    if bug == "dropout_keep_p":              # BUG: p is the keep probability
        return acc(1) / acc(p)
    return acc(1) / (acc(1) - acc(p))


# ---- The statistical tier's bugs (stat_*, in BUGS above): each a hook on one step.


def stat_exp(bug, x):
    """exp; under stat_exp_1e3 off by a relative 1e-3 sin(1e4 x), a deterministic, unbiased error."""
    e = np.exp(x)
    if bug == "stat_exp_1e3":
        e = e * (1 + e.dtype.type(1e-3) * np.sin(e.dtype.type(1e4) * np.where(np.abs(x) < 1e30, x, 0))).astype(e.dtype)
    return e


def stat_denominator(bug, alpha, l, p, acc):
    """l = alpha l + rowsum(p); under stat_f16_denominator every step in float16."""
    if bug != "stat_f16_denominator":
        return alpha * l + p.sum(axis=-1, dtype=acc)
    h = np.float16
    return (alpha.astype(h) * l.astype(h) + p.astype(h).sum(axis=-1, dtype=h)).astype(acc)


def stat_accumulate(bug, alpha, o, p, vb):
    """O = alpha O + p V_blk; under stat_pv_bf16 key by key, every product and sum rounded to BF16."""
    if bug != "stat_pv_bf16" or o.dtype != np.float32:
        return alpha[..., None] * o + p @ vb
    o = round_bf16(alpha[..., None] * o)
    for j in range(p.shape[-1]):
        o = round_bf16(o + round_bf16(p[..., j, None] * vb[:, :, None, j, :]))
    return o


def stat_divide(bug, o, l, out_dtype):
    """O / l; under stat_round_up computed in float64 and rounded toward +inf to out_dtype (the
    writer's rounding to nearest then leaves it as it is)."""
    if bug != "stat_round_up":
        return o / l[..., None]
    x = o.astype(np.float64) / l.astype(np.float64)[..., None]
    if out_dtype == "F64":
        return o / l[..., None]
    if out_dtype == "BF16":
        y = round_bf16(x).astype(np.float64)
        bits = y.astype(np.float32).view(np.uint32).astype(np.int64)
        step = np.where(y >= 0, 1 << 16, -(1 << 16))
        up = (bits + step).astype(np.uint32).view(np.float32).astype(np.float64)
        up = np.where((y == 0) & np.signbit(y), 2.0 ** -133, up)     # -0: up to the least subnormal
    else:
        t = np.float32 if out_dtype == "F32" else np.float16
        with np.errstate(over="ignore"):
            y = x.astype(t)
        up = np.nextafter(y, t(np.inf)).astype(np.float64)
        y = y.astype(np.float64)
    return np.where(y < x, up, y)


def p_round(bug, rnd, arith, p):
    """P in the P V dtype; under p_truncate toward zero (BF16: the low 16 bits of the F32 cleared;
    F16: the nearest F16, one step toward zero where that is larger in magnitude)."""
    if bug != "p_truncate" or arith not in ("fp16", "bf16"):
        return rnd(p)
    p = np.asarray(p, np.float32)
    if arith == "bf16":
        return (p.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    h = p.astype(np.float16)
    h = np.where(np.abs(h.astype(np.float32)) > np.abs(p), np.nextafter(h, np.float16(0)), h)
    return h.astype(np.float32)


def round_bf16(a):
    """float32 -> the nearest BF16 value (ties to even), as float32: the uint32 bits of the float32
    get 0x7FFF plus their bit 16 added, and the low 16 bits cleared (safetensors_np.bf16_bits)."""
    bits = nx.safetensors_np.bf16_bits(np.asarray(a, np.float32)).astype(np.uint32)
    return (bits << 16).view(np.float32)


def round_f16(a):
    """float32 -> the nearest F16 value (ties to even, subnormals included), as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def round_e4m3(a):
    """float32 -> the nearest F8_E4M3 value (ties to even, saturating at 448), as float32: the
    neighbours among the format's 127 non-negative finite values, from safetensors_np's table."""
    a = np.asarray(a, np.float32)
    grid = nx.safetensors_np.FP8_TABLES["F8_E4M3"][:0x7F]        # 0, 2^-9, ..., 448, increasing
    x = np.minimum(np.abs(a), np.float32(448))
    hi = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = x - grid[lo], grid[hi] - x
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)   # pattern index = bits
    return np.where(np.isnan(a), a, np.copysign(grid[pick], a)).astype(np.float32)


ROUND = {"fp32": None, "fp16": round_f16, "bf16": round_bf16, "fp8": round_e4m3}


def round_tf32(a):
    """float32 -> the nearest TF32 value (10-bit mantissa, ties to even), as float32 (bug tf32_matmul)."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def flush(a, tiny):
    """|a| below `tiny` -> 0 (bug flush_subnormals)."""
    return np.where(np.abs(a) < tiny, a.dtype.type(0), a)


def key_allowed(meta, Nq, Nk, j0, j1, bug=None, lq=None, lk=None):
    """[B or 1, 1, Nq, j1 - j0]: causal, window and seqlens_k for keys j0..j1-1, with i' = i
    (top_left) or i + Lk - Lq (bottom_right; lq, lk [B] the sequences' lengths, Nq and Nk without
    them); the window takes the causal alignment (top_left when none)."""
    causal = meta.get("attn.causal", "none")
    if bug == "causal_top_left":        # BUG: bottom_right read as top_left
        causal = "top_left" if causal != "none" else causal
    varlen = lk is not None
    lq = np.array([Nq]) if lq is None else lq
    lk = np.array([Nk]) if lk is None else lk
    offset = lk - lq
    if bug == "seqlens_align_nk_nq":    # BUG: the padded sizes' alignment
        offset = np.full_like(lk, Nk - Nq)
    offset = offset + (1 if bug == "bottom_right_off_by_one" else 0)   # BUG: + 1
    rows = np.arange(Nq)[None, None, :, None] + (offset[:, None, None, None] if causal == "bottom_right" else 0)
    cols = np.arange(j0, j1)[None, None, None, :]
    ok = cols <= rows if causal != "none" else np.ones((1, 1, Nq, j1 - j0), bool)
    if varlen:                          # keys past seqlens_k (without it, the keys past Nk of
        ok = ok & (cols < lk[:, None, None, None])   # bug tail_unmasked stay allowed)
    window = meta.get("attn.window", "none")
    if window != "none":
        left, right = (int(x) for x in window.split(","))
        ok = ok & ((cols > rows - left) if bug == "window_off_by_one" else (cols >= rows - left))
        if bug != "window_right_ignored":   # BUG window_right_ignored skips this
            ok = ok & (cols <= rows + right)
    return ok


class Kernel:
    """Settings of one run; called as the NumPy adapter's `attention`."""

    def __init__(self, block, arith, bug):
        self.block, self.arith, self.bug = block, arith, bug
        self.block_asked = block

    def scores(self, q, kb, meta, bias, Nk, j0, j1, scale, cap):
        """Scores of keys j0..j1-1 in the accumulation dtype, -inf where not allowed (keys past
        Nk, which only bug tail_unmasked visits, are zero keys with no bias and no mask)."""
        acc, bug, n = q.dtype, self.bug, j1 - j0
        pad = lambda a, value: np.concatenate(
            [a, np.full(a.shape[:-1] + (n - a.shape[-1],), value, a.dtype)], axis=-1)
        qk = q @ np.swapaxes(kb, -1, -2)
        if cap != 0 and bug == "softcap_scale_swapped":   # BUG: scale * softcap(Q K^T)
            s = acc.type(cap) * np.tanh(qk / acc.type(cap)) * acc.type(scale)
        else:
            s = qk * acc.type(scale)
            if cap != 0:
                s = acc.type(cap) * np.tanh(s / acc.type(cap))
        ok = np.broadcast_to(key_allowed(meta, q.shape[2], Nk, j0, j1, bug, self.lq, self.lk), s.shape)
        if bias is not None:
            b = pad(bias[..., j0:j1].astype(acc), 0)
            ok = ok & (b != -np.inf)
            if bug == "bias_scaled":         # BUG: the bias scaled with Q K^T
                b = b * acc.type(scale)
            s = s + np.where(ok, b, 0)
        if self.mask is not None:
            ok = ok & pad(self.mask[..., j0:j1], True)
        if self.rnd is not None and bug == "qk_in_input_dtype":   # BUG: scores in F16 / BF16
            s = self.rnd(s)
        masked = np.finfo(acc).min if bug == "masked_fill_min" else -np.inf   # BUG: finite
        return np.where(ok, s, acc.type(masked))

    def __call__(self, q, k, v, meta, bug, mask=None, bias=None, query_mask=None, in_dtype=None,
                 seqlens_q=None, seqlens_k=None, descales=None, sinks=None, returned=True, stored_kv=False,
                 dropout=None):
        bug = self.bug
        B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
        if bug == "block_from_batch":        # BUG: the block size follows the batch size
            self.block = max(1, self.block_asked // B)
        self.lq = None if seqlens_q is None else seqlens_q.astype(np.int64)
        self.lk = None if seqlens_k is None else seqlens_k.astype(np.int64)
        if self.lq is not None:              # queries past seqlens_q are padding
            valid = np.arange(Nq)[None, :] < self.lq[:, None]
            query_mask = valid if query_mask is None else query_mask & valid
        if self.lq is not None or self.lk is not None:
            self.lq = np.full(B, Nq) if self.lq is None else self.lq
            self.lk = np.full(B, Nk) if self.lk is None else self.lk
        acc = np.float64 if in_dtype == "F64" else np.float32
        f32 = acc == np.float32
        self.rnd = rnd = ROUND[self.arith] if in_dtype != "F64" else None
        # fp8 over float K/V (an unquantized cache): K/V read as they are, a stored form of scale 1
        # (their F16 / BF16 elements exact in F32), P in E4M3 as with a quantized cache.
        # FP8 (FlashAttention 3): Q K^T of the stored values, times scale q_descale k_descale per
        # (b, h) in float32; the output times v_descale. Stored FP8 values are exact in float32.
        descales = {} if bug == "descales_dropped" else dict(descales or {})   # BUG: dropped
        if bug == "descales_kv_head0":       # BUG: kv head 0's descales for every head
            descales = {n: np.repeat(d[:, :1], d.shape[1], axis=1) for n, d in descales.items()}
        ftz = bug == "flush_subnormals" and f32
        tf32 = bug == "tf32_matmul" and f32
        # Q, K, V in the input dtype (kind mha: the projections rounded to it, or to the P dtype).
        # Unused positions (keys no query attends, padding queries) may hold NaN or infinities:
        # read as 0 in acc, so that 0 * NaN in P V never reaches a used row (stored K/V come as
        # element x scale in float64: an unused I8 row times F32's largest scale overflows here).
        with np.errstate(over="ignore"):
            q, k, v = (np.asarray(a).astype(acc) for a in (q, k, v))
        q, k = (np.where(np.isfinite(a), a, 0) for a in (q, k))
        if bug not in ("nan_from_padded_key", "paged_tail_page_read"):   # BUG: value rows kept as they are
            v = np.where(np.isfinite(v), v, 0)
        if rnd is not None and self.arith != "fp8":     # fp8: every input read as it is
            q, k, v = rnd(q), rnd(k), rnd(v)
        if ftz:                              # BUG: float32 subnormal inputs read as 0
            q, k, v = (flush(a, np.finfo(np.float32).tiny) for a in (q, k, v))
            bias = None if bias is None else flush(bias.astype(acc), np.finfo(np.float32).tiny)
        if tf32:                             # BUG: the matmul inputs in TF32
            q, k, v = round_tf32(q), round_tf32(k), round_tf32(v)
        B, Hq, Nq, Dk = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
        group = Hq // Hkv
        heads = np.arange(Hq) // group                 # head h reads h // group
        if bug == "gqa_pack2":               # BUG: groups of at most two query heads
            heads = (np.arange(Hq) // min(group, 2)) % Hkv
        k, v = k[:, heads], v[:, heads]
        one = np.ones((B, Hkv))
        dq, dk, dv = (descales.get(n, one)[:, heads][:, :, None, None] for n in nx.DESCALES)
        full = (B, Hq, Nq, Nk)
        self.mask = None if mask is None else np.broadcast_to(mask, full)
        if self.mask is not None and bug == "mask_batch0":    # BUG: batch 0's mask everywhere
            self.mask = np.broadcast_to(self.mask[:1], full)
        bias = None if bias is None else np.broadcast_to(bias, full)
        # dropout: P's kept weights times 1 / (1 - p) (formed in acc) before P's rounding and P V;
        # l sums the weights before dropout
        keep = None if dropout is None else dropout_keep(bug, dropout[0], full)
        rp = None if dropout is None else dropout_scale(bug, dropout[1], acc)
        on_output = keep is not None and bug == "dropout_on_output"
        if bias is not None and bug == "bias_head0":          # BUG: head 0's bias everywhere
            bias = np.broadcast_to(bias[:, :1], full)
        scale = nx.number(meta["attn.scale"]) if "attn.scale" in meta else \
            1.0 / math.sqrt(Dv if bug == "scale_dv" else Dk)  # BUG scale_dv: 1/sqrt(Dv)
        if bug == "scale_twice":             # BUG: Q scaled, then Q K^T scaled again
            q = q * acc(scale)
        if descales:                         # one float32 factor per (b, h)
            scale = acc(scale * dq * dk)
        cap = nx.number(meta.get("attn.softcap", "0"))
        keys = min(Nq, Nk) if bug == "keys_limited_to_nq" else Nk   # BUG: keys past Nq not visited
        exp = np.exp2 if bug == "exp2_no_log2e" else lambda x: stat_exp(bug, x)  # BUG: exp2 of natural scores
        log = np.log2 if bug == "exp2_no_log2e" else np.log

        m = np.full((B, Hq, Nq), 0 if bug == "max_init_zero" else -np.inf, acc)   # running maximum
        l = np.zeros((B, Hq, Nq), acc)                  # running sum of exp(s - m)
        o = np.zeros((B, Hq, Nq, Dv), acc)              # running sum of exp(s - m) v
        stale = []                                      # bug weights_stale: each block's weights
        vsum = np.zeros((B, Hq, Nq, Dv), acc)           # bug sink_in_numerator: sum of allowed v
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for j0 in range(0, keys, self.block):
                j1 = min(j0 + self.block, keys)
                kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]
                if bug == "tail_unmasked" and j1 - j0 < self.block:   # BUG: zero keys, not masked
                    zeros = lambda a: np.zeros(a.shape[:2] + (self.block - (j1 - j0), a.shape[3]), acc)
                    kb, vb = np.concatenate([kb, zeros(kb)], 2), np.concatenate([vb, zeros(vb)], 2)
                    j1 = j0 + self.block
                s = self.scores(q, kb, meta, bias, Nk, j0, j1, scale, cap)
                m_new = np.maximum(m, s.max(axis=-1))
                base = np.where(m_new == -np.inf, 0, m_new).astype(acc)   # no key yet: any constant
                p = exp(s - base[..., None])                             # 0 where not allowed
                alpha = exp(m - base)                                    # exp(-inf) = 0 at the start
                if bug == "no_rescale":        # BUG: the earlier blocks keep their old maximum
                    alpha = np.ones_like(l)
                alpha_o = np.ones_like(l) if bug == "no_rescale_acc" else alpha   # BUG: O not rescaled
                l = stat_denominator(bug, alpha, l, p, acc)
                if bug == "weights_stale":     # BUG: this block's weights from the running m, l
                    stale.append((p / l[..., None])[..., :min(j1, Nk) - j0])
                if keep is not None and not on_output:
                    kb_keep = keep[..., j0:j1] if j1 <= Nk else np.concatenate(
                        [keep[..., j0:], np.zeros(full[:3] + (j1 - Nk,), bool)], -1)
                    p = (p * kb_keep * rp).astype(acc)
                if bug == "p_e4m3_stale_max" and self.arith == "fp8":   # BUG: P against the old max
                    old = np.where(m == -np.inf, base, m).astype(acc)
                    p = round_e4m3(exp(s - old[..., None])) * exp(old - base)[..., None]
                elif rnd is not None:                                    # P in F16 / BF16 / E4M3 before P V
                    p = p_round(bug, rnd, self.arith, p)   # BUG p_truncate: toward zero
                if ftz:                        # BUG: P's subnormals (F16's with --arith fp16) to 0
                    p = flush(p, 2.0 ** -14 if self.arith == "fp16" else np.finfo(np.float32).tiny)
                if tf32:
                    p = round_tf32(p)
                o = stat_accumulate(bug, alpha_o, o, p, vb)
                if bug == "sink_in_numerator":
                    vsum = vsum + (s != -np.inf).astype(acc) @ vb
                m = m_new
            if bug == "sinks_ignored":         # BUG: no sink term
                sinks = None
            if sinks is not None:              # the sink: one more term of l, no value vector
                sink = np.broadcast_to(sinks.astype(acc)[None, :, None], m.shape)
                m_new = np.maximum(m, sink)
                alpha = exp(m - m_new)
                ps = exp(sink - m_new)
                l = alpha * l + ps
                o = alpha[..., None] * o
                if bug == "sink_in_numerator":   # BUG: exp(sink - m) in every weight's numerator
                    o = o + ps[..., None] * vsum
                m = m_new

        if "v_descale" in descales:
            o = (o * acc(dv)).astype(acc)
        if on_output:                        # BUG: the mask and scale on the output's columns
            o = (o * keep[..., np.arange(Dv) % Nk] * rp).astype(acc)
        live = m != -np.inf                            # a row with an allowed key has l >= 1
        if meta.get("attn.masked_rows", "error") == "error" and sinks is None:
            is_query = np.ones((B, Nq), bool) if query_mask is None else query_mask
            bad = np.argwhere(~live & is_query[:, None, :])
            if len(bad):
                b, h, row = bad[0]
                raise nx.Refused(f"fully masked row: b={b}, h={h}, i={row} has no allowed key "
                                 f"(attn.masked_rows=error)")
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            one = np.where(live, l, 1).astype(acc)
            out_dtype = nx.output_dtypes(meta, ["out"], meta.get("attn.output_dtype", in_dtype))["out"]
            out = np.where(live[..., None], stat_divide(bug, o, one, out_dtype),
                           0).astype(acc)
            if ftz:
                out = flush(out, np.finfo(np.float32).tiny)
            lse = np.where(live, m + log(one), -np.inf).astype(acc)
            weights = None
            if "weights" in meta.get("attn.outputs", "out").split(","):
                # A second pass over the blocks: weights = exp(s - lse) from the final lse.
                wcap = 0 if bug == "weights_no_softcap" else cap   # BUG: no softcap in this pass
                parts = [exp(self.scores(q, k[:, :, j0:min(j0 + self.block, keys)], meta, bias, Nk, j0,
                                         min(j0 + self.block, keys), scale, wcap) - lse[..., None])
                         for j0 in range(0, keys, self.block)]
                if bug == "weights_stale":
                    parts = stale
                parts.append(np.zeros((B, Hq, Nq, Nk - keys), acc))   # keys never visited
                weights = np.where(live[..., None], np.concatenate(parts, axis=-1), 0).astype(acc)
                if bug == "sink_in_numerator" and sinks is not None:
                    extra = exp(np.broadcast_to(sinks.astype(acc)[None, :, None], lse.shape) - lse)
                    weights = np.where(weights > 0, weights + extra[..., None], 0).astype(acc)
            scores = None
            if "scores" in meta.get("attn.outputs", "out").split(","):   # S of each block, -inf unvisited
                scores = np.concatenate(
                    [self.scores(q, k[:, :, j0:min(j0 + self.block, keys)], meta, bias, Nk, j0,
                                 min(j0 + self.block, keys), scale, cap)
                     for j0 in range(0, keys, self.block)]
                    + [np.full((B, Hq, Nq, Nk - keys), -np.inf, acc)], axis=-1)
            if bug == "lse_without_max":       # BUG: the maximum left out
                lse = np.where(live, np.log(one), -np.inf).astype(acc)
            if bug == "lse_log2":              # BUG: base 2
                lse = (lse / acc(math.log(2))).astype(acc)
            if bug == "lse_bf16_rounded" and returned:   # BUG: the returned lse through a BF16 buffer
                lse = round_bf16(lse).astype(acc)
        return out, weights, lse, scores

    def merge(self, o, lse, meta, bug, sinks=None):
        """Kind merge as a split-KV combine kernel: one pass over the splits in float32, a running
        maximum m, sum l and accumulator rescaled by exp(m_old - m_new); a split of lse -inf is
        skipped (its O never read); the sink joins last as one more term of l."""
        bug = self.bug
        f32 = np.float32
        o, lse = o.astype(f32), lse.astype(f32)
        m = np.full(lse.shape[1:], -np.inf, f32)
        l = np.zeros(lse.shape[1:], f32)
        acc = np.zeros(o.shape[1:], f32)
        terms = [(lse[s], o[s]) for s in range(lse.shape[0])]
        if sinks is not None:
            terms.append((np.broadcast_to(sinks.astype(f32)[None, :, None], m.shape), None))
        with np.errstate(invalid="ignore", over="ignore"):
            for x, os_ in terms:
                live = x != -np.inf
                m_new = np.where(live, np.maximum(m, x), m)
                alpha = np.where(m == -np.inf, f32(0), np.exp(m - np.where(m_new == -np.inf, 0, m_new))).astype(f32)
                p = np.where(live, np.exp(x - np.where(live, m_new, 0)), f32(0)).astype(f32)
                l = (l * alpha + p).astype(f32)
                acc = (acc * alpha[..., None]).astype(f32)
                if os_ is not None:
                    take = live[..., None] if bug != "merge_nan_empty" else True   # BUG: 0 * NaN read
                    acc = (acc + np.where(take, p[..., None] * os_, f32(0))).astype(f32)
                m = m_new
        row = m != -np.inf
        if meta.get("attn.masked_rows", "error") == "error" and not row.all():
            b, h, i = np.argwhere(~row)[0]
            raise nx.Refused(f"fully masked row: b={b}, h={h}, i={i} has no split (every lse_partial -inf) and no sink")
        one = np.where(row, l, f32(1))
        out = np.where(row[..., None], acc / one[..., None], f32(0)).astype(f32)
        return out, np.where(row, m + np.log(one), -np.inf).astype(f32)

    def gradients(self, q, k, v, dout, meta, bug, names, mask=None, bias=None, query_mask=None,
                  in_dtype=None, seqlens_q=None, seqlens_k=None, out_dtype=None, sinks=None, dropout=None):
        """dq, dk, dv, dbias, dsinks (those in `names`), FlashAttention-2's backward: the forward above
        for out and lse, then per key block P = exp(S - lse) recomputed, and per query block
        dv += P^T dout, dP = dout V^T, dS = P (dP - D) with D_i = rowsum(dout * out) (out rounded
        to the output dtype), dT = dS (1 - tanh^2(T / c)), dq += dT K, dk += dT^T Q, all in the
        accumulation dtype (F32; F64 for F64 inputs); dq, dk times the scale at the end, dk and dv
        summed over each kv head's query heads; with sinks (their term in lse) dsinks[h] =
        -sum over b, i of exp(sink_h - lse_i) D_i in acc. --arith fp16/bf16: dout, P and dT rounded to the
        input format before their products, as the kernel's matmul inputs. Dropout: dP and dv's P
        times keep / (1 - p), the forward's mask and scale."""
        bug = self.bug
        forward = dict(meta, **{"attn.outputs": "out,lse"})
        out, _, lse, _ = self(q, k, v, forward, None, mask=mask, bias=bias, query_mask=query_mask,
                              in_dtype=in_dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sinks=sinks,
                              returned=False, dropout=dropout)
        acc = np.float64 if in_dtype == "F64" else np.float32
        rnd = self.rnd or (lambda a: a)
        B, Hq, Nq, Dk = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
        group = Hq // Hkv
        rows = nx.query_rows(B, Nq, query_mask, seqlens_q)[:, None, :] & (lse != -np.inf)
        finite = lambda a: np.where(np.isfinite(a), a, 0).astype(acc)   # unused positions: 0
        q, k, v = rnd(finite(q)), rnd(finite(k)), rnd(finite(v))
        heads = np.arange(Hq) // group
        k, v = k[:, heads], v[:, heads]
        dout = rnd(np.where(rows[..., None], finite(dout), 0))
        out = {"F64": lambda a: a, "F32": lambda a: a.astype(np.float32), "F16": round_f16,
               "BF16": round_bf16}[out_dtype](out).astype(acc)
        delta = np.sum(dout * out, axis=-1, dtype=acc)                  # D_i, from the rounded out
        if bug == "bwd_lse_rounded":         # BUG: lse kept in F16
            lse = round_f16(lse).astype(acc)
        if bug == "bwd_lse_batch0":          # BUG: batch 0's lse everywhere
            lse = np.broadcast_to(lse[:1], lse.shape)
        full = (B, Hq, Nq, Nk)
        bias_shape = None if bias is None else bias.shape
        bias = None if bias is None else np.broadcast_to(bias, full)
        scale = nx.number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
        cap = nx.number(meta.get("attn.softcap", "0"))
        blocks = [(j0, min(j0 + self.block, Nk)) for j0 in range(0, Nk, self.block)]
        if bug == "dq_block_order_random":   # BUG: an order of the key blocks drawn per run
            random.Random(os.urandom(8)).shuffle(blocks)
        keep = None if dropout is None else dropout_keep(bug, dropout[0], full)
        rp = None if dropout is None else dropout_scale(bug, dropout[1], acc)
        other = dict(meta, **{"attn.causal": {"top_left": "bottom_right", "bottom_right": "top_left"}
                              .get(meta.get("attn.causal", "none"), "none")})
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if bug == "bwd_stale_lse":       # BUG: the lse as it stood after the first key block
                s0 = self.scores(q, k[:, :, :blocks[0][1]], meta, bias, Nk, 0, blocks[0][1], scale, cap)
                m0 = s0.max(axis=-1)
                l0 = np.exp(s0 - np.where(m0 == -np.inf, 0, m0)[..., None]).sum(axis=-1)
                lse = np.where(m0 == -np.inf, lse, m0 + np.log(l0)).astype(acc)
            if bug == "bwd_dv_unnormalised":   # BUG: dv's weights exp(S - m), m the row maximum
                rowmax = np.max([self.scores(q, k[:, :, j0:j1], meta, bias, Nk, j0, j1, scale, cap)
                                 .max(axis=-1) for j0, j1 in blocks], axis=0)
            dq = np.zeros((B, Hq, Nq, Dk), acc)
            dk = np.zeros((B, Hq, Nk, Dk), acc)
            dv = np.zeros((B, Hq, Nk, Dv), acc)
            ds_all = np.zeros(full, acc) if "dbias" in names else None
            for j0, j1 in blocks:
                if bug == "bwd_tail_block_skipped" and j1 - j0 < self.block and j0 > 0:
                    continue                 # BUG: the partial last block left out
                kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]
                s = self.scores(q, kb, meta, bias, Nk, j0, j1, scale, cap)
                if bug == "bwd_mask_ignored":    # BUG: the scores of every key, masks aside
                    s = self.raw_scores(q, kb, bias, j0, j1, scale, cap)
                t = (q @ np.swapaxes(kb, -1, -2)) * acc(scale)
                soft = (1 - np.tanh(t / acc(cap)) ** 2).astype(acc) if cap != 0 else None
                p = np.exp(s - lse[..., None]).astype(acc)
                if bug != "bwd_masked_row_nan":  # BUG: NaN from the rows with no key kept
                    p = np.where(rows[..., None], p, 0)
                pv = p
                if bug == "bwd_dv_unnormalised":
                    pv = np.where(rows[..., None], np.exp(s - rowmax[..., None]), 0).astype(acc)
                p_dq = p
                if bug == "bwd_dq_other_alignment":   # BUG: dq's P masked the other way
                    p_dq = np.where(rows[..., None], np.exp(
                        self.scores(q, kb, other, bias, Nk, j0, j1, scale, cap) - lse[..., None]), 0)
                f16 = bug == "bwd_dk_f16_accumulation"
                dk_b = np.zeros(kb.shape, np.float16 if f16 else acc)   # this key block's dk, dv
                dv_b = np.zeros(vb.shape, acc)
                for i0 in range(0, Nq, self.block):
                    i1 = min(i0 + self.block, Nq)
                    do, d = dout[:, :, i0:i1], delta[:, :, i0:i1, None]
                    pd = pv[:, :, i0:i1]
                    if keep is not None:     # Z = P keep / (1 - p) and dP likewise
                        kk = keep[:, :, i0:i1, j0:j1]
                        pd = (pd * kk * rp).astype(acc)
                    dv_b = dv_b + np.swapaxes(rnd(pd), -1, -2) @ do
                    dp = do @ np.swapaxes(vb, -1, -2)
                    if keep is not None:
                        dp = (dp * kk * rp).astype(acc)
                    ds = p[:, :, i0:i1] * (dp if bug == "bwd_no_delta" else dp - d)   # BUG: no D
                    ds_q = p_dq[:, :, i0:i1] * (dp - d) if p_dq is not p else ds
                    if ds_all is not None:
                        ds_all[:, :, i0:i1, j0:j1] = ds
                    if soft is not None and bug != "bwd_no_softcap_grad":   # BUG: no tanh'
                        ds, ds_q = ds * soft[:, :, i0:i1], ds_q * soft[:, :, i0:i1]
                    dq[:, :, i0:i1] += rnd(ds_q.astype(acc)) @ kb
                    part = np.swapaxes(rnd(ds.astype(acc)), -1, -2) @ q[:, :, i0:i1]
                    dk_b = (dk_b + part).astype(np.float16) if f16 else dk_b + part   # BUG: F16 sum
                dk[:, :, j0:j1], dv[:, :, j0:j1] = dk_b, dv_b
        dq = dq * acc(scale)
        if bug != "bwd_dk_no_scale":          # BUG: dk left unscaled
            dk = dk * acc(scale)

        def per_kv_head(a):                   # the group's query heads summed in acc
            a = a.reshape((B, Hkv, group) + a.shape[2:])
            return a[:, :, -1] if bug == "bwd_gqa_no_sum" else a.sum(axis=2)   # BUG: last one only
        result = {"dq": dq, "dk": per_kv_head(dk), "dv": per_kv_head(dv)}
        if ds_all is not None:
            result["dbias"] = nx.reduce_to(ds_all, bias_shape)   # summed in acc over the broadcast
        if sinks is not None:                 # P_sink = exp(sink - lse); 0 on padding rows
            with np.errstate(over="ignore", invalid="ignore"):
                p_sink = np.where(rows, np.exp(sinks.astype(acc)[None, :, None] - lse), 0).astype(acc)
            result["dsinks"] = -np.sum(p_sink * delta, axis=(0, 2), dtype=acc)
        return {name: result[name] for name in names}

    def raw_scores(self, q, kb, bias, j0, j1, scale, cap):
        """Scores of keys j0..j1-1 with no mask at all (bug bwd_mask_ignored)."""
        acc = q.dtype
        s = (q @ np.swapaxes(kb, -1, -2)) * acc.type(scale)
        if cap != 0:
            s = acc.type(cap) * np.tanh(s / acc.type(cap))
        if bias is not None:
            b = bias[..., j0:j1].astype(acc)
            s = s + np.where(np.isfinite(b), b, 0)
        return s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=64, help="keys per block (default 64)")
    parser.add_argument("--arith", choices=sorted(ROUND), default="fp32",
                        help="fp32: everything in float32; fp16, bf16: P rounded to F16 or BF16 "
                             "before P V (F64 inputs: float64 throughout); fp8 (FP8 inputs, stored "
                             "K/V): P rounded to F8_E4M3 before P V, as FlashAttention 3")
    parser.add_argument("--bug", choices=sorted(BUGS), default=None,
                        help="plant a known bug: " + "; ".join(f"{k}: {v}" for k, v in BUGS.items())
                        .replace("%", "%%"))
    parser.add_argument("--draw-dropout", metavar="SEED", default=None,
                        help="draw each dropout case's keep mask from a generator seeded with SEED "
                             "and return it as the output dropout_mask (the NumPy adapter's option)")
    parser.add_argument("jobs", help="jobs file, one JSON object a line")
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error("--block must be at least 1")
    nx.attention = kernel = Kernel(args.block, args.arith, args.bug)
    nx.KV_BUG = args.bug
    nx.gradients = kernel.gradients
    nx.merge_states = kernel.merge
    nx.ROTARY_BUG = args.bug if args.bug in nx.rotary_np.BUGS else None
    nx.draw_keep = lambda rng, shape, p: draw_keep(args.bug, rng, shape, p)
    # The NumPy adapter's job loop with this kernel; float64 carries every input dtype exactly.
    draw = [] if args.draw_dropout is None else ["--draw-dropout", args.draw_dropout]
    return nx.main(["--dtype", "float64"] + draw + [args.jobs])

if __name__ == "__main__":
    sys.exit(main())
