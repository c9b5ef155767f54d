#!/usr/bin/env python3
"""Mutation score of the conformance gate: it must fail every seeded bug and no correct implementation.

    /usr/bin/python3 conformance/tests/mutation_test.py --cli build/attnoracle \\
        --suite vectors/core --source . [--mutant NAME ...] [-v]

Runs `attnoracle run SUITE --impl CMD --profile P` (CONTRACT section 5) on:
- the correct implementations, on every case of each profile's dtype: the NumPy adapter under
  fp32, fp16, bf16 and fp64 (the last with `--dtype float64`); the flash kernel
  (adapters/flash_numpy) at blocks 16, 64 and 128 under fp32, flash-fp16, flash-bf16 (with
  `--arith fp32|fp16|bf16`) and fp64; ONNX Runtime (when conformance/adapters/onnxruntime/
  node_modules is installed) under fp32 and conformance/profiles/onnxruntime-fp16.json,
  declaring `--returns weights`. Every failed case of these is a false failure.
- each seeded bug (MUTANTS: the NumPy adapter's and the flash kernel's `--bug NAME`) with the
  same adapter flags as the correct run of each profile, so a profile cannot hide a false failure,
  on the cases whose tags say the bug can show there (`--case`, from the manifest). A mutant is
  caught when the gate fails a case under every profile it is expected under; it also runs under
  the profiles where it is not expected (its error is below 4 times that of the declared
  arithmetic, or the bug changes nothing there: the reason is printed) or where it needs rows
  longer than the suite has, and a catch there is reported. A failure that is the adapter's own
  crash (a Python exception written as `.error`) does not count: that would be a broken mutant.
- the bugs that need non-finite values at unused positions (core has none) on a small suite of
  poisoned cases (POISON_SPEC) generated with `attnoracle gen` into a temporary directory, where
  the NumPy adapter under fp32 and the flash kernel at block 16 under FLASH run correct as well.

Prints a table (implementation or mutant, profile, passed/failed/skipped, caught?), the reasons
for the pairs not expected, then `mutation score: caught/seeded` and `false failures: N`. Exit
status 0 when every mutant is caught and there is no false failure, 1 otherwise, 2 when the gate
could not be run. Python standard library only; the gate's JSON report is what is read.
"""
import argparse
import ast
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# Profiles per adapter: label -> (--profile, the case dtype it covers (--dtype), adapter flags).
PROFILES = {
    "numpy": {
        "fp32": ("fp32", "F32", []),
        "fp16": ("fp16", "F16", []),
        "bf16": ("bf16", "BF16", []),
        "fp64": ("fp64", "F64", ["--dtype", "float64"]),
    },
    # The flash kernel under FlashAttention's arithmetic (P rounded to the input format).
    "flash": {
        "fp32": ("fp32", "F32", ["--arith", "fp32"]),
        "flash-fp16": ("flash-fp16", "F16", ["--arith", "fp16"]),
        "flash-bf16": ("flash-bf16", "BF16", ["--arith", "bf16"]),
        "fp64": ("fp64", "F64", []),
        # FP8 inputs under FlashAttention 3's arithmetic (P rounded to E4M3), one label a format
        "flash-fp8": ("flash-fp8", "F8_E4M3", ["--arith", "fp8"]),
        "flash-fp8-e5m2": ("flash-fp8", "F8_E5M2", ["--arith", "fp8"]),
    },
}
ALL = ("fp32", "fp16", "bf16", "fp64")
FLASH = ("fp32", "flash-fp16", "flash-bf16")
FP8 = ("flash-fp8", "flash-fp8-e5m2")
FLASH_BLOCKS = (16, 64, 128)   # the correct kernel runs at each, under FLASH, fp64 and FP8


class Mutant:
    """A seeded bug: the adapter and its flags, the profiles that must catch it (expected), the
    profiles it also runs under with the reason it need not be caught there (not_expected), those
    where it shows only on rows longer than today's core (long_rows), where it shows, and the case
    tags it is run on (None: every case of the profile's dtype)."""

    def __init__(self, adapter, bug, expected, where, not_expected=None, long_rows=None, tags=None,
                 block=None, poison=False):
        self.adapter, self.bug, self.expected, self.where = adapter, bug, tuple(expected), where
        self.poison = poison   # run on the poisoned suite (POISON_SPEC) instead of --suite
        self.not_expected, self.long_rows = dict(not_expected or {}), dict(long_rows or {})
        self.tags, self.block = tags, block
        self.profiles = self.expected + tuple(self.not_expected) + tuple(self.long_rows)

    def flags(self):
        return (["--block", str(self.block)] if self.block else []) + ["--bug", self.bug]


