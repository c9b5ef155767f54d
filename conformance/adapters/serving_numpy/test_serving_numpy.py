"""The serving kernels (attention.py) through the adapter protocol, against a float64 evaluation of
the contract's paged, split-KV and merge semantics written here (gather, then softmax).

    cd conformance/adapters/serving_numpy && /usr/bin/python3 -m pytest -q test_serving_numpy.py

Each case is written with the NumPy adapter's safetensors writer, the kernel runs as a separate
process on a jobs file, and every non-padding row is compared: |got - ref| <= tol * bound, with
bound = sum_j A[i,j] |V[j,c]| (partials: per split; merge: sum_s w_s |O_s|) and tol a few units
of the coarsest rounding of the configuration (module TOL below).
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
import safetensors_np  # noqa: E402

sys.path.insert(0, HERE)
sys.argv = sys.argv[:1] + [a for a in sys.argv[1:] if a.startswith("-")]
import attention  # noqa: E402

KERNEL = [sys.executable, os.path.join(HERE, "attention.py")]
U = {"F64": 2.0 ** -53, "F32": 2.0 ** -24, "F16": 2.0 ** -11, "BF16": 2.0 ** -8}
ARITH_U = {"fp32": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def in_dtype(a, dtype):
    """float64 values made exactly representable in `dtype`."""
    if dtype == "BF16":
        return attention.fx.round_bf16(a.astype(np.float32)).astype(np.float64)
    return a.astype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[dtype]).astype(np.float64)


class Case:
    """Tensors (float64 values exact in their dtype, or ints/bools), dtypes and metadata."""

    def __init__(self, name, tensors, dtypes, meta):
        self.name, self.tensors, self.dtypes = name, tensors, dtypes
        self.meta = {"attn.format": "1", **meta}

    def write(self, path):
        safetensors_np.save(path, self.tensors, self.meta, self.dtypes)


def sdpa_case(name, rng, B=2, Hq=2, Hkv=1, Nq=3, Dk=8, Dv=8, P=3, lk=(7, 5), dtype="F32", paged=True,
              layout="NHD", share=False, poison=True, extra_pages=2, split=None, outputs="out,lse",
              causal=None, window=None, mask=None, bias=None, sinks=None, seqlens_q=None,
              masked_rows="zero", scale=None, Mpages=None, qscale=1.0):
    """A random case of kind sdpa: paged (shuffled pages, optionally row b > 0 sharing row 0's first
    page, NaN in every unused slot, -1 in unused table entries) or contiguous (Nk = max(lk))."""
    lk = np.array(lk, np.int64)
    t, dt = {}, {}
    t["q"] = in_dtype(rng.standard_normal((B, Hq, Nq, Dk)) * qscale, dtype)
    if paged:
        need = -(-lk // P)
        Mpages = int(max(need.max(initial=0), 1)) if Mpages is None else Mpages
        npages = int(need.sum()) + extra_pages
        order = list(rng.permutation(npages))
        table = np.full((B, Mpages), -1, np.int32)
        for b in range(B):
            for p in range(need[b]):
                table[b, p] = table[0, 0] if share and b > 0 and p == 0 and need[0] > 0 else order.pop()
        kc = rng.standard_normal((npages, P, Hkv, Dk))
        vc = rng.standard_normal((npages, P, Hkv, Dv))
        used = np.zeros((npages, P), bool)
        for b in range(B):
            for j in range(lk[b]):
                used[table[b, j // P], j % P] = True
        if poison:
            kc[~used], vc[~used] = np.nan, np.nan
        if layout == "HND":
            kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
        t["k_cache"], t["v_cache"], t["block_table"] = in_dtype(kc, dtype), in_dtype(vc, dtype), table
        dt["block_table"] = "I32"
    else:
        Nk = int(lk.max(initial=0)) if Mpages is None else Mpages
        t["k"] = in_dtype(rng.standard_normal((B, Hkv, Nk, Dk)), dtype)
        t["v"] = in_dtype(rng.standard_normal((B, Hkv, Nk, Dv)), dtype)
        if poison:
            j = np.arange(Nk)[None, None, :, None]
            t["k"] = np.where(j < lk[:, None, None, None], t["k"], np.nan)
            t["v"] = np.where(j < lk[:, None, None, None], t["v"], np.nan)
    if paged or poison or (lk != lk.max(initial=0)).any():
        t["seqlens_k"] = lk.astype(np.int32)
        dt["seqlens_k"] = "I32"
    for key, a in (("mask", mask), ("bias", bias), ("sinks", sinks), ("seqlens_q", seqlens_q)):
        if a is not None:
            t[key] = a
    if seqlens_q is not None:
        t["seqlens_q"] = np.array(seqlens_q, np.int32)
        dt["seqlens_q"] = "I32"
    for key in t:
        if key in ("q", "k", "v", "k_cache", "v_cache"):
            dt[key] = dtype
        elif key in ("bias", "sinks"):
            dt[key] = "F64"
    meta = {"attn.outputs": outputs, "attn.masked_rows": masked_rows}
    if paged:
        meta["attn.kv_layout"] = layout
    for key, value in (("attn.kv_split_size", split), ("attn.causal", causal), ("attn.window", window),
                       ("attn.scale", scale)):
        if value is not None:
            meta[key] = str(value)
    return Case(name, t, dt, meta)


def merge_case(name, rng, S=3, B=2, H=2, Nq=2, Dv=4, dtype="F32", lse_dtype="F32", empty=(), sinks=None,
               posinf=False, masked_rows="zero", outputs="out,lse", spread=3.0):
    """A random kind merge case; `empty` lists (s, b, h, i) with lse_s -inf (+inf when posinf) and
    NaN in O_s."""
    o = in_dtype(rng.standard_normal((S, B, H, Nq, Dv)), dtype)
    lse = in_dtype(rng.standard_normal((S, B, H, Nq)) * spread, lse_dtype)
    for at in empty:
        lse[at] = np.inf if posinf else -np.inf
        o[at] = np.nan
    t, dt = {"o_partial": o, "lse_partial": lse}, {"o_partial": dtype, "lse_partial": lse_dtype}
    if sinks is not None:
        t["sinks"], dt["sinks"] = np.asarray(sinks, np.float64), "F64"
    meta = {"attn.kind": "merge", "attn.outputs": outputs, "attn.masked_rows": masked_rows}
    if posinf:
        meta["attn.lse_posinf"] = "empty"
    return Case(name, t, dt, meta)


# ---- the float64 evaluation of the contract

def gather(case):
    """k, v [B, Hkv, Nk, D] float64 (zeros past Lk) and Lk."""
    t, meta = case.tensors, case.meta
    B = t["q"].shape[0]
    if "k_cache" in t:
        kc, vc, table = t["k_cache"], t["v_cache"], t["block_table"]
        if meta.get("attn.kv_layout", "NHD") == "HND":
            kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
        P, Hkv = kc.shape[1], kc.shape[2]
        Nk = table.shape[1] * P
        lk = t["seqlens_k"].astype(np.int64)
        k = np.zeros((B, Hkv, Nk, kc.shape[3]))
        v = np.zeros((B, Hkv, Nk, vc.shape[3]))
        for b in range(B):
            for j in range(lk[b]):
                k[b, :, j] = kc[table[b, j // P], j % P]
                v[b, :, j] = vc[table[b, j // P], j % P]
        return k, v, lk
    k, v = t["k"], t["v"]
    lk = t["seqlens_k"].astype(np.int64) if "seqlens_k" in t else np.full(B, k.shape[2])
    j = np.arange(k.shape[2])[None, None, :, None]
    keep = j < lk[:, None, None, None]
    return np.where(keep, k, 0), np.where(keep, v, 0), lk


def allowed_keys(case, Nk, lk):
    """allowed [B, Hq, Nq, Nk] (before the bias) and the query rows [B, Nq]."""
    t, meta = case.tensors, case.meta
    B, Hq, Nq, _ = t["q"].shape
    lq = t["seqlens_q"].astype(np.int64) if "seqlens_q" in t else np.full(B, Nq)
    i = np.arange(Nq)[None, None, :, None]
    j = np.arange(Nk)[None, None, None, :]
    shift = (lk - lq)[:, None, None, None] if meta.get("attn.causal") == "bottom_right" else 0
    ip = i + shift
    ok = np.broadcast_to(j < lk[:, None, None, None], (B, Hq, Nq, Nk)).copy()
    if meta.get("attn.causal", "none") != "none":
        ok &= j <= ip
    if meta.get("attn.window", "none") != "none":
        left, right = map(int, meta["attn.window"].split(","))
        ok &= (ip - left <= j) & (j <= ip + right)
    if "mask" in t:
        ok &= np.broadcast_to(t["mask"], ok.shape)
    rows = np.arange(Nq)[None, :] < lq[:, None]
    return ok, rows


def softmax_ref(case, q, k, v, ok, sinks):
    """out, lse, bound over the keys where ok; rows with no key and no sink: 0, -inf, 0."""
    meta = case.meta
    Hq, Hkv = q.shape[1], k.shape[1]
    g = np.arange(Hq) // (Hq // Hkv)
    k, v = k[:, g], v[:, g]
    scale = float(meta.get("attn.scale", 1 / math.sqrt(q.shape[-1])))
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if "bias" in case.tensors:
        bias = np.broadcast_to(case.tensors["bias"], s.shape)
        ok = ok & (bias != -np.inf)
        s = s + np.where(ok, bias, 0)
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None])
    base = np.where(m == -np.inf, 0, m)
    e = np.where(ok, np.exp(s - base[..., None]), 0)
    z = e.sum(axis=-1) + (np.exp(sinks[None, :, None] - base) if sinks is not None else 0)
    a = e / np.where(z > 0, z, 1)[..., None]
    lse = np.where(z > 0, base + np.log(np.where(z > 0, z, 1)), -np.inf)
    softmax_ref.last = a, s                  # the weights and scores of the latest call
    return a @ v, lse, a @ np.abs(v)


def reference(case):
    """The expected outputs (float64) with their bounds, and the rows compared."""
    t, meta = case.tensors, case.meta
    if meta.get("attn.kind") == "merge":
        o, lse = t["o_partial"], np.where(t["lse_partial"] == np.inf, -np.inf, t["lse_partial"])
        live = lse != -np.inf
        top = lse.max(axis=0)
        if "sinks" in t:
            top = np.maximum(top, t["sinks"][None, :, None])
        base = np.where(top == -np.inf, 0, top)
        w = np.where(live, np.exp(lse - base), 0)
        z = w.sum(axis=0) + (np.exp(t["sinks"][None, :, None] - base) if "sinks" in t else 0)
        zz = np.where(z > 0, z, 1)
        o0 = np.where(live[..., None], o, 0)
        return ({"out": (w[..., None] * o0).sum(0) / zz[..., None],
                 "lse": np.where(z > 0, base + np.log(zz), -np.inf)},
                {"out": (w[..., None] * np.abs(o0)).sum(0) / zz[..., None]},
                np.ones(lse.shape[1:2] + lse.shape[3:], bool))
    k, v, lk = gather(case)
    ok, rows = allowed_keys(case, k.shape[2], lk)
    sinks = t.get("sinks")
    out, lse, bound = softmax_ref(case, t["q"], k, v, ok, sinks)
    ref, bounds = {"out": out, "lse": lse}, {"out": bound}
    ref["weights"], ref["scores"] = softmax_ref.last
    if "attn.kv_split_size" in meta:
        n, Nk = int(meta["attn.kv_split_size"]), k.shape[2]
        parts = []
        for s in range(-(-Nk // n)):
            j = np.arange(Nk)
            parts.append(softmax_ref(case, t["q"], k, v, ok & (j >= s * n) & (j < (s + 1) * n), None))
        shape = (0,) + out.shape
        ref["out_partial"] = np.stack([p[0] for p in parts]) if parts else np.zeros(shape)
        ref["lse_partial"] = np.stack([p[1] for p in parts]) if parts else np.zeros(shape[:-1])
        bounds["out_partial"] = np.stack([p[2] for p in parts]) if parts else np.zeros(shape)
    return ref, bounds, rows


# ---- running the kernel through the protocol

def run(flags, cases):
    """{case name: ("ok", tensors) | ("error", text) | ("unsupported", text)} of one kernel run."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = os.path.join(tmp, "jobs.jsonl")
        with open(jobs, "w") as f:
            for c in cases:
                c.write(os.path.join(tmp, c.name + ".safetensors"))
                f.write(json.dumps({"id": c.name, "input": os.path.join(tmp, c.name + ".safetensors"),
                                    "output": os.path.join(tmp, c.name + ".out.safetensors")}) + "\n")
        proc = subprocess.run(KERNEL + flags + [jobs], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results = {}
        for c in cases:
            out = os.path.join(tmp, c.name + ".out.safetensors")
            kinds = [k for k in ("error", "unsupported") if os.path.exists(out + "." + k)]
            assert len(kinds) + os.path.exists(out) == 1, (c.name, kinds)
            if kinds:
                with open(out + "." + kinds[0]) as f:
                    results[c.name] = (kinds[0], f.read())
            else:
                tensors, _, dtypes = safetensors_np.read(out)
                results[c.name] = ("ok", ({n: a.astype(np.float64) for n, a in tensors.items()}, dtypes))
        return results


def ratio(case, got, flags):
    """The worst |got - ref| / limit over the compared elements (inf for NaN or a wrong zero)."""
    ref, bounds, rows = reference(case)
    tensors, dtypes = got
    merge_kind = case.meta.get("attn.kind") == "merge"
    ins = case.dtypes["o_partial" if merge_kind else "q"]
    arith = arith_of(flags, ins)
    u_acc = U["F64"] * 64 if ins == "F64" else U["F32"] * 64     # sums of at most ~64 terms
    u_p = 0 if ins == "F64" else ARITH_U[arith]
    u_part = 2.0 ** -8 if "bf16" in flags and "--partials" in flags else 0
    worst = 0.0
    for name, want in ref.items():
        if name not in tensors:
            continue
        a = tensors[name]
        assert a.shape == want.shape, (case.name, name, a.shape, want.shape)
        u_out = U[dtypes[name]]
        sel = rows[None, :, None, :] if name.endswith("_partial") else rows[:, None, :]
        sel = np.broadcast_to(sel[..., None] if name.startswith("out") or name in ("weights", "scores") else sel,
                              a.shape)
        if name == "weights":
            # exp(S - lse): S and lse each within u_acc (1 + |value|) of their exact values
            lim = 4 * (u_out + u_acc * (1 + np.abs(ref["lse"])[..., None] + np.abs(np.where(
                want > 0, ref["scores"], 0)))) * want + 1e-300
            err = np.abs(a - want)
        elif name == "scores":
            fin = np.isfinite(want)
            lim = np.where(fin, 4 * (u_out + u_acc) * (1 + np.abs(np.where(fin, want, 0))), 0)
            err = np.where(fin, np.abs(a - np.where(fin, want, 0)), np.where(a == want, 0, np.inf))
        elif name.startswith("lse"):
            # lse = m + log l: m exact in the scores' format, log l with relative u_acc
            lim = 4 * (u_out + u_acc + u_p) * np.maximum(1, np.abs(want)) + 1e-12
            lim = np.where(want == -np.inf, 0, lim)
            err = np.where(want == -np.inf, np.where(a == -np.inf, 0, np.inf), np.abs(a - want))
        else:
            b = bounds[name]
            # P in the arith format (u_p), partials in BF16 (u_part), F32 sums, final rounding
            lim = 4 * (u_p + u_part + u_acc + u_out) * b + 1e-30
            err = np.abs(a - want)
        err = np.where(np.isnan(a), np.inf, err)
        if sel.any():
            worst = max(worst, float(np.max(np.where(sel, err / np.where(lim > 0, lim, 1e-300), 0))))
    return worst


def random_cases(rng):
    """The correctness set: paged (P 1, 3, 16; NHD and HND; shuffled, shared pages; NaN slots; -1
    entries), contiguous, split outputs, GQA 2 and 3, causal, window, mask, bias, sinks, padding."""
    c = []
    c.append(sdpa_case("p3_nhd_shared", rng, P=3, lk=(7, 5), share=True, outputs="out,lse,weights,scores"))
    c.append(sdpa_case("p1_hnd", rng, P=1, lk=(4, 6), layout="HND", Hq=4, Hkv=2))
    c.append(sdpa_case("p16_gqa3_causal", rng, P=16, lk=(40, 17), Hq=3, Hkv=1, Nq=5, causal="bottom_right",
                       Mpages=4))
    c.append(sdpa_case("p3_window_sinks", rng, P=3, lk=(11, 9), Hq=2, Hkv=2, Nq=4, window="3,1",
                       causal="bottom_right", sinks=np.array([0.5, -1.0]), outputs="out,lse,weights,scores"))
    c.append(sdpa_case("p16_mask_bias", rng, B=2, P=16, lk=(33, 20), Nq=4, Hq=2,
                       mask=rng.random((2, 1, 4, 48)) < 0.8, bias=rng.standard_normal((1, 2, 4, 48)),
                       Mpages=3, outputs="out,lse,weights,scores"))
    c.append(sdpa_case("p3_padding_rows", rng, P=3, lk=(8, 2), Nq=4, seqlens_q=[4, 2], causal="top_left"))
    c.append(sdpa_case("p3_bf16", rng, P=3, lk=(20, 13), dtype="BF16", Hq=4, Hkv=2, causal="bottom_right",
                       outputs="out,lse,weights"))
    c.append(sdpa_case("p16_f16_sinks", rng, P=16, lk=(50, 31), dtype="F16", Hq=6, Hkv=2,
                       sinks=np.array([0.0, 1.0, -2.0, 0.5, 3.0, -1.0])))
    c.append(sdpa_case("split_contig", rng, paged=False, lk=(70, 45), split=16, Nq=3, causal="bottom_right",
                       outputs="out,lse,out_partial,lse_partial,weights"))
    c.append(sdpa_case("split_paged_masked_rows", rng, P=3, lk=(10, 0), split=4, Nq=3, Hq=3, Hkv=3,
                       outputs="out,lse,out_partial,lse_partial", causal="top_left"))
    c.append(sdpa_case("split_sinks_bf16", rng, P=16, lk=(64, 33), split=32, dtype="BF16",
                       sinks=np.array([1.0, -0.5]), outputs="out,lse,out_partial,lse_partial"))
    c.append(sdpa_case("nk0_contig", rng, paged=False, lk=(0, 0), poison=False, Mpages=0))
    c.append(sdpa_case("nk0_paged", rng, P=4, lk=(0, 0), Mpages=0, extra_pages=1))
    c.append(sdpa_case("b0", rng, B=0, paged=False, lk=(), poison=False, Mpages=5))
    c.append(sdpa_case("f64_p3", rng, P=3, lk=(9, 4), dtype="F64", causal="bottom_right"))
    return c


def merge_cases(rng):
    return [merge_case("m_plain", rng),
            merge_case("m_empty", rng, empty=[(0, 0, 0, 0), (1, 1, 1, 1), (2, 1, 1, 1)]),
            merge_case("m_all_empty_zero", rng, S=2, empty=[(0, 0, 1, 0), (1, 0, 1, 0)]),
            merge_case("m_sinks", rng, sinks=[0.5, -2.0], empty=[(0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0)]),
            merge_case("m_posinf", rng, posinf=True, empty=[(1, 0, 0, 1)]),
            merge_case("m_bf16_f64lse", rng, dtype="BF16", lse_dtype="F64", spread=30.0),
            merge_case("m_s1", rng, S=1, dtype="F16")]


CONFIGS = [
    ["--structure", "splitkv", "--split", "64", "--chunk", "16", "--partials", "f32"],
    ["--structure", "splitkv", "--split", "5", "--chunk", "64", "--partials", "bf16", "--log2"],
    ["--structure", "splitkv", "--split", "16", "--chunk", "16", "--arith", "bf16"],
    ["--structure", "pagewise", "--chunk", "16"],
    ["--structure", "pagewise", "--chunk", "64", "--arith", "fp16"],
    ["--structure", "pagewise", "--chunk", "16", "--arith", "fp32"],
]


def arith_of(flags, ins):
    """The P format of a run: --arith, default fp32 (splitkv) or the input's format (pagewise)."""
    arith = flags[flags.index("--arith") + 1] if "--arith" in flags else \
        "input" if "pagewise" in flags else "fp32"
    return attention.INPUT_ARITH[ins] if arith == "input" else arith


def arith_fits(flags, case):
    """--arith fp16 / bf16 runs on cases of that input dtype (F32 inputs would be rounded too)."""
    ins = case.dtypes.get("q", case.dtypes.get("o_partial"))
    arith = arith_of(flags, ins)
    return arith == "fp32" or ins == {"fp16": "F16", "bf16": "BF16"}[arith] or ins == "F64"


class CorrectKernelTest(unittest.TestCase):
    def test_structures_within_the_bound(self):
        rng = np.random.default_rng(1)
        cases = random_cases(rng) + merge_cases(rng)
        for flags in CONFIGS:
            chosen = [c for c in cases if arith_fits(flags, c)]
            results = run(flags, chosen)
            for c in chosen:
                with self.subTest(flags=" ".join(flags), case=c.name):
                    status, got = results[c.name]
                    if flags[1] == "pagewise" and "out_partial" in c.meta["attn.outputs"]:
                        self.assertEqual(status, "unsupported", got)
                        continue
                    self.assertEqual(status, "ok", got)
                    self.assertLessEqual(ratio(c, got, flags), 1.0)

    def test_reference_agrees_with_the_numpy_adapter(self):
        # The float64 evaluation here against the NumPy adapter's (float64) on the gathered k, v
        # (Nk = 0 left out: the NumPy adapter's row maximum has no identity there).
        nx = attention.nx
        for c in random_cases(np.random.default_rng(1)):
            k, v, lk = gather(c)
            if k.shape[2] == 0:
                continue
            with self.subTest(case=c.name):
                ref, _, rows = reference(c)
                t = c.tensors
                out, _, lse, _ = nx.attention(t["q"], k, v, c.meta, None, mask=t.get("mask"),
                                              bias=t.get("bias"), seqlens_q=t.get("seqlens_q"),
                                              seqlens_k=lk, sinks=t.get("sinks"))
                sel = rows[:, None, :]
                np.testing.assert_allclose(np.where(sel[..., None], out, 0), np.where(sel[..., None], ref["out"], 0),
                                           rtol=1e-12, atol=1e-14)
                np.testing.assert_allclose(np.where(sel, lse, 0), np.where(sel, ref["lse"], 0), rtol=1e-12)

    def test_masked_rows_exact(self):
        # A fully masked row (policy zero) and an empty split: out 0, lse -inf, O_s 0, lse_s -inf.
        rng = np.random.default_rng(2)
        c = sdpa_case("masked", rng, P=3, lk=(10, 0), split=4, Nq=3, outputs="out,lse,out_partial,lse_partial",
                      causal="top_left")
        (status, (t, _)), = run(CONFIGS[0], [c]).values()
        self.assertEqual(status, "ok")
        self.assertTrue((t["out"][1] == 0).all() and (t["lse"][1] == -np.inf).all())
        self.assertTrue((t["out_partial"][1:, 0, :, 0] == 0).all())
        self.assertTrue((t["lse_partial"][1:, 0, :, 0] == -np.inf).all())
        self.assertFalse(np.isnan(t["out_partial"]).any())

    def test_policy_error_refuses(self):
        rng = np.random.default_rng(3)
        cases = [sdpa_case("paged_row", rng, P=3, lk=(10, 0), masked_rows="error"),
                 merge_case("merge_row", rng, S=2, empty=[(0, 1, 0, 1), (1, 1, 0, 1)], masked_rows="error"),
                 sdpa_case("nk0", rng, paged=False, lk=(0, 0), poison=False, Mpages=0, masked_rows="error")]
        for flags in (CONFIGS[0], CONFIGS[3]):
            res = run(flags, cases)
            self.assertEqual(res["paged_row"], ("error", "fully masked row: b=1, h=0, i=0 has no allowed key "
                                                          "(attn.masked_rows=error)\n"))
            self.assertIn("b=1, h=0, i=1", res["merge_row"][1])
            self.assertEqual(res["nk0"][0], "error")


sys.path.insert(0, os.path.join(HERE, "..", "flash_numpy"))
import gate  # noqa: E402


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class CoreGateTest(unittest.TestCase):
    """The contiguous cases of vectors/core through `attnoracle run` (no paged or split cases there)."""

    def test_both_structures_pass_core(self):
        for flags, profile in ((["--structure", "splitkv", "--split", "16", "--chunk", "16", "--log2"], "fp32"),
                               (["--structure", "pagewise", "--arith", "fp32"], "fp32"),
                               (["--structure", "splitkv", "--split", "16", "--arith", "bf16"], "flash-bf16"),
                               (["--structure", "pagewise"], "flash-fp16")):
            with self.subTest(flags=" ".join(flags), profile=profile):
                status, report = gate.run(KERNEL + flags, profile)
                self.assertEqual(gate.failed(report), {})
                self.assertGreater(report["passed"], 120)

    def test_split_bugs_fail_core(self):
        flags = ["--structure", "splitkv", "--split", "16", "--chunk", "16"]
        for bug, least in (("split_off_by_one", 30), ("partials_bf16_undeclared", 40), ("empty_split_nan", 10)):
            with self.subTest(bug=bug):
                status, report = gate.run(KERNEL + flags + ["--bug", bug], "fp32")
                self.assertEqual(status, 1)
                self.assertGreaterEqual(len(gate.failed(report)), least)


class RefusalTest(unittest.TestCase):
    """Bad input: one line naming the file and the tensor (element), no output."""

    def test_refusals(self):
        rng = np.random.default_rng(4)
        bad = {}
        c = sdpa_case("table_range", rng, P=3, lk=(7, 5))
        c.tensors["block_table"][1, 1] = 99
        bad["table_range"] = (c, "block_table[1, 1]: page 99 outside")
        c = sdpa_case("no_seqlens", rng, P=3, lk=(6, 6))
        del c.tensors["seqlens_k"]
        bad["no_seqlens"] = (c, "seqlens_k: missing")
        c = sdpa_case("seqlens_past", rng, P=3, lk=(6, 6))
        c.tensors["seqlens_k"][0] = 7
        bad["seqlens_past"] = (c, "seqlens_k[0]: 7 outside [0, Nk=6]")
        c = sdpa_case("layout", rng, P=3, lk=(6, 6))
        c.meta["attn.kv_layout"] = "NDH"
        bad["layout"] = (c, "attn.kv_layout")
        c = sdpa_case("split_size", rng, paged=False, lk=(6, 6), poison=False, split=0)
        bad["split_size"] = (c, "attn.kv_split_size")
        c = sdpa_case("partial_no_split", rng, paged=False, lk=(6, 6), poison=False, outputs="out,out_partial")
        bad["partial_no_split"] = (c, "attn.outputs: out_partial")
        c = sdpa_case("paged_grad", rng, P=3, lk=(6, 6), outputs="out,dq")
        bad["paged_grad"] = (c, "attn.outputs: dq")
        c = merge_case("lse_nan", rng)
        c.tensors["lse_partial"][1, 0, 1, 0] = np.nan
        bad["lse_nan"] = (c, "lse_partial[1, 0, 1, 0]: nan")
        c = merge_case("lse_posinf", rng)
        c.tensors["lse_partial"][0, 1, 0, 1] = np.inf
        bad["lse_posinf"] = (c, "lse_partial[0, 1, 0, 1]: inf")
        c = merge_case("o_nan", rng)
        c.tensors["o_partial"][2, 0, 0, 0, 3] = np.nan
        bad["o_nan"] = (c, "o_partial[2, 0, 0, 0, 3]")
        for name in ("v_cache", "block_table"):
            c = sdpa_case("no_" + name, rng, P=3, lk=(6, 6))
            del c.tensors[name]
            bad["no_" + name] = (c, name + ": missing")
        c = sdpa_case("k_and_cache", rng, P=3, lk=(6, 6))
        c.tensors["k"], c.dtypes["k"] = np.zeros((2, 1, 6, 8)), "F32"
        bad["k_and_cache"] = (c, "k: given beside k_cache")
        c = sdpa_case("table_i64", rng, P=3, lk=(6, 6))
        c.dtypes["block_table"] = "I64"
        bad["table_i64"] = (c, "block_table: must be I32")
        c = sdpa_case("cache_3d", rng, P=3, lk=(6, 6))
        c.tensors["k_cache"] = c.tensors["k_cache"][:, :, 0]
        bad["cache_3d"] = (c, "k_cache: must have 4 dimensions")
        c = sdpa_case("v_pages", rng, P=3, lk=(6, 6))
        c.tensors["v_cache"] = c.tensors["v_cache"][:-1]
        bad["v_pages"] = (c, "v_cache: shape")
        c = sdpa_case("cache_dk", rng, P=3, lk=(6, 6))
        c.tensors["k_cache"] = c.tensors["k_cache"][..., :4]
        bad["cache_dk"] = (c, "k_cache: Dk 4")
        c = sdpa_case("cache_dtype", rng, P=3, lk=(6, 6))
        c.dtypes["v_cache"] = "F16"
        bad["cache_dtype"] = (c, "v_cache: dtype F16 is not q's (F32)")
        c = sdpa_case("no_k", rng, paged=False, lk=(6, 6), poison=False)
        del c.tensors["k"]
        bad["no_k"] = (c, "k: missing")
        c = sdpa_case("hkv", rng, P=3, lk=(6, 6), Hq=3, Hkv=2)
        bad["hkv"] = (c, "k: Hkv = 2 does not divide Hq = 3")
        c = sdpa_case("seqlens_shape", rng, P=3, lk=(6, 6))
        c.tensors["seqlens_k"] = c.tensors["seqlens_k"][:1]
        bad["seqlens_shape"] = (c, "seqlens_k: shape")
        c = merge_case("no_o", rng)
        del c.tensors["o_partial"]
        bad["no_o"] = (c, "o_partial: missing")
        c = merge_case("lse_shape", rng)
        c.tensors["lse_partial"] = c.tensors["lse_partial"][:, :1]
        bad["lse_shape"] = (c, "lse_partial: shape")
        c = merge_case("sinks_shape", rng, sinks=[0.0, 1.0, 2.0])
        bad["sinks_shape"] = (c, "sinks: shape")
        c = merge_case("sinks_nan", rng, sinks=[0.0, np.nan])
        bad["sinks_nan"] = (c, "sinks[1]: not finite")
        c = merge_case("posinf_value", rng)
        c.meta["attn.lse_posinf"] = "nan"
        bad["posinf_value"] = (c, "attn.lse_posinf")
        for flags in (CONFIGS[0], CONFIGS[3]):
            res = run(flags, [c for c, _ in bad.values()])
            for name, (c, words) in bad.items():
                with self.subTest(flags=flags[1], case=name):
                    status, text = res[name]
                    if flags[1] == "pagewise" and name in ("partial_no_split",):
                        self.assertIn(status, ("error", "unsupported"))
                        continue
                    self.assertEqual(status, "error", text)
                    self.assertEqual(text.count("\n"), 1, text)
                    self.assertIn(name + ".safetensors: ", text)
                    self.assertIn(words, text)


def bug_cases():
    """{bug: (flags, case)}: one case aimed at each planted bug."""
    rng = np.random.default_rng(5)
    split = ["--structure", "splitkv", "--split", "64", "--chunk", "16"]
    parts = "out,lse,out_partial,lse_partial"
    below = np.where(np.arange(8)[None, None, None, :] < 6, -6e4, -np.inf)   # allowed scores below -5e4
    return {
        "last_page_wrong": (split, sdpa_case("last_page", rng, P=3, lk=(8, 7), B=2)),
        "table_batch0": (split, sdpa_case("batch0", rng, P=3, lk=(6, 6), B=2)),
        "page_boundary_off_by_one": (split, sdpa_case("boundary", rng, P=3, lk=(9, 7))),
        "unused_slot_nan": (split, sdpa_case("nan_slot", rng, P=3, lk=(8, 5), causal="top_left", Nq=4,
                                             masked_rows="zero")),
        "split_off_by_one": (split, sdpa_case("split_edge", rng, paged=False, lk=(24, 24), poison=False,
                                              split=8, outputs=parts)),
        "empty_split_nan": (split, sdpa_case("empty_split", rng, paged=False, lk=(24, 24), poison=False, split=8,
                                             Nq=24, causal="top_left", outputs=parts)),
        "merge_nan_on_neginf": (split, merge_case("merge_neginf", rng, empty=[(1, 0, 0, 0)])),
        "merge_ignores_sink": (split, sdpa_case("sink", rng, P=3, lk=(8, 5), sinks=np.array([1.0, 2.0]))),
        "partials_bf16_undeclared": (split + ["--partials", "f32"],
                                     sdpa_case("partials_f32", rng, paged=False, lk=(40, 40), poison=False,
                                               split=16, outputs=parts)),
        "mask_sentinel_5e4": (split, sdpa_case("sentinel", rng, paged=False, lk=(8, 8), poison=False,
                                               bias=below, Nq=2, qscale=0.0)),
        "mask_dropped_last_block": (split, sdpa_case("last_block", rng, paged=False, lk=(192, 192), poison=False,
                                                     Nq=8, causal="top_left")),
        "gqa_group3": (split, sdpa_case("group3", rng, P=3, lk=(7, 5), Hq=6, Hkv=2)),
    }


class PlantedBugTest(unittest.TestCase):
    """Each --bug on its case: beyond the bound (or NaN), where the correct kernel is within it."""

    def test_every_bug_seen(self):
        cases = bug_cases()
        self.assertEqual(set(cases), set(attention.BUGS))
        correct = run(cases["empty_split_nan"][0], [c for _, c in cases.values()])
        for bug, (flags, case) in cases.items():
            with self.subTest(bug=bug):
                status, got = correct[case.name]
                self.assertEqual(status, "ok", got)
                self.assertLessEqual(ratio(case, got, flags), 1.0, "the correct kernel")
                status, got = run(flags + ["--bug", bug], [case])[case.name]
                self.assertEqual(status, "ok", got)
                self.assertGreater(ratio(case, got, flags), 1.0, f"--bug {bug} not seen on {case.name}")

    def test_sentinel_and_merge_nan_on_fully_masked_rows(self):
        # Policy zero, batch row 1 masked out by a key padding mask: a -5e4 sentinel gives it the
        # mean of V (and under policy error nothing is refused); the unguarded merge gives it NaN.
        rng = np.random.default_rng(6)
        mask = np.arange(2)[:, None, None, None] == 0
        zero = sdpa_case("masked_zero", rng, P=3, lk=(7, 5), mask=mask)
        error = sdpa_case("masked_error", rng, P=3, lk=(7, 5), mask=mask, masked_rows="error")
        flags = ["--structure", "splitkv"]
        right = run(flags, [zero, error])
        self.assertEqual(right["masked_error"][0], "error")
        self.assertTrue((right["masked_zero"][1][0]["out"][1] == 0).all())
        wrong = run(flags + ["--bug", "mask_sentinel_5e4"], [zero, error])
        self.assertEqual(wrong["masked_error"][0], "ok")
        self.assertTrue((wrong["masked_zero"][1][0]["out"][1] != 0).all())
        self.assertGreater(ratio(zero, wrong["masked_zero"][1], flags), 1.0)
        (status, got), = run(flags + ["--bug", "merge_nan_on_neginf"], [zero]).values()
        self.assertTrue(np.isnan(got[0]["out"][1]).all())
        self.assertEqual(ratio(zero, got, flags), np.inf)

    def test_pagewise_paging_bugs_seen(self):
        cases = bug_cases()
        flags = ["--structure", "pagewise"]
        for bug in ("last_page_wrong", "table_batch0", "unused_slot_nan", "mask_sentinel_5e4", "gqa_group3"):
            with self.subTest(bug=bug):
                case = cases[bug][1]
                status, got = run(flags + ["--bug", bug], [case])[case.name]
                self.assertEqual(status, "ok", got)
                self.assertGreater(ratio(case, got, flags), 1.0)


if __name__ == "__main__":
    unittest.main()
