"""A small vector set of split-KV partial states and kind merge (CONTRACT section 8), made with
`attnoracle eval`, and `attnoracle run` on it: for the tests of the NumPy adapters.

    suite = splitkv_cases.write(cli, directory)
    status, report = splitkv_cases.run(cli, suite, [python, adapter, ...], "fp32")
"""
import hashlib
import json
import os
import shlex
import subprocess

import numpy as np

import safetensors_np as st


def cases():
    """{id: (tensors, metadata, dtypes)}."""
    rng = np.random.default_rng(8)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    out = {}
    # causal bottom_right, a key padding mask, sinks (kept out of the partials), splits of 3 of
    # 10 keys: rows without a key in a split (lse -inf there)
    mask = np.ones((2, 1, 1, 10), bool)
    mask[1, ..., 3:6] = False
    out["partials_causal_sinks"] = (
        {"q": f32(2, 2, 4, 8), "k": f32(2, 1, 10, 8), "v": f32(2, 1, 10, 5), "mask": mask, "sinks": f32(2)},
        {"attn.format": "1", "attn.causal": "bottom_right", "attn.kv_split_size": "3",
         "attn.outputs": "out,lse,out_partial,lse_partial", "attn.output_dtypes": "lse:F32,out_partial:F32,lse_partial:F32"},
        {})
    out["partials_window_lse_only"] = (
        {"q": f32(1, 2, 6, 4), "k": f32(1, 2, 6, 4), "v": f32(1, 2, 6, 4)},
        {"attn.format": "1", "attn.window": "1,1", "attn.kv_split_size": "2", "attn.outputs": "out,lse_partial"},
        {})
    # merges: S = 3, some splits empty (lse -inf, O NaN), sinks, F32 and BF16 partials
    S, B, H, Nq, Dv = 3, 2, 2, 3, 4
    lse = (rng.normal(size=(S, B, H, Nq)) * 3).astype(np.float32)
    lse[1, 0, 1, :] = -np.inf
    lse[:, 1, 0, 2] = -np.inf           # a row with every split empty: its sink alone
    o = f32(S, B, H, Nq, Dv)
    o[lse == -np.inf] = np.nan
    out["merge_f32_sinks"] = ({"o_partial": o, "lse_partial": lse, "sinks": f32(H)},
                              {"attn.format": "1", "attn.kind": "merge", "attn.outputs": "out,lse"}, {})
    lse2 = lse.copy()
    lse2[:, 1, 0, 2] = 0.5
    out["merge_bf16_out_f32"] = ({"o_partial": np.nan_to_num(o), "lse_partial": lse2},
                                 {"attn.format": "1", "attn.kind": "merge", "attn.outputs": "out,lse",
                                  "attn.output_dtype": "F32"}, {"o_partial": "BF16"})
    return out


def write(cli, directory):
    """The vector set in `directory` (cases/<id>.safetensors with golden tensors, manifest.json)."""
    return write_set(cli, directory, cases(), "splitkv", "splitkv_cases.py", 8)


def write_set(cli, directory, case_set, suite, generator, seed):
    """Cases {id: (tensors, metadata, dtypes)} evaluated by `attnoracle eval` into a vector set in
    `directory` named `suite`."""
    os.makedirs(os.path.join(directory, "cases"), exist_ok=True)
    entries = []
    for id_, (tensors, meta, dtypes) in sorted(case_set.items()):
        raw = os.path.join(directory, f"{id_}.in.safetensors")
        st.save(raw, tensors, meta, dtypes)
        path = os.path.join(directory, "cases", f"{id_}.safetensors")
        subprocess.run([cli, "eval", raw, "-o", path, "-q"], check=True)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        entries.append({"id": id_, "file": f"cases/{id_}.safetensors", "sha256": digest, "expect": "ok",
                        "tags": [id_.split("_")[0]]})
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump({"format": "attnoracle-vectors/1", "suite": suite, "generator": generator,
                   "seed": seed, "cases": entries}, f)
    return directory


def run(cli, suite, impl, profile):
    """`attnoracle run SUITE --impl IMPL --profile PROFILE` -> (status, JSON report)."""
    report = os.path.join(suite, f"report_{profile}.json")
    p = subprocess.run([cli, "run", suite, "--impl", shlex.join(impl), "--profile", profile, "--json", report],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"attnoracle run exited {p.returncode}: {p.stdout}{p.stderr}")
    with open(report, encoding="utf-8") as f:
        return p.returncode, json.load(f)