def numpy(bug, expected, where, not_expected=None, tags=None):
    """A bug of the NumPy adapter, run under every profile of the dtypes it concerns."""
    return Mutant("numpy", bug, expected, where, not_expected, tags=tags)


def flash(bug, where, tags=None, block=16, expected=FLASH, **kw):
    """A bug of the flash kernel (default: block 16, caught under fp32, flash-fp16, flash-bf16)."""
    return Mutant("flash", bug, expected, where, tags=tags, block=block, **kw)


NOT_F16 = "the bug concerns an F16 kernel: it changes nothing for other dtypes"
EXACT_TF32 = "F16 and BF16 values (11 and 8 significant bits) are exact in TF32: no change"
MUTANTS = {
    # The NumPy adapter (conformance/adapters/numpy/attention.py, --bug).
    "causal_leak": numpy("causal_leak", ALL, "causal cases: key i + 1 gets weight",
            tags=("causal",)),
    "no_max_subtraction": numpy("no_max_subtraction", ALL,
                                "large_scores: exp overflows (scores of a few hundred)",
            tags=("large_scores", "overflow")),
    "unnormalised": numpy("unnormalised", ALL, "every case: weights 1% short",
            tags=("basic",)),
    "mask_ignored": numpy("mask_ignored", ALL, "mask_kinds, padding: masked keys get weight",
            tags=("mask", "padding")),
    "heads_swapped": numpy("heads_swapped", ALL, "gqa, mqa, multi-head cases",
            tags=("heads", "gqa", "mqa")),
    "shift_one_key": numpy("shift_one_key", ALL, "every case with Nk > 1",
            tags=("basic",)),
    "padding_key_leak": numpy("padding_key_leak", ("fp32", "bf16", "fp64"),
                              "weights of masked keys, which must be exactly 0: causal, mask, window cases",
                              {"fp16": "in F16 exp(-20) / Z underflows to 0 in the weights: invisible"},
            tags=("causal", "mask", "window")),
    "transposed_gqa": numpy("transposed_gqa", ALL, "gqa cases (Hkv > 1 and Hq > Hkv)",
            tags=("gqa",)),
    "no_scaling": numpy("no_scaling", ALL, "every case with scale != 1",
            tags=("basic",)),
    "scale_by_dk": numpy("scale_by_dk", ALL, "every case with the default scale and Dk > 1",
            tags=("basic",)),
    "no_max_subtraction_f16": numpy("no_max_subtraction_f16", ("fp16",),
                                    "F16 large_scores: exp overflows float16 past 11 (and the float16 "
                                    "softmax's error shows in the statistics of ordinary cases)",
            tags=("large_scores", "overflow")),
    "mask_after_softmax": numpy("mask_after_softmax", ALL,
                                "causal, window, mask cases: the kept weights do not sum to 1",
            tags=("causal", "window", "mask")),
    "causal_off_by_one": numpy("causal_off_by_one", ALL, "causal cases: the diagonal key dropped",
            tags=("causal",)),
    "other_alignment": numpy("other_alignment", ALL, "causal cases with Nq != Nk",
            tags=("causal",)),
    "gqa_tiled": numpy("gqa_tiled", ALL, "gqa cases (the same mapping as transposed_gqa, through np.tile)",
            tags=("gqa",)),
    "softcap_after_bias": numpy("softcap_after_bias", ALL,
                                "cases with both a softcap and a bias (alibi or random)",
            tags=("softcap",)),
    "pv_f16_accumulation": numpy("pv_f16_accumulation", ("fp16",),
                                 "F16 cases with long rows or cancelling outputs"),
    "truncate_output": numpy("truncate_output", ("fp16", "bf16"),
                             "F16/BF16 outputs where the final rounding dominates: the statistics test",
                             {"fp32": "F32 truncation is below 4 x the limit of F32 arithmetic; shows "
                                      "only where the output is F16/BF16 (large_scores_narrow_output)",
                              "fp64": "F64 truncation is below 4 x the limit of F64 arithmetic; shows "
                                      "only where the output is narrower (mixed_output)"}),
    "nan_from_masked": numpy("nan_from_masked", ALL, "every case with a masked key",
            tags=("causal", "mask", "window")),
    "masked_row_nan": numpy("masked_row_nan", ALL, "fully masked rows under attn.masked_rows=zero",
            tags=("fully_masked",)),
    "drop_last_key": numpy("drop_last_key", ALL, "every case with Nk > 1",
            tags=("basic",)),

    # The flash kernel (conformance/adapters/flash_numpy/attention.py, --bug), at --block 16
    # unless named otherwise; most core rows have at most 16 keys, so a bug of the online softmax
    # shows only on the few longer rows of each dtype.
    "flash:no_rescale": flash("no_rescale", "rows of more than 16 keys whose maximum is not in the "
                              "first block: normal-001/-003, -005/-007, -009/-011, long_rows-000",
                              tags=("group:normal", "long_rows")),
    "flash:no_rescale@64": flash("no_rescale", "long_rows and block_edges rows past 64 keys, every dtype",
                                 block=64,
                                 tags=("group:normal", "long_rows")),
    "flash:no_rescale@128": flash("no_rescale", "long_rows and block_edges rows past 128 keys, every dtype",
                                  block=128,
                                  tags=("group:normal", "long_rows")),
    "flash:no_rescale_acc": flash("no_rescale_acc", "rows of more than 16 keys (as no_rescale)",
                                  tags=("group:normal", "long_rows")),
    "flash:max_init_zero": flash("max_init_zero", "fully masked rows (0/0 instead of zeros or a refusal) "
                                 "and rows of scores far below 0", tags=("fully_masked", "large_scores")),
    "flash:exp2_no_log2e": flash("exp2_no_log2e", "every case with Nk > 1: the softmax of s ln 2",
                                 tags=("basic",)),
    "flash:lse_without_max": flash("lse_without_max", "every case returning lse", tags=("basic",)),
    "flash:lse_log2": flash("lse_log2", "every case returning lse with lse != 0", tags=("basic",)),
    "flash:lse_bf16_rounded": flash("lse_bf16_rounded", "every case returning lse not exact in BF16: lse "
                                    "is judged in F32 (fp32, and the flash profiles' lse_dtype)",
                                    tags=("basic",)),
    "flash:weights_stale": flash("weights_stale", "weights of rows of more than 16 keys",
                                 tags=("group:normal",)),
    "flash:weights_no_softcap": flash("weights_no_softcap", "weights of softcap cases",
                                      tags=("softcap",)),
    "flash:tf32_matmul": flash("tf32_matmul", "every F32 case: errors of 2^-11 where F32 allows 2^-24",
                               expected=("fp32",),
                               not_expected={"flash-fp16": EXACT_TF32, "flash-bf16": EXACT_TF32},
                               tags=("basic",)),
    "flash:flush_subnormals": flash("flush_subnormals", "F16: weights below 2^-14 flushed "
                                    "(dominant-003 and others)",
                                    expected=("flash-fp16",),
                                    not_expected={"flash-bf16": "BF16 has float32's exponent range: the "
                                                  "weights flushed are below 2^-126, far below the limit",
                                                  "fp32": "the limit's underflow floor, n times float32's "
                                                  "smallest normal (TOLERANCE.md, step 6), admits every "
                                                  "flushed subnormal of subnormal-000/-001"},
                                    tags=("subnormal", "wide_range", "range", "underflow")),
    "flash:qk_in_input_dtype": flash("qk_in_input_dtype", "F16/BF16: scores rounded (|s| u error in "
                                     "every weight)", expected=("flash-fp16", "flash-bf16"),
                                     not_expected={"fp32": "with --arith fp32 the scores stay float32: "
                                                   "no change"},
                                     tags=("large_scores",)),
    # FP8 descales (FlashAttention 3's convention, per batch and kv head).
    "flash:descales_dropped": flash("descales_dropped", "every FP8 case with descales (all differ from 1)",
                                    expected=FP8, tags=("descales",)),
    "flash:descales_kv_head0": flash("descales_kv_head0", "every FP8 case with descales: B and Hkv are 2, "
                                     "the descales distinct", expected=FP8, tags=("descales",)),
    # Backward bugs (the gradient gate, TOLERANCE.md "Gradients"), on the backward families.
    "bwd_dbias_not_reduced": numpy("bwd_dbias_not_reduced", ALL, "dbias of a broadcast bias (bwd_bias per_key "
                                   "and scalar)", tags=("backward",)),
    "bwd_padding_rows": numpy("bwd_padding_rows", ALL, "padding rows' dout reaching dk and dv (bwd_masks, "
                              "bwd_varlen)", tags=("backward",)),
    "bwd_gqa_sum_tiled": numpy("bwd_gqa_sum_tiled", ALL, "GQA cases: dk and dv summed over the wrong heads",
                               tags=("backward",)),
    "bwd_dsinks_sign": numpy("bwd_dsinks_sign", ALL, "bwd_sinks: dsinks with the wrong sign", tags=("sinks",)),
    "bwd_sinks_ignored": numpy("bwd_sinks_ignored", ALL, "bwd_sinks: the backward's P without the sink",
                               tags=("sinks",)),
    "flash:bwd_no_delta": flash("bwd_no_delta", "every backward case: dS without D_i", tags=("backward",)),
    "flash:bwd_dk_no_scale": flash("bwd_dk_no_scale", "every backward case: dk without the scale", tags=("backward",)),
    "flash:bwd_gqa_no_sum": flash("bwd_gqa_no_sum", "GQA cases (bwd-001/-003/-005/-007)", tags=("backward",)),
    "flash:bwd_no_softcap_grad": flash("bwd_no_softcap_grad", "bwd_softcap: dT = dS", tags=("backward",)),
    "flash:bwd_dv_unnormalised": flash("bwd_dv_unnormalised", "every backward case: dv from exp(S - m)", tags=("backward",)),
    "flash:bwd_lse_rounded": flash("bwd_lse_rounded", "lse kept in F16 between the passes: every F32 case, "
                                   "the large-score ones in F16 and BF16", tags=("backward",)),
    "flash:bwd_lse_batch0": flash("bwd_lse_batch0", "cases with B > 1: batch 0's lse for every batch", tags=("backward",)),
    "flash:bwd_mask_ignored": flash("bwd_mask_ignored", "masked, padded, windowed and fully masked cases",
                                    tags=("backward",)),
    "flash:bwd_dq_other_alignment": flash("bwd_dq_other_alignment", "causal cases with Nq != Nk", tags=("backward",)),
    "flash:bwd_masked_row_nan": flash("bwd_masked_row_nan", "rows with no key under policy zero "
                                      "(bwd_causal bottom_right, bwd_fully_masked)", tags=("backward",)),
    "flash:bwd_stale_lse": flash("bwd_stale_lse", "rows of more than 16 keys (bwd_long_rows, bwd_block_edges)",
                                 tags=("backward",)),
    "flash:bwd_dk_f16_accumulation": flash("bwd_dk_f16_accumulation", "F32 cases: dk summed in F16",
                                           expected=("fp32",),
                                           long_rows={"flash-fp16": "dk summed in F16 over at most 33 query "
                                                      "rows: within the F16 rounding of P and dS that the "
                                                      "limit allows; it shows over 128 rows (the adapter's "
                                                      "own test)",
                                                      "flash-bf16": "as flash-fp16, BF16 rounding of P and "
                                                      "dS being coarser still"},
                                           tags=("backward",)),
    "flash:bwd_tail_block_skipped": flash("bwd_tail_block_skipped", "a partial last key block "
                                          "(bwd_block_edges)", tags=("backward",)),

    # Statistical bugs of the flash kernel's arithmetic, caught by the error distribution's tests
    # (TOLERANCE.md, the statistical tier) where each element stays within its limit.
    "flash:stat_exp_1e3": flash("stat_exp_1e3", "exp with a relative error of 1e-3: many cases",
                                expected=("fp32", "flash-fp16"),
                                not_expected={"flash-bf16": "1e-3 is a quarter of BF16's unit roundoff "
                                              "(P is rounded to BF16): within the declared arithmetic"},
                                tags=("basic", "normal")),
    "flash:stat_f16_denominator": flash("stat_f16_denominator", "the row sum in F16: F32 cases",
                                        expected=("fp32",),
                                        not_expected={"flash-fp16": "P is rounded to F16 already: the "
                                                      "sum's F16 error is of the same order",
                                                      "flash-bf16": "below BF16's rounding of P"},
                                        tags=("basic", "normal")),
    "flash:stat_pv_bf16": flash("stat_pv_bf16", "P V in BF16: most F32 and F16 cases, BF16 ones with "
                                "long sums", tags=("basic", "normal")),
    "flash:stat_round_up": flash("stat_round_up", "every output rounded toward +inf: the mean of the "
                                 "signed errors", tags=("basic", "normal")),
    "flash:p_truncate": flash("p_truncate", "P truncated to F16 / BF16 before P V: the bias test on "
                              "the larger normal cases (normal-005, -007 in F16, normal-011 in BF16)",
                              expected=("flash-fp16", "flash-bf16"),
                              not_expected={"fp32": "P stays F32 under --arith fp32: the bug changes nothing"},
                              tags=("normal",)),
    "flash:scale_dv": flash("scale_dv", "cases with the default scale and Dv != Dk (normal-001, gqa, "
                            "mha, edges)", tags=("dv_ne_dk",)),
    "flash:scale_twice": flash("scale_twice", "every case with scale != 1", tags=("basic",)),
    "flash:softcap_scale_swapped": flash("softcap_scale_swapped", "softcap cases", tags=("softcap",)),
    "flash:bias_scaled": flash("bias_scaled", "bias cases (scale != 1)", tags=("bias",)),
    "flash:bias_head0": flash("bias_head0", "cases with a per-head bias (alibi)", tags=("bias",)),
    "flash:mask_batch0": flash("mask_batch0", "cases with a per-batch mask (padding, mha_masked)",
                               tags=("padding", "mask")),
    "flash:masked_fill_min": flash("masked_fill_min", "fully masked rows: the mean of V, not zeros "
                                   "or a refusal", tags=("fully_masked",)),
    "flash:tail_unmasked": flash("tail_unmasked", "every non-causal case whose Nk is not a multiple of 16",
                                 tags=("basic",)),
    "flash:keys_limited_to_nq": flash("keys_limited_to_nq", "every case with Nq < Nk", tags=("basic",)),
    "flash:gqa_pack2": flash("gqa_pack2", "gqa-000, -002, -004 (Hq 8, Hkv 2: ratio 4)", tags=("gqa",)),
    "flash:causal_top_left": flash("causal_top_left", "bottom_right causal cases with Nq != Nk",
                                   tags=("causal_bottom_right",)),
    "flash:bottom_right_off_by_one": flash("bottom_right_off_by_one", "bottom_right causal cases",
                                           tags=("causal_bottom_right",)),
    "flash:window_off_by_one": flash("window_off_by_one", "window cases with a finite left edge",
                                     tags=("window",)),
    "flash:window_right_ignored": flash("window_right_ignored", "window cases with a finite right edge",
                                        tags=("window",)),
    "flash:seqlens_align_nk_nq": flash("seqlens_align_nk_nq", "bottom_right varlen cases (varlen, "
                                       "varlen_decode, varlen_chunked, varlen_window): rows of the "
                                       "shorter sequences", tags=("seqlens",)),
    "flash:nan_from_padded_key": flash("nan_from_padded_key", "the poisoned suite: NaN in the value "
                                       "rows of masked and padded keys reaches the output", poison=True),
    "flash:sinks_ignored": flash("sinks_ignored", "sinks cases: the weights sum to 1, lse lacks the sink",
                                 tags=("sinks",)),
    "flash:sink_in_numerator": flash("sink_in_numerator", "sinks cases whose sink is not negligible",
                                     tags=("sinks",)),
}

