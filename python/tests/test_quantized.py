"""Quantized K/V (scaled I8 and FP8, mxfp8, nvfp4, V as a view of K) and FP8 outputs through
attnoracle.evaluate and write_case: each stored form evaluates as its F64 twin, the case holding
the real values, bit for bit (CONTRACT section 9)."""

import numpy as np
import pytest

import attnoracle
from attnoracle import _decode, _native
from conftest import run_cli
from test_paged import paged_problem

GOLDEN = ("out", "out.ref", "out.bound", "lse", "lse.ref", "weights", "row.valid")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def assert_twins(a, b, names=GOLDEN):
    for name in names:
        if name in b:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def fp8_bits(rng, shape, fp8="F8_E4M3"):
    """Finite patterns of both signs (E4M3: up to 0x7E, 0x7F is NaN; E5M2: up to 0x7B, infinity
    and the NaNs above)."""
    top = 0x7F if fp8 == "F8_E4M3" else 0x7C
    return (rng.integers(0, top, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)


def query(rng, d=32, hq=4):
    return rng.integers(-8, 8, (1, hq, 3, d)) / 8


OPTS = dict(output_dtype="F64", outputs=("out", "lse", "weights"))


@pytest.mark.parametrize("fp8", ["F8_E4M3", "F8_E5M2"])
def test_scaled_fp8_per_head_equals_twin(fp8):
    rng = np.random.default_rng(1)
    q, kb, vb = query(rng), fp8_bits(rng, (1, 2, 5, 32), fp8), fp8_bits(rng, (1, 2, 5, 32), fp8)
    ks = np.array([0.5, 3.0], np.float32).reshape(1, 2, 1, 1)
    vs = np.float32(0.125)
    a = attnoracle.evaluate(q, kb, vb, kv_dtype=fp8, k_scale=ks, v_scale=vs, **OPTS)
    b = attnoracle.evaluate(q, _decode(fp8, kb).astype(np.float64) * ks, _decode(fp8, vb).astype(np.float64) * vs,
                            **OPTS)
    assert_twins(a, b)
    # the same values as floats the format holds exactly: the same case
    c = attnoracle.evaluate(q, _decode(fp8, kb), _decode(fp8, vb), kv_dtype=fp8, k_scale=ks, v_scale=vs, **OPTS)
    assert_twins(c, a)


def test_scaled_int8_per_token_equals_twin():
    rng = np.random.default_rng(2)
    q = query(rng)
    k = rng.integers(-128, 128, (1, 2, 5, 32)).astype(np.int8)
    v = rng.integers(-128, 128, (1, 2, 5, 32)).astype(np.int8)
    ks = (rng.integers(1, 100, (1, 2, 5, 1)) / 1024).astype(np.float32)
    a = attnoracle.evaluate(q, k, v, k_scale=ks, v_scale=np.float32(1 / 64), **OPTS)  # int8 arrays: I8
    b = attnoracle.evaluate(q, k.astype(np.float64) * ks, v / 64.0, **OPTS)
    assert_twins(a, b)
    c = attnoracle.evaluate(q, k.astype(np.float32), v.astype(np.int64), kv_dtype="I8", k_scale=ks,
                            v_scale=np.float32(1 / 64), **OPTS)
    assert_twins(c, a)


def test_scaled_paged_per_slot_equals_twin():
    paged, _ = paged_problem()
    rng = np.random.default_rng(3)
    kc, vc = paged["k_cache"], paged["v_cache"]
    scale = (2.0 ** rng.integers(-2, 3, kc.shape[:3])).astype(np.float32)  # [Npages, P, Hkv], NHD
    a = attnoracle.evaluate(**paged, kv_dtype="F8_E4M3", k_scale=scale, v_scale=np.float32(2), output_dtype="F64")
    twin = dict(paged, k_cache=kc.astype(np.float64) * scale[..., None], v_cache=vc.astype(np.float64) * 2)
    assert_twins(a, attnoracle.evaluate(**twin, output_dtype="F64"))


def test_mxfp8_equals_twin():
    rng = np.random.default_rng(4)
    q, kb, vb = query(rng, 64), fp8_bits(rng, (1, 2, 5, 64)), fp8_bits(rng, (1, 2, 5, 64))
    kbs = rng.integers(120, 132, (1, 2, 5, 2)).astype(np.uint8)  # E8M0: 2^(e - 127), one per 32
    vbs = rng.integers(120, 132, (1, 2, 5, 2)).astype(np.uint8)

    def real(bits, e):
        return _decode("F8_E4M3", bits).astype(np.float64) * np.repeat(2.0 ** (e.astype(np.int64) - 127), 32, -1)

    a = attnoracle.evaluate(q, kb, vb, kv_block_scale="mxfp8", k_block_scale=kbs, v_block_scale=vbs, **OPTS)
    assert_twins(a, attnoracle.evaluate(q, real(kb, kbs), real(vb, vbs), **OPTS))


def nvfp4(rng, shape):
    """(packed uint8 [..., D / 2], the E2M1 values [..., D])."""
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    values = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), values


