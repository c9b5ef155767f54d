import torch, attnoracle

def sdpa(q, k, v, scale, causal):  # the function under test; PyTorch 2: F.scaled_dot_product_attention
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))  # GQA, MQA
    s = (q @ k.transpose(-2, -1)) * scale
    if causal != "none":  # top_left: key j <= query i; bottom_right: j <= i + Nk - Nq
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq if causal == "bottom_right" else 0)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v

@attnoracle.parametrize_suite("vectors/core", profile="fp64,fp32,torch-cpu-bf16", returns=("out",), unsupported=(
    "mha", "mask", "bias", "query_mask", "window", "softcap", "F16", "masked_rows_zero", "expect_error", "seqlens",
    "sinks", "fp8"))
def test_sdpa(attnoracle_case):
    c, x = attnoracle_case, attnoracle_case.torch()
    c.assert_conforms({"out": sdpa(x["q"], x["k"], x["v"], c.scale_value, c.causal)})