# Poisoned cases for the mutants that need them: unused positions (keys past seqlens_k, masked
# keys, padding queries) hold NaN and infinities. Small, so that generating them takes seconds.
POISON_SPEC = {
    "suite": "poison", "seed": 14,
    "description": "unused positions filled with NaN and infinities, for the mutation test",
    "families": [
        {"name": "poison_varlen", "generator": "normal", "tags": ["poison", "seqlens"],
         "cross": {"dtype": ["F32", "F16", "BF16"], "seqlens": ["varlen", "decode"]},
         "fixed": {"shape": [3, 2, 2, 6, 20, 8, 8], "causal": "bottom_right", "poison": True,
                   "masked_rows": "zero", "outputs": "out,weights,lse"}},
        {"name": "poison_mask", "generator": "normal", "tags": ["poison", "padding"],
         "cross": {"dtype": ["F32", "F16", "BF16"]},
         "fixed": {"shape": [2, 2, 2, 5, 12, 8, 8], "mask": "key_padding", "query_mask": True,
                   "poison": True, "masked_rows": "zero", "outputs": "out,weights"}},
    ],
}


def make_poison_suite(cli, work, timeout):
    """Generates POISON_SPEC into work/poison; returns (its directory, None) or (None, error text)."""
    spec = os.path.join(work, "poison.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump(POISON_SPEC, f)
    out = os.path.join(work, "poison")
    cmd = [cli, "gen", spec, "-o", out, "--jobs", "2", "--quiet"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s: {' '.join(cmd)}"
    if p.returncode != 0:
        return None, f"exit status {p.returncode}: {' '.join(cmd)}\n{p.stderr.strip()}"
    return out, None


def adapter_bugs(path):
    """The names in the BUGS dict of an adapter's source (read, not imported: NumPy not needed)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUGS" for t in node.targets):
            return [ast.literal_eval(k) for k in node.value.keys]
    return []


def selection(manifest, dtype, tags):
    """Ids of the cases of input dtype `dtype` with one of `tags` (every case of it when None); a
    tag "group:NAME" matches the ids NAME-000, NAME-001, ..."""
    def matches(case):
        group = "group:" + case["id"].rsplit("-", 1)[0]
        return tags is None or any(t == group or t in case["tags"] for t in tags)
    return [c["id"] for c in manifest["cases"] if dtype.lower() in c["tags"] and matches(c)]


def adapter_crash(case):
    """A failed case that is the NumPy adapter's own exception, not a verdict on its numbers."""
    reason = case.get("reason", "")
    return "refused a case it must evaluate" in reason and "fully masked row" not in reason


def run_gate(cli, suite, impl, profile, dtype, returns, cases, work, timeout):
    """Runs the gate once (on `cases` when given); returns (report dict, None) or (None, error text)."""
    fd, report = tempfile.mkstemp(prefix="report_", suffix=".json", dir=work)
    os.close(fd)
    cmd = [cli, "run", suite, "--impl", impl, "--profile", profile, "--dtype", dtype,
           "--json", report, "--threads", "1"]
    if cases:
        cmd += ["--case", ",".join(cases)]
    if returns:
        cmd += ["--returns", returns]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s: {' '.join(cmd)}"
    if p.returncode not in (0, 1):
        return None, f"exit status {p.returncode}: {' '.join(cmd)}\n{p.stderr.strip()}"
    try:
        with open(report, encoding="utf-8") as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f"no JSON report ({e}): {' '.join(cmd)}"


def worst_numbers(case):
    """One line of the gate's numbers on a case: per tensor worst ulp, bound error, limit ratio, statistics."""
    def g(x):  # the JSON report writes infinity and NaN as null
        return "inf/nan" if x is None else f"{x:.3g}"

    parts = []
    for t in case.get("tensors", []):
        s = (f"{t['tensor']}: ulp {g(t['worst_ulp'])}, bound {g(t['worst_bound_error'])}, "
             f"limit ratio {g(t['worst_limit_ratio'])}, mean {g(t['mean_bound_error'])} "
             f"({g(t['mean_toward_zero'])} toward zero), rms {g(t['rms_bound_error'])}")
        if t.get("statistics_note"):
            s += f", {t['statistics_note']}"
        parts.append(s)
    return "; ".join(parts) or case.get("reason", "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", required=True, help="the attnoracle binary")
    ap.add_argument("--suite", required=True, help="vector set (vectors/core)")
    ap.add_argument("--source", required=True, help="the repository (adapters and profiles)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="gate runs in parallel")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per gate run")
    ap.add_argument("--mutant", action="append", help="only these mutants (repeatable; default all; the "
                    "flash kernel's are named flash:BUG or flash:BUG@BLOCK)")
    ap.add_argument("-v", "--verbose", action="store_true", help="the gate's numbers for every failed case")
    args = ap.parse_args(argv)

    for path, what in ((args.cli, "--cli"), (os.path.join(args.suite, "manifest.json"), "--suite")):
        if not os.path.exists(path):
            print(f"mutation_test: error: {what}: {path} not found", file=sys.stderr)
            return 2
    src = os.path.abspath(args.source)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"   # no __pycache__ in the source tree
    python = sys.executable or "/usr/bin/python3"
    adapters = {"numpy": os.path.join(src, "conformance", "adapters", "numpy", "attention.py"),
                "flash": os.path.join(src, "conformance", "adapters", "flash_numpy", "attention.py")}
    ort_dir = os.path.join(src, "conformance", "adapters", "onnxruntime")
    ort_profile = os.path.join(src, "conformance", "profiles", "onnxruntime-fp16.json")
    with open(os.path.join(args.suite, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)

    def impl(adapter, profile, flags):
        return " ".join([python, adapters[adapter]] + PROFILES[adapter][profile][2] + flags)

    mutants = args.mutant or list(MUTANTS)
    for m in mutants:
        if m not in MUTANTS:
            print(f"mutation_test: error: unknown mutant {m}", file=sys.stderr)
            return 2
    work = tempfile.mkdtemp(prefix="attn_mutation_")
    poison_suite = None
    if any(MUTANTS[m].poison for m in mutants):
        poison_suite, err = make_poison_suite(args.cli, work, args.timeout)
        if err:
            print(f"mutation_test: error: the poisoned suite: {err}", file=sys.stderr)
            shutil.rmtree(work, ignore_errors=True)
            return 2

    # (label, kind, profile label, profile, dtype, impl, returns, cases, suite)
    runs = []
    for name, (prof, dtype, _) in PROFILES["numpy"].items():
        runs.append(("numpy", "correct", name, prof, dtype, impl("numpy", name, []), "", None))
    if poison_suite:
        runs.append(("numpy (poison)", "correct", "fp32", "fp32", "F32", impl("numpy", "fp32", []), "",
                     None, poison_suite))
        for name in FLASH:
            prof, dtype, _ = PROFILES["flash"][name]
            runs.append(("flash@16 (poison)", "correct", name, prof, dtype,
                         impl("flash", name, ["--block", "16"]), "", None, poison_suite))
    for block in FLASH_BLOCKS:
        for name in FLASH + ("fp64",) + FP8:
            prof, dtype, _ = PROFILES["flash"][name]
            runs.append((f"flash@{block}", "correct", name, prof, dtype,
                         impl("flash", name, ["--block", str(block)]), "", None))
    node = shutil.which("node")
    ort_skip = None
    if not os.path.isdir(os.path.join(ort_dir, "node_modules", "onnxruntime-node")):
        ort_skip = f"{ort_dir}/node_modules/onnxruntime-node is not installed (npm ci --ignore-scripts)"
    elif node is None:
        ort_skip = "node is not on PATH"
    if ort_skip is None:
        adapter = f"{node} {os.path.join(ort_dir, 'adapter.js')}"
        runs.append(("onnxruntime", "correct", "fp32", "fp32", "F32", adapter, "weights", None))
        runs.append(("onnxruntime", "correct", "onnxruntime-fp16", ort_profile, "F16", adapter, "weights", None))
    unlisted = []
    for name, path in adapters.items():
        known = {MUTANTS[m].bug for m in MUTANTS if MUTANTS[m].adapter == name}
        bugs = adapter_bugs(path)
        stale = sorted({MUTANTS[m].bug for m in mutants if MUTANTS[m].adapter == name} - set(bugs))
        if stale:
            print(f"mutation_test: error: {path}: no --bug {', '.join(stale)}", file=sys.stderr)
            return 2
        unlisted += [f"{name} --bug {b}" for b in bugs if b not in known]
    no_case = []
    for m in mutants:
        mu = MUTANTS[m]
        for name in mu.profiles:
            prof, dtype, _ = PROFILES[mu.adapter][name]
            if mu.poison:
                runs.append((m, "mutant", name, prof, dtype, impl(mu.adapter, name, mu.flags()), "", None,
                             poison_suite))
                continue
            cases = selection(manifest, dtype, mu.tags)
            if not cases:
                no_case.append((m, name))
                continue
            runs.append((m, "mutant", name, prof, dtype, impl(mu.adapter, name, mu.flags()), "",
                         None if mu.tags is None else cases))

    start = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_gate, args.cli, r[8] if len(r) > 8 else args.suite, r[5], r[3], r[4],
                                   r[6], r[7], work, args.timeout) for r in runs]
            results = [f.result() for f in futures]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    errors = [(r, err) for r, (rep, err) in zip(runs, results) if err]
    header = (f"{'implementation or mutant':<30} {'profile':<17} {'passed':>6} {'failed':>6} {'skipped':>7}"
              f"  caught?")
    print(header)
    print("-" * len(header))
    false_failures, notes = 0, []
    caught_under = {m: [] for m in mutants}
    crashed = {m: [] for m in mutants}
    for r, (rep, err) in zip(runs, results):
        label, kind, pname = r[0], r[1], r[2]
        if err:
            print(f"{label:<30} {pname:<17} {'-':>6} {'-':>6} {'-':>7}  gate error")
            continue
        cases = rep["cases"]
        failed = [c for c in cases if c["status"] == "fail"]
        if kind == "correct":
            false_failures += len(failed)
            verdict = "-" if not failed else f"FALSE FAILURES: {len(failed)}"
            for c in failed:
                notes.append(f"false failure: {label} under {pname}: {c['id']}: {c.get('reason', '')}\n"
                             f"    {worst_numbers(c)}")
        else:
            mu = MUTANTS[label]
            real = [c for c in failed if not adapter_crash(c)]
            crashed[label] += [c for c in failed if adapter_crash(c)]
            if real:
                caught_under[label].append(pname)
                first = real[0]
                verdict = f"yes: {first['id']}: {first.get('reason', '')}"
            elif pname in mu.not_expected:
                verdict = "no, not expected (below)"
            elif pname in mu.long_rows:
                verdict = "no, needs long rows (below)"
            else:
                verdict = "NO"
            verdict = verdict if len(verdict) <= 90 else verdict[:87] + "..."
            if args.verbose:
                for c in real:
                    notes.append(f"{label} under {pname}: {c['id']}: {c.get('reason', '')}\n    {worst_numbers(c)}")
        print(f"{label:<30} {pname:<17} {rep['passed']:>6} {rep['failed']:>6} {rep['skipped']:>7}  {verdict}")
    for m, pname in no_case:
        print(f"{m:<30} {pname:<17} {'-':>6} {'-':>6} {'-':>7}  no case of this dtype with tags "
              f"{','.join(MUTANTS[m].tags)}")
    if ort_skip:
        print(f"{'onnxruntime':<30} {'-':<17} {'-':>6} {'-':>6} {'-':>7}  skipped: {ort_skip}")

    caught, waivers = [], []
    for m in mutants:
        mu = MUTANTS[m]
        waivers += [f"not expected: {m} under {p}: {why}" for p, why in mu.not_expected.items()]
        waivers += [f"needs long rows: {m} under {p}: {why}" for p, why in mu.long_rows.items()]
        missing = [p for p in mu.expected if p not in caught_under[m]]
        if mu.expected and not missing:
            caught.append(m)
        if crashed[m]:
            notes.append(f"{m}: the adapter crashed on {len(crashed[m])} case(s) (not counted): "
                         f"{crashed[m][0]['id']}: {crashed[m][0].get('reason', '')}")
        if not caught_under[m]:
            notes.append(f"NOT CAUGHT: {m} (expected under {', '.join(mu.expected)}: {mu.where})")
        elif missing:
            notes.append(f"NOT CAUGHT under {', '.join(missing)}: {m}, caught under "
                         f"{', '.join(caught_under[m])} (expected: {mu.where})")
        now = [p for p in mu.long_rows if p in caught_under[m]]
        if now:
            notes.append(f"{m}: now caught under {', '.join(now)}, listed as needing long rows: "
                         f"expect it there")
    for r, err in errors:
        notes.append(f"gate error: {r[0]} under {r[2]}: {err}")
    if unlisted:
        notes.append(f"seeded but not scored (no entry in MUTANTS): {', '.join(unlisted)}")
    for block in (waivers, notes):
        if block:
            print()
            print("\n".join(block))
    waived = sum(len(MUTANTS[m].not_expected) for m in mutants)
    long_rows = sum(len(MUTANTS[m].long_rows) for m in mutants)
    print()
    print(f"mutation score: {len(caught)}/{len(mutants)} "
          f"({sum(MUTANTS[m].adapter == 'flash' for m in caught)}/"
          f"{sum(MUTANTS[m].adapter == 'flash' for m in mutants)} of the flash kernel), "
          f"each caught under every profile it is expected under")
    print(f"not expected: {waived} (mutant, profile) pairs, needs long rows: {long_rows} (reasons above)")
    print(f"false failures: {false_failures}")
    print(f"({len(runs)} gate runs in {time.monotonic() - start:.1f} s)")
    if errors:
        return 2
    return 0 if len(caught) == len(mutants) and false_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
