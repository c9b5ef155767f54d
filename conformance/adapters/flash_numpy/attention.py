#!/usr/bin/env python3
"""A FlashAttention-style kernel in NumPy, as an AttnOracle adapter (CONTRACT section 5).

    /usr/bin/python3 attention.py [--block N] [--arith fp32|fp16|bf16] [--bug no_rescale] JOBS.jsonl

Keys are visited in blocks of N with an online softmax: a running maximum m, a running sum l and
an accumulator O, rescaled by exp(m_old - m_new) whenever a block raises the maximum; out = O / l
and lse = m + log l at the end. The case files, the job loop and the .error / .unsupported files
are those of the NumPy adapter (../numpy/attention.py), loaded by path; only the kernel differs.
"""
import argparse
import importlib.util
import math
import os
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

BUGS = {"no_rescale": "each block's maximum is subtracted, but the earlier blocks' sum and "
                      "accumulator are not rescaled by exp(m_old - m_new)"}


# ---- Arithmetic a few times coarser than declared: each error is within the worst-case limit of
# most elements, and shows in the distribution of the errors (TOLERANCE.md, the statistical tier).
STAT_BUGS = {
    "stat_exp_1e3": "exp with a relative error of up to 1e-3",
    "stat_f16_denominator": "the softmax denominator l summed and kept in F16",
    "stat_pv_bf16": "P V accumulated in BF16, rounded after every product and every addition",
    "stat_round_up": "the output rounded toward +inf instead of to nearest",
}
BUGS.update(STAT_BUGS)


def stat_exp(bug, x):
    """exp; under stat_exp_1e3 off by a relative 1e-3 sin(1e4 x), a deterministic, unbiased error."""
    e = np.exp(x)
    if bug == "stat_exp_1e3":
        e = e * (1 + e.dtype.type(1e-3) * np.sin(e.dtype.type(1e4) * np.where(np.isfinite(x), x, 0))).astype(e.dtype)
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


def round_bf16(a):
    """float32 -> the nearest BF16 value (ties to even), as float32: the uint32 bits of the float32
    get 0x7FFF plus their bit 16 added, and the low 16 bits cleared (safetensors_np.bf16_bits)."""
    bits = nx.safetensors_np.bf16_bits(np.asarray(a, np.float32)).astype(np.uint32)
    return (bits << 16).view(np.float32)


