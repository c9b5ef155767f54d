"""Refusals: InputError (a ValueError) with the command line's one-line message, nothing written."""

import numpy as np
import pytest

import attnoracle
from attnoracle import _attnoracle as native
from conftest import run_cli

F32 = np.float32


def arrays(hq=4, hkv=2):
    rng = np.random.default_rng(3)
    return dict(q=rng.standard_normal((1, hq, 2, 4)).astype(F32), k=rng.standard_normal((1, hkv, 3, 4)).astype(F32),
                v=rng.standard_normal((1, hkv, 3, 2)).astype(F32))


def fp8_arrays(hkv=2):
    """q, k, v of FP8 values (multiples of 1/4 up to 2: exact in E4M3 and E5M2), with descales."""
    rng = np.random.default_rng(4)
    a = {n: rng.integers(-8, 9, s) / 4 for n, s in (("q", (1, 4, 2, 4)), ("k", (1, hkv, 3, 4)), ("v", (1, hkv, 3, 2)))}
    a.update(q_descale=np.full((1, hkv), 0.5, F32), k_descale=np.full((1, hkv), 2.0, F32))
    return a


def raw_file(path, a, meta, input_dtype="F32"):
    """A file written without the case checks, as a user's own writer might write it: q, k, v in
    the input dtype, other floats F32, masks BOOL."""
    tensors = [attnoracle._float_tensor(n, x, input_dtype if n in ("q", "k", "v") else "F32", False, str(path))
               if x.dtype.kind == "f" else attnoracle._bool_tensor(n, x, path) for n, x in a.items()]
    native.write_file(str(path), tensors, {"attn.format": "1", **meta})


E4M3 = {"input_dtype": "F8_E4M3", "output_dtype": "F32"}
E4M3_META = {"attn.output_dtype": "F32"}
DOUT = np.ones((1, 4, 2, 2), F32)
GRAD = {"outputs": ("out", "dq")}
GRAD_META = {"attn.outputs": "out,dq"}
MHA = {n: np.ones(s, F32) for n, s in (("x_q", (1, 2, 4)), ("x_kv", (1, 3, 4)), ("w_q", (2, 4, 3)), ("w_k", (2, 4, 3)),
                                       ("w_v", (2, 4, 2)), ("w_o", (4, 4)))}

# (what is wrong, the arrays, evaluate's keywords, the metadata the same file holds)
REFUSALS = [
    ("hkv", arrays(4, 3), {}, {}),
    ("causal", arrays(), {"causal": "left"}, {"attn.causal": "left"}),
    ("window", arrays(), {"window": "1;2"}, {"attn.window": "1;2"}),
    ("scale", arrays(), {"scale": "1/2"}, {"attn.scale": "1/2"}),
    ("outputs", arrays(), {"outputs": ("out", "probs")}, {"attn.outputs": "out,probs"}),
    ("masked", dict(arrays(), mask=np.zeros((1, 1, 2, 3), bool)), {}, {}),
    ("fp8_output_dtype", fp8_arrays(), {"input_dtype": "F8_E5M2"}, {}),
    ("descale_shape", dict(fp8_arrays(), v_descale=np.ones((2, 1), F32)), E4M3, E4M3_META),
    ("descale_negative", dict(fp8_arrays(), k_descale=np.array([[1, -1]], F32)), E4M3, E4M3_META),
    ("descale_not_fp8", dict(arrays(), k_descale=np.ones((1, 2), F32)), {}, {}),
    ("sinks_shape", dict(arrays(), sinks=np.zeros(2, F32)), {}, {}),
    ("sinks_nan", dict(arrays(), sinks=np.array([0, np.nan, 0, 0], F32)), {}, {}),
    ("gradient_without_dout", arrays(), {"outputs": ("out", "dk")}, {"attn.outputs": "out,dk"}),
    ("dout_shape", dict(arrays(), dout=np.ones((1, 4, 2, 3), F32)), {"outputs": ("out", "dv")}, {"attn.outputs": "out,dv"}),
    ("dout_nan", dict(arrays(), dout=np.full((1, 4, 2, 2), np.nan, F32)), GRAD, GRAD_META),
    ("dbias_without_bias", dict(arrays(), dout=DOUT), {"outputs": "dbias"}, {"attn.outputs": "dbias"}),
    ("dsinks_without_sinks", dict(arrays(), dout=DOUT), {"outputs": "dsinks"}, {"attn.outputs": "dsinks"}),
    ("gradient_of_fp8", dict(fp8_arrays(), dout=DOUT), dict(E4M3, **GRAD), dict(E4M3_META, **GRAD_META)),
    ("dq_of_mha", dict(MHA, dout=np.ones((1, 2, 4), F32)), {"outputs": "dq"}, {"attn.kind": "mha", "attn.outputs": "dq"}),
    ("dout_of_mha_shape", dict(MHA, dout=np.ones((1, 2, 3), F32)), {"outputs": "dx_q"},
     {"attn.kind": "mha", "attn.outputs": "dx_q"}),
]


