"""attnoracle.evaluate on arrays against `attnoracle eval` on the case file, on every core case."""

import concurrent.futures
import os

import numpy as np
import pytest

import attnoracle
from attnoracle import _attnoracle as native
from conftest import CORE, CORE_CASES, run_cli


def arrays_of(case):
    """evaluate()'s arguments for a case, from its arrays: BF16 and FP8 inputs as float32 values,
    a BF16 or FP8 bias, sinks or dout as bit patterns, options from the metadata texts."""
    kw = {}
    for name, a in case.inputs.items():
        side = name in ("bias", "sinks", "dout") and case.dtypes[name] in ("BF16", "F8_E4M3", "F8_E5M2")
        kw[name] = case.bits[name] if side else a
    if case.input_dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
        kw["input_dtype"] = case.input_dtype
    kw.update(scale=case.scale, causal=case.causal, window=case.window, softcap=case.softcap,
              masked_rows=case.masked_rows, outputs=case.outputs, output_dtype=case.metadata.get("attn.output_dtype"))
    return kw


def golden_bytes(tensors):
    return {name: (dtype, tuple(shape), bytes(data)) for name, dtype, shape, data in tensors}


@pytest.fixture(scope="module")
def cli_goldens(core, tmp_path_factory):
    """`attnoracle eval` on every core case: {id: (exit status, stderr, output path)}."""
    out = tmp_path_factory.mktemp("eval")

    def one(entry):
        path = str(out / f"{entry.id}.safetensors")
        r = run_cli("eval", entry.file, "-o", path, "--threads", "1", "-q")
        return entry.id, (r.returncode, r.stderr.strip(), path)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return dict(pool.map(one, list(core)))


def test_evaluate_is_eval_bit_for_bit_on_every_core_case(core, cli_goldens):
    kinds = {"ok": 0, "refused": 0, "BF16": 0, "mha": 0, "sinks": 0, "fp8": 0, "descales": 0, "scores": 0}
    for entry in core:
        case = entry.load()
        status, err, path = cli_goldens[entry.id]
        if entry.expect == "error":
            assert status == 2, entry.id
            with pytest.raises(attnoracle.InputError) as e:
                attnoracle.evaluate(**arrays_of(case), threads=2)
            # the same line, the file named "<arrays>" for arrays given in memory
            assert "attnoracle: error: " + str(e.value).replace("<arrays>", entry.file, 1) == err
            with pytest.raises(attnoracle.InputError) as e:
                case.evaluate(threads=2)
            assert "attnoracle: error: " + str(e.value) == err
            assert e.value.field == "mask"
            kinds["refused"] += 1
            continue
        assert status == 0, (entry.id, err)
        r = attnoracle.evaluate(**arrays_of(case), threads=2)
        expected = attnoracle.load_case(path)
        assert golden_bytes(r.tensors) == golden_bytes(expected.golden.tensors), entry.id
        assert r.metadata["attn.undecided"] == expected.metadata["attn.undecided"]
        assert r.metadata["attn.reference"] == expected.metadata["attn.reference"]
        # the arrays of the Result are the decoded tensors
        for name, a in r.items():
            assert np.array_equal(a, expected.golden[name], equal_nan=True), (entry.id, name)
        kinds["ok"] += 1
        kinds["BF16"] += case.input_dtype == "BF16"
        kinds["mha"] += case.kind == "mha"
        for f in ("sinks", "fp8", "descales", "scores"):
            kinds[f] += f in case.features
    assert kinds["ok"] + kinds["refused"] == len(core) == CORE_CASES
    assert kinds["refused"] > 0 and kinds["BF16"] > 0 and kinds["mha"] > 0
    # every case of the families with sinks, FP8 inputs, descales and scores was evaluated
    for f in ("sinks", "fp8", "descales", "scores"):
        assert kinds[f] == sum(f in e.tags for e in core) > 0, f


