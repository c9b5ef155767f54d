"""Rotary embedding through the gate: a small set of rotary cases (both pairings, R = Dk and
Dk / 2, decode queries after their cache, attn.rotary_round F64, F32 and BF16, dq, dk and dv),
evaluated by `attnoracle eval`, then `attnoracle run` on the NumPy adapter (one-pass softmax)
and on the FlashAttention-style kernel (online softmax over blocks of 4 keys): both pass every
case, and each rotary bug planted in the latter fails at least one.

    cd conformance/adapters/flash_numpy && /usr/bin/python3 -m unittest -v test_rotary_gate
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
import gate  # noqa: E402
import rotary_np  # noqa: E402
import splitkv_cases  # noqa: E402

FLASH = [sys.executable, os.path.join(HERE, "attention.py"), "--block", "4"]
NUMPY = [sys.executable, os.path.join(HERE, "..", "numpy", "attention.py"), "--dtype", "float64"]
PROFILES = "fp64,fp32,bf16"

# id: (dtype, [B, Hq, Hkv, Nq, Nk, Dk], R, pairing, rotary_round, causal, outputs)
CASES = {
    "decode_interleaved": ("F32", [1, 2, 1, 1, 40, 8], 8, "interleaved", "F32", "none", "out,lse,dq,dk,dv"),
    "prefill_half_r4": ("F32", [1, 2, 2, 5, 9, 8], 4, "half", "F32", "bottom_right", "out,lse,dq,dk,dv"),
    "gqa_bf16": ("BF16", [1, 4, 2, 3, 12, 8], 8, "interleaved", "BF16", "none", "out,lse,dq,dk,dv"),
    "decode_bf16_half_r4": ("BF16", [2, 2, 1, 1, 23, 8], 4, "half", "BF16", "none", "out,lse"),
    "f64_half": ("F64", [1, 1, 1, 4, 7, 4], 4, "half", "F64", "bottom_right", "out,lse,dq,dk,dv"),
}


def case_tensors(rng, dtype, shape, R, pairing, rnd, causal, outputs):
    B, Hq, Hkv, Nq, Nk, Dk = shape
    n = lambda *s: rotary_np.round_to(rng.standard_normal(s), dtype)
    inv = 10000.0 ** (-np.arange(R // 2) * 2.0 / R)
    angle = np.arange(Nk)[:, None] * inv[None, :]
    t = {"q": n(B, Hq, Nq, Dk), "k": n(B, Hkv, Nk, Dk), "v": n(B, Hkv, Nk, Dk), "dout": n(B, Hq, Nq, Dk),
         "rotary_cos": np.cos(angle).astype(np.float32), "rotary_sin": np.sin(angle).astype(np.float32)}
    meta = {"attn.format": "1", "attn.rotary": pairing, "attn.rotary_round": rnd, "attn.outputs": outputs,
            "attn.causal": causal}
    dtypes = {x: dtype for x in ("q", "k", "v", "dout")}
    return t, meta, dtypes


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class RotaryGateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="attn_rotary_")
        cls.root = os.path.join(cls.tmp.name, "set")
        rng = np.random.default_rng(20261207)
        case_set = {cid: case_tensors(rng, *spec) for cid, spec in CASES.items()}
        splitkv_cases.write_set(gate.cli(), cls.root, case_set, "rotary_gate", "test", 0)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_gate(self, impl):
        report = os.path.join(self.tmp.name, "report.json")
        p = subprocess.run([gate.cli(), "run", self.root, "--impl", shlex.join(impl), "--profile", PROFILES,
                            "--threads", "2", "--json", report], capture_output=True, text=True)
        self.assertIn(p.returncode, (0, 1), p.stdout + p.stderr)
        with open(report, encoding="utf-8") as f:
            return json.load(f)

    def test_correct_kernels_pass_every_case(self):
        for impl in (NUMPY, FLASH):
            with self.subTest(impl=impl[1]):
                r = self.run_gate(impl)
                self.assertEqual(gate.failed(r), {})
                self.assertEqual(r["passed"], len(CASES), json.dumps(r)[:3000])

    def test_every_rotary_bug_fails(self):
        for bug in sorted(rotary_np.BUGS):
            with self.subTest(bug=bug):
                r = self.run_gate(FLASH + ["--bug", bug])
                self.assertTrue(gate.failed(r), f"{bug}: every case passed")


if __name__ == "__main__":
    unittest.main()
