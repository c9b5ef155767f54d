"""Dropout with a given keep mask (CONTRACT section 10) through attnoracle.evaluate and
write_case: dropout_mask and dropout_p, p's exact double written as a C hex float."""

import numpy as np
import pytest

import attnoracle
from conftest import run_cli

OUTPUTS = ("out", "weights", "lse")


def problem():
    rng = np.random.default_rng(12)
    q = rng.integers(-8, 8, (1, 2, 3, 8)) / 8
    k = rng.integers(-8, 8, (1, 2, 4, 8)) / 8
    v = rng.integers(-8, 8, (1, 2, 4, 8)) / 8
    return q, k, v


def test_keys_dropped_for_every_row_equal_v_scaled_by_hand():
    # keep broadcast from [Nk]: O = A (keep / (1 - p) V), the case whose v is keep * v * 2 for p = 0.5
    q, k, v = problem()
    keep = np.array([True, False, True, True])
    a = attnoracle.evaluate(q, k, v, dropout_mask=keep, dropout_p=0.5, outputs=OUTPUTS)
    b = attnoracle.evaluate(q, k, v * keep[:, None] * 2, outputs=OUTPUTS)
    for name in ("out", "out.ref", "out.bound", "weights", "lse", "row.valid"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_all_kept_with_p_zero_is_the_case_without_dropout():
    q, k, v = problem()
    a = attnoracle.evaluate(q, k, v, dropout_mask=np.ones((1, 2, 3, 4), bool), dropout_p=0.0, outputs=OUTPUTS)
    b = attnoracle.evaluate(q, k, v, outputs=OUTPUTS)
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_dropout_p_float_is_its_exact_double(tmp_path):
    q, k, v = problem()
    keep = np.random.default_rng(13).integers(0, 2, (1, 2, 3, 4)).astype(bool)
    path = attnoracle.write_case(tmp_path / "dropout.safetensors", q, k, v, dropout_mask=keep, dropout_p=0.1)
    case = attnoracle.load_case(path)
    assert case.metadata["attn.dropout_p"] == (0.1).hex() == "0x1.999999999999ap-4"
    assert case.metadata["attn.dropout_p"] != "0.1"
    np.testing.assert_array_equal(case.inputs["dropout_mask"], keep)
    assert "dropout" in case.features and "kv_scale" not in case.features
    # a str is the exact value of its text
    assert attnoracle.load_case(attnoracle.write_case(tmp_path / "text.safetensors", q, k, v, dropout_mask=keep,
                                                      dropout_p="0.1")).metadata["attn.dropout_p"] == "0.1"
    out = tmp_path / "golden.safetensors"
    r = run_cli("eval", path, "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    golden = attnoracle.load_case(out).golden
    direct = attnoracle.evaluate(q, k, v, dropout_mask=keep, dropout_p=0.1)
    for name in ("out", "out.ref", "out.bound"):
        np.testing.assert_array_equal(golden[name], direct[name], err_msg=name)


def test_dropout_with_gradients():
    # dv = Z^T dout with Z = A * keep / (1 - p): with keys kept or dropped for every row, dv of the
    # dropped keys is 0, of the kept ones twice that of the case with v scaled by hand
    q, k, v = problem()
    keep = np.array([True, False, True, True])
    dout = np.random.default_rng(14).integers(-8, 8, (1, 2, 3, 8)) / 8
    a = attnoracle.evaluate(q, k, v, dropout_mask=keep, dropout_p=0.5, dout=dout, outputs=("out", "dv"))
    assert not a["dv"][:, :, 1].any()
    b = attnoracle.evaluate(q, k, v, dout=dout, outputs=("out", "dv"))
    np.testing.assert_array_equal(a["dv.ref"][:, :, keep], b["dv.ref"][:, :, keep] * 2)


def test_dropout_refusals():
    q, k, v = problem()
    keep = np.ones(4, bool)
    for p, match in ((1.0, r'attn.dropout_p: value "0x1.0000000000000p\+0" is not a number in \[0, 1\)'),
                     ("half", r'attn.dropout_p: value "half" is not a number'),
                     ([0.5], r"attn.dropout_p: not a number")):
        with pytest.raises(attnoracle.InputError, match=match):
            attnoracle.evaluate(q, k, v, dropout_mask=keep, dropout_p=p)
    with pytest.raises(attnoracle.InputError, match=r"dropout_mask: given, but attn.dropout_p is missing"):
        attnoracle.evaluate(q, k, v, dropout_mask=keep)
    with pytest.raises(attnoracle.InputError, match=r"attn.dropout_p: given, but the case has no dropout_mask"):
        attnoracle.evaluate(q, k, v, dropout_p=0.5)
    with pytest.raises(attnoracle.InputError, match=r"<arrays>: dropout_mask: a mask is boolean"):
        attnoracle.evaluate(q, k, v, dropout_mask=np.array([0.5, 1, 1, 1]), dropout_p=0.5)
    with pytest.raises(attnoracle.InputError, match=r"dropout_mask: shape \[3\] does not broadcast"):
        attnoracle.evaluate(q, k, v, dropout_mask=np.ones(3, bool), dropout_p=0.5)


def test_check_judges_against_the_mask_the_implementation_returns(tmp_path):
    # the implementation draws its own mask: judged against the case evaluated with that mask
    q, k, v = (a.astype(np.float32) for a in problem())
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, dropout_mask=np.ones((1, 2, 3, 4), bool),
                                 dropout_p=0.5)
    assert run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q").returncode == 0
    case = attnoracle.load_case(tmp_path / "g.safetensors")
    drawn = np.random.default_rng(3).random((1, 2, 3, 4)) >= 0.5
    mine = np.array(attnoracle.evaluate(q, k, v, dropout_mask=drawn, dropout_p=0.5)["out"])
    assert case.check({"out": mine, "dropout_mask": drawn}).passed
    assert case.check({"out": np.array(case.golden["out"]), "dropout_mask": drawn}).failed
    bad = case.check({"out": mine, "dropout_mask": drawn.astype(np.float32)})
    assert bad.failed and bad.reason.startswith("dropout_mask: returned as F32"), bad.reason
