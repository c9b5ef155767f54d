import torch, attnoracle

def sdpa(q, k, v, scale, causal):  # the function under test; PyTorch 2: F.scaled_dot_product_attention
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v

@attnoracle.parametrize_suite("vectors/core", profile="fp64,fp32,torch-cpu-bf16", unsupported=(
    "mha", "gqa", "mask", "bias", "query_mask", "causal_bottom_right", "window", "softcap", "F16", "lse",
    "weights", "masked_rows_zero", "expect_error"))
def test_sdpa(attnoracle_case):
    x = attnoracle_case.torch()
    out = sdpa(x["q"], x["k"], x["v"], attnoracle_case.scale_value, attnoracle_case.causal == "top_left")
    attnoracle_case.assert_conforms({"out": out})
