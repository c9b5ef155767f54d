"""Rotary embedding's certified dq and dk against an independent evaluation: PyTorch's autograd in
float64 (Debian python3-torch) on random problems of kind sdpa, both pairings, R = Dk and R =
Dk / 2, decode and prefill shapes, grouped heads, causal alignment, softcap, sinks, and
attn.rotary_round F64, F32 and BF16. The rotated q and k are rounded as the contract says
(exactly decided, rounded once to nearest even); autograd takes that rounding straight through,
as the contract defines its derivative. Every .ref must agree with autograd far inside its bound,
every bound must hold the value, and every element of dq and dk must be decided (dv over one key
may straddle a tie undecided, as without rotary).

    rotary_gradients_test.py ATTNORACLE [PROBLEMS]     (exit 77: no torch)
"""
import os
import subprocess
import sys
import tempfile
from fractions import Fraction

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "conformance", "adapters", "numpy"))
import safetensors_np as st  # noqa: E402

try:
    import torch
except ImportError:
    print("skipped: PyTorch (python3-torch) is not installed")
    sys.exit(77)

BITS = {"F64": 53, "F32": 24, "BF16": 8}


def rounded(x, bits):
    """The Fraction x rounded to nearest even at `bits` significant bits (normal range)."""
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    scaled = a * Fraction(2) ** (bits - 1 - e)  # in [2^(bits-1), 2^bits)
    q, r = divmod(scaled.numerator, scaled.denominator)
    if 2 * r > scaled.denominator or (2 * r == scaled.denominator and q % 2):
        q += 1
    return float((1 if x > 0 else -1) * Fraction(q) * Fraction(2) ** (e - bits + 1))


def round_array(a, bits):
    return np.vectorize(lambda x: rounded(Fraction(float(x)), bits))(a).astype(np.float64)