def round_f16(a):
    """float32 -> the nearest F16 value (ties to even, subnormals included), as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


ROUND = {"fp32": None, "fp16": round_f16, "bf16": round_bf16}


def key_allowed(meta, Nq, Nk, j0, j1):
    """[Nq, j1 - j0]: causal and window for keys j0..j1-1, with i' = i (top_left) or
    i + Nk - Nq (bottom_right); the window takes the causal alignment (top_left when none)."""
    causal = meta.get("attn.causal", "none")
    rows = np.arange(Nq)[:, None] + (Nk - Nq if causal == "bottom_right" else 0)
    cols = np.arange(j0, j1)[None, :]
    ok = cols <= rows if causal != "none" else np.ones((Nq, j1 - j0), bool)
    window = meta.get("attn.window", "none")
    if window != "none":
        left, right = (int(x) for x in window.split(","))
        ok = ok & (cols >= rows - left) & (cols <= rows + right)
    return ok


class Kernel:
    """Settings of one run; called as the NumPy adapter's `attention`."""

    def __init__(self, block, arith, bug):
        self.block, self.arith, self.bug = block, arith, bug

    def scores(self, q, kb, meta, bias, Nk, j0, j1, scale, cap):
        """Scores of keys j0..j1-1 in the accumulation dtype, -inf where not allowed."""
        acc = q.dtype
        s = (q @ np.swapaxes(kb, -1, -2)) * acc.type(scale)
        if cap != 0:
            s = acc.type(cap) * np.tanh(s / acc.type(cap))
        ok = np.broadcast_to(key_allowed(meta, q.shape[2], Nk, j0, j1), s.shape)
        if bias is not None:
            b = bias[..., j0:j1].astype(acc)
            ok = ok & (b != -np.inf)
            s = s + np.where(ok, b, 0)
        if self.mask is not None:
            ok = ok & self.mask[..., j0:j1]
        return np.where(ok, s, acc.type(-np.inf))

    def __call__(self, q, k, v, meta, bug, mask=None, bias=None, query_mask=None, in_dtype=None):
        acc = np.float64 if in_dtype == "F64" else np.float32
        rnd = ROUND[self.arith] if in_dtype != "F64" else None
        # Q, K, V in the input dtype (kind mha: the projections rounded to it, or to the P dtype).
        q, k, v = (a.astype(acc) for a in (q, k, v))
        if rnd is not None:
            q, k, v = rnd(q), rnd(k), rnd(v)
        B, Hq, Nq, Dk = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
        group = Hq // Hkv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # head h reads h // group
        full = (B, Hq, Nq, Nk)
        self.mask = None if mask is None else np.broadcast_to(mask, full)
        bias = None if bias is None else np.broadcast_to(bias, full)
        scale = nx.number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
        cap = nx.number(meta.get("attn.softcap", "0"))

        m = np.full((B, Hq, Nq), -np.inf, acc)          # running maximum
        l = np.zeros((B, Hq, Nq), acc)                  # running sum of exp(s - m)
        o = np.zeros((B, Hq, Nq, Dv), acc)              # running sum of exp(s - m) v
        with np.errstate(over="ignore", invalid="ignore"):
            for j0 in range(0, Nk, self.block):
                j1 = min(j0 + self.block, Nk)
                s = self.scores(q, k[:, :, j0:j1], meta, bias, Nk, j0, j1, scale, cap)
                m_new = np.maximum(m, s.max(axis=-1))
                base = np.where(m_new == -np.inf, 0, m_new).astype(acc)   # no key yet: any constant
                p = stat_exp(self.bug, s - base[..., None])              # 0 where not allowed
                if self.bug == "no_rescale":   # BUG: the earlier blocks keep their old maximum
                    alpha = np.ones_like(l)
                else:
                    alpha = stat_exp(self.bug, m - base)                 # exp(-inf) = 0 at the start
                l = stat_denominator(self.bug, alpha, l, p, acc)
                if rnd is not None:                                      # P in F16 / BF16 before P V
                    p = rnd(p)
                o = stat_accumulate(self.bug, alpha, o, p, v[:, :, j0:j1])
                m = m_new

        live = m != -np.inf                            # a row with an allowed key has l >= 1
        if meta.get("attn.masked_rows", "error") == "error":
            is_query = np.ones((B, Nq), bool) if query_mask is None else query_mask
            bad = np.argwhere(~live & is_query[:, None, :])
            if len(bad):
                b, h, row = bad[0]
                raise nx.Refused(f"fully masked row: b={b}, h={h}, i={row} has no allowed key "
                                 f"(attn.masked_rows=error)")
        one = np.where(live, l, 1).astype(acc)
        out = np.where(live[..., None], stat_divide(self.bug, o, one, meta.get("attn.output_dtype", in_dtype)), 0).astype(acc)
        lse = np.where(live, m + np.log(one), -np.inf).astype(acc)
        weights = None
        if "weights" in meta.get("attn.outputs", "out").split(","):
            # A second pass over the blocks: weights = exp(s - lse) from the final lse.
            parts = [stat_exp(self.bug, self.scores(q, k[:, :, j0:min(j0 + self.block, Nk)], meta, bias, Nk, j0,
                                        min(j0 + self.block, Nk), scale, cap) - lse[..., None])
                     for j0 in range(0, Nk, self.block)]
            weights = np.where(live[..., None], np.concatenate(parts, axis=-1), 0).astype(acc)
        return out, weights, lse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=64, help="keys per block (default 64)")
    parser.add_argument("--arith", choices=sorted(ROUND), default="fp32",
                        help="fp32: everything in float32; fp16, bf16: P rounded to F16 or BF16 "
                             "before P V (F64 inputs: float64 throughout)")
    parser.add_argument("--bug", choices=sorted(BUGS), default=None,
                        help="plant a known bug: " + "; ".join(f"{k}: {v}" for k, v in BUGS.items()))
    parser.add_argument("jobs", help="jobs file, one JSON object a line")
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error("--block must be at least 1")
    nx.attention = Kernel(args.block, args.arith, args.bug)
    # The NumPy adapter's job loop with this kernel; float64 carries every input dtype exactly.
    return nx.main(["--dtype", "float64", args.jobs])

if __name__ == "__main__":
    sys.exit(main())
