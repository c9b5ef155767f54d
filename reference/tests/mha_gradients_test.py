"""Kind mha's certified gradients against an independent evaluation: PyTorch's autograd in
float64 (Debian python3-torch) on random problems with every feature of the forward (causal in
both alignments, windows, masks, biases broadcast, sinks, softcap, padding rows, fully masked
rows, self-attention). Every .ref must agree with it far inside its bound (float64's own error
is a few units of 2^-53 of the bound), and every bound must hold the value.

    attnoracle_mha_gradients_test.py ATTNORACLE [PROBLEMS]     (exit 77: no torch)
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "conformance", "adapters", "numpy"))
import safetensors_np as st  # noqa: E402

try:
    import torch
except ImportError:
    print("skipped: PyTorch (python3-torch) is not installed")
    sys.exit(77)

GRADS = ("dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o", "dbias", "dsinks")


def problem(rng, k):
    """Problem k: tensors, metadata, dtypes and the allowed matrix [B, H, Nq, Nk]."""
    B, H = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    Nq, Nk, D = int(rng.integers(1, 7)), int(rng.integers(1, 8)), int(rng.integers(1, 5))
    Dk, Dv, Dout = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    self_attn = k % 5 == 4
    if self_attn:
        Nk = Nq
    n = lambda *s: rng.standard_normal(s)
    t = {"x_q": n(B, Nq, D), "w_q": n(H, D, Dk), "w_k": n(H, D, Dk), "w_v": n(H, D, Dv), "w_o": n(H * Dv, Dout)}
    t["x_kv"] = t["x_q"].copy() if self_attn else n(B, Nk, D)
    meta = {"attn.format": "1", "attn.kind": "mha", "attn.masked_rows": "zero"}
    allowed = np.ones((B, H, Nq, Nk), bool)
    causal = ["none", "top_left", "bottom_right"][k % 3]
    qi, kj = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    pos = qi + (Nk - Nq if causal == "bottom_right" else 0)
    if causal != "none":
        meta["attn.causal"] = causal
        allowed &= kj <= pos
    if k % 7 == 3:
        left, right = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        meta["attn.window"] = f"{left},{right}"
        allowed &= (kj >= pos - left) & (kj <= pos + right)
    if k % 4 == 1:
        mask = rng.random((B, 1, 1, Nk)) > 0.3
        t["mask"] = mask
        allowed &= mask
    outs = ["out", "dx_q", "dw_q", "dw_k", "dw_v", "dw_o"] + ([] if self_attn else ["dx_kv"])
    if k % 3 == 2:
        shape = [(1, H, Nq, Nk), (Nq, Nk), (B, 1, 1, Nk), (B, H, Nq, 1)][k % 4]
        t["bias"] = n(*shape)
        outs.append("dbias")
    if k % 4 == 3:
        t["sinks"] = n(H)
        outs.append("dsinks")
    if k % 6 == 5:
        meta["attn.softcap"] = "1.5"
    qm = np.ones((B, Nq), bool)
    if k % 5 == 2 and Nq > 1:
        qm[:, 0] = False
        t["query_mask"] = qm
    t["dout"] = n(B, Nq, Dout)
    meta["attn.outputs"] = ",".join(outs)
    dt = ["F64", "F32", "BF16"][k % 3] if k % 2 else "F64"
    dtypes = {x: dt for x in ("x_q", "x_kv", "w_q", "w_k", "w_v", "w_o")}
    if dt != "F64":
        meta["attn.output_dtype"] = "F32"
    return t, meta, dtypes, allowed, qm


def torch_gradients(g, meta, allowed, qm):
    T = lambda a: torch.tensor(np.asarray(a, np.float64), requires_grad=True)
    xq, wq, wk, wv, wo = (T(g[x]) for x in ("x_q", "w_q", "w_k", "w_v", "w_o"))
    self_attn = "dx_kv" not in meta["attn.outputs"].split(",")
    xkv = xq if self_attn else T(g["x_kv"])
    H, D, Dk = wq.shape
    B, Nq, _ = xq.shape
    q = torch.einsum("bnd,hde->bhne", xq, wq)
    k = torch.einsum("bnd,hde->bhne", xkv, wk)
    v = torch.einsum("bnd,hde->bhne", xkv, wv)
    s = q @ k.transpose(-1, -2) / np.sqrt(Dk)
    if "attn.softcap" in meta:
        c = float(meta["attn.softcap"])
        s = c * torch.tanh(s / c)
    bias = T(g["bias"]) if "bias" in g else None
    if bias is not None:
        s = s + bias
    al = torch.tensor(allowed)
    s = s.masked_fill(~al, -np.inf)
    sinks = T(g["sinks"]) if "sinks" in g else None
    if sinks is not None:
        z = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, Nq, 1)], -1)
        p = torch.softmax(z, -1)[..., :-1]
    else:
        rowok = al.any(-1, keepdim=True)
        p = torch.where(rowok, torch.softmax(s.masked_fill(~rowok, 0.0), -1), torch.zeros(()))
    o = p @ v
    out = o.transpose(1, 2).reshape(B, Nq, -1) @ wo
    dout = torch.tensor(np.asarray(g["dout"], np.float64) * qm[:, :, None])  # padding rows reach nothing
    (out * dout).sum().backward()
    r = {"dx_q": xq.grad, "dw_q": wq.grad, "dw_k": wk.grad, "dw_v": wv.grad, "dw_o": wo.grad}
    if not self_attn:
        r["dx_kv"] = xkv.grad
    if bias is not None:
        r["dbias"] = bias.grad
    if sinks is not None:
        r["dsinks"] = sinks.grad
    return {a: b.detach().numpy() for a, b in r.items()}


def main():
    cli = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    rng = np.random.default_rng(20261202)
    bad, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(count):
            t, meta, dtypes, allowed, qm = problem(rng, k)
            path, gold = os.path.join(tmp, f"p{k}.safetensors"), os.path.join(tmp, f"p{k}.golden.safetensors")
            st.save(path, t, meta, dtypes)
            r = subprocess.run([cli, "eval", path, "-o", gold], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"p{k}: eval failed ({r.returncode}): {r.stderr.strip()}")
            if " 0 undecided" not in r.stderr:
                bad.append(f"p{k}: undecided elements: {r.stderr.strip()}")
            g, m = st.load(gold)
            got = torch_gradients(g, meta, allowed, qm)
            for name, val in got.items():
                ref, bd = np.asarray(g[name + ".ref"]), np.asarray(g[name + ".bound"])
                checked += ref.size
                if not (bd >= np.abs(ref)).all():
                    bad.append(f"p{k} {name}: a bound below |ref|")
                err = np.abs(val - ref)
                if not (err <= 1e-12 * bd + 1e-300).all():
                    e = np.unravel_index(np.argmax(err - 1e-12 * bd), err.shape)
                    bad.append(f"p{k} {name}{list(e)}: ref {ref[e]!r}, torch {val[e]!r}, bound {bd[e]!r} ({meta})")
    print(f"{count} problems, {checked} gradient elements compared with float64 autograd")
    for b in bad:
        print("MISMATCH", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
