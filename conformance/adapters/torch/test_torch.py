"""The PyTorch adapter through the gate on vectors/core, under the profiles its README declares.

    cd conformance/adapters/torch && /usr/bin/python3 -m unittest -v test_torch

Skipped, saying why, when torch cannot be imported (Debian python3-torch) or the attnoracle binary
is not found (ATTNORACLE_CLI, or build/attnoracle).
"""
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "flash_numpy"))
import gate  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
import grad_cases as gc  # noqa: E402

try:
    import torch  # noqa: F401
    NO_TORCH = None
except ImportError as e:
    NO_TORCH = f"torch is not importable ({e}); install Debian's python3-torch"
    print(f"test_torch: skipped: {NO_TORCH}", file=sys.stderr)

import mha_grad_cases as mc  # noqa: E402
import safetensors_np as st  # noqa: E402

ADAPTER = [sys.executable, os.path.join(HERE, "attention.py")]
NUMPY_ADAPTER = [sys.executable, os.path.join(HERE, "..", "numpy", "attention.py")]
# One run gates F32, F64 and BF16, each input dtype under its own profile.
PROFILES = "fp32,fp64,torch-cpu-bf16"


@unittest.skipIf(NO_TORCH, NO_TORCH)
@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class TorchGateTest(unittest.TestCase):
    def check(self, flags, profile, least, *options):
        status, report = gate.run(ADAPTER + flags, profile, *options)
        self.assertEqual(gate.failed(report), {}, f"{flags} under {profile}")
        self.assertEqual(status, 0)
        self.assertGreaterEqual(report["passed"], least, f"{flags} under {profile}")
        return report

    def test_ops(self):
        report = self.check(["--mode", "ops"], PROFILES, 71 + 66 + 62)
        judged = {c["dtype"] for c in report["cases"] if c["status"] != "skip"}
        self.assertEqual(judged, {"F32", "F64", "BF16"})

    def test_ops_f16_is_unsupported(self):
        status, report = gate.run(ADAPTER, "fp16", "--dtype", "F16")
        reasons = {c["reason"] for c in report["cases"]}
        self.assertEqual(report["passed"] + report["failed"], 0, reasons)
        self.assertTrue(any("Half" in r for r in reasons), reasons)

    def test_bf16_needs_its_profile(self):
        # Scores are rounded to BF16 before the softmax: the plain bf16 profile does not cover it.
        status, report = gate.run(ADAPTER, "bf16", "--tag", "large_scores")
        self.assertEqual(status, 1)

    def test_mha(self):
        self.check(["--mode", "mha"], PROFILES, 7 + 1 + 2, "--tag", "mha", "--returns", "weights")


def torch_limit(case):
    """u_out |G.ref| + tiny + 2 n u_in G.bound: the final rounding into the output dtype, and
    every op (the forward, softmax, tanh, the backward's matmuls) rounded in the input dtype (u_in),
    at most n = Nq + Nk + Dk + Dv terms per sum, times 2 for the exp and the softmax's division."""
    u, tiny, u_in = gc.UNIT[case.out_dtype], gc.TINY[case.out_dtype], gc.UNIT[case.dtypes["q"]]
    return lambda ref, bound: u * np.abs(ref) + tiny + 2 * case.n * u_in * bound


@unittest.skipIf(NO_TORCH, NO_TORCH)
@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class TorchGradientTest(unittest.TestCase):
    """Autograd's dq, dk, dv, dbias against `attnoracle eval` on ../numpy/grad_cases.py."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_torch_grad_")
        cls.cases = gc.build(cls.dir, gate.cli())
        cls.got = gc.run_adapter(ADAPTER, cls.cases.values(), cls.dir, "ops")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_gradients_within_the_limit(self):
        for name, case in self.cases.items():
            with self.subTest(case=name):
                got = self.got[name]
                if case.dtypes["q"] == "F16":    # no Half matmul on the CPU
                    self.assertEqual(got[0], ".unsupported")
                    continue
                self.assertIsInstance(got, dict, got)
                for g in case.grads:
                    self.assertEqual(got[g].shape, case.golden[g].shape, g)
                ratios = gc.ratios(got, case, torch_limit(case))
                self.assertLessEqual(max(ratios.values()), 1, ratios)

    def test_gradient_zeros(self):
        c, r = self.cases["seqlens_unused_nan"], self.got["seqlens_unused_nan"]
        for b in range(2):
            lq, lk = c.golden["seqlens_q"][b], c.golden["seqlens_k"][b]
            np.testing.assert_array_equal(r["dq"][b, :, lq:], 0)
            np.testing.assert_array_equal(r["dk"][b, :, lk:], 0)
            np.testing.assert_array_equal(r["dv"][b, :, lk:], 0)
        np.testing.assert_array_equal(self.got["top_left_window_masked_rows"]["dq"][:, :, 4:], 0)
        np.testing.assert_array_equal(self.got["query_mask_padding"]["dq"][:, :, 1:4], 0)

    def test_sdpa_gradients_refused_in_mha(self):
        rng = np.random.default_rng(5)
        t = {"x_q": rng.normal(size=(1, 3, 4)), "x_kv": rng.normal(size=(1, 3, 4)),
             "w_q": rng.normal(size=(2, 4, 2)), "w_k": rng.normal(size=(2, 4, 2)),
             "w_v": rng.normal(size=(2, 4, 2)), "w_o": rng.normal(size=(4, 4))}
        path = os.path.join(self.dir, "mha.safetensors")
        gc.st.save(path, t, {"attn.format": "1", "attn.kind": "mha", "attn.outputs": "out,dq"})
        got = gc.run_adapter(ADAPTER + ["--mode", "mha"], [gc.Case("mha", path, {})], self.dir, "mha")["mha"]
        self.assertEqual(got[0], ".error")
        self.assertIn("dq is not a gradient of kind mha", got[1])



@unittest.skipIf(NO_TORCH, NO_TORCH)
class TorchMhaGradientTest(unittest.TestCase):
    """Kind mha's gradients by autograd (--mode mha) against the NumPy adapter's hand-written
    backward and finite differences, in float64."""
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="attn_torch_mha_")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def run_adapter(self, cmd, path, tag):
        import json
        import subprocess
        out = os.path.join(self.dir, f"{tag}.out.safetensors")
        jobs = os.path.join(self.dir, f"{tag}.jsonl")
        with open(jobs, "w") as f:
            f.write(json.dumps({"id": tag, "input": path, "output": out}) + "\n")
        subprocess.run(cmd + [jobs], check=True)
        self.assertTrue(os.path.exists(out), os.listdir(self.dir))
        return st.read(out)[0]

    def test_autograd_matches_numpy_and_finite_differences(self):
        for name in mc.TORCH_CASES:
            path, tensors, m = mc.write(self.dir, name)
            got = self.run_adapter(ADAPTER + ["--mode", "mha"], path, "torch_" + name)
            ref = self.run_adapter(NUMPY_ADAPTER + ["--dtype", "float64"], path, "numpy_" + name)
            for g in m["attn.outputs"].split(",")[1:]:
                with self.subTest(case=name, gradient=g):
                    self.assertEqual(got[g].dtype, np.float64)
                    np.testing.assert_allclose(got[g], ref[g], rtol=0, atol=1e-12 * max(1, np.abs(ref[g]).max()))
                    fd = mc.finite_difference(tensors, m, g)
                    np.testing.assert_allclose(got[g], fd, rtol=0, atol=1e-7 * max(1, np.abs(fd).max()))
            self.assertEqual("dx_kv" in got, "dx_kv" in m["attn.outputs"])

if __name__ == "__main__":
    unittest.main()
