"""Small seeded cases of kind mha with gradients, and their finite differences, shared by the
tests of the NumPy and PyTorch adapters (no reference binary needed).

    path, tensors, meta = mha_grad_cases.write(tmpdir, name)
    fd = mha_grad_cases.finite_difference(tensors, meta, "w_k")   # dL/dw_k, L = sum(dout * out)
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_np as st  # noqa: E402
import attention as nx  # noqa: E402

GRADS = nx.MHA_GRADIENTS


def _case(rng, B, Nq, Nk, D, H, Dk, Dv, Dout, self_attn=False):
    x_q = rng.normal(size=(B, Nq, D))
    t = {"x_q": x_q, "x_kv": x_q.copy() if self_attn else rng.normal(size=(B, Nk, D)),
         "w_q": rng.normal(size=(H, D, Dk)) / np.sqrt(D), "w_k": rng.normal(size=(H, D, Dk)) / np.sqrt(D),
         "w_v": rng.normal(size=(H, D, Dv)), "w_o": rng.normal(size=(H * Dv, Dout)),
         "dout": rng.normal(size=(B, Nq, Dout))}
    return t


def specs():
    """name -> (tensors, metadata); every case asks out and its gradients."""
    rng = np.random.default_rng(11)
    m = lambda outs, **k: dict({"attn.format": "1", "attn.kind": "mha", "attn.outputs": outs},
                               **{"attn." + a: str(b) for a, b in k.items()})
    cross = "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o"
    selfa = "out,dx_q,dw_q,dw_k,dw_v,dw_o"
    out = {}
    # cross-attention, Dk != Dv, a bias per head and causal bottom_right (Nq < Nk)
    t = _case(rng, 2, 3, 5, 4, 2, 3, 2, 5)
    t["bias"] = rng.normal(size=(1, 2, 3, 5))
    out["cross_bias_causal"] = (t, m(cross + ",dbias", causal="bottom_right"))
    # self-attention with a query_mask (padding rows with large dout), softcap and a window
    t = _case(rng, 1, 5, 5, 6, 3, 2, 2, 4, self_attn=True)
    t["query_mask"] = np.array([[True, False, True, True, False]])
    t["dout"][0, 1] = 1e6
    out["self_query_mask_softcap"] = (t, m(selfa, softcap="2.5", window="2,1"))
    # self-attention, causal top_left, sinks per head, and a fully masked row under policy zero
    t = _case(rng, 1, 4, 4, 4, 2, 2, 3, 3, self_attn=True)
    t["sinks"] = np.array([0.3, -0.5])
    out["self_sinks"] = (t, m(selfa + ",dsinks", causal="top_left", scale="0.7"))
    t = _case(rng, 1, 4, 4, 4, 2, 2, 2, 3)
    mask = np.ones((1, 2, 4, 4), bool)
    mask[0, 1, 2] = False                                 # head 1, row 2: no key
    t["mask"] = mask
    out["cross_masked_row_zero"] = (t, m(cross, masked_rows="zero"))
    # D = H Dk, Dv = Dk and the default scale (what torch's multi_head_attention_forward takes)
    t = _case(rng, 2, 3, 5, 4, 2, 2, 2, 3)
    t["bias"] = rng.normal(size=(2, 1, 3, 5))
    out["equal_heads_cross"] = (t, m(cross + ",dbias", causal="bottom_right"))
    t = _case(rng, 1, 6, 6, 6, 3, 2, 2, 5, self_attn=True)
    t["query_mask"] = np.array([[True, True, False, True, True, False]])
    out["equal_heads_self"] = (t, m(selfa, window="3,0"))
    return out


TORCH_CASES = ("equal_heads_cross", "equal_heads_self")


def write(tmpdir, name, dtype=np.float64):
    tensors, meta = specs()[name]
    path = os.path.join(tmpdir, f"mha_{name}.safetensors")
    st.save(path, {n: (a.astype(dtype) if a.dtype == np.float64 else a) for n, a in tensors.items()}, meta)
    return path, tensors, meta


def loss(tensors, meta):
    """sum(dout * out) on the rows that are not padding, in float64 through the NumPy forward."""
    x = tensors
    proj = lambda a, wt: np.einsum("bnd,hde->bhne", a, wt)
    extra = dict(mask=x.get("mask"), bias=x.get("bias"), query_mask=x.get("query_mask"),
                 sinks=x.get("sinks"))
    o = nx.numpy_attention(proj(x["x_q"], x["w_q"]), proj(x["x_kv"], x["w_k"]), proj(x["x_kv"], x["w_v"]),
                           meta, None, **extra)[0]
    B, H, Nq, Dv = o.shape
    out = np.swapaxes(o, 1, 2).reshape(B, Nq, H * Dv) @ x["w_o"]
    rows = nx.query_rows(B, Nq, x.get("query_mask"))
    return float(np.sum(np.where(rows[:, :, None], x["dout"] * out, 0)))


def finite_difference(tensors, meta, name, h=1e-6):
    """dL/d(name) by central differences; for "x" (self-attention) x_q and x_kv move together."""
    key = {"dx_q": "x_q", "dx_kv": "x_kv", "dw_q": "w_q", "dw_k": "w_k", "dw_v": "w_v", "dw_o": "w_o",
           "dbias": "bias", "dsinks": "sinks"}[name]
    both = name == "dx_q" and nx.self_attention(tensors["x_q"], tensors["x_kv"])
    base = tensors[key]
    g = np.zeros_like(base)
    for idx in np.ndindex(base.shape):
        vals = []
        for s in (h, -h):
            t = dict(tensors)
            a = base.copy()
            a[idx] += s
            t[key] = a
            if both:
                t["x_kv"] = a
            vals.append(loss(t, meta))
        g[idx] = (vals[0] - vals[1]) / (2 * h)
    return g
