"""attnoracle.evaluate on arrays against `attnoracle eval` on the case file, on every core case."""

import concurrent.futures
import os

import numpy as np
import pytest

import attnoracle
from conftest import CORE, CORE_CASES, run_cli


def arrays_of(case):
    """evaluate()'s arguments for a case, from its arrays: BF16 inputs as float32 values, a BF16
    bias as uint16 bit patterns, options from the metadata texts."""
    kw = {}
    for name, a in case.inputs.items():
        kw[name] = case.bits[name] if name == "bias" and case.dtypes[name] == "BF16" else a
    if case.input_dtype == "BF16":
        kw["input_dtype"] = "BF16"
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
    kinds = {"ok": 0, "refused": 0, "BF16": 0, "mha": 0}
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
    assert kinds["ok"] + kinds["refused"] == len(core) == CORE_CASES
    assert kinds["refused"] > 0 and kinds["BF16"] > 0 and kinds["mha"] > 0


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
