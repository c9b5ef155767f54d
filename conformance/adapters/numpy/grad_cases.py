"""Small seeded gradient cases with their golden values from `attnoracle eval`, shared by the
tests of the NumPy, flash and PyTorch adapters.

    cases = grad_cases.build(tmpdir, cli)          # name -> Case (path, golden, metadata)
    got = grad_cases.run_adapter(cmd, cases.values(), tmpdir)  # name -> tensors or (kind, text)
    ratio = grad_cases.worst_ratio(got[name], cases[name], grad_cases.limit_fn(...))

Each case asks for out and the gradients it has (dq, dk, dv, and dbias with a bias), in the
input dtype unless it says otherwise. The features: GQA with softcap and a full bias; a key
padding mask with a bias broadcast over batch and heads and causal bottom_right (Nq < Nk); causal
top_left with a window leaving fully masked rows (policy zero); seqlens_q and seqlens_k with NaN
at every unused position and in dout on padding rows; query_mask padding rows with large finite
dout; a bias broadcast along the keys (dbias exactly 0); F16, BF16 (F32 output) and F64 inputs;
a bias of shape [] with BF16 inputs and outputs; F16 inputs with an F32 dout and a window on
bottom_right; sinks with GQA, a bias along the keys and a row left with only its sink (dsinks);
and a long case (Nq = 128, Nk = 40) for blocked kernels.
"""
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_np as st  # noqa: E402

GRADS = ("dq", "dk", "dv", "dbias", "dsinks")
UNIT = {"F64": 2.0 ** -53, "F32": 2.0 ** -24, "F16": 2.0 ** -11, "BF16": 2.0 ** -8}
# half the smallest subnormal spacing: the absolute error of one rounding near 0
TINY = {"F64": 2.0 ** -1075, "F32": 2.0 ** -150, "F16": 2.0 ** -25, "BF16": 2.0 ** -134}


@dataclass
class Case:
    name: str
    path: str
    meta: dict
    golden: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)

    @property
    def out_dtype(self):
        return self.meta.get("attn.output_dtype", self.dtypes["q"])

    @property
    def grads(self):
        return [g for g in self.meta["attn.outputs"].split(",") if g in GRADS]

    @property
    def n(self):
        """Nq + Nk + Dk + Dv: the most terms any gradient element or its D_i, dP adds up."""
        q, v = self.golden["q"].shape, self.golden["v"].shape
        return q[2] + v[2] + q[3] + v[3]


def _meta(**keys):
    m = {"attn.format": "1"}
    m.update({"attn." + k: str(v) for k, v in keys.items()})
    return m


