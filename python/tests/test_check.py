"""Suite and Case.check against `attnoracle check`, case by case, on results made from the golden
outputs and on perturbed ones; the manifest as the gate reads it."""

import json
import os
import shutil

import numpy as np
import pytest

import attnoracle
from attnoracle import _attnoracle as native
from conftest import CORE, CORE_CASES, run_cli

PROFILE = "fp64,fp32,fp16,bf16,fp8"  # every core case is judged (standard has no FP8 member)


def golden_outputs(case):
    return {n: case.golden.bits.get(n, case.golden[n]) for n in case.outputs}


def perturbed(case, k):
    """The golden outputs with a bug: every third case one element far off, the others one whole
    (batch 0, head 0) of out shifted by 1 percent of its largest magnitude."""
    out = {n: np.array(case.golden[n], np.float64) for n in case.outputs}
    o = out["out"]
    if k % 3 == 0:
        o.reshape(-1)[o.size // 2] += 1.0 + abs(o.reshape(-1)[o.size // 2])
    else:
        o[0, 0] += 0.01 * max(1.0, float(np.nanmax(np.abs(o[np.isfinite(o)]))) if np.isfinite(o).any() else 1.0)
    return out


def write_result(dir, case, outputs):
    """A result file as an implementation writes it, through the format library."""
    path = os.path.join(dir, case.id + ".safetensors")
    if isinstance(outputs, BaseException):
        with open(path + ".error", "w") as f:
            f.write(str(outputs) + "\n")
        return
    tensors = [attnoracle._float_tensor(n, a, case.output_dtype, True, path) for n, a in outputs.items()]
    native.write_file(path, tensors, {})


@pytest.mark.parametrize("variant", ["golden", "perturbed"])
def test_check_agrees_with_attnoracle_check_case_by_case(core, tmp_path, variant):
    results = tmp_path / "results"
    results.mkdir()
    verdicts = {}
    for k, entry in enumerate(core):
        case = entry.load()
        assert (case.id, case.tags, case.expect) == (entry.id, entry.tags, entry.expect)
        if entry.expect == "error":
            outputs = attnoracle.Refused(f"fully masked row in {case.id}")
        elif variant == "golden":
            outputs = golden_outputs(case)
        else:
            outputs = perturbed(case, k)
        write_result(str(results), case, outputs)
        verdicts[entry.id] = case.check(outputs, profile=PROFILE)
    report = tmp_path / "report.json"
    r = run_cli("check", CORE, "--results", str(results), "--profile", PROFILE, "--json", str(report), "--all")
    gate = json.loads(report.read_text())
    assert [c["id"] for c in gate["cases"]] == [e.id for e in core]
    for c in gate["cases"]:
        v = verdicts[c["id"]]
        c.pop("pictures", None)  # the HTML report's data, which --json adds for failing cases
        # the case's place in the manifest, which a one-case verdict does not have
        assert c.pop("position") == [e.id for e in core].index(c["id"])
        assert {k: x for k, x in v.report.items() if k != "position"} == c, c["id"]  # status, reason, every tensor's figures, worst, diagnosis
        assert v.status == c["status"] and v.worst == c.get("worst")
        assert v.findings == [f["text"] for f in c.get("diagnosis", {}).get("findings", [])]
        # the lines `check --all` prints for the case
        assert v.text in r.stdout, c["id"]
    passed = sum(v.passed for v in verdicts.values())
    failed = sum(v.failed for v in verdicts.values())
    if variant == "golden":
        assert r.returncode == 0 and failed == 0 and passed == len(core)
    else:
        # kind mha's limits (projections included) can cover a shift of 1 percent on one row
        assert r.returncode == 1
        assert all(verdicts[e.id].failed for e in core if e.expect == "ok" and "mha" not in e.tags)
        assert failed > 450
        assert all(v.findings or v.worst for v in verdicts.values() if v.failed)


def test_verdict_of_a_failing_case_names_the_worst_element_and_its_limit(core):
    case = next(c for c in (e.load() for e in core) if c.expect == "ok" and c.kind == "sdpa" and c.input_dtype == "F32"
                and c.outputs == ("out",))
    out = np.array(case.golden["out"])
    out[0, 0, 0, 0] = out[0, 0, 0, 0] * 1.5 + 1
    v = case.check({"out": out}, profile="fp32")
    assert v.failed and not v and v.worst["tensor"] == "out" and v.worst["index"] == [0, 0, 0, 0]
    assert v.worst["limit_ratio"] > 1 and v.worst["error"] > v.worst["limit"] > 0
    assert v.text.startswith("FAIL  " + case.id) and "worst: out[0,0,0,0]" in v.text
    # outputs as torch tensors, and the golden outputs pass
    import torch

    assert case.check({"out": torch.from_numpy(case.golden["out"])}, profile="fp32").passed
    # a missing output fails as in the gate
    full = next(c for c in (e.load() for e in core) if c.expect == "ok" and "weights" in c.outputs)
    v = full.check({"out": full.golden["out"]}, profile="fp32")
    assert v.failed and v.reason == "the result has no tensor 'weights'"
    # unless the implementation declares it returns out alone (`--returns out`)
    assert full.check({"out": full.golden["out"]}, profile="standard", returns=("out",)).passed


def test_check_gives_lse_the_dtype_the_profile_returns_it_in(core):
    # flash-bf16 declares lse in F32: lse is converted to F32 and judged there against lse.ref;
    # under bf16 it is converted to BF16, the case's dtype, as before
    case = next(c for c in (e.load() for e in core) if c.expect == "ok" and c.kind == "sdpa" and c.input_dtype == "BF16"
                and "lse" in c.outputs and not c.outputs.count("weights"))
    outputs = {"out": case.golden.bits["out"], "lse": case.golden["lse.ref"]}
    for profile, dtype in (("flash-bf16", "F32"), ("bf16", "BF16")):
        v = case.check(outputs, profile=profile)
        assert v.passed, (profile, v.reason)
        assert [t["dtype"] for t in v.report["tensors"] if t["tensor"] == "lse"] == [dtype]
    # an lse kept in BF16 is many F32 ulps off
    v = case.check({"out": outputs["out"], "lse": case.golden["lse"]}, profile="flash-bf16")
    assert v.failed and v.worst["tensor"] == "lse"


def test_skip_when_the_profile_does_not_cover_the_dtype_and_unsupported(core):
    case = next(e for e in core if e.expect == "ok" and e.load().input_dtype == "F64").load()
    v = case.check(golden_outputs(case), profile="fp32")
    assert v.skipped and v.reason == "profile fp32 does not cover F64 inputs"
    v = case.check(attnoracle.Unsupported("no F64 here"), profile="fp64")
    assert v.skipped and v.reason == "unsupported: no F64 here"
    v = case.check(ValueError("boom"), profile="fp64")
    assert v.failed and v.reason == "refused a case it must evaluate: boom"


def test_suite_reads_the_manifest_as_the_gate(core, tmp_path):
    assert core.name == "core" and len(core) == CORE_CASES
    assert core["normal-015"].id == "normal-015" and "normal-015" in core["normal-015"].file
    assert {e.expect for e in core} == {"ok", "error"}
    assert all(e.id in {x.id for x in core.select(tags=e.tags[:1])} for e in list(core)[:20])
    # an altered case file is refused as the gate refuses it
    altered = tmp_path / "core"
    shutil.copytree(CORE, altered)
    entry = attnoracle.Suite(altered)["normal-015"]
    with open(entry.file, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(attnoracle.InputError) as e:
        entry.load()
    r = run_cli("check", str(altered), "--results", str(tmp_path), "--case", "normal-015")
    # the gate fails the case with the same message
    assert r.returncode == 1 and "      bad golden file: " + str(e.value) + "\n" in r.stdout
    assert str(e.value) == f"{entry.file}: sha256 differs from the manifest: the vector set is altered"
    with pytest.raises(attnoracle.InputError, match="not a vector set directory"):
        attnoracle.Suite(tmp_path / "nowhere")


def test_check_judges_scores_and_accepts_gradients(core, tmp_path):
    case = next(c for c in (e.load() for e in core if "scores" in e.tags) if c.input_dtype == "F32")
    outputs = golden_outputs(case)
    assert set(outputs) == {"out", "scores"} and case.check(outputs).passed
    bad = dict(outputs, scores=np.array(outputs["scores"]))
    bad["scores"][0, 0, 0, 0] += 1.0
    v = case.check(bad)
    assert v.failed and v.worst["tensor"] == "scores" and v.worst["index"] == [0, 0, 0, 0]
    assert case.check({"out": outputs["out"]}).reason == "the result has no tensor 'scores'"
    # gradients are judged like the outputs
    from test_evaluate import gradient_case

    path, _, _ = gradient_case(tmp_path)
    assert run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q").returncode == 0
    grad = attnoracle.load_case(tmp_path / "g.safetensors")
    outputs = {n: grad.golden[n] for n in grad.outputs}
    assert grad.check(outputs).passed
    grads = [n for n in grad.outputs if n.startswith("d")]
    for name in grads:
        bad = dict(outputs, **{name: np.array(outputs[name], np.float64)})
        flat = bad[name].reshape(-1)
        flat[0] += 1 + abs(flat[0])
        v = grad.check(bad)
        assert v.failed and v.worst["tensor"] == name, name
    assert {"dq", "dk", "dv"} <= set(grads)


def test_out_in_a_dtype_of_its_own_is_judged_as_out_in_that_dtype(tmp_path):
    """out given F32 by attn.output_dtypes beside a BF16 output_dtype gets the verdict, statistical
    tier and bias test included, of the same case with output_dtype F32."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    q, k, v = (torch.as_tensor(rng.standard_normal((1, 2, 32, 64)).astype(np.float32)).to(torch.bfloat16)
               for _ in range(3))
    cases = {}
    for name, kw in (("plain", dict(output_dtype="F32")), ("own", dict(output_dtype="BF16", output_dtypes="out:F32"))):
        attnoracle.write_case(tmp_path / f"{name}.safetensors", q, k, v, **kw)
        r = run_cli("eval", str(tmp_path / f"{name}.safetensors"), "-o", str(tmp_path / f"{name}.golden.safetensors"))
        assert r.returncode == 0, r.stderr
        cases[name] = attnoracle.load_case(tmp_path / f"{name}.golden.safetensors")
    out = np.array(cases["plain"].golden["out"], np.float32)
    biased = np.nextafter(out, np.float32(np.inf))  # one F32 ulp up everywhere: biased, within every limit
    tiers = {}
    for name, case in cases.items():
        verdict = case.check({"out": biased}, profile="bf16")
        tiers[name] = [t["tier"] for t in verdict.report["tensors"] if t["tensor"] == "out"][0]
        tiers[name].pop("note", None)
    assert tiers["own"] == tiers["plain"]
    assert tiers["own"]["bias"] is not None and tiers["own"]["bias"] != 0
