"""Same-process A/B of the portable Triton kernels' direct launches (kernels/launch.py; PERFLOG row 96): host
microseconds per eager call and GPU milliseconds, forward and backward, with FLASHPORT_TRITON_DIRECT=0 (every
launch of these kernels through JITFunction.run) and 1, in alternating rounds, on the cells these kernels serve on Hopper (few keys,
Dv != D, D=72, softcap, varlen, chunked prefill).  Each cell's outputs and gradients must match bitwise between
the two sides (the same compiled kernels run).

    PYTHONPATH=. python tools/gpu/host_ab_direct.py --out $OUT/host_ab_direct.json [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402
from flashport.bench.timing import gpu_ms, host_us  # noqa: E402
from flashport.kernels import launch  # noqa: E402

CELLS = {   # name: (b, sq, sk, hq, hkv, d, dv, kwargs)
    "sdxl-cross b2 q4096 k77 h10 d64": (2, 4096, 77, 10, 10, 64, 64, {}),
    "sdxl-cross, backend=None": (2, 4096, 77, 10, 10, 64, 64, dict(backend=None)),
    "mla b1 s1024 h16 d192/128 causal": (1, 1024, 1024, 16, 16, 192, 128, dict(causal=True)),
    "dit d72 b2 s1024 h16": (2, 1024, 1024, 16, 16, 72, 72, {}),
    "softcap b1 s1024 h8/4 d128 causal": (1, 1024, 1024, 8, 4, 128, 128, dict(causal=True, softcap=30.0)),
    "short b4 s256 h16 d128 causal": (4, 256, 256, 16, 16, 128, 128, dict(causal=True)),
}


def _cell(b, sq, sk, hq, hkv, d, dv, kw):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, sk, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(b, sq, hq, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = {"backend": "triton", **kw}
    fwd = lambda: flashport.attention(q, k, v, **kw)  # noqa: E731
    out = fwd()
    bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
    return fwd, bwd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = {"card": torch.cuda.get_device_name(), "direct_available": launch.DIRECT, "cells": {}}
    before = os.environ.get("FLASHPORT_TRITON_DIRECT")
    for name, shape in CELLS.items():
        fwd, bwd = _cell(*shape)
        rows = {False: [], True: []}
        answers = {}
        for _ in range(a.rounds):
            for direct in (False, True):
                os.environ["FLASHPORT_TRITON_DIRECT"] = "1" if direct else "0"
                answers[direct] = [t.clone() for t in (fwd(), *bwd())]
                rows[direct].append(dict(fwd_host_us=host_us(fwd), bwd_host_us=host_us(bwd), fwd_ms=gpu_ms(fwd),
                                         bwd_ms=gpu_ms(bwd)))
        same = all(torch.equal(x, y) for x, y in zip(answers[False], answers[True]))
        med = {side: {m: statistics.median(r[m] for r in rows[side]) for m in rows[side][0]} for side in rows}
        result["cells"][name] = {"jit": med[False], "direct": med[True], "rounds": rows[False] + rows[True],
                                 "bitwise_equal": same}
        j, d = med[False], med[True]
        print(f"{name:38} host fwd {j['fwd_host_us']:6.0f} -> {d['fwd_host_us']:6.0f} us  bwd {j['bwd_host_us']:6.0f}"
              f" -> {d['bwd_host_us']:6.0f} us | ms fwd {j['fwd_ms']:.3f} -> {d['fwd_ms']:.3f}  bwd {j['bwd_ms']:.3f}"
              f" -> {d['bwd_ms']:.3f} | bitwise {'equal' if same else 'DIFFERENT'}", flush=True)
    if before is None:
        del os.environ["FLASHPORT_TRITON_DIRECT"]
    else:
        os.environ["FLASHPORT_TRITON_DIRECT"] = before
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