def specs(seed=11):
    """name -> (tensors, metadata, dtypes) of every case."""
    rng = np.random.default_rng(seed)
    n = lambda *shape: rng.standard_normal(shape)
    out = {}
    grads = "out,dq,dk,dv"
    # GQA 4:2, softcap, a full bias
    out["gqa_softcap_bias"] = (
        {"q": n(2, 4, 5, 4), "k": n(2, 2, 7, 4), "v": n(2, 2, 7, 3), "dout": n(2, 4, 5, 3),
         "bias": n(2, 4, 5, 7)}, _meta(softcap="2", outputs=grads + ",dbias"), None)
    # key padding mask [B,1,1,Nk], a bias [Nq,Nk] broadcast over B and H, causal bottom_right
    mask = np.ones((2, 1, 1, 6), bool)
    mask[0, ..., 2] = mask[1, ..., 4:] = False
    out["mask_bias_bottom_right"] = (
        {"q": 2 * n(2, 2, 3, 4), "k": n(2, 1, 6, 4), "v": n(2, 1, 6, 5), "dout": n(2, 2, 3, 5),
         "mask": mask, "bias": n(3, 6)},
        _meta(causal="bottom_right", scale="0.3", outputs=grads + ",dbias"), None)
    # causal top_left with Nq > Nk and a window 1,0: rows 4 and 5 see no key (policy zero)
    out["top_left_window_masked_rows"] = (
        {"q": n(1, 2, 6, 4), "k": n(1, 2, 4, 4), "v": n(1, 2, 4, 4), "dout": n(1, 2, 6, 4)},
        _meta(causal="top_left", window="1,0", masked_rows="zero", outputs=grads), None)
    # seqlens with NaN at every unused position: k, v past seqlens_k, q and dout past seqlens_q
    q, k, v, d = n(2, 2, 5, 4), n(2, 2, 6, 4), n(2, 2, 6, 3), n(2, 2, 5, 3)
    lq, lk = np.array([3, 5], np.int32), np.array([4, 6], np.int32)
    for b in range(2):
        q[b, :, lq[b]:] = d[b, :, lq[b]:] = np.nan
        k[b, :, lk[b]:] = v[b, :, lk[b]:] = np.nan
    out["seqlens_unused_nan"] = (
        {"q": q, "k": k, "v": v, "dout": d, "seqlens_q": lq, "seqlens_k": lk},
        _meta(causal="bottom_right", outputs=grads), None)
    # query_mask padding rows with large dout; a fully masked row (mask) under policy zero
    qm = np.ones((1, 5), bool)
    qm[0, 1] = qm[0, 3] = False
    mask = np.ones((1, 1, 5, 4), bool)
    mask[..., 2, :] = False
    d = n(1, 2, 5, 3)
    d[:, :, ~qm[0]] = 1e3
    out["query_mask_padding"] = (
        {"q": n(1, 2, 5, 4), "k": n(1, 2, 4, 4), "v": n(1, 2, 4, 3), "dout": d, "query_mask": qm,
         "mask": mask}, _meta(masked_rows="zero", outputs=grads), None)
    # a bias broadcast along the keys: dbias is exactly 0
    out["bias_along_keys"] = (
        {"q": n(2, 2, 4, 4), "k": n(2, 2, 5, 4), "v": n(2, 2, 5, 3), "dout": n(2, 2, 4, 3),
         "bias": n(2, 1, 4, 1)}, _meta(outputs=grads + ",dbias"), None)
    # input dtypes: F16; BF16 with an F32 output; F64 with a softcap
    t = {"q": n(1, 2, 6, 8), "k": n(1, 1, 9, 8), "v": n(1, 1, 9, 4), "dout": n(1, 2, 6, 4)}
    out["f16"] = (t, _meta(causal="bottom_right", outputs=grads), {x: "F16" for x in t})
    t = {"q": n(1, 2, 6, 8), "k": n(1, 2, 9, 8), "v": n(1, 2, 9, 4), "dout": n(1, 2, 6, 4)}
    out["bf16_f32_out"] = (t, _meta(output_dtype="F32", outputs=grads), {x: "BF16" for x in t})
    t = {"q": n(1, 4, 6, 8), "k": n(1, 2, 9, 8), "v": n(1, 2, 9, 4), "dout": n(1, 4, 6, 4),
         "bias": n(1, 4, 1, 9)}
    out["f64_softcap"] = (t, _meta(softcap="1.5", outputs=grads + ",dbias"), {x: "F64" for x in t})
    # a bias of shape [] (dbias: one number, exactly 0) with BF16 inputs and outputs, dout F32
    t = {"q": n(1, 2, 4, 4), "k": n(1, 2, 5, 4), "v": n(1, 2, 5, 3), "dout": n(1, 2, 4, 3),
         "bias": np.array(0.7)}
    out["scalar_bias_bf16"] = (t, _meta(outputs=grads + ",dbias"),
                               {"q": "BF16", "k": "BF16", "v": "BF16", "dout": "F32", "bias": "F64"})
    # F16 inputs with an F32 dout and bias [1,Hq,1,Nk]; a window on causal bottom_right
    t = {"q": n(2, 2, 4, 4), "k": n(2, 1, 5, 4), "v": n(2, 1, 5, 3), "dout": n(2, 2, 4, 3),
         "bias": n(1, 2, 1, 5)}
    out["f16_window_bottom_right"] = (t, _meta(causal="bottom_right", window="1,1", outputs=grads + ",dbias"),
                                      {"q": "F16", "k": "F16", "v": "F16", "dout": "F32", "bias": "F32"})
    # sinks: GQA 4:2, a bias along the keys (with a sink dbias is not 0), row 2 of every head
    # masked (only its sink: out 0), dsinks
    mask = np.ones((1, 1, 5, 6), bool)
    mask[..., 2, :] = False
    out["sinks_gqa"] = (
        {"q": n(1, 4, 5, 4), "k": n(1, 2, 6, 4), "v": n(1, 2, 6, 3), "dout": n(1, 4, 5, 3),
         "bias": n(1, 4, 5, 1), "mask": mask, "sinks": n(4)},
        _meta(outputs=grads + ",dbias,dsinks"), None)
    # long rows and columns for blocked kernels: several query and key blocks, a partial last one
    out["long"] = (
        {"q": n(1, 2, 128, 8), "k": n(1, 1, 40, 8), "v": n(1, 1, 40, 8), "dout": n(1, 2, 128, 8)},
        _meta(scale="0.6", outputs=grads), None)
    return out