def test_result_holds_the_golden_tensors():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2)))
    r = attnoracle.evaluate(q, k, v, causal=True, outputs=("out", "weights", "lse"), threads=1)
    assert set(r) == {"out", "out.ref", "out.bound", "row.valid", "weights", "weights.ref", "lse", "lse.ref"}
    assert r["out"].dtype == np.float32 and r["out"].shape == (1, 2, 3, 2)
    assert r["out.ref"].dtype == np.float64 and r["row.valid"].dtype == np.bool_ and r["row.valid"].all()
    assert r.undecided == {} and r.stats["undecided"] == 0
    # row 0 attends key 0 alone (causal top_left): its output is v[0] exactly, its weight 1
    assert np.array_equal(r["out"][0, :, 0], np.broadcast_to(v[0, 0, 0], (2, 2)))
    assert np.array_equal(r["weights"][0, :, 0, 0], [1.0, 1.0])
    assert np.array_equal(r["weights"][0, :, 0, 1:], np.zeros((2, 4)))
    # the float64 reference of a plain computation is within the bound
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), np.repeat(k, 2, axis=1)) / 2.0
    s = np.where(np.tril(np.ones((3, 5), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = w @ np.repeat(v, 2, axis=1).astype(np.float64)
    assert np.allclose(out, r["out.ref"], rtol=1e-12, atol=1e-14)


def test_output_dtypes_give_an_output_its_own_dtype(tmp_path):
    # BF16 out with an F32 lse (attn.output_dtypes), as a dict or as the metadata's text
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 2)))
    kw = dict(outputs=("out", "lse"), output_dtype="BF16", threads=1)
    r = attnoracle.evaluate(q, k, v, output_dtypes={"lse": "F32"}, **kw)
    assert r.tensors == attnoracle.evaluate(q, k, v, output_dtypes="lse:F32", **kw).tensors
    dtypes = {name: dtype for name, dtype, *_ in r.tensors}
    assert dtypes["out"] == "BF16" and dtypes["lse"] == "F32" and dtypes["lse.ref"] == "F64"
    assert r.metadata["attn.output_dtypes"] == "lse:F32"
    plain = attnoracle.evaluate(q, k, v, **kw)
    assert np.array_equal(r["out"], plain["out"]) and np.array_equal(r["lse.ref"], plain["lse.ref"])
    assert r["lse"].dtype == np.float32 and not np.array_equal(r["lse"], plain["lse"])
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, output_dtypes={"lse": "F32"}, outputs=("out", "lse"),
                                 output_dtype="BF16")
    assert attnoracle.load_case(path).metadata["attn.output_dtypes"] == "lse:F32"
    with pytest.raises(attnoracle.InputError, match="attn.output_dtypes: value \"lse:F8_E4M3\" is not"):
        attnoracle.evaluate(q, k, v, output_dtypes="lse:F8_E4M3", **kw)


def test_bf16_from_float32_values_from_bits_and_from_torch():
    import torch

    x = [torch.randn(s, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
         for n, s in enumerate(((1, 1, 2, 8), (1, 1, 3, 8), (1, 1, 3, 8)))]
    from_torch = attnoracle.evaluate(*x, threads=1)
    values = [t.float().numpy() for t in x]
    from_values = attnoracle.evaluate(*values, input_dtype="BF16", threads=1)
    bits = [t.view(torch.int16).numpy().view(np.uint16) for t in x]
    from_bits = attnoracle.evaluate(*bits, input_dtype="BF16", threads=1)
    assert golden_bytes(from_torch.tensors) == golden_bytes(from_values.tensors) == golden_bytes(from_bits.tensors)
    assert from_torch["out"].dtype == np.float32 and from_torch.bits["out"].dtype == np.uint16
    assert np.array_equal((from_torch.bits["out"].astype(np.uint32) << 16).view(np.float32), from_torch["out"])
    # float32 values BF16 does not hold are refused, never rounded silently
    bad = values[0].copy()
    bad[0, 0, 1, 3] = np.float32(1 + 2.0 ** -10)
    with pytest.raises(attnoracle.InputError, match=r"^<arrays>: q: element 11 \(flat index\), 1.0009765625, is not "
                                                     r"representable in BF16$"):
        attnoracle.evaluate(bad, values[1], values[2], input_dtype="BF16")


def test_write_case_rounds_with_the_format_library_and_eval_reads_it(tmp_path):
    q = np.array([[[[1 + 2.0 ** -9, 0.1]]]])  # float64 values, rounded to nearest-even into BF16
    k = np.array([[[[1.0, 2.0], [3.0, -1.0]]]])
    v = np.array([[[[0.5], [1.0 / 3]]]])
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, input_dtype="BF16", scale="0.1",
                                 metadata={"gen.note": "from python"})
    c = attnoracle.load_case(path)
    assert c.dtypes == {"q": "BF16", "k": "BF16", "v": "BF16"}
    assert c.metadata == {"attn.format": "1", "attn.scale": "0.1", "gen.note": "from python"}
    # 1 + 2^-9 is below half an ulp (2^-7) above 1; 0.1 rounds up to 0x3dcd
    assert c.bits["q"].tolist() == [[[[0x3F80, 0x3DCD]]]]
    assert c.inputs["q"].dtype == np.float32 and c.inputs["q"][0, 0, 0, 0] == 1.0
    with pytest.raises(attnoracle.InputError, match="not representable in BF16"):
        attnoracle.write_case(tmp_path / "d.safetensors", q, k, v, input_dtype="BF16", round_inputs=False)
    assert not (tmp_path / "d.safetensors").exists()
    r = run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q")
    assert r.returncode == 0, r.stderr
    assert golden_bytes(c.evaluate(threads=1).tensors) == golden_bytes(
        attnoracle.load_case(tmp_path / "g.safetensors").golden.tensors)


