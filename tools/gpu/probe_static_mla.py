"""Why static_ab's MLA cell (b1 s3000 h16 d192/128 causal, training) ran 0.52 ms with FLASHPORT_CUDNN_FIRST=0 and
0.66 ms with 1 or with backend='sdpa-cudnn', every side planned as sdpa-cudnn, outputs equal (27th session, H100):
per side, alternating rounds, the plan, do_bench ms, host µs of one eager fwd + bwd, and the CUDA kernels a
profiled call launched.

    PYTHONPATH=. python tools/gpu/probe_static_mla.py --out $OUT/probe_static_mla.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flashport import dispatch  # noqa: E402
from flashport.bench.timing import gpu_ms  # noqa: E402
from static_ab import CELLS, _cell  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cells", default="mla,d80")
    a = ap.parse_args()
    os.environ["FLASHPORT_TABLE"] = "off"
    result = {"card": torch.cuda.get_device_name(), "cells": {}}
    for name, shape in CELLS.items():
        if not any(name.startswith(c) for c in a.cells.split(",")):
            continue
        spec, run = _cell(*shape)
        rows = {}
        for rnd in range(3):
            for side in ("0", "1", "sdpa-cudnn"):
                backend = side if side == "sdpa-cudnn" else None
                if backend is None:
                    os.environ["FLASHPORT_CUDNN_FIRST"] = side
                dispatch.clear_cache()
                plan = dispatch.select(spec, backend)
                run(backend)
                torch.cuda.synchronize()
                t = time.perf_counter()
                run(backend)
                host = (time.perf_counter() - t) * 1e6
                torch.cuda.synchronize()
                ms = gpu_ms(lambda: run(backend))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    run(backend)
                    torch.cuda.synchronize()
                kernels = sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
                r = rows.setdefault(side, {"plan": f"{plan.name} ({type(plan).__name__})", "ms": [], "host_us": [],
                                           "kernels": kernels})
                r["ms"].append(ms)
                r["host_us"].append(host)
                print(f"{name[:30]:30} round {rnd} side {side:10} plan {r['plan']:40} {ms:.3f} ms host {host:.0f} us",
                      flush=True)
        for side, r in rows.items():
            print(f"  {side}: kernels {r['kernels']}")
        result["cells"][name] = rows
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