def test_nvfp4_equals_twin():
    rng = np.random.default_rng(5)
    q = query(rng)
    kp, kx = nvfp4(rng, (1, 2, 5, 32))
    vp, vx = nvfp4(rng, (1, 2, 5, 32))
    kbs = rng.integers(0x20, 0x50, (1, 2, 5, 2)).astype(np.uint8)  # F8_E4M3 patterns, one per 16
    vbs = _decode("F8_E4M3", rng.integers(0x20, 0x50, (1, 2, 5, 2)).astype(np.uint8))  # or their values
    kg, vg = np.float32(0.75), np.float32(1.5)
    a = attnoracle.evaluate(q, kp, vp, kv_block_scale="nvfp4", k_block_scale=kbs, v_block_scale=vbs,
                            k_global_scale=kg, v_global_scale=vg, **OPTS)
    k = kx * np.repeat(_decode("F8_E4M3", kbs).astype(np.float64), 16, -1) * kg
    v = vx * np.repeat(vbs.astype(np.float64), 16, -1) * vg
    assert_twins(a, attnoracle.evaluate(q, k, v, **OPTS))


def test_v_from_k_equals_twin():
    rng = np.random.default_rng(6)
    q, kb = query(rng), fp8_bits(rng, (1, 2, 5, 32), "F8_E5M2")
    ks = np.float32(0.25)
    a = attnoracle.evaluate(q, kb, kv_dtype="F8_E5M2", k_scale=ks, v_from_k=24, **OPTS)
    k = _decode("F8_E5M2", kb).astype(np.float64) * 0.25
    b = attnoracle.evaluate(q, k, k[..., :24].copy(), **OPTS)
    assert a["out"].shape == (1, 4, 3, 24)
    assert_twins(a, b)


@pytest.mark.parametrize("fp8", ["F8_E4M3", "F8_E5M2"])
def test_fp8_out_is_o_over_o_scale_and_amax(fp8):
    rng = np.random.default_rng(7)
    q, k, v = query(rng), rng.integers(-8, 8, (1, 2, 5, 32)) / 8, rng.integers(-64, 64, (1, 2, 5, 32)) / 4
    a = attnoracle.evaluate(q, k, v, output_dtype=fp8, o_scale=np.float32(0.25), outputs=("out", "amax"))
    b = attnoracle.evaluate(q, k, v, outputs=("out",))
    assert_twins(a, b, ("out.ref", "out.bound", "row.valid"))  # those of O itself
    # O / 0.25 is exact in F64, rounded once more to the FP8 format (F64's rounding of O decides
    # the FP8 one in this case: no value lies within an F64 ulp of an FP8 midpoint)
    expect = np.frombuffer(_native.encode(fp8, (b["out"] / 0.25).tobytes(), True, "", ""), np.uint8)
    np.testing.assert_array_equal(a.bits["out"].reshape(-1), expect)
    assert a["amax"].dtype == np.float32 and a["amax"] == np.float32(np.abs(b["out"]).max())


