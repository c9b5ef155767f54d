"""assert_close: a kernel's outputs judged by the gate's own code against golden values evaluated
in memory; its profiles (names, keyword fields), its refusals."""

import json

import numpy as np
import pytest

import attnoracle
from conftest import run_cli


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNORACLE_CACHE", str(tmp_path / "cache"))


def inputs(shape=(1, 2, 6, 8), kv_heads=None, dtype=np.float32, seed=0, nk=None):
    rng = np.random.default_rng(seed)
    b, h, n, d = shape
    kvh = kv_heads or h
    q = rng.standard_normal((b, h, n, d)).astype(dtype)
    k = rng.standard_normal((b, kvh, nk or n, d)).astype(dtype)
    v = rng.standard_normal((b, kvh, nk or n, d)).astype(dtype)
    return q, k, v


def upcast_attention(q, k, v, causal=None, scale=None):
    """The usual test's reference: float64 softmax(q k^T) v, rounded to the inputs' dtype."""
    import torch

    qd, kd, vd = (torch.as_tensor(np.asarray(x, np.float64)) if not hasattr(x, "dtype") or isinstance(x, np.ndarray)
                  else x.double() for x in (q, k, v))
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * (scale or qd.shape[-1] ** -0.5)
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq if causal == "bottom_right" else 0)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ vd


def test_golden_output_passes_and_returns_the_verdict():
    q, k, v = inputs()
    golden = attnoracle.evaluate(q, k, v)["out"]
    verdict = attnoracle.assert_close(golden, q, k, v, profile="fp32")
    assert verdict.passed and verdict.profile == "fp32" and verdict.worst["error"] == 0
    # an F32 kernel computing in float64 then rounding once passes too, with GQA by the shapes
    q, k, v = inputs((2, 4, 9, 16), kv_heads=2, seed=1)
    out = upcast_attention(q, k, v, causal="top_left").float()
    assert attnoracle.assert_close(out, q, k, v, profile="fp32", causal=True).passed
    assert attnoracle.assert_close(out.numpy(), q, k, v, profile="fp32", causal="top_left").passed


def test_a_wrong_element_fails_with_the_gates_verdict():
    q, k, v = inputs()
    out = np.array(attnoracle.evaluate(q, k, v)["out"])
    out[0, 1, 3, 5] += 1e-3
    with pytest.raises(AssertionError) as e:
        attnoracle.assert_close(out, q, k, v, profile="fp32")
    msg = str(e.value)
    assert msg.startswith("attnoracle: the kernel's outputs fail under profile fp32:\nFAIL  assert_close")
    assert "worst: out[0,1,3,5]" in msg and "limit" in msg
    # the same verdict as Case.check on the same case, written as a file and evaluated by the command
    ok = np.array(attnoracle.evaluate(q, k, v)["out"])
    assert attnoracle.assert_close(ok, q, k, v, profile="fp32").passed


def test_verdict_equals_attnoracle_check_on_the_same_case(tmp_path):
    q, k, v = inputs((1, 2, 5, 8), seed=3)
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, causal="bottom_right", masked_rows="zero")
    assert run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q").returncode == 0
    case = attnoracle.load_case(tmp_path / "g.safetensors")
    out = np.array(case.golden["out"], np.float64)
    out[0, 0, 2, 1] *= 1 + 2e-6
    out = out.astype(np.float32)
    expected = case.check({"out": out}, profile="fp32")
    with pytest.raises(AssertionError) as e:
        attnoracle.assert_close(out, q, k, v, profile="fp32", causal="bottom_right")
    got = e.value.verdict
    assert expected.failed and dict(got.report, id=case.id) == expected.report
    assert str(e.value).split("\n")[2:] == expected.text.split("\n")[1:]


def test_torch_bf16_inputs_are_read_exactly_and_judged_in_bf16():
    import torch

    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in inputs((1, 2, 16, 32), seed=4))
    out = upcast_attention(q, k, v).to(torch.bfloat16)  # rounded once: the golden BF16 values
    v1 = attnoracle.assert_close(out, q, k, v, profile="bf16")
    assert v1.passed
    golden = attnoracle.evaluate(q, k, v)
    assert golden.bits["out"].tolist() == out.view(torch.int16).numpy().view(np.uint16).tolist()
    # an F32 output of BF16 inputs is judged as F32 (attn.output_dtype F32)
    assert attnoracle.assert_close(upcast_attention(q, k, v).float(), q, k, v, profile="bf16").passed
    with pytest.raises(AssertionError, match="worst: out"):
        attnoracle.assert_close(out.float() * 1.01, q, k, v, profile="bf16")