def build(directory, cli, seed=11):
    """Writes every case and evaluates it -> name -> Case."""
    cases = {}
    for name, (tensors, meta, dtypes) in specs(seed).items():
        path = os.path.join(directory, f"{name}.safetensors")
        if dtypes is None:              # F32 unless the case says otherwise
            dtypes = {x: "F32" for x, a in tensors.items() if a.dtype == np.float64}
        st.save(path, tensors, meta, dtypes)
        golden = path + ".golden.safetensors"
        p = subprocess.run([cli, "eval", path, "-o", golden, "-q"], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"attnoracle eval {path}: {p.stdout}{p.stderr}")
        g, m, d = st.read(golden)
        cases[name] = Case(name, path, meta, g, d)
    return cases


def run_adapter(cmd, cases, directory, tag="run"):
    """Runs an adapter command on the cases -> name -> tensors (dict), or (".error" or
    ".unsupported", text)."""
    jobs = os.path.join(directory, f"jobs_{tag}.jsonl")
    outputs = {}
    with open(jobs, "w", encoding="utf-8") as f:
        for c in cases:
            outputs[c.name] = os.path.join(directory, f"{c.name}.{tag}.out.safetensors")
            f.write(json.dumps({"id": c.name, "input": c.path, "output": outputs[c.name]}) + "\n")
    p = subprocess.run(list(cmd) + [jobs], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd}: exit status {p.returncode}: {p.stderr}")
    got = {}
    for name, o in outputs.items():
        for suffix in (".error", ".unsupported"):
            if os.path.exists(o + suffix):
                with open(o + suffix, encoding="utf-8") as f:
                    got[name] = (suffix, f.read())
        if name not in got:
            got[name] = st.load(o)[0]
    return got


def rows_compared(case):
    """Bool [B, Nq]: the rows that are not padding."""
    g = case.golden
    B, Nq = g["q"].shape[0], g["q"].shape[2]
    rows = np.ones((B, Nq), bool) if "query_mask" not in g else g["query_mask"].astype(bool)
    if "seqlens_q" in g:
        rows = rows & (np.arange(Nq)[None, :] < g["seqlens_q"][:, None])
    return rows


def ratios(got, case, limit):
    """name -> the largest |G - G.ref| / limit(G.ref, G.bound) of each gradient (NaN: inf); dq
    on padding rows included, since it must be exactly 0 there."""
    result = {}
    for name in case.grads:
        ref, bound = case.golden[name + ".ref"], case.golden[name + ".bound"]
        err = np.abs(got[name].astype(np.float64) - ref)
        err = np.where(np.isnan(err), np.inf, err)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(err == 0, 0, err / limit(ref, bound))    # an exact 0 of bound 0: ratio 0
        result[name] = float(np.max(r))
    return result
