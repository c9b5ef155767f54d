"""Paged KV caches (k_cache, v_cache, block_table, kv_layout) and empty shapes through
attnoracle.evaluate and write_case."""

import numpy as np
import pytest

import attnoracle
from conftest import run_cli


def paged_problem(hnd=False):
    """Pages shuffled, page 2 shared by both rows, NaN in unused slots, an unused -1 entry; and
    the contiguous k, v gathered by hand."""
    rng = np.random.default_rng(5)
    P, pages, Hkv, D = 2, 5, 2, 4
    table = np.array([[4, 2, 0], [2, 1, -1]], np.int32)
    lk = np.array([5, 4], np.int32)
    kc = np.full((pages, P, Hkv, D), np.nan, np.float32)
    vc = np.full((pages, P, Hkv, D), np.nan, np.float32)
    k = np.zeros((2, Hkv, 6, D), np.float32)
    v = np.zeros((2, Hkv, 6, D), np.float32)
    for b in range(2):
        for j in range(lk[b]):
            page, slot = table[b, j // P], j % P
            if np.isnan(kc[page, slot, 0, 0]):
                kc[page, slot] = rng.integers(-8, 8, (Hkv, D)) / 8
                vc[page, slot] = rng.integers(-8, 8, (Hkv, D)) / 8
            k[b, :, j], v[b, :, j] = kc[page, slot], vc[page, slot]
    q = (rng.integers(-8, 8, (2, 4, 3, D)) / 8).astype(np.float32)
    if hnd:
        kc, vc = np.swapaxes(kc, 1, 2).copy(), np.swapaxes(vc, 1, 2).copy()
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table, seqlens_k=lk), dict(q=q, k=k, v=v, seqlens_k=lk)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_evaluate_paged_equals_contiguous(layout):
    paged, twin = paged_problem(layout == "HND")
    opts = dict(causal="bottom_right", outputs=("out", "weights", "lse"))
    a = attnoracle.evaluate(**paged, kv_layout=layout, **opts)
    b = attnoracle.evaluate(**twin, **opts)
    for name in ("out", "out.ref", "out.bound", "weights", "lse", "row.valid"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_write_case_paged_evaluates_as_eval_does(tmp_path):
    paged, _ = paged_problem(hnd=True)
    path = attnoracle.write_case(tmp_path / "paged.safetensors", **paged, kv_layout="HND")
    out = tmp_path / "golden.safetensors"
    r = run_cli("eval", path, "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    case = attnoracle.load_case(out)
    assert "k_cache" in case.inputs and "k" not in case.inputs    # the inputs as given
    assert "gqa" in case.features
    direct = attnoracle.evaluate(**paged, kv_layout="HND")
    np.testing.assert_array_equal(case.golden["out"], direct["out"])


def test_paged_refusals_name_the_field():
    paged, twin = paged_problem()
    bad = dict(paged, block_table=np.array([[4, 9, 0], [2, 1, -1]], np.int32))
    with pytest.raises(attnoracle.InputError, match=r"block_table: entry \[0, 1\] = 9 is outside \[0, 5\)"):
        attnoracle.evaluate(**bad)
    with pytest.raises(attnoracle.InputError, match="attn.kv_layout"):
        attnoracle.evaluate(**paged, kv_layout="DHN")
    with pytest.raises(attnoracle.InputError, match="k: given beside a paged KV cache"):
        attnoracle.evaluate(**paged, k=twin["k"])


def test_empty_shapes():
    z = attnoracle.evaluate(np.ones((2, 2, 3, 4), np.float32), np.ones((2, 1, 0, 4), np.float32),
                            np.ones((2, 1, 0, 2), np.float32), masked_rows="zero", outputs=("out", "weights", "lse"))
    np.testing.assert_array_equal(z["out"], np.zeros((2, 2, 3, 2), np.float32))
    assert z["weights"].shape == (2, 2, 3, 0)
    assert np.all(z["lse"] == -np.inf)
    e = attnoracle.evaluate(np.ones((0, 2, 3, 4), np.float32), np.ones((0, 1, 5, 4), np.float32),
                            np.ones((0, 1, 5, 2), np.float32))
    assert e["out"].shape == (0, 2, 3, 2)


def test_fp8_paged_with_descales_through_eval(tmp_path):
    """Descales apply to the gathered keys and values as to contiguous ones; eval's oracle
    re-gathers the FP8 caches (descales applied) and passes."""
    paged, twin = paged_problem(hnd=True)
    d = dict(q_descale=np.array([[0.5, 2], [1, 0.25]], np.float32), k_descale=np.array([[2, 0.5], [0.125, 1]], np.float32),
             v_descale=np.array([[1, 3], [0.5, 2]], np.float32))
    o = dict(input_dtype="F8_E4M3", output_dtype="BF16", causal="bottom_right", outputs=("out", "lse"))
    a = attnoracle.evaluate(**paged, kv_layout="HND", **d, **o)
    b = attnoracle.evaluate(**twin, **d, **o)
    for name in ("out", "out.ref", "lse"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    path = attnoracle.write_case(tmp_path / "fp8.safetensors", **paged, kv_layout="HND", **d, **o)
    r = run_cli("eval", path, "-o", str(tmp_path / "fp8.out.safetensors"), "-q")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(attnoracle.load_case(tmp_path / "fp8.out.safetensors").golden["out"], a["out"])
