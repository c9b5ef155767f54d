#!/usr/bin/env python3
"""Mutation score of the conformance gate: it must fail every seeded bug and no correct implementation.

    /usr/bin/python3 conformance/tests/mutation_test.py --cli build/attnoracle \\
        --suite vectors/core --source .

Runs `attnoracle run SUITE --impl CMD --profile P` (CONTRACT section 5) on:
- the correct implementations: the NumPy adapter under fp32, fp16, bf16 and fp64 (the last with
  `--dtype float64`), and ONNX Runtime (when conformance/adapters/onnxruntime/node_modules is
  installed) under fp32 and conformance/profiles/onnxruntime-fp16.json, declaring `--returns
  weights` (it has no lse). Every failed case of these is a false failure.
- each seeded bug of the NumPy adapter (`--bug NAME`, see MUTANTS) under the profiles of the
  dtypes its bug concerns, with the same adapter command and profiles as the correct adapter, so
  a profile cannot hide a false failure. A mutant is caught when the gate fails at least one case
  under some profile it runs with. A failure that is the adapter's own crash (a Python exception
  written as `.error`) does not count: that would be a broken mutant, not a caught one.

Prints a table (implementation or mutant, profile, passed/failed/skipped, caught?), then
`mutation score: caught/seeded` and `false failures: N`. Exit status 0 when every mutant is
caught and there is no false failure, 1 otherwise, 2 when the gate could not be run.
Python standard library only; the gate's JSON report is what is read.
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# Profiles: --profile value, the case dtype they cover (--dtype), extra adapter flags.
NUMPY_PROFILES = {
    "fp32": ("fp32", "F32", []),
    "fp16": ("fp16", "F16", []),
    "bf16": ("bf16", "BF16", []),
    "fp64": ("fp64", "F64", ["--dtype", "float64"]),
}
ALL = ("fp32", "fp16", "bf16", "fp64")

# Seeded bugs: name -> (profiles it runs under, profiles expected to catch it, where it shows).
# The profiles are those of the dtypes the bug concerns: every dtype for a bug of the algorithm,
# F16 alone for a bug of an F16 kernel.
MUTANTS = {
    "causal_leak": (ALL, ALL, "causal cases: key i + 1 gets weight"),
    "no_max_subtraction": (ALL, ALL, "large_scores: exp overflows (scores of a few hundred)"),
    "unnormalised": (ALL, ALL, "every case: weights 1% short"),
    "mask_ignored": (ALL, ALL, "mask_kinds, padding: masked keys get weight"),
    "heads_swapped": (ALL, ALL, "gqa, mqa, multi-head cases"),
    "shift_one_key": (ALL, ALL, "every case with Nk > 1"),
    "padding_key_leak": (ALL, ("fp32", "bf16", "fp64"),
                         "weights of masked keys, which must be exactly 0: causal, mask, window cases "
                         "(in F16 exp(-20) / Z underflows to 0: invisible)"),
    "transposed_gqa": (ALL, ALL, "gqa cases (Hkv > 1 and Hq > Hkv)"),
    "no_scaling": (ALL, ALL, "every case with scale != 1"),
    "scale_by_dk": (ALL, ALL, "every case with the default scale and Dk > 1"),
    "no_max_subtraction_f16": (("fp16",), ("fp16",),
                               "F16 large_scores: exp overflows float16 past 11 (and the float16 "
                               "softmax's error shows in the statistics of ordinary cases)"),
    "mask_after_softmax": (ALL, ALL, "causal, window, mask cases: the kept weights do not sum to 1"),
    "causal_off_by_one": (ALL, ALL, "causal cases: the diagonal key dropped"),
    "other_alignment": (ALL, ALL, "causal cases with Nq != Nk"),
    "gqa_tiled": (ALL, ALL, "gqa cases (the same mapping as transposed_gqa, through np.tile)"),
    "softcap_after_bias": (ALL, ALL, "cases with both a softcap and a bias (alibi or random)"),
    "pv_f16_accumulation": (("fp16",), ("fp16",), "F16 cases with long rows or cancelling outputs"),
    "truncate_output": (ALL, ("fp16", "bf16"),
                        "F16/BF16 outputs where the final rounding dominates: the statistics test"),
    "nan_from_masked": (ALL, ALL, "every case with a masked key"),
    "masked_row_nan": (ALL, ALL, "fully masked rows under attn.masked_rows=zero"),
    "drop_last_key": (ALL, ALL, "every case with Nk > 1"),
}


def adapter_crash(case):
    """A failed case that is the NumPy adapter's own exception, not a verdict on its numbers."""
    reason = case.get("reason", "")
    return "refused a case it must evaluate" in reason and "fully masked row" not in reason


