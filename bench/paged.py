#!/usr/bin/env python3
"""Whole-process timing of `attnoracle eval` on a paged KV cache against its contiguous twin.

    /usr/bin/python3 bench/paged.py [--attnoracle build/attnoracle] [-k 3] [--threads N]

The decode shape of a serving kernel: B = 8, Hq = 32 query heads over Hkv = 8 kv heads, Nq = 1,
D = 128, BF16 inputs and outputs, seqlens_k drawn up to 4096 (one row full), page size 16
(Mpages = 256), the pages of every row shuffled over the pool, NaN in the slots no key uses and
-1 in the unused table entries. The twin holds the same keys and values gathered into k and v
(zeros past seqlens_k). Each round runs eval on the paged case, then on the twin (alternating,
-k rounds); the report gives the median wall time of each, their ratio, and checks that the
golden `out` bytes are equal. Markdown on stdout, progress on stderr.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance", "adapters", "numpy"))
import safetensors_np as st  # noqa: E402

B, HQ, HKV, NQ, D, NK, P = 8, 32, 8, 1, 128, 4096, 16


def write_cases(directory, seed):
    rng = np.random.default_rng(seed)
    lk = rng.integers(1, NK + 1, B)
    lk[0] = NK
    width = NK // P
    used = -(-lk // P)                                   # ceil(Lk / P) pages per row
    pages = int(used.sum()) + 8                          # a few pages no row uses
    order = rng.permutation(pages)
    table = np.full((B, width), -1, np.int32)
    kc = np.full((pages, P, HKV, D), np.nan, np.float32)
    vc = np.full((pages, P, HKV, D), np.nan, np.float32)
    k = np.zeros((B, HKV, NK, D), np.float32)
    v = np.zeros((B, HKV, NK, D), np.float32)
    n = 0
    for b in range(B):
        table[b, :used[b]] = order[n:n + used[b]]
        n += used[b]
        kb = rng.standard_normal((lk[b], HKV, D), np.float32)
        vb = rng.standard_normal((lk[b], HKV, D), np.float32)
        j = np.arange(lk[b])
        kc[table[b, j // P], j % P] = kb
        vc[table[b, j // P], j % P] = vb
        k[b, :, :lk[b]] = np.swapaxes(kb, 0, 1)
        v[b, :, :lk[b]] = np.swapaxes(vb, 0, 1)
    q = rng.standard_normal((B, HQ, NQ, D), np.float32)
    meta = {"attn.format": "1"}
    paged = os.path.join(directory, "paged.safetensors")
    twin = os.path.join(directory, "contiguous.safetensors")
    st.save(paged, {"q": q, "k_cache": kc, "v_cache": vc, "block_table": table, "seqlens_k": lk.astype(np.int32)},
            meta, {"q": "BF16", "k_cache": "BF16", "v_cache": "BF16"})
    st.save(twin, {"q": q, "k": k, "v": v, "seqlens_k": lk.astype(np.int32)}, meta,
            {"q": "BF16", "k": "BF16", "v": "BF16"})
    return paged, twin, lk


def run(cli, case, out, threads):
    cmd = [cli, "eval", case, "-o", out, "-q"] + (["--threads", str(threads)] if threads else [])
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t, cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attnoracle", default=os.path.join(HERE, "..", "build", "attnoracle"))
    ap.add_argument("-k", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--threads", type=int, default=0, help="eval's --threads (default: eval's own default)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="paged_bench_") as d:
        paged, twin, lk = write_cases(d, a.seed)
        times = {"paged": [], "contiguous": []}
        for r in range(a.k):
            for name, case in (("paged", paged), ("contiguous", twin)):
                s, cmd = run(a.attnoracle, case, os.path.join(d, name + ".out.safetensors"), a.threads)
                times[name].append(s)
                print(f"round {r + 1}: {name} {s:.3f} s", file=sys.stderr)
        outs = [st.read(os.path.join(d, n + ".out.safetensors"))[0]["out"] for n in ("paged", "contiguous")]
        same = np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
        sizes = {n: os.path.getsize(c) for n, c in (("paged", paged), ("contiguous", twin))}
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"`/usr/bin/python3 bench/paged.py -k {a.k}" + (f" --threads {a.threads}" if a.threads else "") + "`\n")
    print(f"B = {B}, Hq = {HQ}, Hkv = {HKV}, Nq = {NQ}, D = {D}, BF16, page size {P}, seqlens_k "
          f"{', '.join(map(str, lk))}; load average before: {os.getloadavg()[0]:.2f}\n")
    print("| case | file MB | runs (s) | median (s) |")
    print("|---|---|---|---|")
    for n in ("paged", "contiguous"):
        print(f"| {n} | {sizes[n] / 1e6:.1f} | {', '.join(f'{t:.3f}' for t in times[n])} | {med[n]:.3f} |")
    print(f"\npaged / contiguous = {med['paged'] / med['contiguous']:.3f}; golden out bytes equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
