"""The FlashAttention-style NumPy kernel through the gate on vectors/core.

    cd conformance/adapters/flash_numpy && /usr/bin/python3 -m unittest -v test_flash_numpy

The gate tests need the attnoracle binary (ATTNORACLE_CLI, or build/attnoracle) and are skipped,
saying why, without it; the tests of the planted bugs call the kernel directly, on arrays worked by
hand, with the right and the wrong results.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gate  # noqa: E402

sys.argv = sys.argv[:1] + [a for a in sys.argv[1:] if a.startswith("-")]
import attention  # noqa: E402

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

    def test_lse_bf16_rounded_fails_where_lse_is_judged_in_f32(self):
        # flash-bf16 declares lse in F32: the gate asks for lse:F32 and judges it there, where an
        # lse kept in BF16 is many ulps off; judged in BF16 (lse_dtype null) the same lse passes.
        flags = ADAPTER + ["--arith", "bf16", "--bug", "lse_bf16_rounded"]
        status, report = gate.run(flags, "flash-bf16", "--dtype", "BF16")
        self.assertEqual(status, 1)
        fails = gate.failed(report)
        lse_cases = [c for c in report["cases"] if any(t["tensor"] == "lse" for t in c["tensors"])]
        self.assertGreater(len(fails), len(lse_cases) // 2, fails)
        for c in report["cases"]:
            if c["status"] == "fail":
                self.assertEqual(c["worst"]["tensor"], "lse", c["id"])
                self.assertEqual([t["dtype"] for t in c["tensors"] if t["tensor"] == "lse"], ["F32"], c["id"])
        with tempfile.TemporaryDirectory() as tmp:
            profile = os.path.join(tmp, "bf16-lse.json")
            with open(profile, "w") as f:
                f.write('{"name": "flash-bf16-lse-bf16", "base": "flash-bf16", "lse_dtype": null}')
            status, report = gate.run(flags, profile, "--dtype", "BF16")
        self.assertEqual(gate.failed(report), {})
        self.assertEqual(status, 0)

    def test_no_rescale_is_caught_at_block_16(self):
        status, report = gate.run(ADAPTER + ["--block", "16", "--bug", "no_rescale"], "fp32")
        self.assertEqual(status, 1)
        fails = gate.failed(report)
        # The F32 cases with more than 16 keys whose blocks have different maxima (README).
        self.assertLessEqual({"normal-001", "normal-003", "long_rows-000"}, set(fails), fails)


def t(*rows):
    """A [1, 1, N, D] float64 tensor from rows (one head, one batch)."""
    return np.array(rows, np.float64)[None, None]


def kernel(bug, q, k, v, block=16, arith="fp32", in_dtype="F32", **meta_and_tensors):
    """(out, weights, lse) of the kernel with --bug `bug` (None: the correct kernel); keyword
    arguments mask, bias are tensors, the others attn.* metadata (scale 1 unless given)."""
    tensors = {n: meta_and_tensors.pop(n) for n in ("mask", "bias", "seqlens_q", "seqlens_k", "sinks", "dropout")
               if n in meta_and_tensors}
    meta = {"attn.scale": "1", "attn.masked_rows": "zero", "attn.outputs": "out,weights,lse"}
    meta.update({"attn." + key: str(value) for key, value in meta_and_tensors.items()})
    meta = {key: value for key, value in meta.items() if value != "None"}
    return attention.Kernel(block, arith, bug)(q, k, v, meta, None, in_dtype=in_dtype, **tensors)


class PlantedBugTest(unittest.TestCase):
    """Each --bug of the kernel against the correct kernel on a case built to expose it."""

    def test_every_bug_has_a_test(self):
        for bug in attention.BUGS:
            if bug.startswith("bwd_"):           # gradients: GradientTest, against eval
                self.assertIn(bug, BWD_BUGS)
                continue
            if bug in attention.nx.rotary_np.BUGS:   # test_rotary_gate.py runs each at the gate
                continue
            # stored K/V and FP8 outputs: FlashFp8Test, at the gate on fp8_cases.py
            self.assertTrue(hasattr(self, "test_bug_" + bug) or hasattr(FlashFp8Test, "test_bug_" + bug),
                            f"--bug {bug} has no test")

    def both(self, bug, *args, **kw):
        return kernel(None, *args, **kw), kernel(bug, *args, **kw)

    # Kind merge: splits of lse -inf (O NaN), 0, 0 with O 1 and 3: out 2, lse log 2.
    def test_bug_merge_nan_empty(self):
        o = np.array([np.nan, 1.0, 3.0]).reshape(3, 1, 1, 1, 1)
        lse = np.array([-np.inf, 0.0, 0.0]).reshape(3, 1, 1, 1)
        out, l = attention.Kernel(16, "fp32", None).merge(o, lse, {"attn.masked_rows": "zero"}, None)
        self.assertEqual(out.item(), 2.0)
        self.assertAlmostEqual(l.item(), math.log(2), places=6)
        bad, _ = attention.Kernel(16, "fp32", "merge_nan_empty").merge(o, lse, {"attn.masked_rows": "zero"}, None)
        self.assertTrue(np.isnan(bad.item()))

    # Dropout. Two heads, two queries, two keys of score 0 (weights 1/2), V = [2, 6]; keep mask
    # [[1, 0], [1, 1]] in head 0 and [[0, 1], [1, 1]] in head 1, p = 0.5 (scale 2): out = 2,
    # 8 in head 0 and 6, 8 in head 1; the weights stay 1/2.
    def dropout_case(self, bug, p=0.5):
        keep = np.array([[[1, 0], [1, 1]], [[0, 1], [1, 1]]], bool)[None]
        q, k, v = np.zeros((1, 2, 2, 1)), np.zeros((1, 2, 2, 1)), np.array([2.0, 6.0]).reshape(1, 1, 2, 1).repeat(2, 1)
        return self.both(bug, q, k, v, dropout=(keep, p))

    def test_dropout(self):
        (out, w, _, _), _ = self.dropout_case(None)
        self.assertEqual(out[..., 0].tolist(), [[[2, 8], [6, 8]]])
        self.assertTrue(np.all(w == 0.5))
        (out, _, _, _), _ = self.dropout_case(None, p=0.75)       # scale 4
        self.assertEqual(out[0, 0, :, 0].tolist(), [4, 16])

    def test_bug_dropout_no_scale(self):
        _, (out, _, _, _) = self.dropout_case("dropout_no_scale")
        self.assertEqual(out[0, 0, :, 0].tolist(), [1, 4])

    def test_bug_dropout_on_output(self):                        # O = 4 times keep[i, 0] * 2
        _, (out, _, _, _) = self.dropout_case("dropout_on_output")
        self.assertEqual(out[..., 0].tolist(), [[[8, 8], [0, 8]]])

    def test_bug_dropout_transposed(self):                       # head 0 reads [[1, 1], [0, 1]]
        _, (out, _, _, _) = self.dropout_case("dropout_transposed")
        self.assertEqual(out[0, 0, :, 0].tolist(), [8, 6])

    def test_bug_dropout_head0(self):
        _, (out, _, _, _) = self.dropout_case("dropout_head0")
        self.assertEqual(out[0, 1, :, 0].tolist(), [2, 8])

    def test_bug_dropout_keep_p(self):                           # 1 / p = 4 at p = 0.25, not 4/3
        (right, _, _, _), (out, _, _, _) = self.dropout_case("dropout_keep_p", p=0.25)
        self.assertEqual(out[0, 0, :, 0].tolist(), [4, 16])
        np.testing.assert_allclose(right[0, 0, :, 0], [4 / 3, 16 / 3], rtol=1e-6)
        # drawing its own mask, a weight is kept with probability p
        rng = np.random.default_rng(1)
        self.assertAlmostEqual(attention.draw_keep("dropout_keep_p", rng, (1, 1, 100, 100), 0.25).mean(), 0.25, delta=0.02)
        self.assertAlmostEqual(attention.draw_keep(None, rng, (1, 1, 100, 100), 0.25).mean(), 0.75, delta=0.02)
        heads = attention.draw_keep("dropout_head0", rng, (1, 3, 10, 10), 0.5)
        self.assertTrue(np.array_equal(heads[:, 0], heads[:, 2]))

    # Online softmax. Scores [0, 10] in blocks of 1 key, V = [0, 1]: out = e^10 / (1 + e^10).
    def rising(self, bug):
        return self.both(bug, t([1.0]), t([0.0], [10.0]), t([0.0], [1.0]), block=1)

    # Sinks. Two keys of score 0, V = [1, 3], a sink of 0: weights 1/3 each, out = 4/3, lse = log 3.
    def sink_case(self, bug):
        return self.both(bug, t([1.0]), t([0.0], [0.0]), t([1.0], [3.0]), block=1, sinks=np.zeros(1))

    def test_sinks(self):
        (out, w, lse, _), = [kernel(None, t([1.0]), t([0.0], [0.0]), t([1.0], [3.0]), sinks=np.zeros(1))]
        self.assertAlmostEqual(out.item(), 4 / 3, places=6)
        self.assertTrue(np.allclose(w, 1 / 3, rtol=1e-6))
        self.assertAlmostEqual(lse.item(), math.log(3), places=6)
        # a row with no allowed key but a sink: output 0, lse the sink
        out, w, lse, _ = kernel(None, t([1.0]), t([0.0]), t([5.0]), sinks=np.array([0.75]),
                                bias=np.array([-np.inf]), masked_rows="error")
        self.assertEqual(out.item(), 0.0)
        self.assertEqual(w.item(), 0.0)
        self.assertEqual(lse.item(), 0.75)

    def test_bug_sinks_ignored(self):
        right, wrong = self.sink_case("sinks_ignored")
        self.assertAlmostEqual(right[0].item(), 4 / 3, places=6)
        self.assertAlmostEqual(wrong[0].item(), 2.0, places=6)      # the softmax of the keys alone
        self.assertAlmostEqual(wrong[2].item(), math.log(2), places=6)

    def test_bug_sink_in_numerator(self):
        right, wrong = self.sink_case("sink_in_numerator")
        self.assertAlmostEqual(wrong[0].item(), 8 / 3, places=6)    # weights (1 + 1) / 3 each
        self.assertTrue(np.allclose(wrong[1], 2 / 3, rtol=1e-6))
        self.assertAlmostEqual(wrong[2].item(), right[2].item(), places=6)

    def test_scores_output(self):
        *_, s = kernel(None, t([1.0], [2.0]), t([3.0], [-1.0]), t([1.0], [1.0]), causal="top_left",
                       outputs="out,scores", scale="0.5")
        self.assertEqual(s.tolist(), [[[[1.5, -np.inf], [3.0, -1.0]]]])

    def test_bug_block_from_batch(self):
        # Blocks of 16 // B keys: batch row 0 keeps its bits alone and beside another row in the
        # correct kernel, not with the bug (blocks of 16 alone, of 8 in a batch of two).
        rng = np.random.default_rng(7)
        q = rng.standard_normal((2, 1, 3, 8)).astype(np.float32).astype(np.float64)
        k, v = (rng.standard_normal((2, 1, 40, 8)).astype(np.float32).astype(np.float64) for _ in range(2))
        for bug, same in ((None, True), ("block_from_batch", False)):
            alone = kernel(bug, q[:1], k[:1], v[:1])[0]
            both = kernel(bug, q, k, v)[0]
            self.assertEqual(alone.tobytes() == both[:1].tobytes(), same, bug)
            np.testing.assert_allclose(both[:1], alone, rtol=1e-5)
        np.testing.assert_array_equal(kernel("block_from_batch", q[:1], k[:1], v[:1])[0],
                                      kernel(None, q[:1], k[:1], v[:1])[0])   # B 1: blocks of 16

    def test_bug_dq_block_order_random(self):
        # Key blocks visited in a random order by the backward: dq's bits change between calls,
        # dk and dv (one key block each) do not; the correct kernel's never move.
        rng = np.random.default_rng(8)
        q, dout = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32).astype(np.float64) for _ in range(2))
        k, v = (rng.standard_normal((1, 2, 64, 8)).astype(np.float32).astype(np.float64) for _ in range(2))
        meta = {"attn.scale": "0.25", "attn.masked_rows": "zero", "attn.outputs": "out,dq,dk,dv"}

        def grads(bug):
            return attention.Kernel(16, "fp32", bug).gradients(q, k, v, dout, meta, None, ["dq", "dk", "dv"],
                                                               in_dtype="F32", out_dtype="F32")
        right = grads(None)
        runs = [grads("dq_block_order_random") for _ in range(8)]
        self.assertEqual({grads(None)["dq"].tobytes() for _ in range(3)}, {right["dq"].tobytes()})
        self.assertGreater(len({r["dq"].tobytes() for r in runs}), 1)
        for r in runs:
            np.testing.assert_allclose(r["dq"], right["dq"], rtol=1e-4, atol=1e-6)
            for name in ("dk", "dv"):
                self.assertEqual(r[name].tobytes(), right[name].tobytes(), name)

    def test_bug_no_rescale(self):
        right, wrong = self.rising("no_rescale")
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(-10)), places=6)
        self.assertEqual(wrong[0].item(), 0.5)        # l = 1 + 1, O = 0 + 1: block 1 not rescaled

    def test_bug_no_rescale_acc(self):
        # Scores [10, 0], V = [1, 0]: l is rescaled to e^10 + 1 ... O = 1 is not (it stays e^0 v0).
        q, k, v = t([1.0]), t([10.0], [0.0]), t([1.0], [0.0])
        right, wrong = self.both("no_rescale_acc", q, k, v, block=1)
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(-10)), places=6)
        # Block 2 keeps m = 10: alpha = 1 and the bug changes nothing; with the maximum last it does.
        right, wrong = self.rising("no_rescale_acc")
        self.assertAlmostEqual(wrong[0].item(), 1 / (1 + math.exp(-10)), places=6)
        q, k, v = t([1.0]), t([0.0], [10.0]), t([1.0], [0.0])
        right, wrong = self.both("no_rescale_acc", q, k, v, block=1)
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(10)), places=9)
        self.assertAlmostEqual(wrong[0].item(), 1 / (1 + math.exp(10)) * math.exp(10), places=6)

    def test_bug_max_init_zero(self):
        right, wrong = self.both("max_init_zero", t([1.0]), t([-200.0], [-201.0]), t([3.0], [5.0]))
        self.assertAlmostEqual(right[0].item(), (3 + 5 / math.e) / (1 + 1 / math.e), places=5)
        self.assertTrue(np.isnan(wrong[0]).all())    # exp(-200) underflows: 0 / 0

    def test_bug_exp2_no_log2e(self):
        right, wrong = self.both("exp2_no_log2e", t([1.0]), t([0.0], [1.0]), t([0.0], [1.0]))
        self.assertAlmostEqual(right[0].item(), math.e / (1 + math.e), places=6)
        self.assertAlmostEqual(wrong[0].item(), 2 / 3, places=6)
        self.assertAlmostEqual(wrong[2].item(), 1 + math.log2(1.5), places=6)

    def test_bug_lse_without_max(self):
        right, wrong = self.both("lse_without_max", t([1.0]), t([3.0], [3.0]), t([1.0], [2.0]))
        self.assertAlmostEqual(right[2].item(), 3 + math.log(2), places=6)
        self.assertAlmostEqual(wrong[2].item(), math.log(2), places=6)
        np.testing.assert_array_equal(right[0], wrong[0])

    def test_bug_lse_bf16_rounded(self):
        # lse = 3 + log 2 = 3.693..., which BF16 holds only to 2^-6
        right, wrong = self.both("lse_bf16_rounded", t([1.0]), t([3.0], [3.0]), t([1.0], [2.0]))
        self.assertAlmostEqual(right[2].item(), 3 + math.log(2), places=6)
        self.assertEqual(wrong[2].item(), attention.round_bf16(right[2]).item())
        self.assertGreater(abs(wrong[2].item() - right[2].item()), 1e-4)
        np.testing.assert_array_equal(right[0], wrong[0])

    def test_bug_lse_log2(self):
        right, wrong = self.both("lse_log2", t([1.0]), t([0.0], [0.0]), t([1.0], [2.0]))
        self.assertAlmostEqual(right[2].item(), math.log(2), places=6)
        self.assertAlmostEqual(wrong[2].item(), 1.0, places=6)

    def test_bug_weights_stale(self):
        right, wrong = self.rising("weights_stale")
        self.assertAlmostEqual(right[1][0, 0, 0, 0], 1 / (1 + math.exp(10)), places=9)
        self.assertEqual(wrong[1][0, 0, 0, 0], 1.0)    # written when key 0 was the only key seen
        np.testing.assert_array_equal(right[0], wrong[0])

    def test_bug_weights_no_softcap(self):
        # Softcap 1: scores tanh(2) and tanh(0); the weights pass takes 2 and 0.
        right, wrong = self.both("weights_no_softcap", t([1.0]), t([2.0], [0.0]), t([1.0], [0.0]),
                                 softcap=1)
        self.assertAlmostEqual(right[1][0, 0, 0, 0], 1 / (1 + math.exp(-math.tanh(2))), places=6)
        self.assertAlmostEqual(wrong[1][0, 0, 0, 0], math.exp(2 - right[2].item()), places=5)
        np.testing.assert_array_equal(right[0], wrong[0])

    # Arithmetic.
    # The statistical tier's bugs: each hook against its correct arithmetic.
    def test_bug_stat_exp_1e3(self):
        x = np.array([0.5, -3.0, -np.inf])
        np.testing.assert_array_equal(attention.stat_exp(None, x), np.exp(x))
        got = attention.stat_exp("stat_exp_1e3", x)
        np.testing.assert_allclose(got[:2] / np.exp(x[:2]) - 1, 1e-3 * np.sin(1e4 * x[:2]), rtol=1e-9)
        self.assertEqual(got[2], 0.0)   # exp(-inf) stays 0
        right, wrong = self.both("stat_exp_1e3", t([1.0]), t([0.0], [0.5]), t([0.0], [1.0]))
        self.assertNotEqual(right[0].item(), wrong[0].item())

    def test_bug_stat_f16_denominator(self):
        third = np.full((1, 1, 1, 2), 1 / 3, np.float32)
        l0, a = np.zeros((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32)
        self.assertEqual(attention.stat_denominator(None, a, l0, third, np.float32).item(), np.float32(2 / 3))
        f16 = np.float16(np.float16(1 / 3) + np.float16(1 / 3))
        self.assertEqual(attention.stat_denominator("stat_f16_denominator", a, l0, third, np.float32).item(),
                         np.float32(f16))

    def test_bug_stat_pv_bf16(self):
        # 1 * 1 + 1 * 2^-9: BF16 keeps 8 bits, so the sum rounds back to 1
        a, o = np.ones((1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32)
        p = np.ones((1, 1, 1, 2), np.float32)
        vb = np.array([[[[1.0], [2.0 ** -9]]]], np.float32)
        self.assertEqual(attention.stat_accumulate(None, a, o, p, vb).item(), 1 + 2.0 ** -9)
        self.assertEqual(attention.stat_accumulate("stat_pv_bf16", a, o, p, vb).item(), 1.0)

    def test_bug_stat_round_up(self):
        # 1/25 rounds down to nearest in F32; toward +inf it is the float above, 1/5 stays
        o, l = np.array([[[[1.0], [1.0]]]], np.float32), np.array([[[25.0, 5.0]]], np.float32)
        right = attention.stat_divide(None, o, l, "F32")
        wrong = attention.stat_divide("stat_round_up", o, l, "F32")
        self.assertLess(float(np.float32(0.04)), 0.04)
        self.assertEqual(right[0, 0, 0, 0], np.float32(1 / 25))
        self.assertEqual(wrong[0, 0, 0, 0], np.nextafter(np.float32(0.04), np.float32(1)))
        self.assertEqual(wrong[0, 0, 1, 0], np.float32(0.2))

    def test_bug_p_truncate(self):
        # 1 + 3/4 ulp: to nearest one ulp up, truncated to 1 (BF16: ulp 2^-7, F16: 2^-10 above 1);
        # 1 - ulp / 8: to nearest 1, truncated half an ulp down (the spacing below 1); F16's
        # subnormal 2.75 2^-24: 3 and 2 2^-24; 0.5 is exact in both
        for arith, ulp in (("bf16", 2.0 ** -7), ("fp16", 2.0 ** -10)):
            p = np.array([1 + 0.75 * ulp, 0.5, 1 - 0.125 * ulp], np.float32)
            right = attention.p_round(None, attention.ROUND[arith], arith, p)
            wrong = attention.p_round("p_truncate", attention.ROUND[arith], arith, p)
            np.testing.assert_array_equal(right, np.array([1 + ulp, 0.5, 1], np.float32))
            np.testing.assert_array_equal(wrong, np.array([1, 0.5, 1 - 0.5 * ulp], np.float32))
        sub = np.array([2.75 * 2.0 ** -24], np.float32)
        self.assertEqual(attention.p_round(None, attention.round_f16, "fp16", sub)[0], 3 * 2.0 ** -24)
        self.assertEqual(attention.p_round("p_truncate", attention.round_f16, "fp16", sub)[0], 2 * 2.0 ** -24)
        # in the kernel: scores (0, -0.3), V = (0, 1): P = (1, 0.7408) rounds up in BF16 (0.7422),
        # truncates down (0.7383); no change with F32 P
        args = (t([1.0]), t([0.0], [-0.3]), t([0.0], [1.0]))
        right, wrong = self.both("p_truncate", *args, arith="bf16")
        self.assertLess(wrong[0].item(), right[0].item())
        f32_right, f32_wrong = self.both("p_truncate", *args)
        self.assertEqual(f32_right[0].item(), f32_wrong[0].item())

    def test_bug_tf32_matmul(self):
        x = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -12, -(1 + 3 * 2.0 ** -12)], np.float32)
        np.testing.assert_array_equal(attention.round_tf32(x), [1, 1 + 2.0 ** -9, 1, -(1 + 2.0 ** -10)])
        right, wrong = self.both("tf32_matmul", t([1.0]), t([0.0]), t([1 + 2.0 ** -12]))
        self.assertEqual(right[0].item(), np.float32(1 + 2.0 ** -12))
        self.assertEqual(wrong[0].item(), 1.0)
        # F16 values are exact in TF32: no change with --arith fp16.
        right, wrong = self.both("tf32_matmul", t([1.0]), t([0.0], [1.0]), t([1 + 2.0 ** -10], [3.0]),
                                 arith="fp16")
        np.testing.assert_array_equal(right[0], wrong[0])

    def test_bug_flush_subnormals(self):
        tiny = float(np.finfo(np.float32).tiny)
        right, wrong = self.both("flush_subnormals", t([1.0]), t([0.0]), t([tiny / 4]))
        self.assertEqual(right[0].item(), np.float32(tiny / 4))
        self.assertEqual(wrong[0].item(), 0.0)
        # --arith fp16: a weight of e^-10 (below 2^-14) flushed: out = 0 + 0, not e^-10 * 1000.
        right, wrong = self.both("flush_subnormals", t([1.0]), t([10.0], [0.0]), t([0.0], [1000.0]),
                                 arith="fp16")
        self.assertGreater(right[0].item(), 0.04)
        self.assertEqual(wrong[0].item(), 0.0)

    def test_bug_qk_in_input_dtype(self):
        q, k, v = t([1.0]), t([1 + 2.0 ** -12], [0.0]), t([1.0], [0.0])
        right, wrong = self.both("qk_in_input_dtype", q, k, v, arith="fp16", in_dtype="F64")
        np.testing.assert_array_equal(right[0], wrong[0])           # F64 inputs: float64 throughout
        # Score 3 (1 + 2^-11) = 3 + 0.75 2^-9 is exact in F32 and rounds to 3 + 2^-9 in F16.
        right, wrong = self.both("qk_in_input_dtype", t([1.0]), t([3.0], [0.0]), t([1.0], [0.0]),
                                 arith="fp16", scale=1 + 2.0 ** -11)
        self.assertAlmostEqual(right[2].item(), math.log1p(math.exp(3 + 0.75 * 2.0 ** -9)), places=6)
        self.assertAlmostEqual(wrong[2].item(), math.log1p(math.exp(3 + 2.0 ** -9)), places=6)
        self.assertNotEqual(right[2].item(), wrong[2].item())

    # Scores, masks and bias.
    def test_bug_scale_dv(self):
        q, k = np.ones((1, 1, 1, 4)), np.array([[[[1.0] * 4, [0.0] * 4]]])
        v = np.array([[[[1.0], [0.0]]]])                 # Dk = 4, Dv = 1
        right, wrong = self.both("scale_dv", q, k, v, scale=None)
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(-2)), places=6)   # 4 / sqrt(4)
        self.assertAlmostEqual(wrong[0].item(), 1 / (1 + math.exp(-4)), places=6)   # 4 / sqrt(1)

    def test_bug_scale_twice(self):
        right, wrong = self.both("scale_twice", t([1.0]), t([4.0], [0.0]), t([1.0], [0.0]), scale=0.5)
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(-2)), places=6)
        self.assertAlmostEqual(wrong[0].item(), 1 / (1 + math.exp(-1)), places=6)

    def test_bug_softcap_scale_swapped(self):
        right, wrong = self.both("softcap_scale_swapped", t([1.0]), t([4.0], [0.0]), t([1.0], [0.0]),
                                 scale=0.5, softcap=1)
        self.assertAlmostEqual(right[2].item(), math.log(math.exp(math.tanh(2)) + 1), places=6)
        self.assertAlmostEqual(wrong[2].item(), math.log(math.exp(0.5 * math.tanh(4)) + 1), places=6)

    def test_bug_bias_scaled(self):
        bias = np.array([[[[2.0, 0.0]]]])
        right, wrong = self.both("bias_scaled", t([1.0]), t([0.0], [0.0]), t([1.0], [0.0]), scale=0.5,
                                 bias=bias)
        self.assertAlmostEqual(right[0].item(), 1 / (1 + math.exp(-2)), places=6)
        self.assertAlmostEqual(wrong[0].item(), 1 / (1 + math.exp(-1)), places=6)

    def test_bug_bias_head0(self):
        q, k, v = np.ones((1, 2, 1, 1)), np.zeros((1, 2, 2, 1)), np.array([[[[1.0], [0.0]]] * 2])
        bias = np.array([[[[0.0, 0.0]], [[3.0, 0.0]]]])      # head 1: key 0 favoured
        right, wrong = self.both("bias_head0", q, k, v, bias=bias)
        self.assertAlmostEqual(right[0][0, 1, 0, 0], 1 / (1 + math.exp(-3)), places=6)
        self.assertEqual(wrong[0][0, 1, 0, 0], 0.5)
        self.assertEqual(right[0][0, 0, 0, 0], wrong[0][0, 0, 0, 0])

    def test_bug_mask_batch0(self):
        q, k, v = np.ones((2, 1, 1, 1)), np.zeros((2, 1, 2, 1)), np.array([[[[1.0], [3.0]]]] * 2)
        mask = np.array([[[[True, True]]], [[[True, False]]]])   # batch 1: key 1 padded
        right, wrong = self.both("mask_batch0", q, k, v, mask=mask)
        self.assertEqual(right[0][1].item(), 1.0)
        self.assertEqual(wrong[0][1].item(), 2.0)
        self.assertEqual(right[0][0].item(), wrong[0][0].item())

    def test_bug_masked_fill_min(self):
        mask = np.array([[[[False, False]]]])
        right, wrong = self.both("masked_fill_min", t([1.0]), t([0.0], [1.0]), t([2.0], [4.0]), mask=mask)
        self.assertEqual((right[0].item(), right[2].item()), (0.0, -math.inf))
        self.assertEqual(wrong[0].item(), 3.0)           # the mean of V
        with self.assertRaises(attention.nx.Refused):   # the correct kernel refuses under error
            kernel(None, t([1.0]), t([0.0], [1.0]), t([2.0], [4.0]), mask=mask, masked_rows="error")
        kernel("masked_fill_min", t([1.0]), t([0.0], [1.0]), t([2.0], [4.0]), mask=mask, masked_rows="error")

    def test_bug_tail_unmasked(self):
        right, wrong = self.both("tail_unmasked", t([1.0]), t([0.0]), t([5.0]))
        self.assertEqual(right[0].item(), 5.0)
        self.assertEqual(wrong[0].item(), 5.0 / 16)      # 15 zero keys of score 0 in the block
        right, wrong = self.both("tail_unmasked", t([1.0]), t([0.0]), t([5.0]), causal="top_left")
        self.assertEqual(wrong[0].item(), 5.0)           # the causal mask hides the padding keys

    def test_bug_keys_limited_to_nq(self):
        right, wrong = self.both("keys_limited_to_nq", t([1.0]), t([0.0], [0.0]), t([1.0], [3.0]))
        self.assertEqual((right[0].item(), wrong[0].item()), (2.0, 1.0))
        self.assertEqual(wrong[1][0, 0, 0].tolist(), [1.0, 0.0])

    # FP8 descales: B = 1, Hq = 2 over Hkv = 2, one key each, v = 1 (stored), v_descale (3, 5):
    # the output of head h is v_descale[0, h]; with q_descale and k_descale the scores of a
    # two-key row change too.
    def fp8_heads(self, bug):
        d = {"q_descale": np.array([[2.0, 0.5]]), "k_descale": np.array([[4.0, 0.25]]),
             "v_descale": np.array([[3.0, 5.0]])}
        q = np.ones((1, 2, 1, 1))
        k = np.array([1.0, 0.0]).reshape(1, 1, 2, 1).repeat(2, axis=1)
        v = np.array([1.0, 0.0]).reshape(1, 1, 2, 1).repeat(2, axis=1)
        return attention.Kernel(16, "fp8", bug)(q, k, v, {"attn.scale": "1"}, None,
                                                in_dtype="F8_E4M3", descales=d)[0][0, :, 0, 0]

    def test_bug_descales_dropped(self):
        # scores (8, 0) and (0.125, 0): P = (1, e^-s) (the first exact in E4M3, the second
        # meets v = 0), l = 1 + e^-s: out = v_descale / (1 + e^-s)
        w = lambda s: 1 / (1 + np.exp(-s))
        np.testing.assert_allclose(self.fp8_heads(None), [3 * w(8), 5 * w(0.125)], rtol=1e-6)
        np.testing.assert_allclose(self.fp8_heads("descales_dropped"), [w(1), w(1)], rtol=1e-6)

    def test_bug_descales_kv_head0(self):
        w = lambda s: 1 / (1 + np.exp(-s))
        np.testing.assert_allclose(self.fp8_heads("descales_kv_head0"), [3 * w(8), 3 * w(8)], rtol=1e-6)

    def test_round_e4m3(self):
        r = attention.round_e4m3
        np.testing.assert_array_equal(r(np.array([1.0, 1.0625, 1.1875, 1.19, 460, 1e9, -3e-3, 2 ** -10, 0],
                                                 np.float32)),
                                      np.array([1.0, 1.0, 1.25, 1.25, 448, 448, -2 ** -9 * 2, 0, 0], np.float32))

    def test_fp8_over_bf16_kv(self):
        # BF16 K/V under --arith fp8 (an unquantized cache): read as they are, P in E4M3.
        # Scores (0, -1.203125) (BF16 values): P = (1, 0.30022) with 0.30022 rounded to 0.3125
        # (E4M3 spacing 2^-5 in [0.25, 0.5)); l sums P unrounded: out = 0.3125 / 1.30022.
        q, k, v = t([1.0]), t([0.0], [-1.203125]), t([0.0], [1.0])
        p = np.exp(np.float32(-1.203125))
        out = kernel(None, q, k, v, arith="fp8", in_dtype="BF16")[0][0, 0, 0, 0]
        self.assertAlmostEqual(out, 0.3125 / (1 + p), delta=1e-7)
        self.assertGreater(abs(out - p / (1 + p)), 1e-3)    # not P in F32

    def test_bug_gqa_pack2(self):
        def heads(bug, hq, hkv):
            v = np.arange(hkv, dtype=np.float64).reshape(1, hkv, 1, 1)
            out = kernel(bug, np.ones((1, hq, 1, 1)), np.zeros((1, hkv, 1, 1)), v)[0]
            return out[0, :, 0, 0].astype(int).tolist()
        self.assertEqual(heads(None, 8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
        self.assertEqual(heads("gqa_pack2", 8, 2), [0, 0, 1, 1, 0, 0, 1, 1])
        self.assertEqual(heads("gqa_pack2", 4, 2), heads(None, 4, 2))   # ratio 2: right
        self.assertEqual(heads("gqa_pack2", 3, 3), heads(None, 3, 3))

    # Causal and window (keys allowed for 2 queries over 4 keys).
    def allowed(self, bug, **meta):
        return attention.key_allowed({"attn." + k: v for k, v in meta.items()}, 2, 4, 0, 4, bug)[0, 0].astype(int).tolist()

    def test_bug_causal_top_left(self):
        self.assertEqual(self.allowed(None, causal="bottom_right"), [[1, 1, 1, 0], [1, 1, 1, 1]])
        self.assertEqual(self.allowed("causal_top_left", causal="bottom_right"), [[1, 0, 0, 0], [1, 1, 0, 0]])
        self.assertEqual(self.allowed("causal_top_left", causal="top_left"), [[1, 0, 0, 0], [1, 1, 0, 0]])

    def test_bug_bottom_right_off_by_one(self):
        self.assertEqual(self.allowed("bottom_right_off_by_one", causal="bottom_right"), [[1, 1, 1, 1]] * 2)
        self.assertEqual(self.allowed("bottom_right_off_by_one", causal="top_left"), [[1, 0, 0, 0], [1, 1, 0, 0]])

    def test_bug_window_off_by_one(self):
        self.assertEqual(self.allowed(None, window="1,1"), [[1, 1, 0, 0], [1, 1, 1, 0]])
        self.assertEqual(self.allowed("window_off_by_one", window="1,1"), [[1, 1, 0, 0], [0, 1, 1, 0]])

    def test_bug_window_right_ignored(self):
        self.assertEqual(self.allowed("window_right_ignored", window="1,1"), [[1, 1, 1, 1], [1, 1, 1, 1]])
        self.assertEqual(self.allowed("window_right_ignored", window="0,0", causal="top_left"),
                         [[1, 0, 0, 0], [0, 1, 0, 0]])

    # Sequence lengths: batch 0 holds Lq = 2 queries and Lk = 5 keys padded to Nq = 4, Nk = 8;
    # v_j = j and equal scores, so each output is the mean of the allowed keys.
    def varlen(self, bug):
        v = np.tile(np.arange(8, dtype=np.float64).reshape(1, 1, 8, 1), (2, 1, 1, 1))
        out = kernel(bug, np.zeros((2, 1, 4, 1)), np.zeros((2, 1, 8, 1)), v, causal="bottom_right",
                     seqlens_q=np.array([2, 4]), seqlens_k=np.array([5, 8]))[0]
        return out[:, 0, :, 0]

    def test_seqlens_align_per_batch(self):
        out = self.varlen(None)
        self.assertEqual(out[0, :2].tolist(), [1.5, 2.0])            # keys 0..3, then 0..4
        self.assertEqual(out[1].tolist(), [2.0, 2.5, 3.0, 3.5])      # full: keys 0..i+4

    def test_bug_seqlens_align_nk_nq(self):
        out = self.varlen("seqlens_align_nk_nq")
        self.assertEqual(out[0, :2].tolist(), [2.0, 2.0])            # keys 0..4 twice: aligned to 4
        self.assertEqual(out[1].tolist(), [2.0, 2.5, 3.0, 3.5])      # the full batch is right

    def test_bug_nan_from_padded_key(self):
        # key 2 is past seqlens_k = 2 and its value row is NaN
        q, k = np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 3, 1))
        v = np.array([1.0, 3.0, np.nan]).reshape(1, 1, 3, 1)
        right = kernel(None, q, k, v, seqlens_k=np.array([2]))[0]
        self.assertEqual(right[0, 0, 0, 0], 2.0)
        wrong = kernel("nan_from_padded_key", q, k, v, seqlens_k=np.array([2]))[0]
        self.assertTrue(np.isnan(wrong[0, 0, 0, 0]))

    def test_bug_paged_tail_page_read(self):
        # 3 keys in pages of 2 (table [1, 0]); slot 1 of page 0, key 3, is past seqlens_k and NaN
        def paged(bug):
            tensors = {"k_cache": np.zeros((2, 2, 1, 1)), "block_table": np.array([[1, 0]]),
                       "v_cache": np.array([5.0, np.nan, 1.0, 3.0]).reshape(2, 2, 1, 1),
                       "seqlens_k": np.array([3])}
            attention.nx.KV_BUG = bug
            try:
                attention.nx.gather_paged("case", tensors, {n: "F32" for n in tensors}, {})
            finally:
                attention.nx.KV_BUG = None
            return kernel(bug, np.zeros((1, 1, 1, 1)), tensors["k"], tensors["v"],
                          seqlens_k=tensors["seqlens_k"])[0][0, 0, 0, 0]
        self.assertEqual(paged(None), 3.0)        # the mean of 1, 3, 5
        self.assertTrue(np.isnan(paged("paged_tail_page_read")))


# -- gradients (CONTRACT section 7) against `attnoracle eval` ------------------------------

sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
import grad_cases as gc  # noqa: E402

P_UNIT = {"fp32": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def flash_limit(case, arith="fp32"):
    """(2 u_out + 3 u_p + 2 n u_acc) G.bound + tiny: the final rounding (u_out |G| <= u_out G.bound)
    and D_i from the rounded out (u_out on the D terms of G.bound); dout, P and dS rounded to the
    --arith format (u_p), at most three such factors per term; the accumulation in F32 (F64 for
    F64 inputs) of at most n = Nq + Nk + Dk + Dv terms, with the exp of S - lse (factor 2)."""
    u, tiny = gc.UNIT[case.out_dtype], gc.TINY[case.out_dtype]
    u_acc = 2.0 ** -53 if case.dtypes["q"] == "F64" else 2.0 ** -24
    c = 2 * u + 3 * P_UNIT[arith] + 2 * case.n * u_acc
    return lambda ref, bound: c * bound + tiny


# bug -> the case it shows on (grad_cases.specs), at --block 16
BWD_BUGS = {
    "bwd_no_delta": "gqa_softcap_bias", "bwd_mask_ignored": "mask_bias_bottom_right",
    "bwd_dk_no_scale": "gqa_softcap_bias", "bwd_gqa_no_sum": "gqa_softcap_bias",
    "bwd_no_softcap_grad": "gqa_softcap_bias", "bwd_stale_lse": "long",
    "bwd_dv_unnormalised": "gqa_softcap_bias", "bwd_dk_f16_accumulation": "long",
    "bwd_masked_row_nan": "top_left_window_masked_rows", "bwd_dq_other_alignment": "mask_bias_bottom_right",
    "bwd_lse_rounded": "gqa_softcap_bias", "bwd_tail_block_skipped": "long",
    "bwd_lse_batch0": "gqa_softcap_bias",
}


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class GradientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_flash_grad_")
        cls.cases = gc.build(cls.dir, gate.cli())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def run_flash(self, flags, names):
        return gc.run_adapter(ADAPTER + flags, [self.cases[n] for n in names], self.dir, "_".join(flags))

    def test_fp32_every_block(self):
        # F16, BF16 and F64 inputs included: --arith fp32 computes them in F32 (F64 in F64)
        for block in (4, 16, 64):
            got = self.run_flash(["--block", str(block)], self.cases)
            for name, case in self.cases.items():
                with self.subTest(block=block, case=name):
                    self.assertIsInstance(got[name], dict, got[name])
                    for g in case.grads:
                        self.assertEqual(got[name][g].shape, case.golden[g].shape, g)
                    ratios = gc.ratios(got[name], case, flash_limit(case))
                    self.assertLessEqual(max(ratios.values()), 1, ratios)

    def test_fp16_and_bf16_arith(self):
        for arith, name in (("fp16", "f16"), ("fp16", "f16_window_bottom_right"), ("bf16", "bf16_f32_out"),
                            ("bf16", "scalar_bias_bf16")):
            for block in (4, 16):
                with self.subTest(arith=arith, block=block):
                    got = self.run_flash(["--block", str(block), "--arith", arith], [name])[name]
                    ratios = gc.ratios(got, self.cases[name], flash_limit(self.cases[name], arith))
                    self.assertLessEqual(max(ratios.values()), 1, ratios)

    def test_gradient_zeros(self):
        got = self.run_flash(["--block", "4"], ["seqlens_unused_nan", "top_left_window_masked_rows",
                                                "query_mask_padding"])
        c, r = self.cases["seqlens_unused_nan"], got["seqlens_unused_nan"]
        for b in range(2):
            lq, lk = c.golden["seqlens_q"][b], c.golden["seqlens_k"][b]
            np.testing.assert_array_equal(r["dq"][b, :, lq:], 0)
            np.testing.assert_array_equal(r["dk"][b, :, lk:], 0)
            np.testing.assert_array_equal(r["dv"][b, :, lk:], 0)
        np.testing.assert_array_equal(got["top_left_window_masked_rows"]["dq"][:, :, 4:], 0)
        np.testing.assert_array_equal(got["query_mask_padding"]["dq"][:, :, 1:4], 0)

    def test_each_backward_bug_is_beyond_the_limit(self):
        self.assertEqual(set(BWD_BUGS), {b for b in attention.BUGS if b.startswith("bwd_")})
        for bug, name in BWD_BUGS.items():
            with self.subTest(bug=bug):
                got = self.run_flash(["--block", "16", "--bug", bug], [name])[name]
                ratios = gc.ratios(got, self.cases[name], flash_limit(self.cases[name]))
                self.assertGreater(max(ratios.values()), 1, ratios)

    def test_dsinks_without_sinks_refused(self):
        rng = np.random.default_rng(4)
        t = {x: rng.normal(size=(1, 2, 3, 4)) for x in ("q", "k", "v", "dout")}
        path = os.path.join(self.dir, "nosinks.safetensors")
        gc.st.save(path, t, {"attn.format": "1", "attn.outputs": "out,dsinks"})
        case = gc.Case("nosinks", path, {})
        got = gc.run_adapter(ADAPTER, [case], self.dir, "nosinks")["nosinks"]
        self.assertEqual(got[0], ".error")
        self.assertIn("dsinks asked for, but the case has no sinks", got[1])


# -- paged KV caches and empty shapes (CONTRACT section 8) -----------------------------------

class PagedTest(unittest.TestCase):
    """The kernel on a paged case (read through the NumPy adapter's gather) against its
    contiguous twin, bit for bit, for blocks that split pages and for each layout; no keys."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="flash_paged_")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def run_cases(self, cases, block):
        named = [gc.Case(name, self.save(name, t, m), {}) for name, (t, m) in cases.items()]
        return gc.run_adapter(ADAPTER + ["--block", str(block)], named, self.dir, f"b{block}")

    def save(self, name, tensors, metadata):
        path = os.path.join(self.dir, name + ".safetensors")
        gc.st.save(path, tensors, metadata)
        return path

    def test_paged_equals_contiguous(self):
        rng = np.random.default_rng(3)
        P, pages, Hkv, D = 4, 6, 1, 8
        table = np.array([[5, 2, 0, -1], [2, 3, 1, 4]], np.int32)      # page 2 shared, one -1 unused
        lk = np.array([11, 16], np.int32)
        kc, vc = np.full((pages, P, Hkv, D), np.nan), np.full((pages, P, Hkv, D), np.nan)
        k, v = np.zeros((2, Hkv, 16, D)), np.zeros((2, Hkv, 16, D))
        for b in range(2):
            for j in range(lk[b]):
                page, slot = table[b, j // P], j % P
                if np.isnan(kc[page, slot, 0, 0]):
                    kc[page, slot], vc[page, slot] = rng.normal(size=(Hkv, D)), rng.normal(size=(Hkv, D))
                k[b, :, j], v[b, :, j] = kc[page, slot], vc[page, slot]
        q = rng.normal(size=(2, 2, 3, D))
        m = {"attn.format": "1", "attn.causal": "bottom_right", "attn.outputs": "out,lse"}
        hnd = dict(m, **{"attn.kv_layout": "HND"})
        cases = {"nhd": ({"q": q, "k_cache": kc, "v_cache": vc, "block_table": table, "seqlens_k": lk}, m),
                 "hnd": ({"q": q, "k_cache": np.swapaxes(kc, 1, 2).copy(), "v_cache": np.swapaxes(vc, 1, 2).copy(),
                          "block_table": table, "seqlens_k": lk}, hnd),
                 "twin": ({"q": q, "k": k, "v": v, "seqlens_k": lk}, m)}
        for block in (3, 16):
            got = self.run_cases(cases, block)
            for name in ("nhd", "hnd"):
                for out in ("out", "lse"):
                    np.testing.assert_array_equal(got[name][out], got["twin"][out], err_msg=f"{name} {out} {block}")

    def test_no_keys_and_empty_batches(self):
        m = {"attn.format": "1", "attn.masked_rows": "zero", "attn.outputs": "out,lse"}
        cases = {"nk0": ({"q": np.ones((2, 2, 3, 4)), "k": np.ones((2, 1, 0, 4)), "v": np.ones((2, 1, 0, 2))}, m),
                 "b0": ({"q": np.ones((0, 2, 3, 4)), "k": np.ones((0, 1, 5, 4)), "v": np.ones((0, 1, 5, 2))}, m),
                 "nq0": ({"q": np.ones((2, 2, 0, 4)), "k": np.ones((2, 1, 5, 4)), "v": np.ones((2, 1, 5, 2))}, m)}
        got = self.run_cases(cases, 16)
        np.testing.assert_array_equal(got["nk0"]["out"], np.zeros((2, 2, 3, 2)))
        np.testing.assert_array_equal(got["nk0"]["lse"], np.full((2, 2, 3), -np.inf))
        self.assertEqual(got["b0"]["out"].shape, (0, 2, 3, 2))
        self.assertEqual(got["nq0"]["out"].shape, (2, 2, 0, 2))


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class FlashSplitKvTest(unittest.TestCase):
    """Partial states from the blockwise kernel and the F32 combine of kind merge, at the gate;
    the combine reading a -inf split's NaN fails."""

    def test_partials_and_merge(self):
        sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
        import splitkv_cases
        with tempfile.TemporaryDirectory(prefix="attn_flash_splitkv_") as tmp:
            suite = splitkv_cases.write(gate.cli(), tmp)
            for flags in (["--block", "2"], ["--block", "64"]):
                status, report = splitkv_cases.run(gate.cli(), suite, ADAPTER + flags, "fp32")
                self.assertEqual((status, report["passed"]), (0, 3), report["cases"])
            status, report = splitkv_cases.run(gate.cli(), suite, ADAPTER + ["--arith", "bf16"], "flash-bf16")
            self.assertEqual((status, report["passed"]), (0, 1), report["cases"])
            status, report = splitkv_cases.run(gate.cli(), suite, ADAPTER + ["--bug", "merge_nan_empty"], "fp32")
            self.assertEqual(gate.failed(report).keys(), {"merge_f32_sinks"})


class Fp8kvSet:
    """A vector set in cls.suite (made by setUpClass in cls.tmp) judged under fp8kv, where the
    NumPy adapter and the kernel with P in E4M3 (blocks of 16 and 64) pass every case."""

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def run_gate(self, impl):
        import splitkv_cases
        return splitkv_cases.run(gate.cli(), self.suite, impl, "fp8kv")

    def test_correct_kernels_pass(self):
        numpy_adapter = [sys.executable, os.path.join(HERE, "..", "numpy", "attention.py")]
        for impl in (numpy_adapter, ADAPTER + ["--block", "16", "--arith", "fp8"],
                     ADAPTER + ["--block", "64", "--arith", "fp8"]):
            with self.subTest(impl=impl[1:]):
                status, report = self.run_gate(impl)
                self.assertEqual((status, report["failed"], report["skipped"]), (0, 0, 0), gate.failed(report))


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class FlashFp8Test(Fp8kvSet, unittest.TestCase):
    """Quantized K/V in every form and granularity, V as a view of K, FP8 out with o_scale and
    amax, under the fp8kv profiles: the NumPy adapter and the kernel with P in E4M3 (blocks of 16
    and 64) pass every case; each planted bug of stored K/V and FP8 outputs fails the cases that
    show it (fp8_cases.py)."""

    CAUGHT = {
        "kv_descale_dropped": {"scaled_e4m3_tensor", "mxfp8_f16", "nvfp4_bf16", "paged_hnd_i8_slot"},
        "kv_scale_head0": {"scaled_e5m2_head", "paged_nhd_e4m3_slot", "paged_hnd_i8_slot"},
        "kv_scale_wrong_token": {"scaled_i8_token", "paged_nhd_e4m3_slot", "paged_hnd_i8_slot"},
        "e8m0_bias_off_by_one": {"mxfp8_f16"},
        "nvfp4_nibbles_swapped": {"nvfp4_bf16"},
        "e5m2_saturate": {"out_e5m2_overflow"},
        "p_e4m3_stale_max": {"score_jump"},
    }

    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, os.path.join(HERE, "..", "numpy"))
        import fp8_cases
        cls.tmp = tempfile.mkdtemp(prefix="attn_flash_fp8_")
        cls.suite = fp8_cases.write(gate.cli(), cls.tmp)

    def caught(self, bug):
        status, report = self.run_gate(ADAPTER + ["--block", "16", "--arith", "fp8", "--bug", bug])
        self.assertEqual(status, 1)
        self.assertLessEqual(self.CAUGHT[bug], set(gate.failed(report)))

    def test_bug_kv_descale_dropped(self):
        self.caught("kv_descale_dropped")

    def test_bug_kv_scale_head0(self):
        self.caught("kv_scale_head0")

    def test_bug_kv_scale_wrong_token(self):
        self.caught("kv_scale_wrong_token")

    def test_bug_e8m0_bias_off_by_one(self):
        self.caught("e8m0_bias_off_by_one")

    def test_bug_nvfp4_nibbles_swapped(self):
        self.caught("nvfp4_nibbles_swapped")

    def test_bug_e5m2_saturate(self):
        self.caught("e5m2_saturate")

    def test_bug_p_e4m3_stale_max(self):
        self.caught("p_e4m3_stale_max")


@unittest.skipUnless(gate.cli(), "the attnoracle binary was not found (ATTNORACLE_CLI or build/attnoracle)")
class PoisonedKvTest(Fp8kvSet, unittest.TestCase):
    """The quantized suite's poisoned families (vectors/suites/quantized.json, tag poison: NaN,
    infinities and extreme elements at every unused position of stored K/V, contiguous and paged),
    generated with `attnoracle gen`, under fp8kv: the NumPy adapter and the kernel with P in E4M3
    pass every case; the bugs that multiply zero weights by unused value rows fail the cases whose
    poison reaches them."""

    CONTIGUOUS = {"poison_scaled-000", "poison_scaled-001", "poison_scaled-002", "poison_block-000"}
    PAGED = {"poison_scaled-003", "poison_scaled-004", "poison_scaled-005", "poison_block-002",
             "poison_block-003", "poison_latent-000", "poison_latent-001"}

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(gate.REPO, "vectors", "suites", "quantized.json"), encoding="utf-8") as f:
            spec = json.load(f)
        spec["families"] = [fam for fam in spec["families"] if "poison" in fam.get("tags", [])]
        cls.tmp = tempfile.mkdtemp(prefix="attn_flash_poison_")
        with open(os.path.join(cls.tmp, "poison.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f)
        cls.suite = os.path.join(cls.tmp, "set")
        subprocess.run([gate.cli(), "gen", os.path.join(cls.tmp, "poison.json"), "-o", cls.suite, "--jobs", "2",
                        "--quiet"], check=True)

    def test_zero_weights_times_poison_fail(self):
        # nvfp4's contiguous case (poison_block-001) holds +-6, finite: neither bug sees it
        for bug, cases in (("nan_from_padded_key", self.CONTIGUOUS),
                           ("paged_tail_page_read", self.CONTIGUOUS | self.PAGED)):
            with self.subTest(bug=bug):
                status, report = self.run_gate(ADAPTER + ["--block", "64", "--arith", "fp8", "--bug", bug])
                self.assertEqual(status, 1)
                self.assertEqual(set(gate.failed(report)), cases)


if __name__ == "__main__":
    unittest.main()
