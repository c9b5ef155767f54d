"""The pytest plugin, run as a user runs it (pytest in a subprocess): a NumPy and a PyTorch
implementation passing on core, a planted bug failing with its diagnosis, skips with reasons."""

import os
import re

from conftest import CORE, CORE_CASES, ROOT, run_pytest

NUMPY_TEST = """
import os, sys
import numpy as np
import attnoracle
sys.path.insert(0, {adapter!r})
import attention as impl

@attnoracle.parametrize_suite({core!r}, profile="fp32,fp16,bf16,fp8", unsupported=("mha",))
def test_numpy_attention(attnoracle_case):
    c = attnoracle_case
    def run():
        x = {{n: a.astype(np.float32) if a.dtype.kind == "f" else a for n, a in c.inputs.items()}}
        descales = {{n: x[n] for n in ("q_descale", "k_descale", "v_descale") if n in x}}
        out, w, lse, s = impl.attention(x["q"], x["k"], x["v"], c.metadata, {bug!r}, mask=x.get("mask"),
                                        bias=x.get("bias"), query_mask=x.get("query_mask"), in_dtype=c.input_dtype,
                                        seqlens_q=x.get("seqlens_q"), seqlens_k=x.get("seqlens_k"),
                                        descales=descales or None, sinks=x.get("sinks"))
        r = {{n: a for n, a in (("out", out), ("weights", w), ("lse", lse), ("scores", s)) if n in c.outputs}}
        grads = [n for n in ("dq", "dk", "dv", "dbias", "dsinks") if n in c.outputs]
        if grads:  # the adapter's backward, in float64
            x64 = {{n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in c.inputs.items()}}
            r.update(impl.gradients(x64["q"], x64["k"], x64["v"], x64["dout"], c.metadata, {bug!r}, grads,
                                    mask=x64.get("mask"), bias=x64.get("bias"), query_mask=x64.get("query_mask"),
                                    in_dtype=c.input_dtype, seqlens_q=x64.get("seqlens_q"),
                                    seqlens_k=x64.get("seqlens_k"), sinks=x64.get("sinks")))
        return r
    c.assert_conforms(run)
"""


def outcome(text):
    """{'passed': n, 'failed': n, 'skipped': n} from pytest's last line."""
    last = text.strip().splitlines()[-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped)", last)}


def numpy_test(bug=None):
    return NUMPY_TEST.format(adapter=os.path.join(ROOT, "conformance", "adapters", "numpy"), core=CORE, bug=bug)


def test_numpy_implementation_passes_every_case_it_is_judged_on(tmp_path):
    status, out = run_pytest(tmp_path, numpy_test())
    n = outcome(out)
    assert status == 0, out[-3000:]
    assert n.get("failed", 0) == 0 and n["passed"] > 300
    assert n["passed"] + n["skipped"] == CORE_CASES
    # skips name their reason: the profile's dtypes, the feature declared unsupported
    assert "SKIPPED" in out and "profile fp32,fp16,bf16,fp8 does not cover F64 inputs" in out
    assert re.search(r"uses mha, declared unsupported by this test", out)
    # one item per case, named by the case id
    status, listing = run_pytest(tmp_path, numpy_test(), "--collect-only")
    assert "test_numpy_attention[normal-015]" in listing and "test_numpy_attention[long_rows-009]" in listing


def test_planted_bug_fails_with_its_diagnosis(tmp_path):
    status, out = run_pytest(tmp_path, numpy_test("causal_leak"), "--attnoracle-tag", "causal")
    n = outcome(out)
    assert status == 1 and n["failed"] > 0, out[-3000:]
    # the failure message is the gate's: the verdict, the worst element, its limit, the finding
    assert re.search(r"attnoracle: case \S+ fails under profile fp32,fp16,bf16,fp8:\nFAIL  ", out)
    assert re.search(r"worst: out\[[0-9,]+\]: expected .* x limit", out)
    assert "finding: " in out
    assert re.search(r"finding: \d+ masked positions got weight .*: masked by causal \(top_left\)", out)


def test_pytorch_example_passes(tmp_path):
    with open(os.path.join(ROOT, "python", "examples", "test_torch_sdpa.py")) as f:
        text = f.read()
    status, out = run_pytest(tmp_path, text)
    n = outcome(out)
    assert status == 0, out[-3000:]
    assert n.get("failed", 0) == 0 and n["passed"] > 50, out[-2000:]