def run_gate(cli, suite, impl, profile, dtype, returns, work, timeout):
    """Runs the gate once; returns (report dict, None) or (None, error text)."""
    fd, report = tempfile.mkstemp(prefix="report_", suffix=".json", dir=work)
    os.close(fd)
    cmd = [cli, "run", suite, "--impl", impl, "--profile", profile, "--dtype", dtype,
           "--json", report, "--threads", "1"]
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
    ap.add_argument("--mutant", action="append", help="only these mutants (repeatable; default all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="the gate's numbers for every failed case")
    args = ap.parse_args(argv)

    for path, what in ((args.cli, "--cli"), (os.path.join(args.suite, "manifest.json"), "--suite")):
        if not os.path.exists(path):
            print(f"mutation_test: error: {what}: {path} not found", file=sys.stderr)
            return 2
    src = os.path.abspath(args.source)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"   # no __pycache__ in the source tree
    python = sys.executable or "/usr/bin/python3"
    numpy_adapter = os.path.join(src, "conformance", "adapters", "numpy", "attention.py")
    ort_dir = os.path.join(src, "conformance", "adapters", "onnxruntime")
    ort_profile = os.path.join(src, "conformance", "profiles", "onnxruntime-fp16.json")
    numpy_cmd = f"{python} {numpy_adapter}"

    # (label, kind, profile label, profile, dtype, impl, returns)
    runs = []
    for name, (prof, dtype, flags) in NUMPY_PROFILES.items():
        runs.append(("numpy", "correct", name, prof, dtype, " ".join([numpy_cmd] + flags), ""))
    node = shutil.which("node")
    ort_skip = None
    if not os.path.isdir(os.path.join(ort_dir, "node_modules", "onnxruntime-node")):
        ort_skip = f"{ort_dir}/node_modules/onnxruntime-node is not installed (npm ci --ignore-scripts)"
    elif node is None:
        ort_skip = "node is not on PATH"
    if ort_skip is None:
        adapter = f"{node} {os.path.join(ort_dir, 'adapter.js')}"
        runs.append(("onnxruntime", "correct", "fp32", "fp32", "F32", adapter, "weights"))
        runs.append(("onnxruntime", "correct", "onnxruntime-fp16", ort_profile, "F16", adapter, "weights"))
    mutants = args.mutant or list(MUTANTS)
    for m in mutants:
        if m not in MUTANTS:
            print(f"mutation_test: error: unknown mutant {m}", file=sys.stderr)
            return 2
        for name in MUTANTS[m][0]:
            prof, dtype, flags = NUMPY_PROFILES[name]
            runs.append((m, "mutant", name, prof, dtype, " ".join([numpy_cmd] + flags + ["--bug", m]), ""))

    start = time.monotonic()
    work = tempfile.mkdtemp(prefix="attn_mutation_")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_gate, args.cli, args.suite, r[5], r[3], r[4], r[6], work, args.timeout)
                       for r in runs]
            results = [f.result() for f in futures]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    errors = [(r, err) for r, (rep, err) in zip(runs, results) if err]
    header = f"{'implementation or mutant':<26} {'profile':<17} {'passed':>6} {'failed':>6} {'skipped':>7}  caught?"
    print(header)
    print("-" * len(header))
    false_failures, notes = 0, []
    caught_under = {m: [] for m in mutants}
    crashed = {m: [] for m in mutants}
    for r, (rep, err) in zip(runs, results):
        label, kind, pname = r[0], r[1], r[2]
        if err:
            print(f"{label:<26} {pname:<17} {'-':>6} {'-':>6} {'-':>7}  gate error")
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
            real = [c for c in failed if not adapter_crash(c)]
            crashed[label] += [c for c in failed if adapter_crash(c)]
            if real:
                caught_under[label].append(pname)
                first = real[0]
                verdict = f"yes: {first['id']}: {first.get('reason', '')}"
                verdict = verdict if len(verdict) <= 90 else verdict[:87] + "..."
            else:
                verdict = "no"
            if args.verbose:
                for c in real:
                    notes.append(f"{label} under {pname}: {c['id']}: {c.get('reason', '')}\n    {worst_numbers(c)}")
        print(f"{label:<26} {pname:<17} {rep['passed']:>6} {rep['failed']:>6} {rep['skipped']:>7}  {verdict}")
    if ort_skip:
        print(f"{'onnxruntime':<26} {'-':<17} {'-':>6} {'-':>6} {'-':>7}  skipped: {ort_skip}")

    caught = [m for m in mutants if caught_under[m]]
    for m in mutants:
        runs_of, expected, where = MUTANTS[m]
        missing = [p for p in expected if p not in caught_under[m]]
        if crashed[m]:
            notes.append(f"{m}: the adapter crashed on {len(crashed[m])} case(s) (not counted): "
                         f"{crashed[m][0]['id']}: {crashed[m][0].get('reason', '')}")
        if not caught_under[m]:
            notes.append(f"NOT CAUGHT: {m} (expected under {', '.join(expected)}: {where})")
        elif missing:
            notes.append(f"{m}: caught under {', '.join(caught_under[m])}, not under {', '.join(missing)} "
                         f"(expected: {where})")
    for r, err in errors:
        notes.append(f"gate error: {r[0]} under {r[2]}: {err}")
    if notes:
        print()
        print("\n".join(notes))
    print()
    print(f"mutation score: {len(caught)}/{len(mutants)}")
    print(f"false failures: {false_failures}")
    print(f"({len(runs)} gate runs in {time.monotonic() - start:.1f} s)")
    if errors:
        return 2
    return 0 if len(caught) == len(mutants) and false_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
