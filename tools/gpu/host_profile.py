"""Where the host time of one eager flashport call goes (Python, validation, dispatch, launches).

    PYTHONPATH=. python3 tools/gpu/host_profile.py [--calls 300] [--top 25]

Decode at batch 1 takes tens of microseconds on the GPU, so an eager call is bound by its host path:
this profiles `attention_with_kvcache` (1 x 32768 tokens, 32 / 8 heads, D = 128, bf16, dense and
paged) and a short training-shape `attention` forward with cProfile and prints the wall time per call
next to the GPU time of a CUDA-graph replay of the same call.  Needs CUDA.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402
from flashport.bench.timing import gpu_graph_ms  # noqa: E402


def calls(device):
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=device, dtype=dt, generator=g)
    kc = torch.randn(1, 32768, 8, 128, device=device, dtype=dt, generator=g)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), 32768, dtype=torch.int32, device=device)
    kp, vp = kc.view(2048, 16, 8, 128), vc.view(2048, 16, 8, 128)
    table = torch.arange(2048, device=device, dtype=torch.int32).view(1, 2048)
    qs, ks, vs = (torch.randn(4, 1024, 16, 64, device=device, dtype=dt, generator=g) for _ in range(3))
    # D = 128: served by the Gluon Hopper forward / backward on an H100 / H200 (the standard set's short cells)
    qh, kh, vh = (torch.randn(4, 1024, 16, 128, device=device, dtype=dt, generator=g).requires_grad_()
                  for _ in range(3))
    dout = torch.randn_like(qh)

    def train_step():
        out = flashport.attention(qh, kh, vh, causal=True, backend="triton")
        return torch.autograd.grad(out, (qh, kh, vh), dout)
    return {
        "decode dense 1x32768": lambda: flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                         backend="triton"),
        "decode page16 1x32768": lambda: flashport.attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                                          block_table=table, backend="triton"),
        "attention fwd 4x1024 h16 d64 causal": lambda: flashport.attention(qs, ks, vs, causal=True, backend="triton"),
        "attention fwd 4x1024 h16 d128 causal": lambda: flashport.attention(qh.detach(), kh.detach(), vh.detach(),
                                                                           causal=True, backend="triton"),
        "attention fwd+bwd 4x1024 h16 d128 causal": train_step,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--only", default="", help="profile only the calls whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    for name, fn in calls(device).items():
        if args.only not in name:
            continue
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host_us = (time.perf_counter() - t0) / args.calls * 1e6   # launch-queue time: host-bound if > GPU
        torch.cuda.synchronize()
        graph_ms, why = gpu_graph_ms(fn)
        graph_us = graph_ms * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"\n=== {name}: host {host_us:.1f} us per call (no sync), graph replay {graph_us:.1f} us on the GPU"
              + (f" ({why})" if why else ""))
        print("\n".join(buf.getvalue().splitlines()[:args.top + 12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
