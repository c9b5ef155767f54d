"""bench/torch_grad_ref.py, the backward's PyTorch reference: its gradients against the formulas
written out in NumPy float64 on a small case, its refusals (exit status 2, one line naming the
file), and compare.py's reading of eval's gradient units.
"""
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, BENCH)
import compare  # noqa: E402
import make_case  # noqa: E402
from numpy_ref import load, save  # noqa: E402

SCRIPT = os.path.join(BENCH, "torch_grad_ref.py")


def run(case, out):
    return subprocess.run([sys.executable, SCRIPT, case, "-o", out], capture_output=True, text=True, timeout=120)


class TorchGradRefTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def test_gradients_match_the_formulas(self):
        # Two query heads over one kv head (GQA): dk and dv add up both heads.
        case = self.path("c.safetensors")
        make_case.make_case(case, 12, 8, heads=2, kv_heads=1, nk=10, seed=3, input_dtype="BF16",
                            output_dtype="F32", backward=True)
        r = run(case, self.path("o.safetensors"))
        self.assertEqual(r.returncode, 0, r.stderr)
        got, _ = load(self.path("o.safetensors"))
        t, _ = load(case)
        q, k, v, dout = (t[n].astype(np.float64) for n in ("q", "k", "v", "dout"))
        scale = 1 / math.sqrt(q.shape[-1])
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for h in range(q.shape[1]):
            s = q[0, h] @ k[0, 0].T * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            dp = dout[0, h] @ v[0, 0].T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))  # D_i = dout_i . O_i
            dq[0, h] = scale * ds @ k[0, 0]
            dk[0, 0] += scale * ds.T @ q[0, h]
            dv[0, 0] += p.T @ dout[0, h]
        for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
            np.testing.assert_allclose(got[name + ".ref"], want, rtol=1e-12, atol=1e-14, err_msg=name)
            np.testing.assert_array_equal(got[name], want.astype(np.float32), err_msg=name)

    def test_refusals(self):
        forward = self.path("forward.safetensors")  # no dout
        make_case.make_case(forward, 4, 4)
        causal = self.path("causal.safetensors")
        make_case.make_case(causal, 4, 4, backward=True)
        tensors, meta = load(causal)
        save(causal, {n: ("F32", a.astype(np.float64)) for n, a in tensors.items()},
             dict(meta, **{"attn.causal": "top_left"}))
        for case in (forward, causal):
            with self.subTest(case=os.path.basename(case)):
                out = self.path("refused.safetensors")
                r = run(case, out)
                self.assertEqual(r.returncode, 2, r.stderr)
                lines = r.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, r.stderr)
                self.assertIn(case, lines[0])
                self.assertFalse(os.path.exists(out))

    def test_summary_gradient_units(self):
        info = compare.parse_eval_summary(
            "o.safetensors: 10 golden elements, 0 undecided; 4 rows, 4 by the fast path, 0 by MPFR (0 fell back); "
            "gradient units 8 by the fast path (3 fell back to MPFR), 0 needed more precision (up to 0 bits); "
            "1.5 s on 1 thread (reading 0.1 s, evaluation 1.0 s, oracle 0.3 s, writing 0.1 s)")
        self.assertEqual((info["grad_fast"], info["grad_fallback"]), (8, 3))
        self.assertEqual((info["fell_back"], info["evaluation"], info["oracle"]), (0, 1.0, 0.3))


if __name__ == "__main__":
    unittest.main()