def test_write_case_quantized_evaluates_as_eval_does(tmp_path):
    rng = np.random.default_rng(8)
    q, kb = query(rng, 64), fp8_bits(rng, (1, 2, 5, 64))
    kbs = rng.integers(120, 132, (1, 2, 5, 2)).astype(np.uint8)
    opts = dict(kv_block_scale="mxfp8", k_block_scale=kbs, v_from_k=40, output_dtype="F8_E4M3",
                o_scale=np.float32(0.5), outputs=("out", "lse", "amax"))
    path = attnoracle.write_case(tmp_path / "mxfp8.safetensors", q, kb, **opts)
    out = tmp_path / "golden.safetensors"
    r = run_cli("eval", path, "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    case = attnoracle.load_case(out)
    assert case.dtypes["k"] == "F8_E4M3" and case.dtypes["k_block_scale"] == "U8"
    np.testing.assert_array_equal(case.inputs["k_block_scale"], kbs)
    assert case.metadata["attn.v_from_k"] == "40" and case.metadata["attn.kv_block_scale"] == "mxfp8"
    assert {"kv_block_scale", "v_from_k", "fp8_out", "amax"} <= case.features
    assert not {"kv_scale", "dropout", "fp8"} & case.features
    direct = attnoracle.evaluate(q, kb, **opts)
    for name in ("out", "out.ref", "lse", "amax"):
        np.testing.assert_array_equal(case.golden[name], direct[name], err_msg=name)


def test_write_case_int8_keeps_int8(tmp_path):
    rng = np.random.default_rng(9)
    k = rng.integers(-128, 128, (1, 1, 2, 8)).astype(np.int8)
    path = attnoracle.write_case(tmp_path / "i8.safetensors", query(rng, 8, 1), k, k, k_scale=np.float32(0.5),
                                 v_scale=np.float32(0.5), output_dtype="F32")
    case = attnoracle.load_case(path)
    assert case.dtypes["k"] == "I8" and case.inputs["k"].dtype == np.int8
    assert "kv_scale" in case.features and not {"kv_block_scale", "v_from_k", "fp8_out"} & case.features
    np.testing.assert_array_equal(case.inputs["k"], k)


def refusal(match, **kw):
    with pytest.raises(attnoracle.InputError, match=match) as e:
        attnoracle.evaluate(**kw)
    return e.value


def test_refusals_name_the_tensor_and_element():
    rng = np.random.default_rng(10)
    q, kb = query(rng), fp8_bits(rng, (1, 2, 5, 32))
    s = dict(k_scale=np.float32(1), v_scale=np.float32(1), output_dtype="F32")
    k = _decode("F8_E4M3", kb)
    k.reshape(-1)[3] = 0.3  # not an E4M3 value: refused, never rounded
    e = refusal(r"k: element 3 \(flat index\), 0.30000001192092896, is not representable in F8_E4M3",
                q=q, k=k, v=kb, kv_dtype="F8_E4M3", **s)
    assert e.field == "k"
    i8 = np.zeros((1, 2, 5, 32))
    i8.reshape(-1)[7] = 1.5
    refusal(r"v: element 7 \(flat index\), 1.5, is not representable in I8", q=q, k=i8.astype(np.int8), v=i8,
            kv_dtype="I8", **s)
    refusal(r"k: element 0 \(flat index\), 128, is not representable in I8", q=q, k=np.full((1, 2, 5, 32), 128),
            v=i8.astype(np.int8), kv_dtype="I8", **s)
    refusal(r"k: an array of uint8 with k_scale: give kv_dtype", q=q, k=kb, v=kb, **s)
    refusal(r"kv_dtype: 'F16' is not F8_E4M3, F8_E5M2 or I8", q=q, k=kb, v=kb, kv_dtype="F16", **s)
    refusal(r"k_scale: element 0 .* is not representable in F32", q=q, k=kb, v=kb, kv_dtype="F8_E4M3",
            k_scale=np.float64(0.1), v_scale=np.float32(1), output_dtype="F32")
    refusal(r"k: nvfp4 elements are uint8 bytes", q=q, k=np.zeros((1, 2, 5, 16)), v=kb[..., :16],
            kv_block_scale="nvfp4", output_dtype="F32")
    refusal(r"k_block_scale: element 1 \(flat index\), 256, is not representable in U8", q=q, k=kb, v=kb,
            kv_block_scale="mxfp8", k_block_scale=np.array([[[[1, 256]]]]), output_dtype="F32")
    refusal(r"attn.v_from_k: not an integer", q=q, k=kb, kv_dtype="F8_E4M3", k_scale=np.float32(1), v_from_k=2.5,
            output_dtype="F32")
    refusal(r"^<arrays>: kv_dtype: not given with kv_block_scale", q=q, k=kb, v=kb, kv_block_scale="mxfp8",
            kv_dtype="F8_E4M3", output_dtype="F32")
    # the reader's own refusals, with its message
    refusal(r"^<arrays>: attn.kv_block_scale", q=q, k=q, v=q, kv_block_scale="mxfp4", output_dtype="F32")
    refusal(r"^<arrays>: v: given with attn.v_from_k", q=q, k=kb, v=kb, v_from_k=8, kv_dtype="F8_E4M3", **s)
    refusal(r"^<arrays>: k_scale: element 0 is -1", q=q, k=kb, v=kb, kv_dtype="F8_E4M3", k_scale=np.float32(-1),
            v_scale=np.float32(1), output_dtype="F32")
    refusal(r"^<arrays>: o_scale:", q=q, k=q, v=q, output_dtype="F8_E4M3")


def test_write_case_refusal_writes_nothing(tmp_path):
    rng = np.random.default_rng(11)
    q = query(rng)
    path = tmp_path / "bad.safetensors"
    with pytest.raises(attnoracle.InputError, match=r"bad.safetensors: k: element 0 .* not representable in F8_E5M2"):
        attnoracle.write_case(path, q, np.full((1, 2, 5, 32), 0.3), np.zeros((1, 2, 5, 32)), kv_dtype="F8_E5M2",
                              k_scale=np.float32(1), v_scale=np.float32(1), output_dtype="F32")
    assert not path.exists()


def test_torch_int8_and_float8_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    q, k = query(rng, 8, 2), rng.integers(-128, 128, (1, 2, 5, 8)).astype(np.int8)
    s = dict(k_scale=np.float32(0.5), v_scale=np.float32(0.25), **OPTS)
    a = attnoracle.evaluate(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k), **s)  # int8: I8
    assert_twins(a, attnoracle.evaluate(q, k, k, kv_dtype="I8", **s))
    if hasattr(torch, "float8_e4m3fn"):  # PyTorch 2.1 and later: float8 tensors are their own dtype
        kb = fp8_bits(rng, (1, 2, 5, 8))
        t = torch.from_numpy(kb).view(torch.float8_e4m3fn)
        assert_twins(attnoracle.evaluate(q, t, t, **s), attnoracle.evaluate(q, kb, kb, kv_dtype="F8_E4M3", **s))
