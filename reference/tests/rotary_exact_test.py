"""The exact rotation (attn.rotary without attn.rotary_round) against an independent evaluation:
random problems of kind sdpa, both pairings, R = Dk and R = Dk / 2, decode and prefill shapes,
grouped heads, causal alignment, softcap and sinks, F32, F16 and BF16 inputs with F32 tables.
This test rotates q and k in exact rational arithmetic, takes each score as the exact dot product
of the rotated rows, and evaluates the softmax, lse and out with mpmath at 300 bits: out.ref and
lse.ref must be its values correctly rounded to double (within 2^-53 relative), and the tables
are drawn so that most rotated values are not doubles (more than 53 bits), so that the rounding
of rotated q and k to F64 is seen: the same cases with attn.rotary_round F64 must differ in some
out.ref.

    rotary_exact_test.py ATTNORACLE [PROBLEMS]     (exit 77: no mpmath)
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
    import mpmath
except ImportError:
    print("skipped: mpmath (python3-mpmath) is not installed")
    sys.exit(77)

mpmath.mp.prec = 300
BITS = {"F32": 24, "F16": 11, "BF16": 8}


def rounded(x, bits):
    """The float x rounded to nearest even at `bits` significant bits (normal range)."""
    if x == 0:
        return 0.0
    m, e = np.frexp(x)
    return float(np.ldexp(np.round(m * 2.0 ** bits), e - bits))


def pairs(R, interleaved):
    f = np.arange(R // 2)
    return (2 * f, 2 * f + 1) if interleaved else (f, f + R // 2)


def rotate(x, positions, cos, sin, R, interleaved):
    """x [B, H, N, Dk] as Fractions, its first R features rotated exactly at positions[b][n]."""
    B, H, N, Dk = x.shape
    y = [[[[Fraction(float(x[b, h, n, d])) for d in range(Dk)] for n in range(N)] for h in range(H)] for b in range(B)]
    i1, i2 = pairs(R, interleaved)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                t = positions[b][n]
                for f in range(R // 2):
                    x1, x2 = Fraction(float(x[b, h, n, i1[f]])), Fraction(float(x[b, h, n, i2[f]]))
                    c, s = Fraction(float(cos[t, f])), Fraction(float(sin[t, f]))
                    y[b][h][n][i1[f]] = x1 * c - x2 * s
                    y[b][h][n][i2[f]] = x1 * s + x2 * c
    return y


def mp(fr):
    return mpmath.mpf(fr.numerator) / fr.denominator


def problem(rng, k):
    B, Hkv, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq = Hkv * G
    Dk = int(rng.choice([2, 4, 6, 8]))
    R = Dk // 2 if k % 2 and Dk % 4 == 0 else Dk
    interleaved = k % 4 < 2
    Nk = int(rng.integers(1, 7))
    Nq = 1 if k % 3 == 0 else int(rng.integers(1, Nk + 1))
    Dv = int(rng.integers(1, 4))
    in_name = ["F32", "F16", "BF16"][k % 3]
    bits = BITS[in_name]
    n = lambda *s: np.vectorize(lambda x: rounded(x, bits))(rng.standard_normal(s)).astype(np.float64)
    Nrot = Nk + int(rng.integers(0, 3))
    theta = rng.uniform(-np.pi, np.pi, (Nrot, R // 2))
    cos = np.cos(theta).astype(np.float32).astype(np.float64)
    sin = np.sin(theta).astype(np.float32).astype(np.float64)
    t = {"q": n(B, Hq, Nq, Dk), "k": n(B, Hkv, Nk, Dk), "v": n(B, Hkv, Nk, Dv), "rotary_cos": cos, "rotary_sin": sin}
    meta = {"attn.format": "1", "attn.rotary": "interleaved" if interleaved else "half",
            "attn.outputs": "out,lse", "attn.masked_rows": "zero", "attn.output_dtype": "F32"}
    if k % 5 == 1:
        meta["attn.causal"] = "bottom_right"
    if k % 7 == 3:
        meta["attn.softcap"] = "2.5"
    if k % 6 == 4:
        t["sinks"] = n(Hq)
    dtypes = {x: in_name for x in ("q", "k", "v", "sinks")}
    dtypes["rotary_cos"] = dtypes["rotary_sin"] = "F32"
    return t, meta, dtypes, dict(R=R, interleaved=interleaved, G=G)


def exact(t, meta, side):
    """out [B, Hq, Nq, Dv] and lse [B, Hq, Nq] as mpmath numbers."""
    B, Hq, Nq, Dk = t["q"].shape
    Nk, Dv = t["k"].shape[2], t["v"].shape[3]
    q = rotate(t["q"], [[i + Nk - Nq for i in range(Nq)]] * B, t["rotary_cos"], t["rotary_sin"], side["R"],
               side["interleaved"])
    k = rotate(t["k"], [list(range(Nk))] * B, t["rotary_cos"], t["rotary_sin"], side["R"], side["interleaved"])
    scale = 1 / mpmath.sqrt(Dk)
    cap = mpmath.mpf(meta["attn.softcap"]) if "attn.softcap" in meta else None
    out = np.empty((B, Hq, Nq, Dv), object)
    lse = np.empty((B, Hq, Nq), object)
    for b in range(B):
        for h in range(Hq):
            g = h // side["G"]
            for i in range(Nq):
                s = []
                for j in range(Nk):
                    if meta.get("attn.causal") == "bottom_right" and j > i + Nk - Nq:
                        continue
                    x = scale * mp(sum(q[b][h][i][d] * k[b][g][j][d] for d in range(Dk)))
                    s.append((j, cap * mpmath.tanh(x / cap) if cap is not None else x))
                terms = [mpmath.exp(x) for _, x in s]
                z = sum(terms) + (mpmath.exp(mpmath.mpf(float(t["sinks"][h]))) if "sinks" in t else 0)
                lse[b, h, i] = mpmath.log(z)
                for c in range(Dv):
                    out[b, h, i, c] = sum(e * mpmath.mpf(float(t["v"][b, g, j, c])) for e, (j, _) in zip(terms, s)) / z
    return out, lse


def evaluate(cli, tmp, name, t, meta, dtypes):
    path, gold = os.path.join(tmp, name + ".safetensors"), os.path.join(tmp, name + ".golden.safetensors")
    st.save(path, dict(t), meta, {a: b for a, b in dtypes.items() if a in t})
    r = subprocess.run([cli, "eval", path, "-o", gold], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: eval failed ({r.returncode}): {r.stderr.strip()}")
    return st.load(gold)[0]


def main():
    cli = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rng = np.random.default_rng(20261208)
    bad, checked, moved = [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(count):
            t, meta, dtypes, side = problem(rng, k)
            g = evaluate(cli, tmp, f"p{k}", t, meta, dtypes)
            out, lse = exact(t, meta, side)
            for name, x in (("out", out), ("lse", lse)):
                ref = np.asarray(g[name + ".ref"])
                for e in np.ndindex(ref.shape):
                    checked += 1
                    if abs(mpmath.mpf(float(ref[e])) - x[e]) > mpmath.ldexp(abs(x[e]), -53):
                        bad.append(f"p{k} {name}{list(e)}: ref {ref[e]!r}, mpmath {mpmath.nstr(x[e], 20)} ({meta})")
            rounded_case = evaluate(cli, tmp, f"p{k}r", t, dict(meta, **{"attn.rotary_round": "F64"}), dtypes)
            moved += int(np.any(np.asarray(rounded_case["out.ref"]) != np.asarray(g["out.ref"])))
    print(f"{count} problems, {checked} elements of out and lse compared with mpmath; "
          f"{moved} differ from the rotation rounded to F64")
    for b in bad:
        print("MISMATCH", b)
    if moved == 0:
        print("no problem tells the exact rotation from the one rounded to F64")
    sys.exit(1 if bad or moved == 0 else 0)


if __name__ == "__main__":
    main()
