"""Every plan on a few shapes on the GPU, against the float64 reference (max |err| / max |ref|, output and
gradients): a minute-long smoke check before a longer device run (issue [6])."""
import torch

import flashport
from flashport import dispatch

PLANS = ["gluon", "triton", "gluon/triton", "triton/gluon", "blockwise/gluon", "gluon/blockwise", "triton/reference",
         "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", None]
SHAPES = [(2, 512, 4, 4, 128, True), (1, 1024, 8, 2, 64, False), (2, 512, 4, 4, 256, True), (1, 640, 4, 1, 128, False)]

bad = 0
for b, s, hq, hkv, d, causal in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = flashport.attention(*leaves, causal=causal, backend="reference")
    ref_g = torch.autograd.grad(ref, leaves, do.double())
    for plan in PLANS:
        ls = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            out = flashport.attention(*ls, causal=causal, backend=plan)
            gr = torch.autograd.grad(out, ls, do)
        except dispatch.UnsupportedError as e:
            print(f"{plan or 'auto':<18} b{b} s{s} h{hq}/{hkv} d{d} causal={causal}: unsupported ({str(e)[:120]!r})")
            continue
        errs = [((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip((out, *gr), (ref, *ref_g))]
        ok = all(e < 3e-2 for e in errs)
        bad += not ok
        name = plan or "auto:" + dispatch.select(flashport.spec.dense_spec(
            ls[0], ls[1], ls[2], causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]).name
        print(f"{name:<18} b{b} s{s} h{hq}/{hkv} d{d} causal={causal}: rel err out/dq/dk/dv "
              + " ".join(f"{e:.1e}" for e in errs) + ("" if ok else "  <-- BAD"))
print(f"plan smoke: {bad} bad")
