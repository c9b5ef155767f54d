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


def raw_file(path, a, meta):
    """A file written without the case checks, as a user's own writer might write it."""
    tensors = [attnoracle._float_tensor(n, x, "F32", False, path) if x.dtype.kind == "f"
               else attnoracle._bool_tensor(n, x, path) for n, x in a.items()]
    native.write_file(str(path), tensors, {"attn.format": "1", **meta})


# (what is wrong, the arrays, evaluate's keywords, the metadata the same file holds)
REFUSALS = [
    ("hkv", arrays(4, 3), {}, {}),
    ("causal", arrays(), {"causal": "left"}, {"attn.causal": "left"}),
    ("window", arrays(), {"window": "1;2"}, {"attn.window": "1;2"}),
    ("scale", arrays(), {"scale": "1/2"}, {"attn.scale": "1/2"}),
    ("outputs", arrays(), {"outputs": ("out", "probs")}, {"attn.outputs": "out,probs"}),
    ("masked", dict(arrays(), mask=np.zeros((1, 1, 2, 3), bool)), {}, {}),
]


@pytest.mark.parametrize("what,a,kw,meta", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_is_the_command_lines(tmp_path, what, a, kw, meta):
    path = tmp_path / "case.safetensors"
    raw_file(path, a, meta)
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
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: input_dtype: 'F8' is not F64, F32, F16 or BF16$"):
        attnoracle.evaluate(**a, input_dtype="F8")
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
