"""Same-process A/B of static priority's cuDNN-first rule (PERFLOG row 97: FLASHPORT_CUDNN_FIRST, on by default since the 27th session):
backend=None with the selection table off and the switch 0 / 1 in alternating rounds, beside cuDNN alone, on
shapes of issue [8]'s kinds that no shipped table bucket holds (other batches, lengths and head counts than the
workloads suite's, as its verification uses).  Forward + backward milliseconds (training) or forward (inference),
the plan each side ran, and the ratio of switch 1 to switch 0; outputs must agree within the contract's rule
(different kernels: compared by max |diff| against the float64 reference's scale, not bitwise).

    PYTHONPATH=. python tools/gpu/static_ab.py --out $OUT/static_ab.json [--rounds 3]
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
from flashport import dispatch  # noqa: E402
from flashport.bench.timing import gpu_ms  # noqa: E402
from flashport.spec import dense_spec  # noqa: E402

CELLS = {   # name: (b, s, hq, hkv, d, dv, causal, train)
    "llama3-like b2 s3072 h32/8 d128 causal": (2, 3072, 32, 8, 128, 128, True, True),
    "gqa b1 s6144 h16/4 d128 causal": (1, 6144, 16, 4, 128, 128, True, True),
    "d64 b8 s1536 h12 (bert-like)": (8, 1536, 12, 12, 64, 64, False, True),
    "d64 b2 s6000 h16 causal": (2, 6000, 16, 16, 64, 64, True, True),
    "vit-like b32 s577 h12 d64": (32, 577, 12, 12, 64, 64, False, True),
    "d128 b4 s1000 h20 (odd length)": (4, 1000, 20, 20, 128, 128, False, True),
    "d80 b4 s2304 h12 (dit-like)": (4, 2304, 12, 12, 80, 80, False, True),
    "d96 b2 s3000 h16 causal": (2, 3000, 16, 16, 96, 96, True, True),
    "mla b1 s3000 h16 d192/128 causal": (1, 3000, 16, 16, 192, 128, True, True),
    "long b1 s32768 h8/2 d128 causal": (1, 32768, 8, 2, 128, 128, True, True),
    "infer b8 s700 h16 d128 causal": (8, 700, 16, 16, 128, 128, True, False),
    "infer b1 s3000 h32/8 d128 causal": (1, 3000, 32, 8, 128, 128, True, False),
}


def _cell(b, s, hq, hkv, d, dv, causal, train, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype, generator=g).requires_grad_(train)
    k = torch.randn(b, s, hkv, d, device=device, dtype=dtype, generator=g).requires_grad_(train)
    v = torch.randn(b, s, hkv, dv, device=device, dtype=dtype, generator=g).requires_grad_(train)
    do = torch.randn(b, s, hq, dv, device=device, dtype=dtype, generator=g)
    spec = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0, deterministic=False, return_lse=False)[0]

    def run(backend=None):
        out = flashport.attention(q, k, v, causal=causal, backend=backend)
        if train:
            torch.autograd.grad(out, (q, k, v), do)
        return out
    return spec, run


def _cpu_ms(run, backend) -> float:
    import time
    t = time.perf_counter()
    run(backend)
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="CPU, float32, 1/16 of each length, batch 1: the script's "
                                                          "own path only (no cuDNN there: its column errors)")
    a = ap.parse_args()
    os.environ["FLASHPORT_TABLE"] = "off"
    device = "cpu" if a.smoke else "cuda"
    result = {"card": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), "cells": {}}
    before = os.environ.get("FLASHPORT_CUDNN_FIRST")
    for name, shape in CELLS.items():
        if a.smoke:
            b, sl, *rest = shape
            shape = (1, max(sl // 16, 16), *rest)
        spec, run = _cell(*shape, device=device, dtype=torch.float32 if a.smoke else torch.bfloat16)
        rows, plans, outs, errors = {"0": [], "1": [], "sdpa-cudnn": []}, {}, {}, {}
        for rnd in range(a.rounds):
            order = list(rows)[rnd % 3:] + list(rows)[:rnd % 3]   # each side measured first once in 3 rounds
            for side in order:
                if side in errors:
                    continue
                if side == "sdpa-cudnn":
                    backend = side
                else:
                    os.environ["FLASHPORT_CUDNN_FIRST"] = side
                    backend = None
                dispatch.clear_cache()
                try:
                    plans[side] = dispatch.select(spec, backend).name
                    outs[side] = run(backend).detach().float()
                    rows[side].append(gpu_ms(lambda: run(backend)) if device == "cuda" else _cpu_ms(run, backend))
                except Exception as e:   # noqa: BLE001 - a side that cannot serve the cell (cuDNN refusing it)
                    errors[side] = f"{type(e).__name__}: {e}"[:300]
        med = {k: statistics.median(v) for k, v in rows.items() if v}
        diff = None   # the largest output difference from the switch-off side, relative to its largest value
        if "0" in outs:
            scale = outs["0"].abs().max().item() or 1.0
            diff = max((outs[k] - outs["0"]).abs().max().item() for k in outs) / scale
        row = {"ms": med, "plans": plans, "errors": errors, "max_rel_diff": diff, "train": shape[-1]}
        if "0" in med and "1" in med:
            row["speedup_switch"] = med["0"] / med["1"]
        if "1" in med and "sdpa-cudnn" in med:
            row["vs_cudnn_switch1"] = med["sdpa-cudnn"] / med["1"]
        result["cells"][name] = row
        print(f"{name:42} " + "  ".join(f"{k} {v:.3f} ms ({plans.get(k, '-')})" for k, v in med.items())
              + (f"  on/off speedup {row['speedup_switch']:.3f}" if "speedup_switch" in row else "")
              + (f"  diff {diff:.1e}" if diff is not None else "") + (f"  errors: {sorted(errors)}" if errors else ""), flush=True)
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))
    if before is None:
        os.environ.pop("FLASHPORT_CUDNN_FIRST", None)
    else:
        os.environ["FLASHPORT_CUDNN_FIRST"] = before
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