def test_profile_from_keywords_is_the_gates_profile():
    import torch

    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in inputs((1, 1, 40, 16), seed=5))
    out = upcast_attention(q, k, v).to(torch.bfloat16)
    bad = out.clone()
    bad[0, 0, 7, 3] += 0.0625
    texts = []
    for profile in ("flash-bf16", attnoracle.Profile(p_dtype="BF16", name="flash-bf16"),
                    {"base": "bf16", "p": "BF16", "name": "flash-bf16"},
                    attnoracle.Profile("bf16", p_dtype=torch.bfloat16, name="flash-bf16", key_block=16)):
        with pytest.raises(AssertionError) as e:
            attnoracle.assert_close(bad, q, k, v, profile=profile)
        texts.append(str(e.value))
        assert attnoracle.assert_close(out, q, k, v, profile=profile).passed
    assert texts[1:] == texts[:1] * 3
    # a wider key block and an F16 accumulation change the limits: a larger limit, the same element
    wide = attnoracle.Profile(accum="F16", key_block=0, safety=8)
    assert attnoracle.assert_close(bad, q, k, v, profile=wide).profile == "custom"
    with pytest.raises(attnoracle.InputError, match=r"^profile: colour: unknown profile field$"):
        attnoracle.assert_close(out, q, k, v, profile=attnoracle.Profile(colour="blue"))
    with pytest.raises(attnoracle.InputError, match=r"^profile: key_block: must be an integer >= 0"):
        attnoracle.assert_close(out, q, k, v, profile={"key_block": -1})
    with pytest.raises(attnoracle.InputError, match="unknown profile 'fp31'"):
        attnoracle.assert_close(out, q, k, v, profile="fp31")
    with pytest.raises(attnoracle.InputError, match=r"^profile: profile fp32 does not cover BF16 inputs$"):
        attnoracle.assert_close(out, q, k, v, profile="fp32")


def test_outputs_and_gradients_in_a_dict():
    q, k, v = inputs((1, 2, 5, 4), dtype=np.float64, seed=6)
    dout = np.random.default_rng(7).standard_normal((1, 2, 5, 4))
    names = ("out", "lse", "weights", "dq", "dk", "dv")
    g = attnoracle.evaluate(q, k, v, dout=dout, outputs=names, causal=True)
    actual = {n: g[n] for n in names}
    v1 = attnoracle.assert_close(actual, q, k, v, dout=dout, causal=True, profile="fp64")
    assert v1.passed and {t["tensor"] for t in v1.report["tensors"]} >= set(names)
    bad = dict(actual, dk=np.array(g["dk"]))
    bad["dk"][0, 1, 2, 3] += 1e-9
    with pytest.raises(AssertionError, match=r"worst: dk\[0,1,2,3\]"):
        attnoracle.assert_close(bad, q, k, v, dout=dout, causal=True, profile="fp64")
    with pytest.raises(attnoracle.InputError, match="dout"):
        attnoracle.assert_close({"out": g["out"], "dq": g["dq"]}, q, k, v, causal=True, profile="fp64")


def test_an_f32_lse_beside_a_bf16_out_is_judged_in_f32():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.as_tensor(x).to(torch.bfloat16) for x in inputs((1, 2, 64, 64), seed=10))
    g = attnoracle.evaluate(q, k, v, outputs=("out", "lse"), output_dtypes={"lse": "F32"})
    out, lse = torch.as_tensor(np.asarray(g["out"], np.float32)).to(torch.bfloat16), torch.as_tensor(g["lse"])
    assert lse.dtype == torch.float32
    verdict = attnoracle.assert_close({"out": out, "lse": lse}, q, k, v, profile="flash-bf16")
    assert verdict.passed and {t["tensor"]: t["dtype"] for t in verdict.report["tensors"]}["lse"] == "F32"
    # an lse that went through BF16: within a BF16 ulp, hundreds of F32 ulps off
    coarse = lse.to(torch.bfloat16).float()
    assert (coarse != lse).any()
    with pytest.raises(AssertionError, match=r"lse"):
        attnoracle.assert_close({"out": out, "lse": coarse}, q, k, v, profile="flash-bf16")
    # the same values given as float32 arrays, their dtypes named
    named = attnoracle.assert_close({"out": out.float().numpy(), "lse": lse.numpy()}, q, k, v, profile="flash-bf16",
                                    output_dtype="BF16", output_dtypes={"lse": "F32"})
    assert named.passed


def test_fully_masked_rows_under_the_kernels_convention():
    q, k, v = inputs((1, 1, 6, 8), nk=3, seed=8)  # bottom_right with Nq > Nk: rows 0..2 see no key
    g = attnoracle.evaluate(q, k, v, causal="bottom_right", masked_rows="zero")
    out = np.array(g["out"])
    assert not out[0, 0, :3].any()
    assert attnoracle.assert_close(out, q, k, v, causal="bottom_right", profile="fp32").passed
    nan = out.copy()
    nan[0, 0, :3] = np.nan
    assert attnoracle.assert_close(nan, q, k, v, causal="bottom_right", masked_rows="nan", profile="fp32").passed
    with pytest.raises(AssertionError):
        attnoracle.assert_close(nan, q, k, v, causal="bottom_right", profile="fp32")
    with pytest.raises(attnoracle.InputError, match="fully masked row at b=0, h=0, i=0"):
        attnoracle.assert_close(out, q, k, v, causal="bottom_right", masked_rows="error", profile="fp32")


