"""A target for Nsight Compute: one workloads-suite cell run by one implementation, the profiled launches fenced by
cudaProfilerStart / Stop (so ncu sees only the last iteration's kernels, none of the compile or warm-up ones).

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 tools/gpu/ncu_cells.py --cell phi3 --impl fa4 --mode fwd

--impl: flashport-triton (our kernels as the static priority picks them) or fa4 (or any bench peer); --mode fwd
(inference forward) or bwd (the backward of a training forward).  Issue [14]: where our kernels trail FA4, the note
reads what bounds each side from these profiles.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", required=True, help="regex over the workloads suite's labels (the first match)")
    ap.add_argument("--impl", default="flashport-triton")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    from flashport.bench import peers
    from flashport.bench.shapes import workloads
    shape = next(s for s in workloads() if s.kind == "dense" and re.search(args.cell, s.label()))
    print("cell:", shape.label(), "impl:", args.impl, "mode:", args.mode, flush=True)
    train = args.mode == "bwd"
    q, k, v = peers.make_inputs(shape, torch.device("cuda"), requires_grad=train)
    with peers.context(args.impl):
        fn = peers.dense_fn(args.impl, shape, q, k, v)
        if train:
            out = fn()
            do = torch.randn_like(out)
            step = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        else:
            step = fn
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
