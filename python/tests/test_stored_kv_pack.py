"""The bit patterns of stored K/V from values (attnoracle.pack_e2m1, e4m3_bits, e8m0_bits): every
value the format holds maps to its pattern, the reader decodes the patterns back to the values,
and a value the format does not hold is refused, never rounded."""

import numpy as np
import pytest

import attnoracle
from attnoracle import _decode
from test_quantized import E2M1, OPTS, assert_twins, query


def test_pack_e2m1_low_nibble_first():
    # 0.5 is nibble 1, -6 nibble 0xF (s=1, ee=11, m=1); -0.0 keeps its sign (8), 3 is 5
    np.testing.assert_array_equal(attnoracle.pack_e2m1([[0.5, -6.0], [-0.0, 3.0]]), [[0xF1], [0x58]])
    assert attnoracle.pack_e2m1(np.zeros((2, 3, 4), np.float32)).shape == (2, 3, 2)


def test_pack_e2m1_every_nibble():
    codes = np.arange(16)
    values = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    values[8] = -0.0
    packed = attnoracle.pack_e2m1(values)
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, codes[0::2] | (codes[1::2] << 4))


def test_packed_nvfp4_evaluates_as_its_values():
    rng = np.random.default_rng(11)
    q = query(rng)
    k, v = (E2M1[rng.integers(0, 8, (1, 2, 5, 32))] * rng.choice([-1.0, 1.0], (1, 2, 5, 32)) for _ in range(2))
    scales = rng.choice([0.0, 2.0 ** -9, 0.375, 448.0, 13.0], (1, 2, 5, 2))
    a = attnoracle.evaluate(q, attnoracle.pack_e2m1(k), attnoracle.pack_e2m1(v), kv_block_scale="nvfp4",
                            k_block_scale=attnoracle.e4m3_bits(scales), v_block_scale=attnoracle.e4m3_bits(scales),
                            k_global_scale=np.float32(0.5), v_global_scale=np.float32(2), **OPTS)
    real = np.repeat(scales, 16, -1)
    assert_twins(a, attnoracle.evaluate(q, k * real * 0.5, v * real * 2, **OPTS))


def test_e4m3_bits_every_finite_pattern():
    bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    values = _decode("F8_E4M3", bits).astype(np.float64)
    values[bits == 0x80] = -0.0
    np.testing.assert_array_equal(attnoracle.e4m3_bits(values), bits)
    assert attnoracle.e4m3_bits(np.float32(448)) == 0x7E


def test_e8m0_bits_powers_of_two():
    k = np.arange(-127, 128)
    bits = attnoracle.e8m0_bits(2.0 ** k)
    np.testing.assert_array_equal(bits, (k + 127).astype(np.uint8))
    rng = np.random.default_rng(12)
    q, kb, vb = query(rng, 64), rng.integers(0, 0x7F, (1, 2, 5, 64)).astype(np.uint8), np.zeros((1, 2, 5, 64), np.uint8)
    s = 2.0 ** rng.integers(-20, 20, (1, 2, 5, 2))
    a = attnoracle.evaluate(q, kb, vb, kv_block_scale="mxfp8", k_block_scale=attnoracle.e8m0_bits(s),
                            v_block_scale=attnoracle.e8m0_bits(s), **OPTS)
    k = _decode("F8_E4M3", kb).astype(np.float64) * np.repeat(s, 32, -1)
    assert_twins(a, attnoracle.evaluate(q, k, np.zeros((1, 2, 5, 64)), **OPTS))


@pytest.mark.parametrize("fn, values, match", [
    (attnoracle.pack_e2m1, [0.5, 0.7], r"pack_e2m1: element 1 \(flat index\), 0.7, is not an E2M1 value"),
    (attnoracle.pack_e2m1, [6.0, 8.0], r"element 1 \(flat index\), 8.0, is not an E2M1 value"),
    (attnoracle.pack_e2m1, [np.nan, 1.0], r"element 0 \(flat index\), nan, is not an E2M1"),
    (attnoracle.pack_e2m1, [1.0, 2.0, 3.0], r"pack_e2m1: the last axis must have an even length"),
    (attnoracle.pack_e2m1, ["1", "2"], r"pack_e2m1: an array of <U1 is not numeric"),
    (attnoracle.e4m3_bits, [448.0, 480.0], r"e4m3_bits: element 1 \(flat index\), 480.0, is not an F8_E4M3 value"),
    (attnoracle.e4m3_bits, [0.1], r"element 0 \(flat index\), 0.1, is not an F8_E4M3 value"),
    (attnoracle.e4m3_bits, [2.0 ** -10], r"is not an F8_E4M3 value"),
    (attnoracle.e4m3_bits, [np.inf], r"element 0 \(flat index\), inf, is not an F8_E4M3"),
    (attnoracle.e8m0_bits, [1.0, 3.0], r"e8m0_bits: element 1 \(flat index\), 3.0, is not a power of two"),
    (attnoracle.e8m0_bits, [0.0], r"element 0 \(flat index\), 0.0, is not a power of two"),
    (attnoracle.e8m0_bits, [-2.0], r"is not a power of two"),
    (attnoracle.e8m0_bits, [2.0 ** 128], r"is not a power of two 2\^k with k from -127 to 127"),
    (attnoracle.e8m0_bits, [2.0 ** -128], r"is not a power of two 2\^k with k from -127 to 127"),
])
def test_values_the_format_does_not_hold_are_refused(fn, values, match):
    with pytest.raises(ValueError, match=match):
        fn(values)
