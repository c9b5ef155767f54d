"""Split-KV partial states (kv_split_size, out_partial, lse_partial) and kind merge (o_partial,
lse_partial) through attnoracle.evaluate and write_case, against `attnoracle eval`."""

import math

import numpy as np
import pytest

import attnoracle
from conftest import run_cli


def test_partials_merge_back_into_the_whole():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 2, 3, 4), (1, 1, 7, 4), (1, 1, 7, 2)))
    sinks = np.array([0.5, -1.0], np.float32)
    r = attnoracle.evaluate(q, k, v, sinks=sinks, causal="bottom_right", kv_split_size=3,
                            outputs=("out", "lse", "out_partial", "lse_partial"), output_dtype="F64")
    assert r["out_partial"].shape == (3, 1, 2, 3, 2) and r["lse_partial"].shape == (3, 1, 2, 3)
    assert np.isneginf(r["lse_partial"][2, 0, :, 0]).all()        # query 0 sees keys 0..4 only
    assert (r["out_partial"][2, 0, :, 0] == 0).all()
    # the merge of the golden partials (float64 arithmetic) is the whole case within rounding
    lp, op = r["lse_partial.ref"], r["out_partial.ref"]
    m = np.maximum(lp.max(axis=0), sinks[None, :, None])
    z = np.exp(lp - m).sum(axis=0) + np.exp(sinks[None, :, None] - m)
    lse = m + np.log(z)
    np.testing.assert_allclose(lse, r["lse.ref"], rtol=0, atol=1e-14)
    np.testing.assert_allclose((np.exp(lp - lse)[..., None] * op).sum(axis=0), r["out.ref"], rtol=0, atol=1e-14)
    # and kind merge on them gives the same bits as the whole, to F32 rounding of the partials
    mg = attnoracle.evaluate(o_partial=op.astype(np.float32), lse_partial=lp, sinks=sinks.astype(np.float64),
                             outputs=("out", "lse"), output_dtype="F32")
    assert mg["out"].shape == (1, 2, 3, 2) and mg["lse"].shape == (1, 2, 3)
    np.testing.assert_allclose(mg["out"], r["out"], rtol=1e-6)
    np.testing.assert_allclose(mg["lse"], r["lse"], rtol=1e-6)


def test_merge_by_hand():
    o = np.array([np.nan, 1.0, 2.0], np.float32).reshape(3, 1, 1, 1, 1)
    lse = np.array([-np.inf, 0.0, 0.0], np.float32).reshape(3, 1, 1, 1)
    r = attnoracle.evaluate(o_partial=o, lse_partial=lse, outputs=("out", "lse"))
    assert r["out"].dtype == np.float32 and r["out"].ravel().tolist() == [1.5]
    assert r["lse.ref"].ravel().tolist() == [math.log(2)]
    assert "lse_partial" not in r                                   # an input of kind merge
    with pytest.raises(attnoracle.InputError, match="lse_partial: element 0 is \\+infinity"):
        attnoracle.evaluate(o_partial=o, lse_partial=-lse)
    r = attnoracle.evaluate(o_partial=o, lse_partial=np.array([np.inf, 0, 0], np.float32).reshape(3, 1, 1, 1),
                            lse_posinf="empty")
    assert r["out"].ravel().tolist() == [1.5]


def test_write_case_and_eval_agree(tmp_path):
    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=s) for s in ((1, 1, 2, 3), (1, 1, 5, 3), (1, 1, 5, 3)))
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, kv_split_size=2,
                                 outputs=("out", "out_partial", "lse_partial"), output_dtypes={"out_partial": "F32"})
    out = tmp_path / "g.safetensors"
    assert run_cli("eval", path, "-o", str(out), "-q").returncode == 0
    golden = attnoracle.load_case(out)
    r = attnoracle.evaluate(q, k, v, kv_split_size=2, outputs=("out", "out_partial", "lse_partial"),
                            output_dtypes={"out_partial": "F32"})
    assert r["out_partial"].dtype == np.float32 and r["out_partial"].shape == (3, 1, 1, 2, 3)
    np.testing.assert_array_equal(golden.golden["out_partial"], r["out_partial"])
    np.testing.assert_array_equal(golden.golden["lse_partial"], r["lse_partial"])
    merge = attnoracle.write_case(tmp_path / "m.safetensors", o_partial=r["out_partial"], lse_partial=r["lse_partial"])
    assert run_cli("eval", merge, "-o", str(tmp_path / "mg.safetensors"), "-q").returncode == 0
    m = attnoracle.load_case(tmp_path / "mg.safetensors")
    assert m.kind == "merge" and m.input_dtype == "F32" and "lse_partial" in m.inputs
    np.testing.assert_array_equal(m.golden["out"], m.evaluate()["out"])


def test_refusals():
    q = np.zeros((1, 1, 1, 1))
    with pytest.raises(attnoracle.InputError, match="attn.kv_split_size is missing"):
        attnoracle.evaluate(q, q, q, outputs=("out_partial",))
    with pytest.raises(attnoracle.InputError, match="attn.kv_split_size"):
        attnoracle.evaluate(q, q, q, kv_split_size=0)