def test_statistical_tier_rejects_errors_all_one_way():
    q, k, v = inputs((1, 4, 64, 64), seed=9)
    g = attnoracle.evaluate(q, k, v)
    golden = np.array(g["out"])
    # every element 8 F32 ulps up: each far within its limit, the bias not
    biased = golden
    for _ in range(8):
        biased = np.nextafter(biased, np.float32(np.inf))
    with pytest.raises(AssertionError) as e:
        attnoracle.assert_close(biased, q, k, v, profile="fp32")
    assert "out: biased: mean normalised error" in str(e.value)
    assert e.value.verdict.worst["limit_ratio"] < 0.01


def test_refusals():
    q, k, v = inputs()
    out = attnoracle.evaluate(q, k, v)["out"]
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: k: dtype F16 differs from q's F32"):
        attnoracle.assert_close(out, q, k.astype(np.float16), v, profile="fp32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: output_dtypes: lse: not an output the kernel returned"):
        attnoracle.assert_close(out, q, k, v, profile="fp32", output_dtypes={"lse": "F32"})
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: output: unknown output"):
        attnoracle.assert_close({"out": out, "output": out}, q, k, v, profile="fp32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: out: missing"):
        attnoracle.assert_close({"lse": out}, q, k, v, profile="fp32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: masked_rows: 'zeros' is not"):
        attnoracle.assert_close(out, q, k, v, profile="fp32", masked_rows="zeros")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: out: an array of int64 is not an output"):
        attnoracle.assert_close(np.zeros((1, 2, 6, 8), np.int64), q, k, v, profile="fp32")
    # an output given for another output dtype is never rounded silently
    with pytest.raises(attnoracle.InputError, match=r"^actual: out: element 0 .* is not representable in BF16"):
        attnoracle.assert_close(out, q, k, v, profile="fp32", output_dtype="BF16")
    # the case's own refusals, as evaluate gives them
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: k: "):
        attnoracle.assert_close(out, q, k[:, :, :, :4], v, profile="fp32")


def test_profile_json_is_the_gates_json_form():
    p = attnoracle.Profile(accum="fp32", p_dtype="bfloat16", key_block=64, name="mine")
    j = json.loads(p.json("BF16"))
    assert j == {"name": "mine", "base": "bf16", "qk_accum": "F32", "pv_accum": "F32", "p": "BF16", "key_block": 64}
    assert json.loads(attnoracle.Profile("flash-fp16").json("BF16"))["base"] == "flash-fp16"


def test_flash_attention_example_passes_both_ways(tmp_path):
    """python/examples/test_flash_attention.py on a slice of its grid: the classic comparison and
    assert_close both pass the kernel, forward and backward, MHA and MQA, F16 and BF16, causal
    with fully masked rows (Nq > Nk, bottom right)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, ATTNORACLE_CACHE=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(ROOT, "python", "examples", "test_flash_attention.py"),
                        "-k", "64-113-203-mqa-1 or bf16-causal-128-200-64-mha-2"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0 and "10 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_kind_mha_by_its_inputs():
    rng = np.random.default_rng(12)
    f = lambda *s: rng.standard_normal(s).astype(np.float64)  # noqa: E731
    x = f(1, 5, 6)
    mha = dict(x_q=x, x_kv=x, w_q=f(2, 6, 3), w_k=f(2, 6, 3), w_v=f(2, 6, 4), w_o=f(8, 6))
    out = np.array(attnoracle.evaluate(**mha, causal=True)["out"])
    assert attnoracle.assert_close(out, **mha, causal=True, profile="fp64").passed
    out[0, 4, 5] += 1e-6
    with pytest.raises(AssertionError, match=r"worst: out\[0,4,5\]"):
        attnoracle.assert_close(out, **mha, causal=True, profile="fp64")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: w_k: dtype F32 differs from x_q's F64"):
        attnoracle.assert_close(out, **dict(mha, w_k=mha["w_k"].astype(np.float32)), causal=True, profile="fp64")


def test_profile_json_text_refusals():
    q, k, v = inputs((1, 1, 3, 4))
    tensors, meta = attnoracle._case_tensors(dict(q=q, k=k, v=v), scale=None, causal=None, window=None, softcap=None,
                                             masked_rows=None, outputs=("out",), input_dtype=None, output_dtype=None,
                                             round_values=False, file="<arrays>")
    golden, gmeta, _ = attnoracle._native.evaluate(tensors, meta, "<arrays>", 1, 2048)
    result = [t for t in golden if t[0] == "out"]

    def check(text):
        return attnoracle._native.check("c", [], tensors + golden, gmeta, "ok", "output", "", result, "", "", "", text)

    assert '"status": "pass"' in check('{"base": "fp32"}')[0].replace('":"', '": "')
    for text, what in (("{", r"^profile: not JSON: "), ("[" * 70 + "]" * 70, r"^profile: not JSON: nested deeper than 64"),
                       ("[]", r"^profile: a profile is a JSON object$"), ('{"base": "fp99"}', r"unknown profile 'fp99'"),
                       ('{"p": "F8_E5M2"}', r"^profile: p: must be one of F64, F32, F16, BF16, F8_E4M3$")):
        with pytest.raises(attnoracle.InputError, match=what):
            check(text)