def test_command_line_options_parametrize_a_test_without_decorator(tmp_path):
    text = """
def test_ids(attnoracle_case):
    assert attnoracle_case.profile == "fp16"
    assert attnoracle_case.input_dtype == "F16"
    v = attnoracle_case.check({n: attnoracle_case.golden[n] for n in attnoracle_case.outputs}
                              if attnoracle_case.expect == "ok" else ValueError("refused"))
    assert v.passed, v.text
"""
    status, out = run_pytest(tmp_path, text, "--attnoracle-suite", "vectors/core", "--attnoracle-profile", "fp16",
                             "--attnoracle-tag", "f16", "-vv")
    assert status == 0, out[-3000:]
    assert re.search(r"test_ids\[[\w.-]+\] PASSED", out)
    assert outcome(out).get("passed", 0) > 10


def test_usage_errors(tmp_path):
    status, out = run_pytest(tmp_path, "def test_x(attnoracle_case):\n    pass\n")
    assert status == 2 and "no vector set is given (--attnoracle-suite DIR" in out
    status, out = run_pytest(tmp_path, "def test_x(attnoracle_case):\n    pass\n", "--attnoracle-suite", "nowhere")
    assert status == 2 and "attnoracle: " in out and "nowhere: not a vector set directory" in out
    text = ("import attnoracle\n@attnoracle.parametrize_suite('vectors/core', unsupported=('casual',))\n"
            "def test_x(attnoracle_case):\n    pass\n")
    status, out = run_pytest(tmp_path, text)
    assert status == 2 and "unknown feature 'casual'" in out


GRADIENT_TEST = """
import attnoracle

@attnoracle.parametrize_suite({suite!r}, profile="fp32", unsupported={unsupported!r})
def test_features(attnoracle_case):
    c = attnoracle_case
    c.assert_conforms({{n: c.golden[n] for n in ("out", "scores", "dq", "dk", "dv", "dbias") if n in c.outputs}})
"""


def test_unsupported_skips_gradient_sinks_and_scores_cases(tmp_path):
    """A vector set of three cases (gradients, sinks, scores): each new feature declared
    unsupported skips its case, with the reason."""
    import hashlib
    import json

    import numpy as np

    import attnoracle
    from conftest import run_cli

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 2, 4), (1, 1, 3, 4), (1, 1, 3, 2)))
    suite = tmp_path / "set"
    (suite / "cases").mkdir(parents=True)
    kws = {"grad": dict(dout=np.ones((1, 2, 2, 2), np.float32), outputs=("out", "dv")),
           "sink": dict(sinks=np.array([0.5, -0.5], np.float32)), "score": dict(outputs=("out", "scores"))}
    cases = []
    for id, kw in kws.items():
        src = attnoracle.write_case(tmp_path / f"{id}.safetensors", q, k, v, **kw)
        dst = suite / "cases" / f"{id}.safetensors"
        assert run_cli("eval", src, "-o", str(dst), "-q").returncode == 0
        cases.append({"id": id, "file": f"cases/{id}.safetensors", "sha256": hashlib.sha256(dst.read_bytes()).hexdigest(),
                      "expect": "ok", "tags": []})
    (suite / "manifest.json").write_text(json.dumps({"format": "attnoracle-vectors/1", "suite": "features",
                                                     "generator": "test", "seed": 0, "cases": cases}))
    features = {e.id: e.load().features for e in attnoracle.Suite(suite)}
    assert "gradients" in features["grad"] and "sinks" in features["sink"] and "scores" in features["score"]
    assert not {"gradients", "sinks", "scores"} & features["grad"] - {"gradients"}
    status, out = run_pytest(tmp_path, GRADIENT_TEST.format(suite=str(suite), unsupported=()))
    assert status == 0 and outcome(out) == {"passed": 3}, out[-3000:]
    status, out = run_pytest(tmp_path, GRADIENT_TEST.format(suite=str(suite), unsupported=("gradients", "sinks")))
    assert status == 0 and outcome(out) == {"passed": 1, "skipped": 2}, out[-3000:]
    assert "case grad uses gradients, declared unsupported by this test" in out
    assert "case sink uses sinks, declared unsupported by this test" in out
    status, out = run_pytest(tmp_path, GRADIENT_TEST.format(suite=str(suite), unsupported=("scores",)))
    assert outcome(out) == {"passed": 2, "skipped": 1} and "case score uses scores" in out, out[-3000:]
