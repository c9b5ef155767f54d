"""K and V stored scaled or block-scaled (CONTRACT section 9), read into their real values.

    real_kv(tensors, dtypes, meta, compute, bug=None)

replaces k and v (or k_cache and v_cache, in their cache shapes) by element x scale computed in
`compute` (one rounding of each product in float32: the scale applied in F32), drops the scale
tensors, and makes v the view k[..., 0:Dv] under attn.v_from_k. Scaled F8_E4M3, F8_E5M2 and I8
take k_scale, v_scale broadcast to [B, Hkv, Nk, 1] (a paged cache: to its slots, [Npages, P, Hkv]
under NHD, [Npages, Hkv, P] under HND); mxfp8 takes E8M0 exponents (2^(e - 127)) per 32 elements
along D, nvfp4 E2M1 nibbles (low nibble first) with an F8_E4M3 scale per 16 and a global scale.
`bug` plants the mistakes of the FlashAttention-style kernel's --bug list: kv_descale_dropped,
kv_scale_head0, kv_scale_wrong_token, e8m0_bias_off_by_one, nvfp4_nibbles_swapped.
"""
import numpy as np

SCALES = ("k_scale", "v_scale", "k_block_scale", "v_block_scale", "k_global_scale", "v_global_scale")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def uses_stored_kv(tensors, meta):
    """Whether k and v are stored scaled or block-scaled (or v is a view of k)."""
    return "attn.kv_block_scale" in meta or "attn.v_from_k" in meta or any(n in tensors for n in SCALES)


def nvfp4_elements(a, bug):
    """U8 bytes [..., D / 2] -> E2M1 values [..., D], the low nibble first."""
    lo, hi = a & 0x0F, a >> 4
    first, second = (hi, lo) if bug == "nvfp4_nibbles_swapped" else (lo, hi)
    nib = np.stack([first, second], axis=-1).reshape(a.shape[:-1] + (2 * a.shape[-1],))
    return np.where(nib & 0x8, -1.0, 1.0) * E2M1[nib & 0x7]


def scale_axes(paged, layout):
    """The axes of a stored tensor that a scale of it broadcasts over: (head axis, token axis)."""
    if not paged:
        return 1, 2                                   # [B, Hkv, Nk, D]
    return (2, 1) if layout == "NHD" else (1, 2)      # [Npages, P, Hkv, D] or [Npages, Hkv, P, D]


def wrong_scale(s, shape, paged, bug, head_axis, token_axis):
    """A per-tensor/head/token (or slot) scale broadcast to `shape` (the stored tensor's without
    D): NumPy's way to [B, Hkv, Nk, 1] (contiguous) or to [Npages, P, Hkv] / [Npages, Hkv, P]
    (paged), with the bugs that read it at the wrong place."""
    s = np.broadcast_to(s, shape if paged else shape + (1,))
    s = s if paged else s[..., 0]
    if bug == "kv_scale_head0":
        s = np.broadcast_to(np.take(s, [0], axis=head_axis), shape)
    if bug == "kv_scale_wrong_token":
        s = np.roll(s, -1, axis=token_axis)
    return s


def real_kv(tensors, dtypes, meta, compute, bug=None):
    paged = "k_cache" in tensors
    layout = meta.get("attn.kv_layout", "NHD")
    scheme = meta.get("attn.kv_block_scale", "scaled")
    head_axis, token_axis = scale_axes(paged, layout)
    names = ("k_cache", "v_cache") if paged else ("k", "v")
    for name in names:
        if name not in tensors:
            continue                                  # v under attn.v_from_k
        if scheme == "scaled" and name[0] + "_scale" not in tensors:
            continue                                  # float K/V (V a view of it alone)
        x, which = tensors[name], name[0]
        if scheme == "nvfp4":
            elem = nvfp4_elements(x.astype(np.uint8), bug)
        else:
            elem = x.astype(np.float64)               # FP8 decoded by the reader, I8 integers
        if bug == "kv_descale_dropped":
            real = elem.astype(compute)
        elif scheme == "mxfp8":
            e = tensors[which + "_block_scale"].astype(np.int64)
            s = np.ldexp(1.0, e - (126 if bug == "e8m0_bias_off_by_one" else 127))
            real = elem.astype(compute) * np.repeat(s, 32, axis=-1).astype(compute)
        elif scheme == "nvfp4":
            s = tensors[which + "_block_scale"].astype(np.float64)
            g = tensors[which + "_global_scale"].astype(compute)
            real = (elem * np.repeat(s, 16, axis=-1)).astype(compute) * g   # E2M1 x E4M3: exact
        else:
            s = tensors[which + "_scale"]
            s = wrong_scale(s, elem.shape[:-1], paged, bug, head_axis, token_axis)
            real = elem.astype(compute) * s[..., None].astype(compute)
        tensors[name] = np.asarray(real, compute)
        dtypes[name] = "F64" if compute == np.float64 else "F32"
    for n in SCALES:
        tensors.pop(n, None)
        dtypes.pop(n, None)
    if "attn.v_from_k" in meta:
        dv = int(meta["attn.v_from_k"])
        tensors[names[1]] = np.ascontiguousarray(tensors[names[0]][..., :dv])
        dtypes[names[1]] = dtypes[names[0]]
