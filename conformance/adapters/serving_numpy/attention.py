#!/usr/bin/env python3
"""Serving kernels in NumPy (paged KV cache, split-KV, merge), as an AttnOracle adapter (CONTRACT
sections 5 and 8).

    /usr/bin/python3 attention.py [--structure splitkv|pagewise] [--split N] [--chunk 16|64]
                                  [--partials f32|bf16] [--log2] [--arith fp32|fp16|bf16|input]
                                  [--bug NAME] JOBS.jsonl

splitkv (flash-decoding): each batch row's keys, read through its block table chunk by chunk, are
cut into splits of N keys; each split runs an online softmax over chunks and keeps a partial
state (O_s, lse_s); a merge in F32 combines the splits and adds the sink. pagewise: one online
softmax pass, one page per key block, no splits. Kind `merge` cases run the merge alone. The job
loop, case reader, writer and .error / .unsupported files are the NumPy adapter's
(../numpy/attention.py), loaded by path; the rounding functions and the causal/window rule are the
FlashAttention-style kernel's (../flash_numpy/attention.py).
"""
import argparse
import importlib.util
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load_by_path(name, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nx = load_by_path("attnoracle_numpy_adapter_for_serving", "numpy", "attention.py")
fx = load_by_path("attnoracle_flash_numpy_for_serving", "flash_numpy", "attention.py")

BUGS = {
    # Paging
    "last_page_wrong": "the last page of a row, when partial (Lk mod P != 0), read from the page of "
                       "the previous block_table entry",
    "table_batch0": "block_table row 0 used for every batch row",
    "page_boundary_off_by_one": "the key at slot 0 of a page (j mod P = 0, j > 0) read from the "
                                "previous entry's page (splitkv's gather)",
    "unused_slot_nan": "V read at unused cache slots and masked keys as stored: their zero weight "
                       "times NaN gives NaN (0 x NaN)",
    # Splits and merge
    "split_off_by_one": "each split visits one key past its end (the next split's first key "
                        "counted twice)",
    "empty_split_nan": "a split's online softmax unguarded where no key is allowed yet: "
                       "exp(-inf - -inf) and 0 / 0 give NaN partials (and lse_s NaN)",
    "merge_nan_on_neginf": "the merge weighs every split by exp(lse_s - max lse_s), -inf splits "
                           "included: 0 x NaN, and NaN where every lse_s is -inf",
    "merge_ignores_sink": "the merge leaves the sink out",
    "partials_bf16_undeclared": "the partial outputs O_s rounded to BF16 although --partials f32 "
                                "declares them F32",
    # Masks and heads
    "mask_sentinel_5e4": "masked scores set to the finite -5e4 instead of -inf: rows whose allowed "
                         "scores all lie below it, and fully masked rows, go wrong",
    "mask_dropped_last_block": "when Nk mod 128 = 64, the causal, window and mask tensor are not "
                               "applied in the key block holding the row's last key",
    "gqa_group3": "at group size Hq / Hkv = 3, query head h reads kv head h % Hkv",
}

KEYS = set(nx.KEYS) | {"attn.kv_layout", "attn.kv_split_size", "attn.lse_posinf"}
OUTPUTS = ("out", "lse", "out_partial", "lse_partial", "weights", "scores")
NUMPY_TYPE = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
SENTINEL = -5e4                          # bug mask_sentinel_5e4
INPUT_ARITH = {"F64": "fp32", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}   # --arith input


def finite(a, dt):
    """Non-finite values (allowed only at unused positions) read as 0."""
    return np.where(np.isfinite(a), a, 0).astype(dt)


class Kernel:
    """Settings of one run; `run_case` replaces the NumPy adapter's."""

    def __init__(self, structure, split, chunk, partials, log2, arith, bug):
        self.structure, self.split, self.chunk = structure, split, chunk
        self.partials, self.log2, self.arith, self.bug = partials, log2, arith, bug

    # ---- the case: reading, checking

    def run_case(self, path, compute=None, _bug=None):
        try:
            tensors, meta, dtypes = nx.safetensors_np.read(path)
        except nx.safetensors_np.UnsupportedDtype as e:
            raise nx.Unsupported(str(e))
        for key in meta:
            if key.startswith("attn.") and key not in KEYS and key not in ("attn.reference", "attn.undecided"):
                raise nx.Unsupported(f"metadata key {key}")
        if meta.get("attn.format") != "1":
            raise nx.Unsupported(f"attn.format {meta.get('attn.format')!r}")
        if meta.get("attn.masked_rows", "error") not in ("error", "zero"):
            raise nx.Unsupported(f"attn.masked_rows {meta['attn.masked_rows']}")
        kind = meta.get("attn.kind", "sdpa")
        outputs = meta.get("attn.outputs", "out").split(",")
        paged = "k_cache" in tensors
        for name in outputs:
            if name in nx.GRADIENTS and paged:
                raise nx.Refused(f"{path}: attn.outputs: {name}: gradients of paged cases are not defined")
            if name not in OUTPUTS or kind == "merge" and name not in ("out", "lse"):
                raise nx.Unsupported(f"attn.outputs {name}")
        if kind == "merge":
            result, out_dtype = self.merge_case(path, tensors, meta, dtypes)
        elif kind == "sdpa":
            result, out_dtype = self.sdpa_case(path, tensors, meta, dtypes, outputs, paged)
        else:
            raise nx.Unsupported(f"attn.kind {kind}")
        dtype_of = nx.output_dtypes(meta, outputs + ["out"], out_dtype)
        result = {name: result[name] for name in dict.fromkeys(["out"] + outputs)}
        with np.errstate(over="ignore", invalid="ignore"):   # BF16 is rounded by the writer
            result = {name: a.astype(NUMPY_TYPE[dtype_of[name]]) if dtype_of[name] != "BF16" else a
                      for name, a in result.items()}
        return result, {name: dtype_of[name] for name in result}

    def sdpa_case(self, path, tensors, meta, dtypes, outputs, paged):
        in_dtype = dtypes["q"] if "q" in dtypes else None
        if in_dtype not in nx.FLOATS:
            raise nx.Unsupported(f"dtype {in_dtype} of q")
        out_dtype = meta.get("attn.output_dtype", in_dtype)
        if out_dtype not in nx.FLOATS:
            raise nx.Unsupported(f"attn.output_dtype {out_dtype}")
        if meta.get("attn.causal", "none") not in ("none", "top_left", "bottom_right"):
            raise nx.Unsupported(f"attn.causal {meta['attn.causal']}")
        for name in ("q_descale", "k_descale", "v_descale", "dout"):
            if name in tensors:
                raise nx.Unsupported(f"tensor {name}")
        q = tensors["q"]
        B, Hq, Nq, Dk = q.shape
        if paged:
            for name in ("v_cache", "block_table", "seqlens_k"):
                if name not in tensors:
                    raise nx.Refused(f"{path}: {name}: missing (a paged case with k_cache needs it)")
            for name in ("k", "v"):
                if name in tensors:
                    raise nx.Refused(f"{path}: {name}: given beside k_cache")
            layout = meta.get("attn.kv_layout", "NHD")
            if layout not in ("NHD", "HND"):
                raise nx.Refused(f"{path}: attn.kv_layout: {layout!r} is neither NHD nor HND")
            kc, vc, table = tensors["k_cache"], tensors["v_cache"], tensors["block_table"]
            if dtypes["block_table"] != "I32" or table.ndim != 2 or table.shape[0] != B:
                raise nx.Refused(f"{path}: block_table: must be I32 [B={B}, Mpages], "
                                 f"got {dtypes['block_table']} {list(table.shape)}")
            if kc.ndim != 4 or vc.ndim != 4:
                raise nx.Refused(f"{path}: k_cache: must have 4 dimensions")
            if layout == "HND":                  # [Npages, Hkv, P, D] -> [Npages, P, Hkv, D]: a view
                kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
            npages, P, Hkv = kc.shape[:3]
            if vc.shape[:3] != kc.shape[:3]:
                raise nx.Refused(f"{path}: v_cache: shape {list(tensors['v_cache'].shape)} does not "
                                 f"match k_cache {list(tensors['k_cache'].shape)}")
            if kc.shape[3] != Dk:
                raise nx.Refused(f"{path}: k_cache: Dk {kc.shape[3]} != q's {Dk}")
            Nk, Dv = table.shape[1] * P, vc.shape[3]
            for name in ("k_cache", "v_cache"):
                if dtypes[name] != in_dtype:
                    raise nx.Refused(f"{path}: {name}: dtype {dtypes[name]} is not q's ({in_dtype})")
        else:
            if "k" not in tensors or "v" not in tensors:
                raise nx.Refused(f"{path}: k: missing (neither k nor k_cache given)")
            k, v = tensors["k"], tensors["v"]
            Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
            for name in ("k", "v"):
                if dtypes[name] != in_dtype:
                    raise nx.Refused(f"{path}: {name}: dtype {dtypes[name]} is not q's ({in_dtype})")
        if Hkv == 0 or Hq % Hkv:
            raise nx.Refused(f"{path}: k: Hkv = {Hkv} does not divide Hq = {Hq}")
        lk = np.full(B, Nk, np.int64)
        if "seqlens_k" in tensors:
            lk = tensors["seqlens_k"].astype(np.int64).reshape(-1)
            if lk.shape != (B,):
                raise nx.Refused(f"{path}: seqlens_k: shape must be [B={B}]")
            bad = np.flatnonzero((lk < 0) | (lk > Nk))
            if len(bad):
                raise nx.Refused(f"{path}: seqlens_k[{bad[0]}]: {lk[bad[0]]} outside [0, Nk={Nk}]")
        if paged:                                # used entries: j div P for j < Lk
            used = np.arange(table.shape[1])[None, :] < -(-lk // P)[:, None]
            bad = np.argwhere(used & ((table < 0) | (table >= npages)))
            if len(bad):
                b, p = bad[0]
                raise nx.Refused(f"{path}: block_table[{b}, {p}]: page {table[b, p]} outside "
                                 f"[0, Npages={npages})")
        lq = np.full(B, Nq, np.int64)
        if "seqlens_q" in tensors:
            lq = tensors["seqlens_q"].astype(np.int64).reshape(-1)
        split = self.split
        if "attn.kv_split_size" in meta:
            try:
                split = int(meta["attn.kv_split_size"])
            except ValueError:
                split = 0
            if split < 1:
                raise nx.Refused(f"{path}: attn.kv_split_size: {meta['attn.kv_split_size']!r} is not "
                                 f"a positive integer")
        elif "out_partial" in outputs or "lse_partial" in outputs:
            raise nx.Refused(f"{path}: attn.outputs: out_partial, lse_partial need attn.kv_split_size")
        partial_asked = "out_partial" in outputs or "lse_partial" in outputs
        if self.structure == "pagewise" and partial_asked:
            raise nx.Unsupported("out_partial, lse_partial: --structure pagewise has no splits")

        acc = np.float64 if in_dtype == "F64" else np.float32
        self.acc = acc
        arith = INPUT_ARITH[in_dtype] if self.arith == "input" else self.arith
        self.rnd = rnd = fx.ROUND[arith] if in_dtype != "F64" else None
        ident = rnd or (lambda a: a)
        # Q in the P format; K, V rounded as the chunks are read (unused slots never touched).
        self.qs = ident(finite(q, acc))
        if paged:
            self.kc, self.vc, self.table, self.P = kc, vc, table, P
        else:
            self.k, self.v = k, v
        self.paged, self.ident = paged, ident
        self.B, self.Hq, self.Hkv, self.Nq, self.Nk, self.Dv = B, Hq, Hkv, Nq, Nk, Dv
        self.lq, self.lk, self.meta = lq, lk, meta
        group = Hq // Hkv
        heads = np.arange(Hq) // group
        if self.bug == "gqa_group3" and group == 3:    # BUG: tiled at group size 3
            heads = np.arange(Hq) % Hkv
        self.heads = heads
        full = (B, Hq, Nq, Nk)
        self.mask = None if "mask" not in tensors else np.broadcast_to(tensors["mask"], full)
        self.bias = None if "bias" not in tensors else np.broadcast_to(tensors["bias"], full)
        self.scale = acc(nx.number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk))
        self.cap = acc(nx.number(meta.get("attn.softcap", "0")))
        sinks = tensors.get("sinks")

        S = -(-Nk // split) if self.structure == "splitkv" else 0
        o_parts = np.zeros((S, B, Hq, Nq, Dv), acc)
        l_parts = np.full((S, B, Hq, Nq), -np.inf, acc)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if self.structure == "splitkv":
                for b in range(B):
                    for s in range(S):
                        j1 = min((s + 1) * split, Nk)
                        if self.bug == "split_off_by_one":    # BUG: one key past the split
                            j1 = min(j1 + 1, Nk)
                        o_parts[s, b], l_parts[s, b] = self.split_state(b, s * split, j1)
                if self.partials == "bf16" or self.bug == "partials_bf16_undeclared":
                    o_parts = fx.round_bf16(o_parts).astype(acc)   # BUG partials_bf16_undeclared: here too
                mt = np.float32 if acc == np.float32 else np.float64     # F64 inputs: float64 throughout
                out, lse = merge(o_parts.astype(mt), l_parts.astype(mt),
                                 None if sinks is None else sinks.astype(mt)[None, :, None],
                                 self.log2, self.bug, mt)
                keyed = (l_parts != -np.inf).any(axis=0)
            else:
                out, lse = np.zeros((B, Hq, Nq, Dv), acc), np.full((B, Hq, Nq), -np.inf, acc)
                keyed = np.zeros((B, Hq, Nq), bool)
                for b in range(B):
                    out[b], lse[b], keyed[b] = self.pagewise(b, sinks)
        # Fully masked rows: no allowed key in any split and no sink (padding rows excepted).
        live = keyed | (sinks is not None)
        if self.bug == "mask_sentinel_5e4":      # BUG: every row has a finite maximum: never masked
            live = np.ones_like(live)
        rows = nx.query_rows(B, Nq, tensors.get("query_mask"), tensors.get("seqlens_q"))
        if meta.get("attn.masked_rows", "error") == "error":
            bad = np.argwhere(~live & rows[:, None, :])
            if len(bad):
                b, h, i = bad[0]
                raise nx.Refused(f"fully masked row: b={b}, h={h}, i={i} has no allowed key "
                                 f"(attn.masked_rows=error)")
        if self.bug != "merge_nan_on_neginf":    # BUG: the merge's NaN on such rows kept
            out = np.where(live[..., None], out, 0)
            lse = np.where(live, lse, -np.inf)
        result = {"out": out, "lse": lse, "out_partial": o_parts, "lse_partial": l_parts}
        if "weights" in outputs or "scores" in outputs:
            result.update(self.second_pass(lse, live))
        return result, out_dtype

    def second_pass(self, lse, live):
        """weights = exp(S - lse) from the final lse (sink included), and the scores S, -inf
        where not allowed, chunk by chunk through the block table again; 0 and -inf past Lk."""
        weights = np.zeros((self.B, self.Hq, self.Nq, self.Nk), self.acc)
        scores = np.full(weights.shape, -np.inf, self.acc)
        lse = np.where(live, lse, np.inf).astype(self.acc)    # rows with no key: exp(-inf) = 0
        with np.errstate(over="ignore", invalid="ignore"):
            for b in range(self.B):
                for j0 in range(0, self.lk[b], self.chunk):
                    j1 = min(j0 + self.chunk, self.Nk)
                    kb, _ = self.keys(b, j0, j1)
                    s = self.scores(b, kb, j0, j1)
                    scores[b, :, :, j0:j1] = s
                    weights[b, :, :, j0:j1] = np.exp(s - lse[b][..., None])
        return {"weights": weights, "scores": scores}

    # ---- reading keys through the block table

    def keys(self, b, j0, j1):
        """K, V of keys j0..j1-1 of batch row b, [Hq, n, D] in the accumulation dtype, gathered
        slot by slot through the block table; keys past Lk are zeros (their entries unread)."""
        bug, acc, j = self.bug, self.acc, np.arange(j0, j1)
        used = j < self.lk[b]
        if self.paged:
            P, row = self.P, self.table[0 if bug == "table_batch0" else b]   # BUG table_batch0
            entry = j // P
            if bug == "page_boundary_off_by_one":    # BUG: slot 0 of a page from the previous entry
                entry = np.where((j % P == 0) & (j > 0), entry - 1, entry)
            last = (self.lk[b] - 1) // P
            if bug == "last_page_wrong" and self.lk[b] % P and last > 0:   # BUG: the entry before
                entry = np.where(entry == last, last - 1, entry)
            page = np.where(used, row[np.minimum(entry, len(row) - 1)] if len(row) else 0, 0)
            if bug == "unused_slot_nan":             # BUG: unused slots read as well (wrapped: -1 too)
                page = row[np.minimum(entry, len(row) - 1)] % len(self.kc) if len(row) else page
            kb, vb = self.kc[page, j % P], self.vc[page, j % P]   # [n, Hkv, D]
            kb, vb = kb.transpose(1, 0, 2), vb.transpose(1, 0, 2)
        else:
            kb, vb = self.k[b, :, j0:j1], self.v[b, :, j0:j1]
        kb = finite(np.where(used[None, :, None], kb, 0), acc)
        if bug == "unused_slot_nan":                 # BUG: V kept as stored, NaN and all
            vb = vb.astype(acc)
        else:
            vb = finite(np.where(used[None, :, None], vb, 0), acc)
        return self.ident(kb)[self.heads], self.ident(vb)[self.heads]

    def scores(self, b, kb, j0, j1):
        """[Hq, Nq, n] scores of keys j0..j1-1, -inf (bug: -5e4) where not allowed."""
        acc, bug = self.acc, self.bug
        s = (self.qs[b] @ np.swapaxes(kb, -1, -2)) * self.scale
        if self.cap != 0:
            s = self.cap * np.tanh(s / self.cap)
        ok = fx.key_allowed(self.meta, self.Nq, self.Nk, j0, j1, None, self.lq[b:b + 1], self.lk[b:b + 1])[0]
        if self.mask is not None:
            ok = ok & self.mask[b, :, :, j0:j1]
        if bug == "mask_dropped_last_block" and self.Nk % 128 == 64 and j0 <= self.lk[b] - 1 < j1:
            ok = np.broadcast_to(np.arange(j0, j1) < self.lk[b], s.shape)   # BUG: only Lk applied
        if self.bias is not None:
            bias = self.bias[b, :, :, j0:j1].astype(acc)
            ok = ok & (bias != -np.inf)
            s = s + np.where(ok, bias, 0)
        return np.where(ok, s, acc(SENTINEL) if bug == "mask_sentinel_5e4" else acc(-np.inf))

    # ---- the online softmax

    def update(self, state, s, vb):
        """One key block: m, l, O rescaled by exp(m_old - m_new); P in the --arith format before P V."""
        m, l, o = state
        m_new = np.maximum(m, s.max(axis=-1)) if s.shape[-1] else m
        base = m_new if self.bug == "empty_split_nan" else np.where(m_new == -np.inf, 0, m_new)
        p = np.exp(s - base[..., None])          # BUG empty_split_nan: exp(-inf - -inf) = NaN
        alpha = np.exp(m - base)
        l = alpha * l + p.sum(axis=-1, dtype=self.acc)
        o = alpha[..., None] * o + self.ident(p) @ vb
        return m_new, l, o

    def start(self):
        shape = (self.Hq, self.Nq)
        return (np.full(shape, -np.inf, self.acc), np.zeros(shape, self.acc),
                np.zeros(shape + (self.Dv,), self.acc))

    def finish(self, state):
        """(O / l, m + log l); a row with no allowed key: (0, -inf) (bug empty_split_nan: 0 / 0)."""
        m, l, o = state
        if self.bug == "empty_split_nan":
            return o / l[..., None], m + np.log(l)
        live = m != -np.inf                      # an allowed key gives l >= 1 (its own exp(0))
        one = np.where(live, l, 1)
        return np.where(live[..., None], o / one[..., None], 0), np.where(live, m + np.log(one), -np.inf)

    def split_state(self, b, j0, j1):
        """Split [j0, j1) of row b, visited chunk by chunk up to Lk."""
        state = self.start()
        for c0 in range(j0, min(j1, self.lk[b]), self.chunk):
            c1 = min(c0 + self.chunk, j1)
            kb, vb = self.keys(b, c0, c1)
            state = self.update(state, self.scores(b, kb, c0, c1), vb)
        return self.finish(state)

    def pagewise(self, b, sinks):
        """Row b in one pass, one page (contiguous cases: --chunk keys) per key block; the sink
        after the last page as one more term of l -> out, lse, whether the row had a key."""
        state = self.start()
        size = self.P if self.paged else self.chunk
        npages = -(-int(self.lk[b]) // size)
        for p in range(npages):
            j0, j1 = p * size, min((p + 1) * size, self.Nk)
            kb, vb = self.page(b, p, npages) if self.paged else self.keys(b, j0, j1)
            state = self.update(state, self.scores(b, kb, j0, j1), vb)
        m, l, o = state
        keyed = m != -np.inf
        if sinks is not None:
            sink = sinks.astype(self.acc)[:, None]
            m_new = np.maximum(m, sink)
            alpha = np.exp(m - m_new)
            l, o, m = alpha * l + np.exp(sink - m_new), alpha[..., None] * o, m_new
        out, lse = self.finish((m, l, o))
        return out, lse, keyed

    def page(self, b, p, npages):
        """Page p of row b's block table, [Hq, P, D]; slots past Lk zeroed."""
        bug, acc = self.bug, self.acc
        row = self.table[0 if bug == "table_batch0" else b]   # BUG table_batch0
        entry = p
        if bug == "last_page_wrong" and p == npages - 1 and self.lk[b] % self.P and p > 0:
            entry = p - 1                        # BUG: the entry before
        page = row[entry]
        used = (np.arange(self.P) + p * self.P < self.lk[b])[None, :, None]
        kb, vb = self.kc[page].transpose(1, 0, 2), self.vc[page].transpose(1, 0, 2)
        kb = finite(np.where(used, kb, 0), acc)
        vb = vb.astype(acc) if bug == "unused_slot_nan" else finite(np.where(used, vb, 0), acc)
        return self.ident(kb)[self.heads], self.ident(vb)[self.heads]

    # ---- kind merge

    def merge_case(self, path, tensors, meta, dtypes):
        for name in ("o_partial", "lse_partial"):
            if name not in tensors:
                raise nx.Refused(f"{path}: {name}: missing (kind merge)")
        o, lse = tensors["o_partial"], tensors["lse_partial"]
        if dtypes["o_partial"] not in ("F32", "F16", "BF16"):
            raise nx.Unsupported(f"dtype {dtypes['o_partial']} of o_partial")
        if dtypes["lse_partial"] not in ("F32", "F64"):
            raise nx.Unsupported(f"dtype {dtypes['lse_partial']} of lse_partial")
        if o.ndim != 5 or lse.shape != o.shape[:4]:
            raise nx.Refused(f"{path}: lse_partial: shape {list(lse.shape)} is not o_partial's "
                             f"[S, B, H, Nq] {list(o.shape[:4])}")
        sinks = tensors.get("sinks")
        if sinks is not None and sinks.shape != (o.shape[2],):
            raise nx.Refused(f"{path}: sinks: shape {list(sinks.shape)} is not [H={o.shape[2]}]")
        posinf_empty = meta.get("attn.lse_posinf") == "empty"
        if "attn.lse_posinf" in meta and not posinf_empty:
            raise nx.Refused(f"{path}: attn.lse_posinf: {meta['attn.lse_posinf']!r} is not 'empty'")
        bad = np.argwhere(np.isnan(lse) | (lse == np.inf) & (not posinf_empty))
        if len(bad):
            at = ", ".join(str(x) for x in bad[0])
            raise nx.Refused(f"{path}: lse_partial[{at}]: {lse[tuple(bad[0])]} (lse_s must be finite or -inf)")
        if sinks is not None and not np.isfinite(sinks).all():
            raise nx.Refused(f"{path}: sinks[{np.flatnonzero(~np.isfinite(sinks))[0]}]: not finite")
        lse = np.where(lse == np.inf, -np.inf, lse)      # attn.lse_posinf=empty: +inf is an empty split
        live_s = lse != -np.inf
        bad = np.argwhere(live_s[..., None] & ~np.isfinite(o))
        if len(bad):
            at = ", ".join(str(x) for x in bad[0])
            raise nx.Refused(f"{path}: o_partial[{at}]: not finite in a split with a finite lse")
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out, lse_out = merge(o.astype(np.float32), lse.astype(np.float32),
                                 None if sinks is None else sinks.astype(np.float32)[None, :, None],
                                 self.log2, self.bug)
        live = live_s.any(axis=0) | (sinks is not None)
        if meta.get("attn.masked_rows", "error") == "error":
            bad = np.argwhere(~live)
            if len(bad):
                b, h, i = bad[0]
                raise nx.Refused(f"fully masked row: b={b}, h={h}, i={i}: every lse_s is -inf and "
                                 f"there is no sink (attn.masked_rows=error)")
        if self.bug != "merge_nan_on_neginf":
            out = np.where(live[..., None], out, 0)
            lse_out = np.where(live, lse_out, -np.inf)
        return {"out": out, "lse": lse_out}, meta.get("attn.output_dtype", dtypes["o_partial"])


def merge(o, lse, sink, log2, bug, f32=np.float32):
    """out, lse of partial states o [S, ..., Dv], lse [S, ...] (natural log) and a sink
    broadcastable to lse[0], all float32: M = max(lse_s, sink); w_s = exp(lse_s - M), 0 for
    -inf splits; lse = M + log(sum w_s + exp(sink - M)); out = sum w_s O_s / that sum.
    --log2: the exponentials in base 2 with log2(e) folded in, w_s = exp2((lse_s - M) log2(e)),
    lse = M + log2(sum) ln(2): M stays natural (the maximum itself is not rescaled).
    `f32`: the merge's dtype (float64 for F64 inputs)."""
    if bug == "merge_ignores_sink":              # BUG: no sink term
        sink = None
    if log2:
        log2e, ln2 = f32(1 / math.log(2)), f32(math.log(2))
        exp, log = (lambda x: np.exp2(x * log2e)), (lambda x: np.log2(x) * ln2)
    else:
        exp, log = np.exp, np.log
    live = lse != -np.inf
    top = lse.max(axis=0, initial=-np.inf)
    if sink is not None:
        sink = np.broadcast_to(sink, top.shape)
        top = np.maximum(top, sink)
    if bug == "merge_nan_on_neginf":             # BUG: every split weighed, unguarded
        w = exp(lse - top)
        z = w.sum(axis=0) + (exp(sink - top) if sink is not None else f32(0))
        out = (w[..., None] * o).sum(axis=0) / z[..., None]
        return out, top + log(z)
    base = np.where(top == -np.inf, f32(0), top)
    w = np.where(live, exp(lse - base), f32(0))
    z = w.sum(axis=0, dtype=f32)
    if sink is not None:
        z = z + exp(sink - base)
    acc = (w[..., None] * np.where(live[..., None], o, f32(0))).sum(axis=0, dtype=f32)
    one = np.where(z > 0, z, f32(1))
    out = np.where((z > 0)[..., None], acc / one[..., None], f32(0))
    lse_out = np.where(z > 0, base + log(one), -np.inf)
    return out.astype(f32), lse_out.astype(f32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structure", choices=["splitkv", "pagewise"], default="splitkv")
    parser.add_argument("--split", type=int, default=64,
                        help="keys per split (splitkv; the case's attn.kv_split_size wins; default 64)")
    parser.add_argument("--chunk", type=int, choices=[16, 64], default=16,
                        help="keys per online-softmax step within a split (splitkv), or per block "
                             "of a contiguous case (pagewise); default 16")
    parser.add_argument("--partials", choices=["f32", "bf16"], default="f32",
                        help="splitkv: each split's O_s kept in F32 or rounded to BF16")
    parser.add_argument("--log2", action="store_true", help="the merge in base 2 (exp2, log2)")
    parser.add_argument("--arith", choices=["fp32", "fp16", "bf16", "input"], default=None,
                        help="fp16, bf16: Q, K, V and P rounded to F16 / BF16 before the products; "
                             "input: to the case's input format (F16, BF16; F32 unchanged); F64 "
                             "inputs: float64 throughout. Default: fp32 for splitkv, input for pagewise")
    parser.add_argument("--bug", choices=sorted(BUGS), default=None,
                        help="plant a known bug: " + "; ".join(f"{k}: {v}" for k, v in BUGS.items())
                        .replace("%", "%%"))
    parser.add_argument("jobs", help="jobs file, one JSON object a line")
    args = parser.parse_args(argv)
    if args.split < 1:
        parser.error("--split must be at least 1")
    arith = args.arith or ("input" if args.structure == "pagewise" else "fp32")
    kernel = Kernel(args.structure, args.split, args.chunk, args.partials, args.log2, arith, args.bug)
    nx.run_case = kernel.run_case
    return nx.main(["--dtype", "float64", args.jobs])


if __name__ == "__main__":
    sys.exit(main())
