"""Tests of the NumPy adapter and its safetensors module.

    cd conformance/adapters/numpy && /usr/bin/python3 -m unittest -v test_attention

Each test builds small case files, runs attention.py on a jobs file as the runner would, and
checks hand-worked results. With the reference binary (ATTNORACLE_CLI, or build/attnoracle or
build/tools/attnoracle in the repository) the float64 adapter is also compared with `eval`.
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
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)
import safetensors_np as st  # noqa: E402

ADAPTER = os.path.join(HERE, "attention.py")
F32, F64 = np.float32, np.float64


def find_cli():
    candidates = [os.environ.get("ATTNORACLE_CLI", ""),
                  os.path.join(REPO, "build", "attnoracle"),
                  os.path.join(REPO, "build", "tools", "attnoracle")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def meta(**keys):
    """Case metadata: meta(causal="top_left") -> {"attn.format": "1", "attn.causal": ...}."""
    m = {"attn.format": "1"}
    m.update({"attn." + k: str(v) for k, v in keys.items()})
    return m


class AdapterTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="attn_np_")
        self.n = 0

    def tearDown(self):
        shutil.rmtree(self.dir)

    def case(self, tensors, metadata, dtypes=None):
        """Writes a case file; returns its path."""
        self.n += 1
        path = os.path.join(self.dir, f"case{self.n}.safetensors")
        st.save(path, tensors, metadata, dtypes)
        return path

    def run_adapter(self, cases, *flags):
        """Runs the adapter on a list of case paths; returns one result per case:
        ("ok", tensors, dtypes), ("error", text) or ("unsupported", text)."""
        self.n += 1
        jobs = os.path.join(self.dir, f"jobs{self.n}.jsonl")
        outputs = [os.path.join(self.dir, f"out{self.n}_{i}.safetensors") for i in range(len(cases))]
        with open(jobs, "w") as f:
            for i, (c, o) in enumerate(zip(cases, outputs)):
                f.write(json.dumps({"id": f"c{i}", "input": c, "output": o}) + "\n")
        p = subprocess.run([sys.executable, ADAPTER, *flags, jobs], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        results = []
        for o in outputs:
            found = [s for s in ("", ".error", ".unsupported") if os.path.exists(o + s)]
            self.assertEqual(len(found), 1, f"{o}: expected exactly one output, found {found}")
            if found[0] == "":
                results.append(("ok",) + st.read(o)[::2])
            else:
                with open(o + found[0], encoding="utf-8") as f:
                    results.append((found[0][1:], f.read()))
        leftovers = [f for f in os.listdir(self.dir) if ".tmp" in f]
        self.assertEqual(leftovers, [], "temporary files left behind")
        return results

    def run_one(self, case, *flags):
        kind, *rest = self.run_adapter([case], *flags)[0]
        self.assertEqual(kind, "ok", rest)
        return rest[0]

    # -- the basics ---------------------------------------------------------------------

    def test_one_key_gives_its_value(self):
        rng = np.random.default_rng(1)
        q = rng.normal(size=(1, 1, 3, 4))
        k = rng.normal(size=(1, 1, 1, 4))
        v = np.array([[[[1.5, -2.0, 0.25]]]])
        out = self.run_one(self.case({"q": q, "k": k, "v": v}, meta()), "--dtype", "float64")["out"]
        np.testing.assert_array_equal(out, np.broadcast_to(v, (1, 1, 3, 3)))

    def test_equal_scores_give_the_mean(self):
        q = np.ones((1, 1, 2, 2), F32)
        k = np.ones((1, 1, 4, 2), F32)             # every score equal
        v = np.arange(8, dtype=F32).reshape(1, 1, 4, 2)
        r = self.run_one(self.case({"q": q, "k": k, "v": v}, meta(outputs="out,weights,lse")))
        np.testing.assert_allclose(r["out"][0, 0], [[3, 4], [3, 4]], rtol=1e-6)
        np.testing.assert_allclose(r["weights"], 0.25, rtol=1e-6)
        # lse = s + log(4) with s = 2 / sqrt(2)
        np.testing.assert_allclose(r["lse"], math.sqrt(2) + math.log(4), rtol=1e-6)

    def test_default_output_dtype_is_the_input_dtype(self):
        for dtype, name in ((F64, "F64"), (F32, "F32"), (np.float16, "F16")):
            c = self.case({"q": np.ones((1, 1, 1, 2), dtype), "k": np.ones((1, 1, 2, 2), dtype),
                           "v": np.ones((1, 1, 2, 2), dtype)}, meta(outputs="out,lse"))
            _, tensors, dtypes = self.run_adapter([c])[0]
            self.assertEqual(dtypes, {"out": name, "lse": name})
            self.assertEqual(tensors["out"].dtype, dtype)

    def test_output_dtype_f16_and_bf16(self):
        rng = np.random.default_rng(2)
        t = {"q": rng.normal(size=(1, 2, 3, 4)).astype(F32), "k": rng.normal(size=(1, 2, 5, 4)).astype(F32),
             "v": rng.normal(size=(1, 2, 5, 3)).astype(F32)}
        f32 = self.run_one(self.case(t, meta()))["out"]
        _, f16, d16 = self.run_adapter([self.case(t, meta(output_dtype="F16"))])[0]
        _, b16, db16 = self.run_adapter([self.case(t, meta(output_dtype="BF16"))])[0]
        self.assertEqual((d16["out"], db16["out"]), ("F16", "BF16"))
        np.testing.assert_array_equal(f16["out"], f32.astype(np.float16))
        expect = (st.bf16_bits(f32).astype(np.uint32) << 16).view(F32)
        np.testing.assert_array_equal(b16["out"], expect)

    def test_output_dtypes_one_per_output(self):
        # BF16 inputs and out with an F32 lse (attn.output_dtypes), as FlashAttention returns them
        rng = np.random.default_rng(3)
        t = {"q": rng.normal(size=(1, 2, 3, 4)).astype(F32), "k": rng.normal(size=(1, 2, 5, 4)).astype(F32),
             "v": rng.normal(size=(1, 2, 5, 3)).astype(F32)}
        bf16 = {name: "BF16" for name in t}
        plain = self.run_one(self.case(t, meta(outputs="out,weights,lse"), bf16))
        _, r, dtypes = self.run_adapter([self.case(t, meta(outputs="out,weights,lse", output_dtypes="lse:F32"), bf16)])[0]
        self.assertEqual(dtypes, {"out": "BF16", "weights": "BF16", "lse": "F32"})
        np.testing.assert_array_equal(r["out"], plain["out"])
        self.assertEqual(r["lse"].dtype, F32)
        np.testing.assert_array_equal(st.bf16_bits(r["lse"]), st.bf16_bits(plain["lse"]))  # the same value
        _, r, dtypes = self.run_adapter([self.case(t, meta(outputs="lse,weights", output_dtype="F16",
                                                           output_dtypes="out:F64,weights:F32"), bf16)])[0]
        self.assertEqual(dtypes, {"out": "F64", "weights": "F32", "lse": "F16"})
        kind, text = self.run_adapter([self.case(t, meta(outputs="out,lse", output_dtypes="lse:F8_E4M3"), bf16)])[0]
        self.assertEqual((kind, text.strip()), ("unsupported", "attn.output_dtypes: dtype 'F8_E4M3' of 'lse'"))

    def test_scale_softcap_bias(self):
        # Dk = 1, q = 2, keys 1 and 0: T = scale * [2, 0] with scale = 0.75 (given in hex).
        q = np.array([[[[2.0]]]])
        k = np.array([[[[1.0], [0.0]]]])
        v = np.array([[[[10.0], [20.0]]]])
        bias = np.array([0.5, -0.25])              # rank 1, broadcast over rows
        r = self.run_one(self.case({"q": q, "k": k, "v": v, "bias": bias},
                                   meta(scale="0x1.8p-1", softcap="1.5", outputs="out,weights,lse")),
                         "--dtype", "float64")
        s = np.array([1.5 * math.tanh(1.5 / 1.5), 0.0]) + bias
        w = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(r["weights"][0, 0, 0], w, rtol=1e-14)
        np.testing.assert_allclose(r["out"][0, 0, 0], [w @ [10, 20]], rtol=1e-14)
        np.testing.assert_allclose(r["lse"][0, 0, 0], math.log(np.exp(s).sum()), rtol=1e-14)

    def test_bias_minus_inf_masks(self):
        v = np.array([[[[1.0], [2.0], [4.0]]]])
        bias = np.array([[0.0, -np.inf, 0.0]])
        r = self.run_one(self.case({"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 3, 1)), "v": v,
                                    "bias": bias}, meta(outputs="out,weights")), "--dtype", "float64")
        np.testing.assert_array_equal(r["weights"][0, 0, 0], [0.5, 0.0, 0.5])
        np.testing.assert_array_equal(r["out"][0, 0, 0], [2.5])

    # -- masks --------------------------------------------------------------------------

    def weights(self, Nq, Nk, flags=("--dtype", "float64"), **keys):
        """Weights of a case with equal scores (all zero), so they show the mask pattern."""
        t = {"q": np.zeros((1, 1, Nq, 2)), "k": np.zeros((1, 1, Nk, 2)), "v": np.zeros((1, 1, Nk, 1))}
        return self.run_one(self.case(t, meta(outputs="weights", **keys)), *flags)["weights"][0, 0]

    def test_causal_top_left_with_nq_lt_nk(self):
        w = self.weights(2, 3, causal="top_left")
        np.testing.assert_array_equal(w, [[1, 0, 0], [0.5, 0.5, 0]])

    def test_causal_bottom_right_with_nq_lt_nk(self):
        w = self.weights(2, 3, causal="bottom_right")
        np.testing.assert_allclose(w, [[0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-15)

    def test_causal_bottom_right_with_nq_gt_nk(self):
        # Nq = 3, Nk = 2: row 0 may see j <= -1, nothing: zeros under policy zero.
        w = self.weights(3, 2, causal="bottom_right", masked_rows="zero")
        np.testing.assert_array_equal(w, [[0, 0], [1, 0], [0.5, 0.5]])
        w = self.weights(3, 2, causal="top_left")
        np.testing.assert_array_equal(w, [[1, 0], [0.5, 0.5], [0.5, 0.5]])

    def test_window(self):
        # top_left (no causal): i - 1 <= j <= i
        w = self.weights(3, 4, window="1,0")
        np.testing.assert_array_equal(w, [[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0]])
        # bottom_right, i' = i + 1: i' - 0 <= j <= i' + 1
        w = self.weights(3, 4, window="0,1", causal="bottom_right")
        np.testing.assert_array_equal(w, [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])

    def test_boolean_mask_broadcast(self):
        mask = np.array([[True, False, True], [False, True, True]])        # [Nq, Nk]
        w = self.run_one(self.case({"q": np.zeros((2, 2, 2, 1)), "k": np.zeros((2, 1, 3, 1)),
                                    "v": np.zeros((2, 1, 3, 1)), "mask": mask},
                                   meta(outputs="weights")), "--dtype", "float64")["weights"]
        np.testing.assert_array_equal(w, np.broadcast_to(mask * 0.5, (2, 2, 2, 3)))

    def test_key_padding_mask_and_scalar_bias_broadcast(self):
        # mask [B,1,1,Nk] (the key padding mask of PyTorch and ONNX) and a bias of shape []
        mask = np.array([True, True, False, True, False, False]).reshape(2, 1, 1, 3)
        t = {"q": np.zeros((2, 2, 2, 1)), "k": np.zeros((2, 1, 3, 1)),
             "v": np.array([2.0, 6.0, 100.0, 8.0, 100.0, 100.0]).reshape(2, 1, 3, 1),
             "mask": mask, "bias": np.array(0.5)}
        r = self.run_one(self.case(t, meta(outputs="out,weights,lse")), "--dtype", "float64")
        np.testing.assert_array_equal(r["weights"], np.broadcast_to(mask / mask.sum(-1, keepdims=True),
                                                                    (2, 2, 2, 3)))
        np.testing.assert_array_equal(r["out"][0], np.full((2, 2, 1), 4.0))
        np.testing.assert_array_equal(r["out"][1], np.full((2, 2, 1), 8.0))
        np.testing.assert_allclose(r["lse"][0], np.full((2, 2), 0.5 + np.log(2)), rtol=1e-15)

    def test_nan_in_a_masked_key_changes_nothing(self):
        # key 2 is masked for every query; its k and v rows hold NaN and infinity
        k = np.array([3.0, -1.0, np.inf]).reshape(1, 1, 3, 1)
        v = np.array([1.0, 0.0, np.nan]).reshape(1, 1, 3, 1)
        t = {"q": np.full((1, 1, 1, 1), 0.5), "k": k, "v": v, "mask": np.array([True, True, False])}
        r = self.run_one(self.case(t, meta(outputs="out,weights", scale="1")), "--dtype", "float64")
        np.testing.assert_allclose(r["out"].ravel(), [1 / (1 + np.exp(-2))], rtol=1e-15)
        np.testing.assert_array_equal(r["weights"][0, 0, 0, 2], 0.0)

    def test_seqlens_align_bottom_right_per_batch(self):
        # Batch 0 holds Lq = 2 queries and Lk = 5 keys padded to Nq = 4, Nk = 8; batch 1 is full.
        # Equal scores, v_j = j: each output is the mean of the allowed keys. Keys past Lk hold
        # NaN and infinity (unused positions).
        v = np.tile(np.arange(8.0).reshape(1, 1, 8, 1), (2, 1, 1, 1))
        k = np.zeros((2, 1, 8, 1))
        k[0, 0, 5:, 0], v[0, 0, 6:, 0] = np.nan, np.inf
        t = {"q": np.zeros((2, 1, 4, 1)), "k": k, "v": v,
             "seqlens_q": np.array([2, 4], np.int32), "seqlens_k": np.array([5, 8], np.int64)}
        r = self.run_one(self.case(t, meta(causal="bottom_right", outputs="out,weights")), "--dtype", "float64")
        np.testing.assert_array_equal(r["out"][0, 0, :2, 0], [1.5, 2.0])   # keys 0..3, then 0..4
        np.testing.assert_allclose(r["out"][1, 0, :, 0], [2.0, 2.5, 3.0, 3.5], rtol=1e-15)
        np.testing.assert_array_equal(r["weights"][0, 0, 1, 5:], 0.0)

    def test_seqlens_q_rows_are_padding(self):
        # seqlens_k = 0 in batch 0: its query 0 has no key; with seqlens_q = 0 it is padding and
        # not refused under policy error, with seqlens_q = 1 it is refused.
        t = {"q": np.ones((2, 1, 1, 1)), "k": np.ones((2, 1, 2, 1)), "v": np.ones((2, 1, 2, 1)),
             "seqlens_k": np.array([0, 2], np.int32)}
        ok = self.case(dict(t, seqlens_q=np.array([0, 1], np.int32)), meta())
        bad = self.case(dict(t, seqlens_q=np.array([1, 1], np.int32)), meta())
        got = self.run_adapter([ok, bad])
        self.assertEqual(got[0][0], "ok", got[0])
        self.assertEqual(got[1][0], "error", got[1])

    def fully_masked_case(self, policy, query_mask=None):
        mask = np.ones((1, 2, 3, 2), bool)
        mask[0, 1, 2, :] = False                   # b=0, h=1, i=2 sees nothing
        t = {"q": np.ones((1, 2, 3, 2), F32), "k": np.ones((1, 2, 2, 2), F32),
             "v": np.full((1, 2, 2, 1), 3, F32), "mask": mask}
        if query_mask is not None:
            t["query_mask"] = query_mask
        return self.case(t, meta(masked_rows=policy, outputs="out,weights,lse"))

    def test_fully_masked_row_refused_under_error(self):
        kind, text = self.run_adapter([self.fully_masked_case("error")])[0]
        self.assertEqual(kind, "error")
        self.assertIn("b=0, h=1, i=2", text)

    def test_fully_masked_row_zero_policy(self):
        r = self.run_one(self.fully_masked_case("zero"))
        self.assertTrue(np.all(r["out"][0, 1, 2] == 0) and np.all(r["weights"][0, 1, 2] == 0))
        self.assertEqual(r["lse"][0, 1, 2], -np.inf)
        np.testing.assert_allclose(r["out"][0, 0], 3, rtol=1e-6)        # others as usual
        self.assertTrue(np.all(np.isfinite(r["lse"][0, 0])))

    def test_sinks_one_key(self):
        # score 2 (scale 1), sink 1: weight 1 / (1 + e^-1); lse = 2 + log(1 + e^-1)
        t = {"q": np.array([[[[1.0, 0.0]]]]), "k": np.array([[[[2.0, 5.0]]]]),
             "v": np.array([[[[3.0]]]]), "sinks": np.array([1.0])}
        r = self.run_one(self.case(t, meta(scale="1", outputs="out,weights,lse")), "--dtype", "float64")
        w = 1 / (1 + math.exp(-1))
        self.assertAlmostEqual(r["weights"].item(), w, places=15)
        self.assertAlmostEqual(r["out"].item(), 3 * w, places=14)
        self.assertAlmostEqual(r["lse"].item(), 2 + math.log1p(math.exp(-1)), places=14)

    def test_row_with_only_its_sink_is_not_refused(self):
        path = self.fully_masked_case("error")
        tensors, metadata, dtypes = st.read(path)
        tensors["sinks"] = np.array([0.5, -0.25], F32)
        r = self.run_one(self.case(tensors, metadata))
        self.assertTrue(np.all(r["out"][0, 1, 2] == 0) and np.all(r["weights"][0, 1, 2] == 0))
        self.assertEqual(r["lse"][0, 1, 2], np.float32(-0.25))
        self.assertLess(r["weights"][0, 0, 0].sum(), 1)                  # the sink's share

    def test_scores_output(self):
        t = {"q": np.array([[[[1.0], [2.0]]]], F32), "k": np.array([[[[3.0], [-1.0]]]], F32),
             "v": np.ones((1, 1, 2, 1), F32), "bias": np.array([0.25, 0], F32)}
        r = self.run_one(self.case(t, meta(scale="0.5", causal="top_left", outputs="out,scores")))
        self.assertEqual(r["scores"].tolist(), [[[[1.75, -np.inf], [3.25, -1.0]]]])

    def test_fully_masked_padding_row_never_refused(self):
        qm = np.array([[True, True, False]])      # row 2 is padding
        r = self.run_one(self.fully_masked_case("error", qm))
        self.assertTrue(np.all(r["out"][0, 1, 2] == 0))
        self.assertEqual(r["lse"][0, 1, 2], -np.inf)

    # -- heads --------------------------------------------------------------------------

    def gqa_case(self):
        # Hq = 4 over Hkv = 2, one key: head h outputs the value of its kv head, 1 or 2.
        v = np.array([1.0, 2.0]).reshape(1, 2, 1, 1)
        return self.case({"q": np.ones((1, 4, 1, 1)), "k": np.ones((1, 2, 1, 1)), "v": v}, meta())

    # -- paged KV caches and empty shapes (CONTRACT section 8) ---------------------------------

    def paged_problem(self, hnd=False):
        """A paged case (pages shuffled, page 1 shared by both batch rows, NaN in unused slots, an
        unused -1 entry) and its contiguous twin gathered by hand."""
        rng = np.random.default_rng(7)
        P, pages, Hkv, Dk, Dv = 3, 5, 2, 4, 2
        table = np.array([[3, 1, 0], [1, 4, -1]], np.int32)
        lk = np.array([8, 5], np.int32)
        kc = np.full((pages, P, Hkv, Dk), np.nan)
        vc = np.full((pages, P, Hkv, Dv), np.nan)
        k = np.zeros((2, Hkv, 9, Dk))
        v = np.zeros((2, Hkv, 9, Dv))
        for b in range(2):
            for j in range(lk[b]):
                page, slot = table[b, j // P], j % P
                if np.isnan(kc[page, slot, 0, 0]):
                    kc[page, slot], vc[page, slot] = rng.normal(size=(Hkv, Dk)), rng.normal(size=(Hkv, Dv))
                k[b, :, j], v[b, :, j] = kc[page, slot], vc[page, slot]
        q = rng.normal(size=(2, 4, 3, Dk))
        m = meta(causal="bottom_right", outputs="out,weights,lse")
        if hnd:
            kc, vc = np.swapaxes(kc, 1, 2).copy(), np.swapaxes(vc, 1, 2).copy()
            m["attn.kv_layout"] = "HND"
        paged = {"q": q, "k_cache": kc, "v_cache": vc, "block_table": table, "seqlens_k": lk}
        twin = {"q": q, "k": k, "v": v, "seqlens_k": lk}
        return paged, twin, m

    def test_paged_cache_gives_its_contiguous_twin(self):
        for hnd in (False, True):
            paged, twin, m = self.paged_problem(hnd)
            a = self.run_one(self.case(paged, m), "--dtype", "float64")
            m.pop("attn.kv_layout", None)
            b = self.run_one(self.case(twin, m), "--dtype", "float64")
            for name in ("out", "weights", "lse"):
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"{name}, hnd={hnd}")

    def test_paged_cache_against_eval(self):
        cli = find_cli()
        if cli is None:
            self.skipTest("no attnoracle binary")
        paged, _, m = self.paged_problem(hnd=True)
        path = self.case(paged, m)
        golden = os.path.join(self.dir, "golden.safetensors")
        subprocess.run([cli, "eval", path, "-o", golden, "-q"], check=True)
        want = st.read(golden)[0]
        got = self.run_one(path, "--dtype", "float64")
        np.testing.assert_allclose(got["out"], want["out"], rtol=1e-13, atol=1e-15)

    def test_paged_used_entry_outside_the_pages_is_refused(self):
        paged, _, m = self.paged_problem()
        paged["block_table"] = np.array([[3, 1, 0], [1, 9, -1]], np.int32)
        kind, text = self.run_adapter([self.case(paged, m)], "--dtype", "float64")[0]
        self.assertEqual(kind, "error")
        self.assertIn("block_table", text)

    def test_no_keys_and_empty_batches(self):
        t = {"q": np.ones((2, 2, 3, 4)), "k": np.ones((2, 1, 0, 4)), "v": np.ones((2, 1, 0, 2))}
        r = self.run_one(self.case(t, meta(masked_rows="zero", outputs="out,weights,lse")), "--dtype", "float64")
        np.testing.assert_array_equal(r["out"], np.zeros((2, 2, 3, 2)))
        self.assertEqual(r["weights"].shape, (2, 2, 3, 0))
        np.testing.assert_array_equal(r["lse"], np.full((2, 2, 3), -np.inf))
        kind, _ = self.run_adapter([self.case(t, meta(outputs="out"))], "--dtype", "float64")[0]
        self.assertEqual(kind, "error")             # policy error: every row fully masked
        for q in ((0, 2, 3, 4), (2, 2, 0, 4)):
            t = {"q": np.ones(q), "k": np.ones((q[0], 1, 5, 4)), "v": np.ones((q[0], 1, 5, 2))}
            r = self.run_one(self.case(t, meta(outputs="out,lse")), "--dtype", "float64")
            self.assertEqual(r["out"].shape, (q[0], 2, q[2], 2))

    def test_gate_on_empty_shapes_and_a_paged_case(self):
        """`attnoracle run` over a set of empty-shape and paged cases: golden files with zero-size
        tensors are compared (and reported) without trouble; the error case is refused."""
        import hashlib
        cli = find_cli()
        if cli is None:
            self.skipTest("no attnoracle binary")
        ones = lambda *shape: np.ones(shape, F32)
        zero = meta(masked_rows="zero", outputs="out,weights,lse")
        paged, _, m = self.paged_problem()
        cases = {"nk0": ({"q": ones(2, 2, 3, 4), "k": ones(2, 1, 0, 4), "v": ones(2, 1, 0, 2)}, zero, "ok"),
                 "b0": ({"q": ones(0, 2, 3, 4), "k": ones(0, 1, 5, 4), "v": ones(0, 1, 5, 2)}, zero, "ok"),
                 "nq0": ({"q": ones(2, 2, 0, 4), "k": ones(2, 1, 5, 4), "v": ones(2, 1, 5, 2)}, zero, "ok"),
                 "nk0_error": ({"q": ones(2, 2, 3, 4), "k": ones(2, 1, 0, 4), "v": ones(2, 1, 0, 2)}, meta(), "error"),
                 "paged": (paged, m, "ok")}
        root = os.path.join(self.dir, "set")
        os.makedirs(os.path.join(root, "cases"))
        entries = []
        for cid, (t, md, expect) in cases.items():
            path = os.path.join(root, "cases", cid + ".safetensors")
            if expect == "ok":
                subprocess.run([find_cli(), "eval", self.case(t, md), "-o", path, "-q"], check=True)
            else:
                st.save(path, t, md)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            entries.append({"id": cid, "file": f"cases/{cid}.safetensors", "sha256": digest, "expect": expect, "tags": []})
        with open(os.path.join(root, "manifest.json"), "w") as f:
            json.dump({"format": "attnoracle-vectors/1", "suite": "empty", "generator": "test", "seed": 0,
                       "cases": entries}, f)
        report = os.path.join(self.dir, "report.json")
        p = subprocess.run([cli, "run", root, "--profile", "fp64,fp32", "--impl", f"{sys.executable} {ADAPTER} --dtype float64",
                            "--json", report, "--html", os.path.join(self.dir, "report.html")],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(report) as f:
            r = json.load(f)
        self.assertEqual(r["passed"], 5, json.dumps(r)[:2000])

    def test_gqa_mapping(self):
        out = self.run_one(self.gqa_case())["out"]
        np.testing.assert_array_equal(out.ravel(), [1, 1, 2, 2])

    def test_mha(self):
        # H = 2, D = 2, Dk = Dv = 1, W_q = 0 so every score is 0 and A is the mean.
        x_kv = np.array([[[1.0, 2.0], [3.0, 4.0]]])                     # [B=1, Nk=2, D=2]
        t = {"x_q": np.ones((1, 1, 2)), "x_kv": x_kv,
             "w_q": np.zeros((2, 2, 1)), "w_k": np.ones((2, 2, 1)),
             "w_v": np.array([[[1.0], [0.0]], [[0.0], [1.0]]]),         # V_0 = x[:,0], V_1 = x[:,1]
             "w_o": np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])}      # [H*Dv=2, Dout=3]
        r = self.run_one(self.case(t, meta(kind="mha", outputs="out,weights")), "--dtype", "float64")
        # O_0 = mean(1, 3) = 2, O_1 = mean(2, 4) = 3; [2, 3] W_o = [2, 3, 5]
        np.testing.assert_array_equal(r["out"], [[[2.0, 3.0, 5.0]]])
        self.assertEqual(r["weights"].shape, (1, 2, 1, 2))

    # -- the protocol -------------------------------------------------------------------

    def test_bad_job_does_not_stop_the_others(self):
        good = self.gqa_case()
        missing = os.path.join(self.dir, "no_such_case.safetensors")
        odd = self.case({"q": np.ones((1, 1, 1, 1)), "k": np.ones((1, 1, 1, 1)), "v": np.ones((1, 1, 1, 1))},
                        meta(dropout="0.1"))
        r = self.run_adapter([missing, odd, good])
        self.assertEqual([x[0] for x in r], ["error", "unsupported", "ok"])
        self.assertIn("attn.dropout", r[1][1])

    # -- safetensors_np -----------------------------------------------------------------

    def test_bf16_bits(self):
        cases = [(1.0, 0x3F80), (-2.0, 0xC000), (1 + 2 ** -8, 0x3F80),         # tie -> even
                 (1 + 3 * 2 ** -8, 0x3F82), (1 + 2 ** -8 + 2 ** -20, 0x3F81),   # tie -> even; above
                 (float(np.finfo(F32).max), 0x7F80), (np.inf, 0x7F80), (-np.inf, 0xFF80),
                 (2.0 ** -133, 0x0001), (2.0 ** -134, 0x0000), (0.0, 0x0000)]
        for x, bits in cases:
            self.assertEqual(int(st.bf16_bits(F32(x))), bits, x)
        # float64 rounded once: 1 + 2^-8 + 2^-30 would round to the tie 1 + 2^-8 through float32
        self.assertEqual(int(st.bf16_bits(np.float64(1 + 2 ** -8 + 2 ** -30))), 0x3F81)
        self.assertEqual(int(st.bf16_bits(np.float64(-(1 + 2 ** -8 + 2 ** -30)))), 0xBF81)
        self.assertEqual(int(st.bf16_bits(np.float64(1e39))), 0x7F80)
        nan = st.bf16_bits(np.array([np.nan, -np.nan], F32))
        self.assertTrue(all((int(b) & 0x7F80) == 0x7F80 and (int(b) & 0x7F) != 0 for b in nan))

    def test_bf16_file_round_trip(self):
        x = np.array([1.0, -2.0, 1 + 2 ** -8, 3.140625, np.nan], F32)
        path = os.path.join(self.dir, "bf16.safetensors")
        st.save(path, {"x": x, "b": np.array([True, False]), "i": np.array([-1, 7], np.int64)},
                {"note": "hi"}, dtypes={"x": "BF16"})
        with open(path, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        self.assertEqual(n % 8, 0)
        header = json.loads(raw[8:8 + n])
        self.assertEqual([k for k in header if k != "__metadata__"], ["b", "i", "x"])   # sorted
        begin, end = header["x"]["data_offsets"]
        bits = np.frombuffer(raw[8 + n + begin:8 + n + end], "<u2")
        np.testing.assert_array_equal(bits[:4], [0x3F80, 0xC000, 0x3F80, 0x4049])
        tensors, metadata, dtypes = st.read(path)
        self.assertEqual(metadata, {"note": "hi"})
        self.assertEqual(dtypes, {"b": "BOOL", "i": "I64", "x": "BF16"})
        self.assertEqual(tensors["x"].dtype, F32)
        np.testing.assert_array_equal(tensors["x"][:4], [1.0, -2.0, 1.0, 3.140625])
        self.assertTrue(np.isnan(tensors["x"][4]))
        np.testing.assert_array_equal(tensors["b"], [True, False])
        np.testing.assert_array_equal(tensors["i"], [-1, 7])

    def test_bf16_scalar_round_trip(self):
        # a tensor of shape [] (a dbias of a bias []) in BF16
        path = os.path.join(self.dir, "bf16_scalar.safetensors")
        st.save(path, {"x": np.array(-1.5, F32)}, {}, dtypes={"x": "BF16"})
        x = st.load(path)[0]["x"]
        self.assertEqual((x.shape, x.dtype, float(x)), ((), F32, -1.5))

    def test_readme_snippet_reads_like_load(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
        scope = {}
        exec(snippet, scope)
        path = os.path.join(self.dir, "snippet.safetensors")
        st.save(path, {"x": np.array([1.5, -0.5, 3.140625], F32), "m": np.array([[True, False]]),
                       "d": np.arange(6.0).reshape(2, 3)}, {"attn.format": "1"}, dtypes={"x": "BF16"})
        got, got_meta = scope["load"](path)
        want, want_meta = st.load(path)
        self.assertEqual(got_meta, want_meta)
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            self.assertEqual(got[name].dtype, want[name].dtype)
            np.testing.assert_array_equal(got[name], want[name])

    def f8_case(self, dtype, data, extra=b"", extra_header=None, **md):
        # q [1,1,1,1], k and v [1,1,2,1] in FP8, written by hand (safetensors_np does not write F8).
        header = {"q": {"dtype": dtype, "shape": [1, 1, 1, 1], "data_offsets": [0, 1]},
                  "k": {"dtype": dtype, "shape": [1, 1, 2, 1], "data_offsets": [1, 3]},
                  "v": {"dtype": dtype, "shape": [1, 1, 2, 1], "data_offsets": [3, 5]},
                  "__metadata__": meta(**md)}
        header.update(extra_header or {})
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = os.path.join(self.dir, f"f8-{dtype}-{len(os.listdir(self.dir))}.safetensors")
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + bytes(data) + extra)
        return path

    def test_fp8_tables(self):
        e4, e5 = st.FP8_TABLES["F8_E4M3"], st.FP8_TABLES["F8_E5M2"]
        self.assertEqual(e4[0x7E], 448)
        self.assertEqual(e4[0xFE], -448)
        self.assertEqual(e4[0x01], 2.0 ** -9)
        self.assertEqual(e4[0x38], 1)
        self.assertTrue(np.isnan(e4[0x7F]) and np.isnan(e4[0xFF]))
        self.assertEqual(int(np.isnan(e4).sum()), 2)
        self.assertFalse(np.isinf(e4).any())
        self.assertEqual(e5[0x7B], 57344)
        self.assertEqual(e5[0x01], 2.0 ** -16)
        self.assertEqual(e5[0x7C], np.inf)
        self.assertEqual(int(np.isnan(e5).sum()), 6)
        # both formats agree with float16 where it holds them (E5M2 is float16's top byte)
        np.testing.assert_array_equal(
            e5, (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32))

    def test_fp8_inputs_with_descales(self):
        # q 1 (0x38), k (1, 0.5), v (448, 2^-9), scale 1; k_descale 2, v_descale 0.25: scores 2
        # and 1, out = (112 e^2 + 2^-11 e) / (e^2 + e)
        f4 = np.array([2.0], F32).tobytes() + np.array([0.25], F32).tobytes()
        extra_header = {"k_descale": {"dtype": "F32", "shape": [1, 1], "data_offsets": [5, 9]},
                        "v_descale": {"dtype": "F32", "shape": [1, 1], "data_offsets": [9, 13]}}
        path = self.f8_case("F8_E4M3", [0x38, 0x38, 0x30, 0x7E, 0x01], f4, extra_header,
                            scale="1", output_dtype="F32")
        plain = self.f8_case("F8_E4M3", [0x38, 0x38, 0x30, 0x7E, 0x01], scale="1", output_dtype="F32")
        e = np.exp(1.0)
        (kind, got, _), (kind2, got2, _) = self.run_adapter([path, plain])
        self.assertEqual((kind, kind2), ("ok", "ok"))
        out = got["out"]
        self.assertAlmostEqual(float(out[0, 0, 0, 0]), (112 * e * e + 2 ** -11 * e) / (e * e + e), places=4)
        out = got2["out"]
        self.assertAlmostEqual(float(out[0, 0, 0, 0]), (448 * e + 2 ** -9 * e ** 0.5) / (e + e ** 0.5), places=3)

    def test_fp8_needs_sdpa_and_an_output_dtype(self):
        path = self.f8_case("F8_E5M2", [0x3C] * 5)
        kind, text = self.run_adapter([path])[0]
        self.assertEqual(kind, "unsupported")
        self.assertIn("F8_E5M2", text)

    # -- planted bugs -------------------------------------------------------------------

    def test_each_bug_changes_a_case_built_for_it(self):
        v2 = np.array([1.0, 2.0]).reshape(1, 1, 2, 1)
        mask = np.array([[True, False]])
        exposing = {
            # causal, Nq = Nk = 2: row 0 sees only key 0
            "causal_leak": ({"q": np.zeros((1, 1, 2, 1)), "k": np.zeros((1, 1, 2, 1)), "v": v2},
                            meta(causal="top_left")),
            # scores of 100: exp overflows float32 unless the maximum is subtracted
            "no_max_subtraction": ({"q": np.ones((1, 1, 1, 1)), "k": np.ones((1, 1, 2, 1)), "v": v2},
                                   meta(scale="100")),
            "unnormalised": ({"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 2, 1)), "v": v2}, meta()),
            "mask_ignored": ({"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 2, 1)), "v": v2,
                              "mask": mask}, meta()),
            "shift_one_key": ({"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 2, 1)), "v": v2}, meta()),
            # the masked key's value is large enough for exp(-20) of it to show in float32
            "padding_key_leak": ({"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 2, 1)),
                                  "v": np.array([1.0, 1e7]).reshape(1, 1, 2, 1), "mask": mask}, meta()),
        }
        gqa = self.gqa_case()
        from attention import BUGS
        for bug in BUGS:
            with self.subTest(bug=bug):
                if bug in exposing:
                    tensors, m = exposing[bug]
                    c = self.case({n: (a.astype(F32) if a.dtype == F64 else a) for n, a in tensors.items()}, m)
                elif bug in ("heads_swapped", "transposed_gqa", "gqa_tiled"):
                    c = gqa
                elif bug.startswith("bwd_"):         # gradients: GradientTest, against eval
                    self.assertIn(bug, BWD_BUGS)
                    continue
                elif bug in ("merge_nan_empty", "split_with_sink"):   # split-KV: SplitKvTest, at the gate
                    self.assertTrue(hasattr(SplitKvTest, "test_bug_" + bug), f"--bug {bug} has no test")
                    continue
                elif bug.startswith("mha_bwd_"):     # gradients of kind mha: MhaGradientTest
                    self.assertTrue(hasattr(MhaGradientTest, "test_bug_" + bug), f"--bug {bug} has no test")
                    continue
                else:                                # a test of its own below: test_bug_<name>
                    self.assertTrue(hasattr(self, "test_bug_" + bug), f"--bug {bug} has no test")
                    continue
                right = self.run_one(c)["out"]
                wrong = self.run_adapter([c], "--bug", bug)[0]
                self.assertEqual(wrong[0], "ok")
                self.assertFalse(np.array_equal(right, wrong[1]["out"]), f"--bug {bug} changed nothing")

    def test_correct_results_of_the_bug_cases(self):
        # The right answers the bugs depart from, worked by hand.
        gqa = self.gqa_case()
        self.assertEqual(list(self.run_adapter([gqa], "--bug", "transposed_gqa")[0][1]["out"].ravel()),
                         [1, 2, 1, 2])
        self.assertEqual(list(self.run_adapter([gqa], "--bug", "heads_swapped")[0][1]["out"].ravel()),
                         [1, 2, 2, 1])

    # One test per bug below: a case built to expose it, the right and the wrong results.

    def both(self, tensors, metadata, bug, flags=("--dtype", "float64"), dtypes=None):
        """Runs a case right and with --bug; returns (right, wrong) result tensors."""
        c = self.case(tensors, metadata, dtypes)
        return self.run_one(c, *flags), self.run_one(c, *flags, "--bug", bug)

    def scale_case(self, **keys):
        # Dk = 4: T = 4 * scale for key 0 and 0 for key 1; v = [1, 0] gives key 0's weight.
        t = {"q": np.ones((1, 1, 1, 4)), "k": np.array([[[[1.0] * 4, [0.0] * 4]]]),
             "v": np.array([[[[1.0], [0.0]]]])}
        return t, meta(**keys)

    def test_bug_no_scaling(self):
        right, wrong = self.both(*self.scale_case(), "no_scaling")
        self.assertAlmostEqual(right["out"].item(), 1 / (1 + math.exp(-2)), places=14)   # scale 1/2
        self.assertAlmostEqual(wrong["out"].item(), 1 / (1 + math.exp(-4)), places=14)   # scale 1
        right, wrong = self.both(*self.scale_case(scale="0.125"), "no_scaling")         # given: ignored too
        self.assertAlmostEqual(right["out"].item(), 1 / (1 + math.exp(-0.5)), places=14)
        self.assertAlmostEqual(wrong["out"].item(), 1 / (1 + math.exp(-4)), places=14)

    def test_bug_scale_by_dk(self):
        right, wrong = self.both(*self.scale_case(), "scale_by_dk")
        self.assertAlmostEqual(right["out"].item(), 1 / (1 + math.exp(-2)), places=14)   # 1/sqrt(4)
        self.assertAlmostEqual(wrong["out"].item(), 1 / (1 + math.exp(-1)), places=14)   # 1/4
        right, wrong = self.both(*self.scale_case(scale="0.125"), "scale_by_dk")         # a given scale is kept
        np.testing.assert_array_equal(right["out"], wrong["out"])

    def test_bug_no_max_subtraction_f16(self):
        # Scores 12 and 0 (scale 1): exp(12) = 162755 > 65504, the float16 maximum: inf / inf = NaN.
        t = {"q": np.ones((1, 1, 1, 1), np.float16), "k": np.array([12.0, 0.0], np.float16).reshape(1, 1, 2, 1),
             "v": np.array([1.0, 2.0], np.float16).reshape(1, 1, 2, 1)}
        right, wrong = self.both(t, meta(scale="1"), "no_max_subtraction_f16", flags=())
        self.assertEqual(right["out"].item(), 1.0)              # (e^12 + 2) / (e^12 + 1) in F16
        self.assertTrue(np.isnan(wrong["out"].item()))
        t32 = {n: a.astype(F32) for n, a in t.items()}         # F32 inputs: not this bug's kernel
        right, wrong = self.both(t32, meta(scale="1"), "no_max_subtraction_f16", flags=())
        np.testing.assert_array_equal(right["out"], wrong["out"])

    def test_bug_mask_after_softmax(self):
        # Equal scores over 3 keys, key 2 masked: weights 1/2, 1/2, 0; the bug leaves 1/3, 1/3, 0.
        t = {"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 3, 1)), "v": np.array([1.0, 2.0, 4.0]).reshape(1, 1, 3, 1),
             "mask": np.array([[True, True, False]])}
        right, wrong = self.both(t, meta(outputs="out,weights"), "mask_after_softmax")
        np.testing.assert_array_equal(right["weights"].ravel(), [0.5, 0.5, 0])
        np.testing.assert_allclose(wrong["weights"].ravel(), [1 / 3, 1 / 3, 0], rtol=1e-15)
        self.assertEqual(right["out"].item(), 1.5)
        self.assertAlmostEqual(wrong["out"].item(), 1.0, places=15)

    def test_bug_causal_off_by_one(self):
        right = self.weights(3, 3, causal="top_left", masked_rows="zero")
        wrong = self.weights(3, 3, ("--dtype", "float64", "--bug", "causal_off_by_one"),
                             causal="top_left", masked_rows="zero")
        np.testing.assert_allclose(right, [[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-15)
        np.testing.assert_array_equal(wrong, [[0, 0, 0], [1, 0, 0], [0.5, 0.5, 0]])   # row 0 fully masked
        # Under policy error the row left with no key is refused.
        t = {"q": np.zeros((1, 1, 3, 2)), "k": np.zeros((1, 1, 3, 2)), "v": np.zeros((1, 1, 3, 1))}
        kind, text = self.run_adapter([self.case(t, meta(causal="top_left"))], "--bug", "causal_off_by_one")[0]
        self.assertEqual(kind, "error")
        self.assertIn("i=0", text)

    def test_bug_other_alignment(self):
        flags = ("--dtype", "float64", "--bug", "other_alignment")
        np.testing.assert_allclose(self.weights(2, 3, flags, causal="top_left"),
                                   [[0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-15)   # bottom_right's
        np.testing.assert_array_equal(self.weights(2, 3, flags, causal="bottom_right"),
                                      [[1, 0, 0], [0.5, 0.5, 0]])                         # top_left's
        np.testing.assert_allclose(self.weights(3, 3, flags, causal="top_left"),          # Nq = Nk: the same
                                   self.weights(3, 3, causal="top_left"), rtol=0)

    def test_bug_gqa_tiled(self):
        # The same mapping as transposed_gqa, through np.tile (torch .repeat) of K and V.
        out = self.run_adapter([self.gqa_case()], "--bug", "gqa_tiled")[0][1]["out"]
        np.testing.assert_array_equal(out.ravel(), [1, 2, 1, 2])           # right: [1, 1, 2, 2]

    def test_bug_softcap_after_bias(self):
        # Dk = 1, scale 1, softcap 1, bias [1, 0]: scores tanh(2) + 1 and 0; the bug: tanh(3) and 0.
        t = {"q": np.array([[[[2.0]]]]), "k": np.array([[[[1.0], [0.0]]]]), "v": np.array([[[[1.0], [0.0]]]]),
             "bias": np.array([1.0, 0.0])}
        right, wrong = self.both(t, meta(scale="1", softcap="1"), "softcap_after_bias")
        self.assertAlmostEqual(right["out"].item(), 1 / (1 + math.exp(-(math.tanh(2) + 1))), places=14)
        self.assertAlmostEqual(wrong["out"].item(), 1 / (1 + math.exp(-math.tanh(3))), places=14)

    def test_bug_pv_f16_accumulation(self):
        # 4096 equal keys, v = 1: each term is 2^-12; a float16 sum reaches 0.5 exactly, then
        # 0.5 + 2^-12 is a tie that rounds back to 0.5 (even): it stalls there. Right: 1.
        n = 4096
        t = {"q": np.zeros((1, 1, 1, 1), np.float16), "k": np.zeros((1, 1, n, 1), np.float16),
             "v": np.ones((1, 1, n, 1), np.float16)}
        right, wrong = self.both(t, meta(), "pv_f16_accumulation", flags=())
        self.assertEqual(right["out"].item(), 1.0)
        self.assertEqual(wrong["out"].item(), 0.5)
        t32 = {n: a.astype(F32) for n, a in t.items()}         # F32 inputs: not this bug's kernel
        right, wrong = self.both(t32, meta(), "pv_f16_accumulation", flags=())
        np.testing.assert_array_equal(right["out"], wrong["out"])

    def test_bug_truncate_output(self):
        # One key: out = v exactly (F64 inputs). Each value is 3/4 of an output ulp past a
        # representable one, normal or subnormal: nearest rounds away from zero, truncation toward it.
        for out_dtype, bits, tiny in (("F16", 11, 2.0 ** -24), ("BF16", 8, 2.0 ** -133), ("F32", 24, 2.0 ** -149)):
            with self.subTest(out_dtype=out_dtype):
                x = 1 + 3 * 2.0 ** -(bits + 1)
                t = {"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 1, 1)),
                     "v": np.array([x, -x, 2 * x, 1.75 * tiny]).reshape(1, 1, 1, 4)}
                right, wrong = self.both(t, meta(output_dtype=out_dtype), "truncate_output")
                up = 1 + 2.0 ** (1 - bits)
                np.testing.assert_array_equal(right["out"].ravel(), [up, -up, 2 * up, 2 * tiny])
                np.testing.assert_array_equal(wrong["out"].ravel(), [1, -1, 2, tiny])

    def test_bug_nan_from_masked(self):
        # Row 0 has a masked key: NaN; row 1 has none: as usual.
        t = {"q": np.zeros((1, 1, 2, 1)), "k": np.zeros((1, 1, 2, 1)), "v": np.array([1.0, 2.0]).reshape(1, 1, 2, 1),
             "mask": np.array([[True, False], [True, True]])}
        right, wrong = self.both(t, meta(), "nan_from_masked")
        np.testing.assert_array_equal(right["out"].ravel(), [1.0, 1.5])
        self.assertTrue(np.isnan(wrong["out"].ravel()[0]))
        self.assertEqual(wrong["out"].ravel()[1], 1.5)

    def test_bug_masked_row_nan(self):
        c = self.fully_masked_case("zero")
        right, wrong = self.run_one(c), self.run_one(c, "--bug", "masked_row_nan")
        self.assertTrue(np.all(right["out"][0, 1, 2] == 0) and np.all(right["weights"][0, 1, 2] == 0))
        self.assertTrue(np.all(np.isnan(wrong["out"][0, 1, 2])) and np.all(np.isnan(wrong["weights"][0, 1, 2])))
        np.testing.assert_array_equal(right["out"][0, 0], wrong["out"][0, 0])           # other rows as usual
        kind, _ = self.run_adapter([self.fully_masked_case("error")], "--bug", "masked_row_nan")[0]
        self.assertEqual(kind, "error")                                                 # still refused

    def test_bug_drop_last_key(self):
        t = {"q": np.zeros((1, 1, 1, 1)), "k": np.zeros((1, 1, 3, 1)), "v": np.array([1.0, 2.0, 4.0]).reshape(1, 1, 3, 1)}
        right, wrong = self.both(t, meta(), "drop_last_key")
        self.assertAlmostEqual(right["out"].item(), 7 / 3, places=14)
        self.assertEqual(wrong["out"].item(), 1.5)
        t["mask"] = np.array([False, False, True])             # only the last key: now a fully masked row
        kind, _ = self.run_adapter([self.case(t, meta())], "--bug", "drop_last_key")[0]
        self.assertEqual(kind, "error")

    # -- the meta_ bugs (caught by the parameter relations of `attnoracle invariants`) -------

    def test_bug_meta_head_bias_ignored(self):
        # Two heads, equal scores over keys 0 and 1, bias [1, 0]: head 1 weighs key 0 by
        # e / (1 + e); head 0, its bias ignored, by 1/2. A -inf bias still masks head 0's key 1.
        t = {"q": np.zeros((1, 2, 1, 1)), "k": np.zeros((1, 2, 2, 1)), "v": np.array([[[[1.0], [0.0]]] * 2]),
             "bias": np.array([[1.0, 0.0]])}
        right, wrong = self.both(t, meta(), "meta_head_bias_ignored")
        e = math.e / (1 + math.e)
        self.assertAlmostEqual(right["out"][0, 0].item(), e, places=14)
        self.assertEqual(wrong["out"][0, 0].item(), 0.5)
        self.assertAlmostEqual(wrong["out"][0, 1].item(), e, places=14)
        t["bias"] = np.array([[0.0, -np.inf]])
        right, wrong = self.both(t, meta(), "meta_head_bias_ignored")
        np.testing.assert_array_equal(right["out"], wrong["out"])

    def test_bug_meta_window_off_by_one(self):
        # Window 1,0 over 3 keys with equal scores: query 2 sees keys 1 and 2, the bug key 2 alone.
        t = {"q": np.zeros((1, 1, 3, 1)), "k": np.zeros((1, 1, 3, 1)), "v": np.array([1.0, 2.0, 4.0]).reshape(1, 1, 3, 1)}
        right, wrong = self.both(t, meta(window="1,0"), "meta_window_off_by_one")
        self.assertEqual(right["out"][0, 0, 2].item(), 3.0)
        self.assertEqual(wrong["out"][0, 0, 2].item(), 4.0)

    def test_bug_meta_softcap_ignored(self):
        # Scores 4 and 0 (scale 1), softcap 1: tanh(4) instead of 4 for key 0.
        t = {"q": np.ones((1, 1, 1, 1)), "k": np.array([4.0, 0.0]).reshape(1, 1, 2, 1),
             "v": np.array([1.0, 0.0]).reshape(1, 1, 2, 1)}
        right, wrong = self.both(t, meta(scale="1", softcap="1"), "meta_softcap_ignored")
        self.assertAlmostEqual(right["out"].item(), 1 / (1 + math.exp(-math.tanh(4))), places=14)
        self.assertAlmostEqual(wrong["out"].item(), 1 / (1 + math.exp(-4)), places=14)

    # -- against the reference ----------------------------------------------------------

    def test_float64_matches_the_reference(self):
        cli = find_cli()
        if cli is None:
            reason = "no attnoracle binary (set ATTNORACLE_CLI or build into build/)"
            print(f"\nskipped: {reason}", file=sys.stderr)
            self.skipTest(reason)
        rng = np.random.default_rng(7)
        mask = rng.random((1, 1, 5, 7)) < 0.8
        mask[..., 0] = True                                # no fully masked row
        sdpa = ({"q": rng.normal(size=(2, 4, 5, 8)), "k": rng.normal(size=(2, 2, 7, 8)),
                 "v": rng.normal(size=(2, 2, 7, 3)), "mask": mask, "bias": rng.normal(size=(5, 7))},
                meta(causal="bottom_right", softcap="2.5", outputs="out,weights,lse"))
        mha = ({"x_q": rng.normal(size=(1, 4, 6)), "x_kv": rng.normal(size=(1, 6, 6)),
                "w_q": rng.normal(size=(3, 6, 4)), "w_k": rng.normal(size=(3, 6, 4)),
                "w_v": rng.normal(size=(3, 6, 2)), "w_o": rng.normal(size=(6, 5))},
               meta(kind="mha", window="2,1", scale="0x1.6a09e667f3bcdp-2", outputs="out,weights,lse"))
        for tensors, m in (sdpa, mha):
            c = self.case(tensors, m)
            golden = c + ".golden.safetensors"
            subprocess.run([cli, "eval", c, "-o", golden, "-q"], check=True)
            ref = st.load(golden)[0]
            got = self.run_one(c, "--dtype", "float64")
            # |error| <= 1e-12 * out.bound (the sum of |terms|, >= |out|): relative, cancellation-proof
            self.assertLessEqual(np.max(np.abs(got["out"] - ref["out.ref"]) / ref["out.bound"]), 1e-12)
            np.testing.assert_allclose(got["weights"], ref["weights.ref"], rtol=1e-12, atol=0)
            np.testing.assert_allclose(got["lse"], ref["lse.ref"], rtol=1e-12, atol=0)


# -- gradients (CONTRACT section 7) against `attnoracle eval` ------------------------------

import grad_cases as gc  # noqa: E402

# The backward is float64 rounded once into the output dtype: the rounding costs at most
# u |G.ref| (u the output dtype's unit roundoff; TINY near 0), and the float64 path at most
# about n float64 roundings of the terms G adds up, n = Nq + Nk + Dk + Dv, i.e. c n 2^-53 G.bound
# (c = 4 for the exp, the division and D_i).
def numpy_limit(case):
    u, tiny = gc.UNIT[case.out_dtype], gc.TINY[case.out_dtype]
    return lambda ref, bound: u * np.abs(ref) + tiny + 4 * case.n * 2.0 ** -53 * bound


# bug -> the case it shows on (grad_cases.specs)
BWD_BUGS = {"bwd_dbias_not_reduced": "mask_bias_bottom_right", "bwd_padding_rows": "query_mask_padding",
            "bwd_gqa_sum_tiled": "gqa_softcap_bias", "bwd_dsinks_sign": "sinks_gqa",
            "bwd_sinks_ignored": "sinks_gqa"}


@unittest.skipUnless(find_cli(), "no attnoracle binary (set ATTNORACLE_CLI or build into build/)")
class GradientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_np_grad_")
        cls.cases = gc.build(cls.dir, find_cli())
        cls.got = {flag: gc.run_adapter([sys.executable, ADAPTER, "--dtype", flag], cls.cases.values(),
                                        cls.dir, flag) for flag in ("float32", "float64")}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_gradients_within_the_limit(self):
        for flag, got in self.got.items():
            for name, case in self.cases.items():
                with self.subTest(flag=flag, case=name):
                    self.assertIsInstance(got[name], dict, got[name])
                    for g in case.grads:
                        ref = case.golden[g]
                        self.assertEqual(got[name][g].shape, ref.shape, g)
                        self.assertEqual(got[name][g].dtype, ref.dtype, g)
                    ratios = gc.ratios(got[name], case, numpy_limit(case))
                    self.assertLessEqual(max(ratios.values()), 1, ratios)

    def test_gradient_zeros(self):
        got = self.got["float32"]
        # padding rows (past seqlens_q) and keys past seqlens_k: exactly 0, NaN inputs there
        c, r = self.cases["seqlens_unused_nan"], got["seqlens_unused_nan"]
        lq, lk = c.golden["seqlens_q"], c.golden["seqlens_k"]
        for b in range(2):
            np.testing.assert_array_equal(r["dq"][b, :, lq[b]:], 0)
            np.testing.assert_array_equal(r["dk"][b, :, lk[b]:], 0)
            np.testing.assert_array_equal(r["dv"][b, :, lk[b]:], 0)
        for name in self.cases:
            for g in self.cases[name].grads:
                self.assertTrue(np.isfinite(got[name][g]).all(), (name, g))
        # fully masked rows under policy zero (window, mask) and query_mask padding rows
        np.testing.assert_array_equal(got["top_left_window_masked_rows"]["dq"][:, :, 4:], 0)
        np.testing.assert_array_equal(got["query_mask_padding"]["dq"][:, :, 1:4], 0)
        np.testing.assert_array_equal(self.cases["query_mask_padding"].golden["dq"][:, :, 1:4], 0)
        # a bias broadcast along the keys (or of shape []): each row of dS sums to 0
        np.testing.assert_array_equal(got["bias_along_keys"]["dbias"], 0)
        self.assertEqual(got["scalar_bias_bf16"]["dbias"].shape, ())
        np.testing.assert_array_equal(got["scalar_bias_bf16"]["dbias"], 0)
        np.testing.assert_array_equal(self.cases["bias_along_keys"].golden["dbias"], 0)

    def test_each_backward_bug_is_beyond_the_limit(self):
        from attention import BUGS
        self.assertEqual(set(BWD_BUGS), {b for b in BUGS if b.startswith("bwd_")})
        for bug, name in BWD_BUGS.items():
            with self.subTest(bug=bug):
                case = self.cases[name]
                got = gc.run_adapter([sys.executable, ADAPTER, "--bug", bug], [case], self.dir, bug)[name]
                ratios = gc.ratios(got, case, numpy_limit(case))
                self.assertGreater(max(ratios.values()), 1, ratios)

    def test_gradients_unsupported(self):
        rng = np.random.default_rng(3)
        t = {"q": rng.normal(size=(1, 2, 3, 4)), "k": rng.normal(size=(1, 2, 3, 4)),
             "v": rng.normal(size=(1, 2, 3, 4)), "dout": rng.normal(size=(1, 2, 3, 4))}
        cases = [(t, meta(outputs="out,dk", output_dtype="F32"), {x: "F8_E4M3" for x in t if x != "dout"},
                  "F8_E4M3")]
        for i, (tensors, m, dtypes, why) in enumerate(cases):
            path = os.path.join(self.dir, f"unsupported{i}.safetensors")
            if dtypes:                      # FP8 bytes: the nearest E4M3 of small normals
                tensors = {x: a.astype(np.float32) for x, a in tensors.items()}
                raw = {x: a for x, a in tensors.items() if x not in dtypes}
                st.save(path, raw, m, {"dout": "F32"})
                path = self.fp8_copy(path, tensors, dtypes)
            else:
                st.save(path, tensors, m)
            out = os.path.join(self.dir, f"unsupported{i}.out")
            jobs = os.path.join(self.dir, f"unsupported{i}.jsonl")
            with open(jobs, "w") as f:
                f.write(json.dumps({"id": "u", "input": path, "output": out}) + "\n")
            subprocess.run([sys.executable, ADAPTER, jobs], check=True)
            with open(out + ".unsupported", encoding="utf-8") as f:
                self.assertIn(why, f.read())

    def fp8_copy(self, path, tensors, dtypes):
        """A copy of the case with the tensors in `dtypes` stored as F8_E4M3, every element 0x38
        (1.0), the others as F32."""
        header, blobs, offset = {"__metadata__": st.read(path)[1]}, [], 0
        for name in sorted(tensors):
            a = tensors[name]
            if name in dtypes:
                data = np.full(a.shape, 0x38, np.uint8).tobytes()
                dt = "F8_E4M3"
            else:
                data = a.astype("<f4").tobytes()
                dt = "F32"
            header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        fp8 = path + ".fp8.safetensors"
        with open(fp8, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))
        return fp8


# -- gradients of kind mha, against finite differences of the forward ---------------------

import mha_grad_cases as mc  # noqa: E402


class MhaGradientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_np_mha_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def run_case(self, name, *flags):
        path, tensors, m = mc.write(self.dir, name)
        out = os.path.join(self.dir, f"{name}{'_'.join(flags)}.out.safetensors")
        jobs = os.path.join(self.dir, f"{name}.jsonl")
        with open(jobs, "w") as f:
            f.write(json.dumps({"id": name, "input": path, "output": out}) + "\n")
        subprocess.run([sys.executable, ADAPTER, "--dtype", "float64", *flags, jobs], check=True)
        self.assertTrue(os.path.exists(out), [f for f in os.listdir(self.dir) if f.startswith(name)])
        return st.read(out)[0], tensors, m

    def test_gradients_match_finite_differences(self):
        for name in mc.specs():
            got, tensors, m = self.run_case(name)
            for g in m["attn.outputs"].split(",")[1:]:
                with self.subTest(case=name, gradient=g):
                    fd = mc.finite_difference(tensors, m, g)
                    self.assertEqual(got[g].shape, fd.shape)
                    # central differences with h = 1e-6 on O(1) values: error about 1e-9
                    np.testing.assert_allclose(got[g], fd, rtol=0, atol=1e-7 * max(1, np.abs(fd).max()))

    def test_padding_rows_and_self_attention(self):
        got, tensors, _ = self.run_case("self_query_mask_softcap")
        self.assertNotIn("dx_kv", got)
        # padding rows 1 and 4 (dout 1e6 on row 1) are still keys: dx_q there is the key part only
        self.assertLess(np.abs(got["dx_q"]).max(), 100)
        self.assertTrue(np.any(got["dx_q"][0, 1] != 0))
        got, _, _ = self.run_case("cross_masked_row_zero")
        self.assertTrue(np.all(np.isfinite(got["dx_q"])))

    def test_bug_mha_bwd_dwo_transposed(self):
        right, _, _ = self.run_case("cross_bias_causal")
        wrong, _, _ = self.run_case("cross_bias_causal", "--bug", "mha_bwd_dwo_transposed")
        self.assertEqual(wrong["dw_o"].shape, right["dw_o"].shape)
        self.assertGreater(np.abs(wrong["dw_o"] - right["dw_o"]).max(), 0.1)
        np.testing.assert_array_equal(wrong["dx_kv"], right["dx_kv"])

    def test_bug_mha_bwd_dxkv_no_dv(self):
        for name, g in (("cross_bias_causal", "dx_kv"), ("self_sinks", "dx_q")):
            right, _, _ = self.run_case(name)
            wrong, _, _ = self.run_case(name, "--bug", "mha_bwd_dxkv_no_dv")
            self.assertGreater(np.abs(wrong[g] - right[g]).max(), 0.1, name)
            np.testing.assert_array_equal(wrong["dw_o"], right["dw_o"])

    def test_sdpa_gradient_names_refused_in_mha(self):
        path, _, m = mc.write(self.dir, "cross_bias_causal")
        tensors, meta_, _ = st.read(path)
        meta_["attn.outputs"] = "out,dq"
        path = os.path.join(self.dir, "mha_dq.safetensors")
        st.save(path, tensors, meta_)
        out = os.path.join(self.dir, "mha_dq.out")
        jobs = os.path.join(self.dir, "mha_dq.jsonl")
        with open(jobs, "w") as f:
            f.write(json.dumps({"id": "d", "input": path, "output": out}) + "\n")
        subprocess.run([sys.executable, ADAPTER, jobs], check=True)
        with open(out + ".error", encoding="utf-8") as f:
            self.assertIn("dq is not a gradient of kind mha", f.read())



# -- split-KV partial states and kind merge (CONTRACT section 8) ----------------------------

import splitkv_cases  # noqa: E402


class SplitKvTest(unittest.TestCase):
    setUp, tearDown, case = AdapterTest.setUp, AdapterTest.tearDown, AdapterTest.case
    run_adapter, run_one = AdapterTest.run_adapter, AdapterTest.run_one

    def test_partials_of_two_equal_keys(self):
        t = {"q": np.ones((1, 1, 1, 1)), "k": np.zeros((1, 1, 3, 1)), "v": np.array([2.0, 4.0, 8.0]).reshape(1, 1, 3, 1)}
        got = self.run_one(self.case(t, meta(kv_split_size=2, outputs="out,out_partial,lse_partial")), "--dtype", "float64")
        np.testing.assert_array_equal(got["out_partial"].ravel(), [3, 8])
        np.testing.assert_allclose(got["lse_partial"].ravel(), [math.log(2), 0], rtol=1e-15)
        self.assertEqual(got["out_partial"].shape, (2, 1, 1, 1, 1))

    def test_merge_skips_minus_inf_splits_and_adds_the_sink(self):
        o = np.array([np.nan, 1.0, 2.0]).reshape(3, 1, 1, 1, 1)
        lse = np.array([-np.inf, 0.0, 0.0]).reshape(3, 1, 1, 1)
        m = meta(kind="merge", outputs="out,lse")
        got = self.run_one(self.case({"o_partial": o, "lse_partial": lse, "sinks": np.zeros(1)}, m, {"o_partial": "F32"}),
                           "--dtype", "float64")
        np.testing.assert_allclose(got["out"].ravel(), [1.0], rtol=1e-6)       # (1 + 2 + 0) / 3
        np.testing.assert_allclose(got["lse"].ravel(), [math.log(3)], rtol=1e-6)
        kind, text = self.run_adapter([self.case({"o_partial": o, "lse_partial": np.full_like(lse, -np.inf)}, m,
                                                 {"o_partial": "F32"})])[0]
        self.assertEqual(kind, "error")
        self.assertIn("fully masked row", text)

    def gate(self, profile, *flags):
        if not find_cli():
            self.skipTest("the attnoracle binary was not found")
        suite = os.path.join(self.dir, "suite")
        if not os.path.exists(suite):
            splitkv_cases.write(find_cli(), suite)
        return splitkv_cases.run(find_cli(), suite, [sys.executable, ADAPTER, *flags], profile)

    def test_gate_passes_the_adapter(self):
        status, report = self.gate("fp32")
        self.assertEqual((status, report["passed"]), (0, 3), report["cases"])   # the BF16 merge skipped
        status, report = self.gate("bf16")
        self.assertEqual((status, report["passed"]), (0, 1), report["cases"])

    def failing(self, bug):
        status, report = self.gate("fp32", "--bug", bug)
        self.assertEqual(status, 1, bug)
        return [c["id"] for c in report["cases"] if c["status"] == "fail"]

    def test_bug_merge_nan_empty(self):
        self.assertEqual(self.failing("merge_nan_empty"), ["merge_f32_sinks"])

    def test_bug_split_with_sink(self):
        self.assertEqual(self.failing("split_with_sink"), ["partials_causal_sinks"])


if __name__ == "__main__":
    unittest.main()


import stored_kv_np  # noqa: E402


class StoredKvTest(unittest.TestCase):
    """Stored K/V read into real values and FP8 outputs written, on values worked by hand."""

    def test_fp8_bits_round_to_nearest_even_saturate_and_overflow(self):
        # E4M3 between 1 (0x38) and 1.125 (0x39): 1.0625 is a tie, to the even 0x38; past 448 saturates
        self.assertEqual(list(st.fp8_bits([1.0625, 1.07, 449, 1e9, -2.0], "F8_E4M3")), [0x38, 0x39, 0x7E, 0x7E, 0xC0])
        # E5M2: 57344 is 0x7B; 61440 (halfway to 2^16) and past go to infinity (0x7C)
        self.assertEqual(list(st.fp8_bits([57344, 61439, 61440, -1e6], "F8_E5M2")), [0x7B, 0x7B, 0x7C, 0xFC])

    def test_block_scaled_elements(self):
        # nvfp4: byte 0x21 holds 0.5 (low nibble 1) then 1 (high nibble 2), block scale 2, global 0.5
        t = {"k": np.full((1, 1, 1, 8), 0x21, np.uint8), "v": np.full((1, 1, 1, 8), 0x9A, np.uint8),
             "k_block_scale": np.full((1, 1, 1, 1), 2, np.float32), "v_block_scale": np.full((1, 1, 1, 1), 2, np.float32),
             "k_global_scale": np.float32(0.5), "v_global_scale": np.float32(0.5)}
        d = {n: "U8" for n in t}
        stored_kv_np.real_kv(t, d, {"attn.kv_block_scale": "nvfp4"}, np.float32)
        np.testing.assert_array_equal(t["k"][0, 0, 0, :2], [0.5, 1.0])
        np.testing.assert_array_equal(t["v"][0, 0, 0, :2], [-1.0, -0.5])   # 0xA: -1, 0x9: -0.5 (sign bit 8)
        self.assertNotIn("k_block_scale", t)
        swapped = {"k": np.full((1, 1, 1, 16), 0x21, np.uint8)}
        np.testing.assert_array_equal(stored_kv_np.nvfp4_elements(swapped["k"], "nvfp4_nibbles_swapped")[0, 0, 0, :2],
                                      [1.0, 0.5])
        # mxfp8: E8M0 128 is 2^1; v as k's view (attn.v_from_k)
        t = {"k": np.full((1, 1, 1, 32), 1.5, np.float32), "k_block_scale": np.full((1, 1, 1, 1), 128, np.uint8)}
        d = {"k": "F8_E4M3", "k_block_scale": "U8"}
        stored_kv_np.real_kv(t, d, {"attn.kv_block_scale": "mxfp8", "attn.v_from_k": "16"}, np.float32)
        self.assertEqual(float(t["k"][0, 0, 0, 0]), 3.0)
        self.assertEqual(t["v"].shape, (1, 1, 1, 16))

    def test_float_k_with_v_as_its_view(self):
        # latent attention without scales: a BF16 k read as it is, v its first 2 columns
        k = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
        t, d = {"k": k.copy()}, {"k": "BF16"}
        stored_kv_np.real_kv(t, d, {"attn.v_from_k": "2"}, np.float32)
        np.testing.assert_array_equal(t["k"], k)
        np.testing.assert_array_equal(t["v"], k[..., :2])
        self.assertEqual(d["v"], "BF16")

    def test_scales_per_head_and_token(self):
        k = np.ones((1, 2, 3, 2), np.float32)
        head = np.array([2.0, 3.0], np.float32).reshape(1, 2, 1, 1)
        t = {"k": k.copy(), "v": k.copy(), "k_scale": head, "v_scale": np.float32(0.5)}
        stored_kv_np.real_kv(t, {"k": "I8", "v": "I8"}, {}, np.float32)
        np.testing.assert_array_equal(t["k"][0, :, 0, 0], [2, 3])
        np.testing.assert_array_equal(t["v"], np.full_like(k, 0.5))
        t = {"k": k.copy(), "v": k.copy(), "k_scale": head, "v_scale": np.float32(0.5)}
        stored_kv_np.real_kv(t, {"k": "I8", "v": "I8"}, {}, np.float32, "kv_scale_head0")
        np.testing.assert_array_equal(t["k"][0, :, 0, 0], [2, 2])
        token = np.arange(1, 4, dtype=np.float32).reshape(1, 1, 3, 1)
        t = {"k": k.copy(), "v": k.copy(), "k_scale": token, "v_scale": token}
        stored_kv_np.real_kv(t, {"k": "I8", "v": "I8"}, {}, np.float32, "kv_scale_wrong_token")
        np.testing.assert_array_equal(t["k"][0, 0, :, 0], [2, 3, 1])