def pairs(R, interleaved):
    f = np.arange(R // 2)
    return (2 * f, 2 * f + 1) if interleaved else (f, f + R // 2)


def rotate_exact(x, positions, cos, sin, R, interleaved, bits):
    """x [B, H, N, Dk] with its first R features rotated at positions[b, n], each value decided
    exactly and rounded once."""
    y = x.copy()
    i1, i2 = pairs(R, interleaved)
    B, H, N, _ = x.shape
    for b in range(B):
        for h in range(H):
            for n in range(N):
                t = positions[b][n]
                for f in range(R // 2):
                    x1, x2 = Fraction(x[b, h, n, i1[f]]), Fraction(x[b, h, n, i2[f]])
                    c, s = Fraction(cos[t, f]), Fraction(sin[t, f])
                    y[b, h, n, i1[f]] = rounded(x1 * c - x2 * s, bits)
                    y[b, h, n, i2[f]] = rounded(x1 * s + x2 * c, bits)
    return y


def rotate_torch(x, positions, cos, sin, R, interleaved):
    i1, i2 = (torch.tensor(p) for p in pairs(R, interleaved))
    pos = torch.tensor(positions)  # [B, N]
    c = torch.tensor(cos)[pos][:, None]  # [B, 1, N, R/2]
    s = torch.tensor(sin)[pos][:, None]
    x1, x2 = x[..., i1], x[..., i2]
    y = x.clone()
    y[..., i1] = x1 * c - x2 * s
    y[..., i2] = x1 * s + x2 * c
    return y


def problem(rng, k):
    """Problem k: tensors, metadata, dtypes and what the torch side needs."""
    B, Hkv, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq = Hkv * G
    Dk = int(rng.choice([2, 4, 6, 8]))
    R = Dk // 2 if k % 2 and Dk % 4 == 0 else Dk
    interleaved = k % 4 < 2
    Nk = int(rng.integers(2 if k % 7 == 3 else 1, 8))  # softcap over one key: P = 1 not decided
    Nq = 1 if k % 3 == 0 else int(rng.integers(1, Nk + 1))  # decode: one query after the cache
    Dv = int(rng.integers(1, 4))
    round_name = ["F64", "F32", "BF16"][k % 3]
    in_name = {"F64": ["F64", "F32"][k % 2], "F32": "F32", "BF16": "BF16"}[round_name]
    bits = BITS[in_name]
    n = lambda *s: round_array(rng.standard_normal(s), bits)
    Nrot = Nk + int(rng.integers(0, 3))
    theta = rng.uniform(-np.pi, np.pi, (Nrot, R // 2))
    tbits = 53 if in_name == "F64" and k % 5 else 24
    cos, sin = round_array(np.cos(theta), tbits), round_array(np.sin(theta), tbits)
    t = {"q": n(B, Hq, Nq, Dk), "k": n(B, Hkv, Nk, Dk), "v": n(B, Hkv, Nk, Dv), "dout": n(B, Hq, Nq, Dv),
         "rotary_cos": cos, "rotary_sin": sin}
    meta = {"attn.format": "1", "attn.rotary": "interleaved" if interleaved else "half",
            "attn.rotary_round": round_name, "attn.outputs": "out,dq,dk,dv", "attn.masked_rows": "zero"}
    if in_name != "F64":
        meta["attn.output_dtype"] = "F32"
    if k % 5 == 1:
        meta["attn.causal"] = "bottom_right"
    if k % 7 == 3:
        meta["attn.softcap"] = "2.5"
    if k % 6 == 4:
        t["sinks"] = n(Hq)
    dtypes = {x: in_name for x in ("q", "k", "v", "dout", "sinks")}
    dtypes["rotary_cos"] = dtypes["rotary_sin"] = "F64" if tbits == 53 else "F32"
    side = dict(R=R, interleaved=interleaved, bits=BITS[round_name], Nq=Nq, Nk=Nk, B=B, G=G)
    return t, meta, dtypes, side


def torch_gradients(t, meta, side):
    B, Nq, Nk, R, il = side["B"], side["Nq"], side["Nk"], side["R"], side["interleaved"]
    qpos = [[i + Nk - Nq for i in range(Nq)]] * B
    kpos = [list(range(Nk))] * B
    cos, sin = t["rotary_cos"], t["rotary_sin"]
    T = lambda a: torch.tensor(np.asarray(a, np.float64), requires_grad=True)
    q, k, v = T(t["q"]), T(t["k"]), T(t["v"])
    # The contract's rotated values (rounded once), with autograd's derivative of the rotation.
    def rot(x, name, pos):
        exact = torch.tensor(rotate_exact(t[name], pos, cos, sin, R, il, side["bits"]))
        r = rotate_torch(x, pos, cos, sin, R, il)
        return exact + (r - r.detach())
    qr, kr = rot(q, "q", qpos), rot(k, "k", kpos)
    kr = kr.repeat_interleave(side["G"], 1)
    vr = v.repeat_interleave(side["G"], 1)
    s = qr @ kr.transpose(-1, -2) / np.sqrt(qr.shape[-1])
    if "attn.softcap" in meta:
        c = float(meta["attn.softcap"])
        s = c * torch.tanh(s / c)
    if meta.get("attn.causal") == "bottom_right":
        allowed = torch.tensor(np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + Nk - Nq)
        s = s.masked_fill(~allowed, -np.inf)
    if "sinks" in t:
        H = q.shape[1]
        z = torch.cat([s, torch.tensor(t["sinks"]).view(1, H, 1, 1).expand(B, H, Nq, 1)], -1)
        p = torch.softmax(z, -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    o = p @ vr
    (o * torch.tensor(t["dout"])).sum().backward()
    return {"dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy()}


def main():
    cli = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    rng = np.random.default_rng(20261207)
    bad, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(count):
            t, meta, dtypes, side = problem(rng, k)
            path, gold = os.path.join(tmp, f"p{k}.safetensors"), os.path.join(tmp, f"p{k}.golden.safetensors")
            st.save(path, {a: b for a, b in t.items()}, meta, {a: b for a, b in dtypes.items() if a in t})
            r = subprocess.run([cli, "eval", path, "-o", gold], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"p{k}: eval failed ({r.returncode}): {r.stderr.strip()}")
            g, _ = st.load(gold)
            for name in ("dq.undecided", "dk.undecided"):
                if name in g:
                    bad.append(f"p{k}: {name} {np.asarray(g[name]).tolist()}: {r.stderr.strip()}")
            for name, val in torch_gradients(t, meta, side).items():
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