@pytest.mark.parametrize("what,a,kw,meta", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_is_the_command_lines(tmp_path, what, a, kw, meta):
    path = tmp_path / "case.safetensors"
    raw_file(path, a, meta, kw.get("input_dtype", "F32"))
    r = run_cli("eval", str(path), "-o", str(tmp_path / "out.safetensors"))
    assert r.returncode == 2 and not (tmp_path / "out.safetensors").exists()
    line = r.stderr.strip()
    assert line.startswith("attnoracle: error: " + str(path) + ": ")
    with pytest.raises(attnoracle.InputError) as e:
        attnoracle.evaluate(**a, **kw)
    assert isinstance(e.value, ValueError)
    assert "attnoracle: error: " + str(e.value).replace("<arrays>", str(path), 1) == line
    assert e.value.file == "<arrays>" and e.value.field and line.split(": ")[3] == e.value.field
    with pytest.raises(attnoracle.InputError) as e:
        attnoracle.load_case(path).evaluate() if what == "masked" else attnoracle.load_case(path)
    assert "attnoracle: error: " + str(e.value) == line
    # write_case refuses the same, and writes nothing
    target = tmp_path / "w.safetensors"
    if what != "masked":  # a fully masked row is refused by evaluation, not by the file's rules
        with pytest.raises(attnoracle.InputError) as e:
            attnoracle.write_case(target, **a, **kw)
        assert "attnoracle: error: " + str(e.value).replace(str(target), str(path), 1) == line
        assert not target.exists()


def test_a_file_of_mixed_dtypes_is_refused_as_by_eval(tmp_path):
    # arrays given in memory are all encoded in the input dtype; a file can mix them
    path = tmp_path / "mixed.safetensors"
    a = arrays()
    tensors = [attnoracle._float_tensor(n, x, "F64" if n == "k" else "F32", False, str(path)) for n, x in a.items()]
    native.write_file(str(path), tensors, {"attn.format": "1"})
    r = run_cli("eval", str(path), "-o", str(tmp_path / "out.safetensors"))
    with pytest.raises(attnoracle.InputError) as e:
        attnoracle.load_case(path)
    assert r.returncode == 2 and r.stderr.strip() == "attnoracle: error: " + str(e.value)
    assert str(e.value) == f"{path}: k: dtype F64 differs from q's F32"


def test_messages_of_the_python_side():
    a = arrays()
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: input_dtype is needed for an array of int64"):
        attnoracle.evaluate(np.ones((1, 1, 2, 4), np.int64), a["k"], a["v"])
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: input_dtype: 'F8' is not F64, F32, F16, BF16, F8_E4M3 or F8_E5M2$"):
        attnoracle.evaluate(**a, input_dtype="F8")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: element 0 \(flat index\), 1.0625, is not "
                                                     r"representable in F8_E4M3$"):
        attnoracle.evaluate(a["q"] * 0 + F32(1.0625), a["k"], a["v"], input_dtype="F8_E4M3", output_dtype="F32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: k: element 0 \(flat index\), 480, is not "
                                                     r"representable in F8_E4M3$"):  # 448 is E4M3FN's largest
        attnoracle.evaluate(a["q"] * 0, a["k"] * 0 + 480, a["v"] * 0, input_dtype="F8_E4M3", output_dtype="F32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: uint16 bit patterns are read only as BF16 or F16, "
                                                     r"not F8_E5M2$"):
        attnoracle.evaluate(np.zeros((1, 1, 2, 4), np.uint16), a["k"], a["v"], input_dtype="F8_E5M2")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: mask: a mask is boolean \(or 0 and 1\), not float32$"):
        attnoracle.evaluate(**a, mask=np.full((1, 1, 2, 3), 0.5, F32))
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: uint16 bit patterns are read only as BF16 or F16"):
        attnoracle.evaluate(np.zeros((1, 1, 2, 4), np.uint16), a["k"], a["v"], input_dtype="F32")
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: missing"):
        attnoracle.evaluate(k=a["k"], v=a["v"])
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: k: element 0 \(flat index\), .* not representable in F32$"):
        attnoracle.evaluate(a["q"], a["k"].astype(np.float64) + 2.0 ** -40, a["v"])


def test_write_case_into_a_missing_directory(tmp_path):
    target = tmp_path / "no" / "c.safetensors"
    with pytest.raises(attnoracle.InputError) as e:
        attnoracle.write_case(target, **arrays())
    assert str(e.value) == f"{target}: directory {target.parent} does not exist"


def test_check_refuses_an_unknown_profile(core, tmp_path):
    case = core["normal-015"].load()
    with pytest.raises(attnoracle.InputError) as e:
        case.check({"out": case.golden["out"]}, profile="fp31")
    r = run_cli("check", core.path, "--results", str(tmp_path), "--profile", "fp31")
    assert r.returncode == 2
    assert r.stderr.strip().split(": ", 3)[-1] == str(e.value).split(": ", 2)[-1]
