"""The FlashAttention-style NumPy kernel through the gate on vectors/core.

    cd conformance/adapters/flash_numpy && /usr/bin/python3 -m unittest -v test_flash_numpy

Needs the attnoracle binary (ATTNORACLE_CLI, or build/attnoracle); skipped, saying why, without it.
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gate  # noqa: E402

ADAPTER = [sys.executable, os.path.join(HERE, "attention.py")]
BLOCKS = (16, 64, 128)


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class FlashGateTest(unittest.TestCase):
    def check(self, flags, profile, allowed=frozenset()):
        status, report = gate.run(ADAPTER + flags, profile)
        fails = gate.failed(report)
        self.assertLessEqual(set(fails), set(allowed), f"{flags} under {profile}: {fails}")
        self.assertGreater(report["passed"], 50, f"{flags} under {profile}")
        return report

    def test_fp32_and_fp64_every_block(self):
        for block in BLOCKS:
            for profile in ("fp32", "fp64"):
                with self.subTest(block=block, profile=profile):
                    self.check(["--block", str(block)], profile)

    def test_bf16_p_under_flash_bf16(self):
        for block in BLOCKS:
            with self.subTest(block=block):
                self.check(["--block", str(block), "--arith", "bf16"], "flash-bf16")

    def test_fp16_p_under_flash_fp16_every_block(self):
        # wide_range-002 and -003 included: their F16 weights below 2^-14 are covered by the
        # analysis's absolute term for P's rounding (TOLERANCE.md, step 4b).
        for block in BLOCKS:
            with self.subTest(block=block):
                self.check(["--block", str(block), "--arith", "fp16"], "flash-fp16")

    def test_no_rescale_is_caught_at_block_16(self):
        status, report = gate.run(ADAPTER + ["--block", "16", "--bug", "no_rescale"], "fp32")
        self.assertEqual(status, 1)
        fails = gate.failed(report)
        # The F32 cases with more than 16 keys whose blocks have different maxima (README).
        self.assertLessEqual({"normal-001", "normal-003", "long_rows-000"}, set(fails), fails)


if __name__ == "__main__":
    unittest.main()
