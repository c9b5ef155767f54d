"""A FlashAttention-style kernel tested the way FlashAttention's and FlexAttention's own tests do
it (a stacked parametrize over batch, heads, sequence lengths, head dimension, causal, GQA and
dtype; random inputs; forward and backward), twice: test_flash_attn_classic ends with the usual
comparison against an upcast reference and a fudge factor, test_flash_attn with
attnoracle.assert_close. Nothing else differs.

    PYTHONPATH=build/python /usr/bin/python3 -m pytest python/examples/test_flash_attention.py

The kernel is plain PyTorch: key blocks with an online softmax in float32, P rounded to the input
dtype before P V, and FlashAttention 2's backward (P recomputed from lse, dS rounded to the input
dtype for the products).
"""

import math

import pytest
import torch

import attnoracle

BLOCK_N = 64


def _mask(nq, nk, start, stop, causal):
    """Allowed keys start..stop-1 of every query, causal aligned bottom right as FlashAttention's."""
    if not causal:
        return None
    i = torch.arange(nq).unsqueeze(1) + (nk - nq)
    return torch.arange(start, stop).unsqueeze(0) <= i


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        nq, nk = q.shape[-2], k.shape[-2]
        m = torch.full(q.shape[:-1], -math.inf)
        l = torch.zeros(q.shape[:-1])
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],))
        for start in range(0, nk, BLOCK_N):
            stop = min(start + BLOCK_N, nk)
            s = (q.float() @ kr[:, :, start:stop].float().transpose(-1, -2)) * scale
            allowed = _mask(nq, nk, start, stop, causal)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + p.to(q.dtype).float() @ vr[:, :, start:stop].float()
            m = m_new
        out = torch.where(l.unsqueeze(-1) > 0, acc / l.unsqueeze(-1), torch.zeros_like(acc)).to(q.dtype)
        lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, -math.inf))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
        nq, nk = q.shape[-2], k.shape[-2]
        do = dout.float()
        d_row = (do * out.float()).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape)
        dkr, dvr = torch.zeros(kr.shape), torch.zeros(vr.shape)
        lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse).unsqueeze(-1)
        for start in range(0, nk, BLOCK_N):
            stop = min(start + BLOCK_N, nk)
            s = (q.float() @ kr[:, :, start:stop].transpose(-1, -2)) * ctx.scale
            allowed = _mask(nq, nk, start, stop, ctx.causal)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            p = torch.exp(s - lse_safe)
            dp = do @ vr[:, :, start:stop].transpose(-1, -2)
            ds = (p * (dp - d_row)).to(q.dtype).float()
            dvr[:, :, start:stop] = p.to(q.dtype).float().transpose(-1, -2) @ do
            dq += ds @ kr[:, :, start:stop] * ctx.scale
            dkr[:, :, start:stop] = ds.transpose(-1, -2) @ q.float() * ctx.scale
        b, hk = k.shape[:2]
        dk = dkr.view(b, hk, g, *k.shape[2:]).sum(2)
        dv = dvr.view(b, hk, g, *v.shape[2:]).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attn_func(q, k, v, causal=False):
    return FlashAttention.apply(q, k, v, causal, q.shape[-1] ** -0.5)


def attention_ref(q, k, v, causal=False, upcast=True):
    """The usual reference: plain softmax attention, in float32 when upcast, else with each step
    rounded to the inputs' dtype (PyTorch 1.13 has no float16 matmul on the CPU)."""
    rnd = (lambda x: x) if upcast else (lambda x: x.to(q.dtype).float())
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = rnd(rnd(q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5)
    allowed = _mask(q.shape[-2], k.shape[-2], 0, k.shape[-2], causal)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = rnd(torch.softmax(s, -1).nan_to_num(0.0))  # a row with no allowed key gives zeros, as the kernel
    return rnd(p @ v.float())


def run(batch_size, nheads, nheads_k, seqlen_q, seqlen_k, d, causal, dtype):
    torch.manual_seed(0)
    q = torch.randn(batch_size, nheads, seqlen_q, d, dtype=dtype, requires_grad=True)
    k = torch.randn(batch_size, nheads_k, seqlen_k, d, dtype=dtype, requires_grad=True)
    v = torch.randn(batch_size, nheads_k, seqlen_k, d, dtype=dtype, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return q, k, v, g, out, dq, dk, dv


GRID = [
    pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"]),
    pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
    pytest.mark.parametrize("d", [64, 128]),
    pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (113, 203), (128, 128), (200, 64)]),
    pytest.mark.parametrize("nheads,nheads_k", [(4, 4), (4, 1)], ids=["mha", "mqa"]),
    pytest.mark.parametrize("batch_size", [1, 2]),
]


def grid(test):
    for mark in GRID:
        test = mark(test)
    return test


@grid
def test_flash_attn_classic(batch_size, nheads, nheads_k, seqlen_q, seqlen_k, d, causal, dtype):
    q, k, v, g, out, dq, dk, dv = run(batch_size, nheads, nheads_k, seqlen_q, seqlen_k, d, causal, dtype)
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    out_ref = attention_ref(qr, kr, vr, causal)
    out_pt = attention_ref(qr, kr, vr, causal, upcast=False)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (qr, kr, vr), g.float())
    dq_pt, dk_pt, dv_pt = torch.autograd.grad(out_pt, (qr, kr, vr), g.float())
    # at most twice the error of the same computation in the inputs' dtype, plus a little
    assert (out - out_ref).abs().max() <= 2 * (out_pt - out_ref).abs().max() + 1e-5
    for x, x_ref, x_pt in ((dq, dq_ref, dq_pt), (dk, dk_ref, dk_pt), (dv, dv_ref, dv_pt)):
        assert (x - x_ref).abs().max() <= 3 * (x_pt - x_ref).abs().max() + 1e-5


@grid
def test_flash_attn(batch_size, nheads, nheads_k, seqlen_q, seqlen_k, d, causal, dtype):
    q, k, v, g, out, dq, dk, dv = run(batch_size, nheads, nheads_k, seqlen_q, seqlen_k, d, causal, dtype)
    attnoracle.assert_close({"out": out, "dq": dq, "dk": dk, "dv": dv}, q, k, v, dout=g,
                            causal="bottom_right" if causal else False, profile="flash")
