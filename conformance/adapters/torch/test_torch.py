"""The PyTorch adapter through the gate on vectors/core, under the profiles its README declares.

    cd conformance/adapters/torch && /usr/bin/python3 -m unittest -v test_torch

Skipped, saying why, when torch cannot be imported (Debian python3-torch) or the attnoracle binary
is not found (ATTNORACLE_CLI, or build/attnoracle).
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "flash_numpy"))
import gate  # noqa: E402

try:
    import torch  # noqa: F401
    NO_TORCH = None
except ImportError as e:
    NO_TORCH = f"torch is not importable ({e}); install Debian's python3-torch"
    print(f"test_torch: skipped: {NO_TORCH}", file=sys.stderr)

ADAPTER = [sys.executable, os.path.join(HERE, "attention.py")]
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


if __name__ == "__main__":
    unittest.main()
