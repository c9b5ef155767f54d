"""A small vector set of quantized K/V and FP8 outputs (CONTRACT section 9), made with
`attnoracle eval`: for the tests of the NumPy adapters under the `fp8kv` profiles.

    suite = fp8_cases.write(cli, directory)
    status, report = splitkv_cases.run(cli, suite, [python, adapter, ...], "fp8kv")

Every stored form and scale granularity (scaled F8_E4M3, F8_E5M2 and I8 per tensor, head and
token, paged per slot under NHD and HND, mxfp8, nvfp4), V as a view of K, FP8 outputs through
o_scale with amax (E4M3 saturating, E5M2 overflowing), and a row whose scores jump by more than
ln 448 across key blocks.
"""
import numpy as np

import safetensors_np as st
import splitkv_cases

E4M3, E5M2 = "F8_E4M3", "F8_E5M2"


def fp8(a, dtype=E4M3):
    """Values -> their nearest FP8 bit patterns (uint8), stored as `dtype`."""
    return st.fp8_bits(a, dtype)


def nvfp4_bytes(rng, shape):
    """Random E2M1 nibbles packed two per byte: [..., D] elements -> [..., D / 2] bytes."""
    nib = rng.integers(0, 16, size=shape).astype(np.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def cases():
    """{id: (tensors, metadata, dtypes)}."""
    rng = np.random.default_rng(9)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    base = {"attn.format": "1"}
    out = {}

    def case(id_, tensors, meta, dtypes):
        out[id_] = (tensors, dict(base, **meta), dtypes)

    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 16, 80, 64
    q = normal(B, Hq, Nq, D)
    kv = lambda: normal(B, Hkv, Nk, D) * 4
    # scaled F8_E4M3, one scale per tensor; BF16 out
    case("scaled_e4m3_tensor", {"q": q, "k": fp8(kv()), "v": fp8(kv()), "k_scale": np.float32(0.3),
                                "v_scale": np.float32(0.7)},
         {"attn.output_dtype": "BF16", "attn.outputs": "out,lse"}, {"q": "BF16", "k": E4M3, "v": E4M3})
    # scaled F8_E5M2 per kv head, GQA, F32 out
    case("scaled_e5m2_head", {"q": q, "k": fp8(kv(), E5M2), "v": fp8(kv(), E5M2),
                              "k_scale": np.array([0.2, 0.45], np.float32).reshape(1, 2, 1, 1),
                              "v_scale": np.array([1.5, 0.25], np.float32).reshape(1, 2, 1, 1)},
         {"attn.output_dtype": "F32", "attn.outputs": "out,lse"}, {"q": "BF16", "k": E5M2, "v": E5M2})
    # scaled I8 per token, causal bottom_right
    i8 = lambda: rng.integers(-127, 128, size=(B, Hkv, Nk, D)).astype(np.int8)
    tok = lambda: (rng.uniform(0.002, 0.02, size=(B, Hkv, Nk, 1))).astype(np.float32)
    case("scaled_i8_token", {"q": q, "k": i8(), "v": i8(), "k_scale": tok(), "v_scale": tok()},
         {"attn.output_dtype": "BF16", "attn.causal": "bottom_right", "attn.outputs": "out,lse"},
         {"q": "BF16"})
    # F32 query, per-token E4M3
    case("scaled_e4m3_token_f32", {"q": q, "k": fp8(kv()), "v": fp8(kv()),
                                   "k_scale": tok() * 20, "v_scale": tok() * 20},
         {"attn.output_dtype": "F32", "attn.outputs": "out,lse"}, {"k": E4M3, "v": E4M3})
    # paged caches, a scale per slot: NHD E4M3 and HND I8; pages shuffled, the last partly used
    P, pages = 16, 8
    table = np.array([[3, 0, 6, 1, 5], [2, 7, 4, 0, 1]], np.int32)
    lens = np.array([70, 52], np.int32)
    qp = normal(2, Hq, 4, D)
    case("paged_nhd_e4m3_slot", {"q": qp, "k_cache": fp8(normal(pages, P, Hkv, D) * 4),
                                 "v_cache": fp8(normal(pages, P, Hkv, D) * 4), "block_table": table,
                                 "seqlens_k": lens,
                                 "k_scale": rng.uniform(0.1, 0.5, (pages, P, Hkv)).astype(np.float32),
                                 "v_scale": rng.uniform(0.1, 0.5, (pages, P, Hkv)).astype(np.float32)},
         {"attn.output_dtype": "BF16", "attn.kv_layout": "NHD", "attn.outputs": "out,lse"},
         {"q": "BF16", "k_cache": E4M3, "v_cache": E4M3})
    case("paged_hnd_i8_slot", {"q": qp, "k_cache": rng.integers(-127, 128, (pages, Hkv, P, D)).astype(np.int8),
                               "v_cache": rng.integers(-127, 128, (pages, Hkv, P, D)).astype(np.int8),
                               "block_table": table, "seqlens_k": lens,
                               "k_scale": rng.uniform(0.002, 0.01, (pages, Hkv, P)).astype(np.float32),
                               "v_scale": rng.uniform(0.002, 0.01, (pages, Hkv, P)).astype(np.float32)},
         {"attn.output_dtype": "BF16", "attn.kv_layout": "HND", "attn.outputs": "out,lse"}, {"q": "BF16"})
    # mxfp8 (E8M0 per 32) with an F16 query; nvfp4 (E4M3 per 16, global) with a BF16 one
    e8m0 = lambda: rng.integers(123, 128, size=(B, Hkv, Nk, D // 32)).astype(np.uint8)
    case("mxfp8_f16", {"q": q, "k": fp8(kv()), "v": fp8(kv()), "k_block_scale": e8m0(), "v_block_scale": e8m0()},
         {"attn.output_dtype": "F32", "attn.kv_block_scale": "mxfp8", "attn.outputs": "out,lse"},
         {"q": "F16", "k": E4M3, "v": E4M3})
    bs = lambda: fp8(rng.uniform(0.5, 4, size=(B, Hkv, Nk, D // 16)))
    case("nvfp4_bf16", {"q": q, "k": nvfp4_bytes(rng, (B, Hkv, Nk, D)), "v": nvfp4_bytes(rng, (B, Hkv, Nk, D)),
                        "k_block_scale": bs(), "v_block_scale": bs(), "k_global_scale": np.float32(0.3),
                        "v_global_scale": np.float32(0.2)},
         {"attn.output_dtype": "BF16", "attn.kv_block_scale": "nvfp4", "attn.outputs": "out,lse"},
         {"q": "BF16", "k_block_scale": E4M3, "v_block_scale": E4M3})
    # V as a view of K (Dv = 48 of Dk = 64), per-head E4M3 scales
    case("v_from_k_e4m3", {"q": q, "k": fp8(kv()), "k_scale": np.array([0.25, 0.5], np.float32).reshape(1, 2, 1, 1)},
         {"attn.output_dtype": "BF16", "attn.v_from_k": "48", "attn.outputs": "out,lse"}, {"q": "BF16", "k": E4M3})
    # FP8 outputs: E4M3 through o_scale with amax; E4M3 saturating (o_scale small); E5M2 past
    # its largest finite value (infinity)
    scaled = {"q": q, "k": fp8(kv()), "v": fp8(kv()), "k_scale": np.float32(0.3), "v_scale": np.float32(0.7)}
    for id_, dtype, o_scale in (("out_e4m3_amax", E4M3, 0.01), ("out_e4m3_saturating", E4M3, 0.002),
                                ("out_e5m2_overflow", E5M2, 2.0 ** -19)):
        case(id_, dict(scaled, o_scale=np.float32(o_scale)),
             {"attn.output_dtype": dtype, "attn.outputs": "out,lse,amax"}, {"q": "BF16", "k": E4M3, "v": E4M3})
    # FP8 inputs with descales and an E4M3 out (flash-fp8)
    case("fp8_inputs_out_e4m3", {"q": fp8(q), "k": fp8(kv()), "v": fp8(kv()),
                                 "q_descale": np.full((B, Hkv), 0.5, np.float32),
                                 "k_descale": np.full((B, Hkv), 0.25, np.float32),
                                 "v_descale": np.full((B, Hkv), 0.5, np.float32), "o_scale": np.float32(0.02)},
         {"attn.output_dtype": E4M3, "attn.outputs": "out,lse,amax"}, {"q": E4M3, "k": E4M3, "v": E4M3})
    # scores jumping by 8 (> ln 448) after the first 64 keys: 0 for keys 0..63, about 8 after
    Nj = 128
    kj = np.zeros((B, Hkv, Nj, D), np.float32)
    kj[:, :, 64:] = 1
    kj = kj + rng.uniform(-0.25, 0.25, size=kj.shape).astype(np.float32)
    case("score_jump", {"q": np.abs(q) * 0 + 1, "k": fp8(kj), "v": fp8(normal(B, Hkv, Nj, D) * 4),
                        "k_scale": np.float32(1), "v_scale": np.float32(0.5)},
         {"attn.output_dtype": "BF16", "attn.scale": "0.125", "attn.outputs": "out,lse"},
         {"q": "BF16", "k": E4M3, "v": E4M3})
    return out


def write(cli, directory):
    """The vector set in `directory` (cases/<id>.safetensors with golden tensors, manifest.json)."""
    return splitkv_cases.write_set(cli, directory, cases(), "fp8", "fp8_cases.py", 9)
