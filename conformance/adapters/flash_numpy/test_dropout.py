"""Dropout through the gate, end to end: a small vector set of dropout cases (the keep mask given,
p = 0.1, 0.5 and 0.3, whose 1 / (1 - p) = 10/7 is not a binary fraction; forward and gradients;
F32, BF16, F16) built with `attnoracle eval`, then `attnoracle run` on correct kernels of two
structures (the NumPy adapter's one-pass softmax, the flash kernel's online softmax over key
blocks, P in F32 or BF16) and on the flash kernel's dropout bugs; the same with each kernel
drawing its own mask (--draw-dropout) and returning it.

    cd conformance/adapters/flash_numpy && /usr/bin/python3 -m unittest -v test_dropout
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
import splitkv_cases  # noqa: E402

FLASH = [sys.executable, os.path.join(HERE, "attention.py")]
NUMPY = [sys.executable, os.path.join(HERE, "..", "numpy", "attention.py")]

# id: (dtype, B, Hq, Hkv, Nq, Nk, D, p, causal, mask shape: "full" or "rows")
CASES = {
    "dropout-f32-tenth": ("F32", 1, 2, 2, 33, 47, 16, "0.1", "none", "full"),
    "dropout-f32-half-gqa": ("F32", 1, 4, 2, 40, 40, 16, "0.5", "bottom_right", "full"),
    "dropout-f32-tenths3-broadcast": ("F32", 2, 2, 1, 24, 37, 8, "0.3", "none", "rows"),
    "dropout-bf16-tenths3": ("BF16", 1, 2, 2, 40, 70, 64, "0.3", "top_left", "full"),
    "dropout-f16-tenth": ("F16", 1, 2, 1, 33, 65, 32, "0.1", "none", "full"),
}
PROFILES = "fp32,flash-bf16,flash-fp16"


def write_set(root):
    """The cases, evaluated by `attnoracle eval` into cases/, and their manifest."""
    case_set = {}
    for seed, (cid, (dtype, B, Hq, Hkv, Nq, Nk, D, p, causal, shape)) in enumerate(CASES.items()):
        rng = np.random.default_rng(seed)
        x = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("q", (B, Hq, Nq, D)), ("k", (B, Hkv, Nk, D)), ("v", (B, Hkv, Nk, D)), ("dout", (B, Hq, Nq, D)))}
        keep = rng.random((B, Hq, Nq, Nk) if shape == "full" else (Nq, Nk)) >= float(p)
        tensors = dict(x, dropout_mask=keep)
        dtypes = {n: dtype for n in x}
        dtypes["dropout_mask"] = "BOOL"
        if dtype == "F16":                 # (BF16: the writer rounds the float32 values)
            tensors.update({n: a.astype(np.float16) for n, a in x.items()})
        meta = {"attn.format": "1", "attn.dropout_p": p, "attn.causal": causal,
                "attn.outputs": "out,lse,dq,dk,dv"}
        case_set[cid] = (tensors, meta, dtypes)
    splitkv_cases.write_set(gate.cli(), root, case_set, "dropout-test", "test_dropout.py", 0)


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class DropoutGateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="attn_dropout_")
        cls.set = os.path.join(cls.tmp.name, "set")
        write_set(cls.set)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_gate(self, impl, *options):
        report = os.path.join(self.tmp.name, "report.json")
        p = subprocess.run([gate.cli(), "run", self.set, "--impl", shlex.join(impl), "--profile", PROFILES,
                            "--threads", "2", "--json", report, *options], capture_output=True, text=True)
        self.assertIn(p.returncode, (0, 1), p.stdout + p.stderr)
        with open(report, encoding="utf-8") as f:
            return json.load(f)

    def verdicts(self, report):
        return {c["id"]: (c["status"], c.get("reason", "")) for c in report["cases"]}

    def assert_all_pass(self, impl, *options):
        v = self.verdicts(self.run_gate(impl, *options))
        self.assertEqual({cid: s for cid, (s, _) in v.items()}, dict.fromkeys(v, "pass"), v)
        return v

    def test_correct_kernels_pass(self):
        # F32 and F16 inputs: P in F32 (the NumPy adapter in float32, the flash kernel's blocks
        # of 16); BF16 inputs: the flash kernel with P rounded to BF16 after the keep scale
        self.assert_all_pass(NUMPY, "--dtype", "F32", "--dtype", "F16")
        self.assert_all_pass(FLASH + ["--block", "16"], "--dtype", "F32", "--dtype", "F16")
        self.assert_all_pass(FLASH + ["--arith", "bf16"], "--dtype", "BF16")

    def test_correct_kernels_drawing_their_own_masks_pass(self):
        for impl in (NUMPY, FLASH + ["--block", "16"]):
            with self.subTest(impl=impl[1]):
                self.assert_all_pass(impl + ["--draw-dropout", "7"], "--dtype", "F32", "--dtype", "F16")

    def test_every_bug_is_caught(self):
        for bug in ("dropout_no_scale", "dropout_on_output", "dropout_transposed", "dropout_head0",
                    "dropout_keep_p"):
            with self.subTest(bug=bug):
                v = self.verdicts(self.run_gate(FLASH + ["--block", "16", "--bug", bug], "--dtype", "F32"))
                self.assertIn("fail", {s for s, _ in v.values()}, v)
        # the keep scale left out fails every case (p > 0 in all of them)
        v = self.verdicts(self.run_gate(FLASH + ["--arith", "bf16", "--bug", "dropout_no_scale"], "--dtype", "BF16"))
        self.assertEqual({s for s, _ in v.values()}, {"fail"}, v)

    def test_generator_bugs_are_caught_by_the_mask_statistics(self):
        for bug, what in (("dropout_head0", "agreement between heads"), ("dropout_keep_p", "keep rate")):
            with self.subTest(bug=bug):
                v = self.verdicts(self.run_gate(FLASH + ["--bug", bug, "--draw-dropout", "7"], "--dtype", "F32"))
                reasons = [r for s, r in v.values() if s == "fail"]
                self.assertTrue(any(r.startswith("dropout_mask: " + what) for r in reasons), v)


if __name__ == "__main__":
    unittest.main()
