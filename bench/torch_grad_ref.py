#!/usr/bin/python3
"""The usual uncertified reference of the gradients: PyTorch float64 autograd, as a whole process.

    /usr/bin/python3 bench/torch_grad_ref.py CASE -o OUT

Loads the case as bench/numpy_ref.py does (the NumPy snippet of vectors/FORMAT.md), then, in
float64 on the CPU, plain attention (scores Q K^T * scale, softmax, weights V; the key and value
heads repeated over their query heads for GQA) forward, and its backward by autograd from the
case's dout. Writes `out`, dq, dk and dv (those the case asks for) in the case's output dtype,
rounded once from float64, and each as `.ref` in F64. The import of torch (about a second) is
part of the process, as eval's start-up is part of eval's.

Kind sdpa with dout, without mask, bias, causal, window, softcap, dropout or sinks: what
bench/make_case.py --backward writes. Exit status 2 on anything else.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from numpy_ref import input_dtype, load, parse_scale, save  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)

    tensors, meta = load(a.case)
    unsupported = [k for k in ("mask", "bias", "query_mask", "sinks") if k in tensors]
    unsupported += [k for k, off in (("attn.kind", "sdpa"), ("attn.causal", "none"), ("attn.window", "none"),
                                     ("attn.softcap", "0"), ("attn.dropout", "0")) if meta.get(k, off) != off]
    if unsupported or not all(t in tensors for t in ("q", "k", "v", "dout")):
        print(f"torch_grad_ref: {a.case}: unsupported case ({', '.join(unsupported) or 'no q, k, v, dout'})",
              file=sys.stderr)
        return 2
    import torch  # after the checks: a refusal costs no import

    q, k, v, dout = (torch.from_numpy(tensors[t].astype("float64")) for t in ("q", "k", "v", "dout"))
    Hq, Dk = q.shape[1], q.shape[3]
    group = Hq // k.shape[1]
    scale = parse_scale(meta["attn.scale"]) if "attn.scale" in meta else 1.0 / math.sqrt(Dk)
    outputs = meta.get("attn.outputs", "out").split(",")
    out_dtype = meta.get("attn.output_dtype") or input_dtype(a.case)

    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.matmul(q, kk.transpose(-1, -2)) * scale, dim=-1)
    out = torch.matmul(weights, vv)
    out.backward(dout)
    result = {}
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        if name in outputs:
            x = t.detach().numpy()
            result[name] = (out_dtype, x)
            result[name + ".ref"] = ("F64", x)
    save(a.output, result, {"attn.format": "1", "bench.reference": "torch float64 autograd " + torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
