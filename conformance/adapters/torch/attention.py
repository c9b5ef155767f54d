#!/usr/bin/env python3
"""Attention in PyTorch on the CPU, as an AttnOracle adapter (CONTRACT section 5).

    /usr/bin/python3 attention.py [--mode ops|mha] [--threads N] JOBS.jsonl

--mode ops (default): kind sdpa written with plain tensor ops in the input dtype (matmul,
masked_fill, softmax, matmul), as PyTorch users write it. --mode mha: kind mha through
torch.nn.functional.multi_head_attention_forward; its gradients (dx_q, dx_kv, dw_q, dw_k, dw_v,
dw_o, dbias) by autograd through it. The case files, the job loop and the .error /
.unsupported files are those of the NumPy adapter (../numpy/attention.py), loaded by path.
"""
import argparse
import importlib.util
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "attnoracle_numpy_adapter_for_torch",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "numpy", "attention.py"))
nx = importlib.util.module_from_spec(_spec)   # a private instance: its job loop, reader, exceptions
_spec.loader.exec_module(nx)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16}


def torch_dtype(name):
    if name == "F16":
        raise nx.Unsupported("F16 inputs: PyTorch 1.13 on the CPU has no Half matmul or softmax "
                             "(\"bmm\" not implemented for 'Half')")
    if name not in DTYPES:
        raise nx.Unsupported(f"input dtype {name}")
    return DTYPES[name]


