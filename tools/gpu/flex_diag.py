"""Why the `flex` backend failed on the GPU (14th session): graph breaks and recompiles of compiled Flex under
flashport's composed mods, one case at a time, each with its traceback.

    TORCH_LOGS=graph_breaks,recompiles python tools/gpu/flex_diag.py
"""
import traceback

import torch

import flashport
from flashport import mods


def case(name, **kw):
    q, k, v = (torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        out = flashport.attention(q, k, v, backend="flex", **kw)
        out.float().sum().backward()
        ref = flashport.attention(q.detach(), k.detach(), v.detach(), backend="blockwise", **kw)
        print(f"{name}: ok, max |flex - blockwise| = {(out.detach() - ref).abs().max().item():.3e}", flush=True)
    except Exception:  # noqa: BLE001
        print(f"{name}: FAILED\n{traceback.format_exc()[-2500:]}", flush=True)


table = torch.zeros(8, 33, device="cuda", requires_grad=True)
slopes = torch.rand(8, device="cuda")
bias = torch.randn(1, 8, 1, 512, device="cuda", requires_grad=True)
case("causal only", causal=True)
case("mask_mod causal", mask_mod=mods.causal)
case("alibi score_mod", score_mod=mods.alibi(slopes), causal=True)
case("softcap builtin", softcap=20.0, causal=True)
case("rel table (grad)", score_mod=mods.relative_position(table), causal=True)
case("attn_bias (grad)", attn_bias=bias)
case("block mask doc", block_mask=flashport.create_block_mask(mods.prefix_lm(100), None, None, 512, 512, device="cuda"))
