"""Negative control of the compute-sanitizer runs (issue [5]): the same bad-content call as
tests/gpu/test_contents_gpu.py with flashport.contents.guard switched off in this process.  Under
`compute-sanitizer --tool memcheck` this must report invalid global reads (the block_table entry points
far outside the cache), which shows the clean runs are clean because of the guard, not because memcheck
sees nothing.  Without memcheck it may corrupt nothing visibly or kill the context: run it last, alone."""
import torch

import flashport
import flashport.api

flashport.api.guard = lambda spec, inputs, cache_seqlens=None: inputs
g = torch.Generator(device="cuda").manual_seed(0)
kc = torch.randn(6, 16, 2, 64, generator=g, device="cuda").to(torch.bfloat16)
vc = torch.randn_like(kc)
q = torch.randn(2, 1, 4, 64, generator=g, device="cuda").to(torch.bfloat16)
table = torch.tensor([[0, 1, 2], [3, 1 << 26, 5]], dtype=torch.int32, device="cuda")
lens = torch.tensor([40, 48], dtype=torch.int32, device="cuda")
out = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, backend="triton")
torch.cuda.synchronize()
print("returned", out.float().abs().max().item())