def tensor(a, dtype=None):
    """A NumPy array (float64 from the reader, or bool) as a torch tensor, converted to dtype."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(dtype)


def lengths(seqlens, B, n):
    """seqlens_q or seqlens_k [B] as int64, or n for every batch when absent."""
    return torch.full((B,), n, dtype=torch.int64) if seqlens is None else tensor(seqlens).long()


def allowed_keys(meta, shape, mask, bias, seqlens_q=None, seqlens_k=None):
    """Bool [B, H, Nq, Nk]: the boolean mask, keys before seqlens_k, causal (either alignment,
    bottom_right per batch: i' = i + Lk - Lq), window, bias != -inf."""
    B, Nq, Nk = shape[0], shape[-2], shape[-1]
    lq, lk = lengths(seqlens_q, B, Nq).view(B, 1, 1, 1), lengths(seqlens_k, B, Nk).view(B, 1, 1, 1)
    causal = meta.get("attn.causal", "none")
    i = torch.arange(Nq).view(1, 1, Nq, 1) + (lk - lq if causal == "bottom_right" else 0)
    j = torch.arange(Nk).view(1, 1, 1, Nk)
    allowed = j < lk
    if causal != "none":
        allowed = allowed & (j <= i)
    window = meta.get("attn.window", "none")
    if window != "none":
        left, right = (int(x) for x in window.split(","))
        allowed = allowed & (j >= i - left) & (j <= i + right)
    allowed = allowed.expand(*shape)
    if mask is not None:
        allowed = allowed & tensor(mask)
    if bias is not None:
        allowed = allowed & (tensor(bias) != -math.inf)
    return allowed


def queries(live, query_mask, seqlens_q):
    """Bool [B, Nq]: the rows compared (query_mask true and i < seqlens_q[b])."""
    B, Nq = live.shape[0], live.shape[2]
    valid = torch.arange(Nq).view(1, Nq) < lengths(seqlens_q, B, Nq).view(B, 1)
    return valid if query_mask is None else valid & tensor(query_mask)


def refuse_masked_rows(meta, live, query_mask, seqlens_q=None):
    """Under attn.masked_rows=error, a row with no allowed key that is not padding is refused."""
    if meta.get("attn.masked_rows", "error") != "error":
        return
    is_query = queries(live, query_mask, seqlens_q)
    bad = (~live & is_query[:, None, :]).nonzero()
    if len(bad):
        b, h, i = bad[0].tolist()
        raise nx.Refused(f"fully masked row: b={b}, h={h}, i={i} has no allowed key (attn.masked_rows=error)")


def scale_of(meta, head_dim):
    return nx.number(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(head_dim)


def ops_attention(q, k, v, meta, bug=None, mask=None, bias=None, query_mask=None, in_dtype=None,
                  seqlens_q=None, seqlens_k=None, descales=None, sinks=None):
    """Called as the NumPy adapter's `attention` (float64 arrays in, float64 arrays out). FP8
    inputs (the only ones with descales) are unsupported: torch_dtype names the dtype. Sinks
    join the softmax as one more column of logits (a key with no value), dropped after it."""
    if meta.get("attn.kind", "sdpa") != "sdpa":
        raise nx.Unsupported("attn.kind mha in --mode ops (--mode mha runs it)")
    dt = torch_dtype(in_dtype)
    q, k, v = tensor(q, dt), tensor(k, dt), tensor(v, dt)
    result = ops_forward(q, k, v, meta, mask, bias, None if bias is None else tensor(bias, dt),
                         query_mask, seqlens_q, seqlens_k, sinks, dt)
    return tuple(t.double().numpy() for t in result)


def ops_forward(q, k, v, meta, mask, bias, bias_t, query_mask, seqlens_q, seqlens_k, sinks, dt):
    """The ops on torch tensors q, k, v and bias_t (the bias in dt; `bias` the array it came
    from, for its -inf entries) -> out, weights, lse, scores."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:                                               # GQA / MQA
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale_of(meta, q.shape[-1])
    cap = nx.number(meta.get("attn.softcap", "0"))
    if cap != 0:
        scores = cap * torch.tanh(scores / cap)
    if bias_t is not None:
        scores = scores + bias_t
    allowed = allowed_keys(meta, scores.shape, mask, bias, seqlens_q, seqlens_k)
    live = allowed.any(dim=-1)
    if sinks is None:
        refuse_masked_rows(meta, live, query_mask, seqlens_q)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
        weights = weights.masked_fill(~live[..., None], 0)      # policy zero: no NaN from 0/0
        lse = torch.logsumexp(scores, dim=-1)                    # -inf on fully masked rows
    else:
        sinks_t = sinks if torch.is_tensor(sinks) else tensor(sinks, dt)   # a leaf for dsinks
        column = sinks_t[None, :, None, None].expand(*scores.shape[:-1], 1)
        with_sink = torch.cat([scores, column], dim=-1)
        weights = torch.softmax(with_sink, dim=-1)[..., :-1]
        lse = torch.logsumexp(with_sink, dim=-1)
    # Unused positions may hold NaN or infinities: a value row no query other than padding
    # attends (the contract refuses any other). As 0, it keeps 0 * NaN out of the other rows.
    out = weights @ torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    return out, weights, lse, scores


def ops_gradients(q, k, v, dout, meta, bug, names, mask=None, bias=None, query_mask=None,
                  in_dtype=None, seqlens_q=None, seqlens_k=None, out_dtype=None, sinks=None):
    """Called as the NumPy adapter's `gradients`: dq, dk, dv, dbias, dsinks by autograd through
    the ops above, in the input dtype: q, k, v, bias and sinks leaves with requires_grad, out.backward(dout)
    with dout 0 on padding rows. Non-finite values at unused positions (q of padding rows, k and
    v rows no query attends, bias entries of padding rows) are read as 0 first, so that no NaN
    reaches a sum; padding rows' dq is 0."""
    dt = torch_dtype(in_dtype)
    rows = nx.query_rows(q.shape[0], q.shape[2], query_mask, seqlens_q)
    finite = lambda a: np.where(np.isfinite(a), a, 0)
    leaves = {"q": tensor(finite(q), dt), "k": tensor(finite(k), dt), "v": tensor(finite(v), dt)}
    if bias is not None:
        leaves["bias"] = tensor(np.where(np.isfinite(bias) | (bias == -np.inf), bias, 0), dt)
    if sinks is not None:
        leaves["sinks"] = tensor(sinks, dt)
    with torch.enable_grad():
        for t in leaves.values():
            t.requires_grad_(True)
        out = ops_forward(leaves["q"], leaves["k"], leaves["v"], meta, mask, bias, leaves.get("bias"),
                          query_mask, seqlens_q, seqlens_k, leaves.get("sinks"), dt)[0]
        out.backward(tensor(np.where(rows[:, None, :, None], finite(dout), 0), dt))
    result = {"d" + name: t.grad.double().numpy() for name, t in leaves.items()}
    if bias is not None:                # a bias of shape [] became [1] (np.ascontiguousarray)
        result["dbias"] = result["dbias"].reshape(bias.shape)
    result["dq"] = np.where(rows[:, None, :, None], result["dq"], 0)
    return {name: result[name] for name in names}


def mha_case(path, compute=None, bug=None):
    """Called as the NumPy adapter's `run_case`: one case of kind mha -> (tensors, dtypes)."""
    try:
        x, meta, dtypes = nx.safetensors_np.read(path)
    except nx.safetensors_np.UnsupportedDtype as e:
        raise nx.Unsupported(str(e))
    for key in meta:
        if key.startswith("attn.") and key not in nx.KEYS | {"attn.reference", "attn.undecided"}:
            raise nx.Unsupported(f"metadata key {key}")
    if meta.get("attn.kind", "sdpa") != "mha":
        raise nx.Unsupported("attn.kind sdpa in --mode mha (--mode ops runs it)")
    if meta.get("attn.masked_rows", "error") not in ("error", "zero"):
        raise nx.Unsupported(f"attn.masked_rows {meta['attn.masked_rows']}")
    if "sinks" in x:
        raise nx.Unsupported("sinks: multi_head_attention_forward has no sink logits")
    if "scores" in meta.get("attn.outputs", "out").split(","):
        raise nx.Unsupported("attn.outputs scores: multi_head_attention_forward returns no scores")
    grads = [g for g in meta.get("attn.outputs", "out").split(",") if g in nx.GRADIENTS]
    wrong = [g for g in grads if g not in nx.MHA_GRADIENTS + ("dbias",)]
    if wrong:
        raise nx.Refused(f"{path}: attn.outputs: {wrong[0]} is not a gradient of kind mha")
    if grads and "dout" not in x:
        raise nx.Refused(f"{path}: dout: missing (attn.outputs asks for {','.join(grads)})")
    if "dbias" in grads and "bias" not in x:
        raise nx.Refused(f"{path}: attn.outputs: dbias asked for, but the case has no bias")
    in_dtype = dtypes["x_q"]
    out_dtype = meta.get("attn.output_dtype", in_dtype)
    dt = torch_dtype(in_dtype)
    H, D, Dk = x["w_q"].shape
    Dv = x["w_v"].shape[2]
    if H * Dk != D or Dv != Dk:
        raise nx.Unsupported(f"head sizes: multi_head_attention_forward needs Dk = Dv = D / H "
                             f"(D={D}, H={H}, Dk={Dk}, Dv={Dv})")
    if "attn.scale" in meta and nx.number(meta["attn.scale"]) != 1.0 / math.sqrt(Dk):
        raise nx.Unsupported("attn.scale other than 1/sqrt(head_dim)")
    if nx.number(meta.get("attn.softcap", "0")) != 0:
        raise nx.Unsupported("attn.softcap")
    B, Nq, Nk = x["x_q"].shape[0], x["x_q"].shape[1], x["x_kv"].shape[1]
    bias = x.get("bias")
    allowed = allowed_keys(meta, (B, H, Nq, Nk), x.get("mask"), bias, x.get("seqlens_q"), x.get("seqlens_k"))
    live = allowed.any(dim=-1)
    refuse_masked_rows(meta, live, x.get("query_mask"), x.get("seqlens_q"))
    padding = ~queries(live, x.get("query_mask"), x.get("seqlens_q"))
    if (~live & ~padding[:, None, :]).any():
        raise nx.Unsupported("fully masked rows under attn.masked_rows=zero: the softmax of a row of "
                             "-inf is NaN, and out_proj mixes it into every feature of the row")
    allowed = allowed | ~live[..., None]          # padding rows with no key: anything (not compared)
    # The inputs as leaves; in self-attention one tensor x serves as query, key and value, so that
    # autograd adds both paths into dx_q.
    leaves = {n: tensor(x[n], dt) for n in ("x_q", "w_q", "w_k", "w_v", "w_o")}
    self_attn = nx.self_attention(x["x_q"], x["x_kv"])
    leaves["x_kv"] = leaves["x_q"] if self_attn else tensor(x["x_kv"], dt)
    if bias is not None:
        leaves["bias"] = tensor(bias, dt)
    with torch.enable_grad():
        if grads:
            for t in leaves.values():
                t.requires_grad_(True)
        additive = torch.zeros(B, H, Nq, Nk, dtype=dt) if bias is None else \
            leaves["bias"].reshape(bias.shape).expand(B, H, Nq, Nk)
        attn_mask = additive.masked_fill(~allowed, -math.inf).reshape(B * H, Nq, Nk)

        def per_head(w):                          # [H, D, d] -> [H * d, D], row r * d + e
            return w.permute(0, 2, 1).reshape(-1, D)

        want_weights = "weights" in meta.get("attn.outputs", "out").split(",")
        kv = leaves["x_kv"].transpose(0, 1)
        out, weights = F.multi_head_attention_forward(
            leaves["x_q"].transpose(0, 1), kv, kv, D, H, None, None, None, None, False, 0.0,
            leaves["w_o"].t(), None, training=False, need_weights=want_weights, attn_mask=attn_mask,
            use_separate_proj_weight=True, q_proj_weight=per_head(leaves["w_q"]),
            k_proj_weight=per_head(leaves["w_k"]), v_proj_weight=per_head(leaves["w_v"]),
            average_attn_weights=False)
        out = out.transpose(0, 1)                 # [Nq, B, Dout] -> [B, Nq, Dout]
        if grads:                                 # dout 0 on padding rows: their rows reach nothing
            dout = np.where(~padding.numpy()[:, :, None], x["dout"], 0)
            out.backward(tensor(dout, dt))
    result = {"out": out.detach()}
    if want_weights:
        result["weights"] = weights.detach()      # [B, H, Nq, Nk]
    for g in grads:
        t = leaves["x_q" if g == "dx_q" else g[1:]]
        result[g] = t.grad.reshape(bias.shape) if g == "dbias" else t.grad
    if self_attn and "dx_kv" in grads:            # the case reader refuses it; no second tensor here
        raise nx.Refused(f"{path}: attn.outputs: dx_kv in self-attention (dx_q holds the gradient of x)")
    dtype_of = nx.output_dtypes(meta, list(result), out_dtype)   # attn.output_dtypes over out_dtype
    numpy_type = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
    result = {name: t.double().numpy() for name, t in result.items()}
    result = {name: a.astype(numpy_type[dtype_of[name]]) if dtype_of[name] in numpy_type else a
              for name, a in result.items()}          # BF16 is rounded by the writer
    return result, dtype_of


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ops", "mha"], default="ops",
                        help="ops: kind sdpa in plain tensor ops; mha: kind mha through "
                             "multi_head_attention_forward")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("jobs", help="jobs file, one JSON object a line")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mode == "ops":
        nx.attention = ops_attention
        nx.gradients = ops_gradients
    else:
        nx.run_case = mha_case
    # The NumPy adapter's job loop; float64 carries every input dtype exactly (converted back here).
    with torch.no_grad():
        return nx.main(["--dtype", "float64", args.jobs])

if __name__ == "__main__":
    sys.exit(main())
