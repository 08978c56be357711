"""The flex backend's three GPU-tier failures of the 22nd session, each with its diagnosis printed: a second
backward with retain_graph (donated buffers) with the patch inside the call only and with donation off for the
whole process; a new sequence length with Dynamo's recompile log on; the flex fuzz's case 38."""
import logging
import sys

import torch
import torch._functorch.config as fcfg

import flashport
from flashport import mods
from flashport.fuzz import mods as fuzz_mods


def twice(label):
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        out = flashport.attention(q, k, v, backend="flex", causal=True, score_mod=mods.tanh_softcap(20.0))
        a = torch.autograd.grad(out.float().sum(), (q,), retain_graph=True)[0]
        b = torch.autograd.grad(out.float().sum(), (q,))[0]
        print(f"retain_graph [{label}]: ok, equal={torch.equal(a, b)}", flush=True)
    except Exception as e:
        print(f"retain_graph [{label}]: {type(e).__name__}: {str(e)[:300]}", flush=True)


print(torch.__version__, "donated_buffer default:", fcfg.donated_buffer, flush=True)
twice("patch inside the call")
twice("again, compiled graph reused")
torch._dynamo.reset()
fcfg.donated_buffer = False
twice("donation off process-wide")
fcfg.donated_buffer = True
torch._dynamo.reset()

torch._logging.set_logs(recompiles=True, dynamic=logging.INFO)
from torch._dynamo.utils import counters
table = torch.randn(8, 33, device="cuda", requires_grad=True)
for s in (256, 384, 512, 1000):
    q, k, v = (torch.randn(2, s, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashport.attention(q, k, v, backend="flex", causal=True, score_mod=mods.relative_position(table))
    out.float().sum().backward()
    print(f"S={s}: unique_graphs={counters['stats']['unique_graphs']}", flush=True)
torch._logging.set_logs()

case = fuzz_mods.draw(20261206, 38)
r = fuzz_mods.run(case, "flex", "cuda")
print("flex case 38:", r["status"], str(r.get("problems") or r.get("reason"))[:400], flush=True)
sys.exit(0)