def test_undecided_elements_are_reported_with_both_candidates():
    # Scores 0, 0, 1 with v = 1, 1 + 2^-10, 1 + 2^-11: the output is exactly 1 + 2^-11, the
    # midpoint of two F16 values, which no enclosure can settle.
    f = np.float32
    r = attnoracle.evaluate(np.ones((1, 1, 1, 1), f), np.array([0, 0, 1], f).reshape(1, 1, 3, 1),
                            np.array([1, 1 + 2.0 ** -10, 1 + 2.0 ** -11], f).reshape(1, 1, 3, 1), output_dtype="F16")
    assert r.stats["undecided"] == 1 and r.metadata["attn.undecided"] == "1"
    assert r.undecided["out"].tolist() == [0] and set(r.undecided) == {"out"}
    assert sorted([float(r["out"][0, 0, 0, 0]), float(r.alt["out"][0])]) == [1.0, 1 + 2.0 ** -10]
    assert r["out.ref"][0, 0, 0, 0] == 1 + 2.0 ** -11  # in F64 it is proven
    assert r["out"].dtype == np.float16 and r.bits["out"].dtype == np.uint16


class DLPackOnly:
    """An array that offers only the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_arrays_through_dlpack_and_torch_tensors_give_the_same_bits():
    import torch

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    a = attnoracle.evaluate(q, k, v, threads=1)
    b = attnoracle.evaluate(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), threads=1)
    c = attnoracle.evaluate(*(torch.from_numpy(x) for x in (q, k, v)), threads=1)
    assert golden_bytes(a.tensors) == golden_bytes(b.tensors) == golden_bytes(c.tensors)


def fp8_values(dtype):
    """The value of each of the 256 patterns, from the formats' definitions (CONTRACT section 2):
    E4M3FN bias 7, no infinity, NaN s1111111; E5M2 bias 15, IEEE-style."""
    out = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        if dtype == "F8_E4M3":
            e, m = (b >> 3) & 15, b & 7
            v = np.nan if (e, m) == (15, 7) else m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
        else:
            e, m = (b >> 2) & 31, b & 3
            v = (np.inf if m == 0 else np.nan) if e == 31 else m * 2.0 ** -16 if e == 0 else (4 + m) * 2.0 ** (e - 17)
        out.append(np.copysign(v, sign))  # a product would not set the sign of a NaN
    return np.array(out)


def fp8_encode(values, dtype, round_values=False):
    return np.frombuffer(attnoracle._float_tensor("q", values, dtype, round_values, "<arrays>")[3], np.uint8)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2"])
def test_fp8_encoding_and_decoding_on_all_256_patterns(tmp_path, dtype):
    bits = np.arange(256, dtype=np.uint8)
    values = fp8_values(dtype)
    nan = np.isnan(values)
    # decoding, as for Case.inputs: the exact values (float32), and the patterns
    decoded, raw = attnoracle._tensor_arrays([("q", dtype, [256], bits.tobytes())])
    assert decoded["q"].dtype == np.float32 and raw["q"].dtype == np.uint8 and np.array_equal(raw["q"], bits)
    assert np.array_equal(decoded["q"], values, equal_nan=True)
    assert np.array_equal(np.signbit(decoded["q"]), bits >= 0x80)
    # encoding values is exact and gives back every pattern (a NaN the format's own NaN of its sign)
    for v in (values, values.astype(np.float32)):
        enc = fp8_encode(v, dtype)
        assert np.array_equal(enc[~nan], bits[~nan])
        assert np.array_equal(fp8_values(dtype)[enc[nan]], values[nan], equal_nan=True)
        assert np.array_equal(enc[nan] >= 0x80, bits[nan] >= 0x80)
    # rounding to nearest-even: the midpoint of two neighbours goes to the even pattern, a value
    # off the midpoint to the nearer one; past the largest finite value E4M3FN saturates, E5M2
    # goes to infinity
    finite = np.isfinite(values) & (bits < 0x80)
    order = np.argsort(values[finite])
    v, b = values[finite][order], bits[finite][order]
    mid = (v[:-1] + v[1:]) / 2
    even = np.where(b[:-1] % 2 == 0, b[:-1], b[1:])
    assert np.array_equal(fp8_encode(mid, dtype, True), even)
    assert np.array_equal(fp8_encode(-mid, dtype, True), even | 0x80)
    assert np.array_equal(fp8_encode(np.nextafter(mid, 0), dtype, True), b[:-1])
    assert np.array_equal(fp8_encode(np.nextafter(mid, np.inf), dtype, True), b[1:])
    if dtype == "F8_E4M3":  # 448, then 480 (NaN's binade): the midpoint is 464
        assert fp8_encode(np.array([463.9, 464, 470, 1e6, np.inf]), dtype, True).tolist() == [0x7E] * 5
    else:  # 57344, then 65536 (infinity): the midpoint is 61440
        assert fp8_encode(np.array([61439, 61440, 1e6, np.inf]), dtype, True).tolist() == [0x7B, 0x7C, 0x7C, 0x7C]
    # not exact: refused, naming the element
    with pytest.raises(attnoracle.InputError, match=rf"^<arrays>: q: element 1 \(flat index\), 1.03125, is not "
                                                     rf"representable in {dtype}$"):
        fp8_encode(np.array([1.0, 1 + 2.0 ** -5]), dtype)


def test_fp8_bit_patterns_and_float_values_give_the_same_case_bytes(core, tmp_path):
    fp8 = [c for c in (e.load() for e in core if "fp8" in e.tags)]
    assert len(fp8) == sum("fp8" in e.tags for e in core) > 0
    for case in fp8:
        kw = arrays_of(case)
        written = {}
        for how in ("bits", "values"):
            arrays = {n: case.bits[n] if how == "bits" and n in ("q", "k", "v") else kw[n] for n in case.inputs}
            opts = {n: x for n, x in kw.items() if n not in case.inputs and n != "masked_rows"}
            path = tmp_path / f"{case.id}-{how}.safetensors"
            attnoracle.write_case(path, **arrays, **opts, masked_rows=None if case.masked_rows == "error" else
                                  case.masked_rows, round_inputs=False)
            written[how] = path.read_bytes()
        assert written["bits"] == written["values"], case.id
        # and the tensors are the core case's inputs, byte for byte
        c = attnoracle.load_case(tmp_path / f"{case.id}-bits.safetensors")
        mine = {t[0]: t for t in c._tensors}
        assert mine == {t[0]: t for t in case._tensors if not attnoracle._is_golden(t[0])}, case.id
        # from torch float8 tensors where PyTorch has them (2.1 and later)
        import torch

        if hasattr(torch, "float8_e4m3fn"):
            t = case.torch()
            r = attnoracle.write_case(tmp_path / "t.safetensors", **t, **opts, round_inputs=False)
            assert open(r, "rb").read() == written["bits"]


def gradient_case(tmp_path):
    rng = np.random.default_rng(11)
    f = np.float32
    q, k, v = (rng.standard_normal(s).astype(f) for s in ((1, 2, 3, 3), (1, 1, 4, 3), (1, 1, 4, 2)))
    bias = rng.standard_normal((1, 2, 1, 4)).astype(f)  # broadcast along the queries
    dout = rng.standard_normal((1, 2, 3, 2)).astype(f)
    kw = dict(bias=bias, dout=dout, causal="bottom_right", outputs=("out", "dq", "dk", "dv", "dbias"))
    return attnoracle.write_case(tmp_path / "grad.safetensors", q, k, v, **kw), (q, k, v), kw


def test_gradients_of_a_case_written_with_dout_are_eval_bit_for_bit(tmp_path):
    path, (q, k, v), kw = gradient_case(tmp_path)
    case = attnoracle.load_case(path)
    assert case.outputs == ("out", "dq", "dk", "dv", "dbias") and case.dtypes["dout"] == "F32"
    assert np.array_equal(case.inputs["dout"], kw["dout"]) and "gradients" in case.features
    r = run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q", "--threads", "1")
    assert r.returncode == 0, r.stderr
    expected = attnoracle.load_case(tmp_path / "g.safetensors").golden
    a = attnoracle.evaluate(q, k, v, **kw, threads=1)
    b = case.evaluate(threads=1)
    assert golden_bytes(a.tensors) == golden_bytes(b.tensors) == golden_bytes(expected.tensors)
    for g, shape in (("dq", q.shape), ("dk", k.shape), ("dv", v.shape), ("dbias", kw["bias"].shape)):
        assert {g, g + ".ref", g + ".bound"} <= set(a) and a[g].shape == shape and a[g].dtype == np.float32
        assert a[g + ".ref"].dtype == np.float64 and np.all(np.abs(a[g + ".ref"]) <= a[g + ".bound"])
    # against a float64 computation of the formulas (CONTRACT section 7)
    x = [t.astype(np.float64) for t in (q, np.repeat(k, 2, 1), np.repeat(v, 2, 1), kw["dout"])]
    s = x[0] @ x[1].transpose(0, 1, 3, 2) / np.sqrt(3) + kw["bias"]
    s = np.where(np.tril(np.ones((3, 4), bool), 1), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ x[2]
    ds = p * (x[3] @ x[2].transpose(0, 1, 3, 2) - (x[3] * o).sum(-1, keepdims=True))
    want = {"dq": ds @ x[1] / np.sqrt(3), "dk": (ds.transpose(0, 1, 3, 2) @ x[0] / np.sqrt(3)).sum(1, keepdims=True),
            "dv": (p.transpose(0, 1, 3, 2) @ x[3]).sum(1, keepdims=True), "dbias": ds.sum(2, keepdims=True)}
    for g, w in want.items():
        assert np.allclose(a[g + ".ref"], w, rtol=1e-9, atol=1e-12), g


def test_undecided_gradient_elements_come_with_both_candidates():
    # Two query heads share a kv head with keys 0 and 1; head 0 scores them (0, 1), head 1 (0, -1),
    # so that P0[j] + P1[j] = 1 for each key: with dout = m for both, dv[j] = m exactly, the
    # midpoint 1 + 2^-11 of two F16 values, which no enclosure can settle.
    f = np.float32
    m = 1 + 2.0 ** -11
    r = attnoracle.evaluate(np.array([1, -1], f).reshape(1, 2, 1, 1), np.array([0, 1], f).reshape(1, 1, 2, 1),
                            np.array([1, 2], f).reshape(1, 1, 2, 1), dout=np.full((1, 2, 1, 1), m, f),
                            output_dtype="F16", outputs=("out", "dv"), threads=1, max_precision=256)
    assert r.undecided["dv"].tolist() == [0, 1] and set(r.undecided) == {"dv"}
    assert r.stats["undecided"] == 2 and r.metadata["attn.undecided"] == "2"
    for j in range(2):
        assert sorted([float(r["dv"].reshape(-1)[j]), float(r.alt["dv"][j])]) == [1.0, 1 + 2.0 ** -10]
    assert r["dv.ref"].reshape(-1).tolist() == [m, m] and r["dv"].dtype == np.float16


def test_sinks_and_scores_in_the_result():
    rng = np.random.default_rng(2)
    f = np.float32
    q, k, v = (rng.standard_normal(s).astype(f) for s in ((1, 2, 2, 4), (1, 1, 3, 4), (1, 1, 3, 2)))
    sinks = np.array([0.5, -1.0], f)
    r = attnoracle.evaluate(q, k, v, sinks=sinks, causal=True, outputs=("out", "weights", "scores"), threads=1)
    assert {"scores", "scores.ref", "weights"} <= set(r) and r["scores"].shape == (1, 2, 2, 3)
    s = q.astype(np.float64) @ np.repeat(k, 2, 1).transpose(0, 1, 3, 2).astype(np.float64) / 2.0
    allowed = np.tril(np.ones((2, 3), bool))
    assert np.allclose(np.where(allowed, r["scores.ref"], 0), np.where(allowed, s, 0), rtol=1e-14)
    assert np.all(r["scores"][..., ~allowed] == -np.inf)
    # the sink takes its share of each row: the weights sum to 1 - P_sink
    e = np.where(allowed, np.exp(s), 0)
    sink = np.exp(sinks.astype(np.float64))[None, :, None]
    assert np.allclose(r["weights.ref"].sum(-1), 1 - sink / (sink + e.sum(-1)), rtol=1e-12)


def test_write_case_rounds_fp8_inputs_and_load_case_decodes_them(tmp_path):
    q = np.array([[[[1 + 2.0 ** -4, 1 + 3 * 2.0 ** -4, 500.0, -0.1]]]])  # float64 values
    k, v = np.ones((1, 1, 2, 4)), np.array([[[[0.5], [-3.0]]]])
    path = attnoracle.write_case(tmp_path / "c.safetensors", q, k, v, input_dtype="F8_E4M3", output_dtype="BF16",
                                 q_descale=np.array([[0.25]]), v_descale=np.array([[3.0]], np.float32))
    c = attnoracle.load_case(path)
    assert c.dtypes == {"q": "F8_E4M3", "k": "F8_E4M3", "v": "F8_E4M3", "q_descale": "F32", "v_descale": "F32"}
    # ties to even (the ulp of [1, 2) is 2^-3): 1 + 2^-4 to 1 (0x38), 1 + 3 * 2^-4 to 1.25 (0x3A);
    # 500 saturates to 448 (0x7E); -0.1 to -1.625 * 2^-4 = -0.1015625 (0x9D)
    assert c.bits["q"].tolist() == [[[[0x38, 0x3A, 0x7E, 0x9D]]]]
    assert c.inputs["q"].dtype == np.float32 and c.inputs["q"].tolist() == [[[[1.0, 1.25, 448.0, -0.1015625]]]]
    assert c.inputs["q_descale"].tolist() == [[0.25]] and {"fp8", "F8_E4M3", "descales"} <= c.features
    r = run_cli("eval", path, "-o", str(tmp_path / "g.safetensors"), "-q")
    assert r.returncode == 0, r.stderr
    assert golden_bytes(c.evaluate(threads=1).tensors) == golden_bytes(
        attnoracle.load_case(tmp_path / "g.safetensors").golden.tensors)


def test_dsinks_of_a_case_with_sinks(tmp_path):
    rng = np.random.default_rng(12)
    f = np.float32
    q, k, v = (rng.standard_normal(s).astype(f) for s in ((1, 2, 3, 3), (1, 1, 4, 3), (1, 1, 4, 2)))
    sinks = np.array([0.5, -1.25], f)
    dout = rng.standard_normal((1, 2, 3, 2)).astype(f)
    kw = dict(sinks=sinks, dout=dout, outputs=("out", "dq", "dsinks"))
    a = attnoracle.evaluate(q, k, v, **kw, threads=1)
    assert a["dsinks"].shape == (2,) and a["dsinks"].dtype == np.float32 and a["dsinks.ref"].dtype == np.float64
    assert np.all(np.abs(a["dsinks.ref"]) <= a["dsinks.bound"])
    case = attnoracle.load_case(attnoracle.write_case(tmp_path / "s.safetensors", q, k, v, **kw))
    assert "dsinks" in case.features and "gradients" in case.features
    # dsinks[h] = - sum_i P_sink[i] D_i, in float64 (CONTRACT section 7)
    x = [t.astype(np.float64) for t in (q, np.repeat(k, 2, 1), np.repeat(v, 2, 1), dout)]
    s = x[0] @ x[1].transpose(0, 1, 3, 2) / np.sqrt(3)
    z = np.exp(s).sum(-1) + np.exp(sinks.astype(np.float64))[None, :, None]
    o = (np.exp(s) / z[..., None]) @ x[2]
    want = -((np.exp(sinks.astype(np.float64))[None, :, None] / z) * (x[3] * o).sum(-1)).sum(axis=(0, 2))
    np.testing.assert_allclose(a["dsinks.ref"], want, rtol=1e-12)
    with pytest.raises(attnoracle.InputError, match="dsinks is asked but the case has no sinks"):
        attnoracle.evaluate(q, k, v, dout=dout, outputs=("out", "dsinks"))
