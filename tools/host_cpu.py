"""Host time per call of flashport's Python path on a CPU, against F.scaled_dot_product_attention (tiny shapes, where
the kernel costs little and the path is most of the call).  PERFLOG rows 55, 60 and 61.

    PYTHONPATH=. python tools/host_cpu.py     # µs per call, the best of 5 loops of N calls
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import flashport


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    torch.set_num_threads(2)
    q, k, v = (torch.randn(1, 16, 4, 64) for _ in range(3))
    t = [x.transpose(1, 2) for x in (q, k, v)]
    rows = []
    with torch.no_grad():
        rows.append(("dense forward", per_call_us(lambda: flashport.attention(q, k, v)),
                     per_call_us(lambda: F.scaled_dot_product_attention(*t))))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    tg = [x.transpose(1, 2) for x in (qg, kg, vg)]
    rows.append(("dense forward + backward", per_call_us(lambda: flashport.attention(qg, kg, vg).sum().backward(), 1000),
                 per_call_us(lambda: F.scaled_dot_product_attention(*tg).sum().backward(), 1000)))
    kc, vc = torch.randn(1, 64, 4, 64), torch.randn(1, 64, 4, 64)
    q1, k1 = torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64)
    lens = torch.full((1,), 32, dtype=torch.int32)
    with torch.no_grad():
        rows.append(("decode, no append", per_call_us(lambda: flashport.attention_with_kvcache(q1, kc, vc,
                                                                                               cache_seqlens=lens)), None))
        rows.append(("decode, one-token append", per_call_us(
            lambda: flashport.attention_with_kvcache(q1, kc, vc, k1, k1, cache_seqlens=lens)), None))
    print(f"{'call':28} {'flashport µs':>13} {'F.sdpa µs':>10}")
    for name, ours, theirs in rows:
        print(f"{name:28} {ours:13.1f} {'' if theirs is None else f'{theirs:10.1f}'}")


if __name__ == "__main__":
    main()
