"""Command line: `flashport info | check | bench` (also `python -m flashport ...`)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ENV_VARS = ("FLASHPORT_BACKEND", "FLASHPORT_CHECKS", "FLASHPORT_ALLOW_TF32", "TRITON_INTERPRET")


def info_dict() -> dict:
    """Device, versions and every backend with availability, reasons and capabilities."""
    import torch

    import flashport
    from .bench.report import cpu_name
    d = {"flashport": flashport.__version__, "python": platform.python_version(), "torch": torch.__version__,
         "platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count()}
    try:
        import triton
        d["triton"] = triton.__version__
    except ImportError:
        d["triton"] = None
    if torch.cuda.is_available():
        d["device"] = "cuda"
        d["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            d["gpus"].append({"index": i, "name": p.name, "sm_count": p.multi_processor_count,
                              "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)})
        d["cuda"] = torch.version.cuda
    else:
        d["device"] = "cpu"
    d["env"] = {k: os.environ.get(k) for k in ENV_VARS}
    d["backends"] = [{"name": b.name, "available": b.available, "reasons": b.reasons,
                      "capabilities": b.capabilities} for b in flashport.backends()]
    return d


def cmd_info(args) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=1, default=str))
        return 0
    print(f"flashport {d['flashport']}  python {d['python']}  torch {d['torch']}  triton {d['triton'] or 'not installed'}")
    print(f"platform  {d['platform']}  ({d['cpu']}, {d['cpu_count']} cores)")
    if d["device"] == "cuda":
        print(f"device    cuda {d['cuda']}")
        for g in d["gpus"]:
            print(f"  gpu {g['index']}: {g['name']}  sm_{g['capability'].replace('.', '')} ({g['capability']}), "
                  f"{g['sm_count']} SMs, {g['memory_gib']} GiB")
    else:
        print("device    cpu (no CUDA device)")
    print("env       " + ("  ".join(f"{k}={v}" for k, v in d["env"].items() if v is not None) or "(none set)"))
    print("backends (auto order):")
    for b in d["backends"]:
        state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        print(f"  {b['name']:<10} {state}")
        caps = ", ".join(f"{k}={v}" for k, v in b["capabilities"].items())
        if caps:
            print(f"  {'':<10} {caps}")
    return 0


def cmd_check(args) -> int:
    import time

    import torch

    from .check import format_table, run_check
    dtypes = [getattr(torch, t) for t in args.dtype.split(",")] if args.dtype else None
    t0 = time.perf_counter()
    results = run_check(args.backend or None, args.device, dtypes)
    print(format_table(results))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if counts["FAIL"] else 0


def cmd_bench(args) -> int:
    from . import bench
    return bench.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashport", description="exact FlashAttention-style attention, portable backends")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="device, versions, backends with reasons and capabilities")
    pi.add_argument("--json", action="store_true")
    pc = sub.add_parser("check", help="conformance of every available backend against `reference`")
    pc.add_argument("--backend", action="append", help="check only this backend (repeatable)")
    pc.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    pc.add_argument("--dtype", default=None, help="comma-separated, e.g. float16,bfloat16 (default per device)")
    pb = sub.add_parser("bench", help="benchmark on the hardware present (JSON + PNG into --out)")
    from .bench import add_arguments
    add_arguments(pb)
    args = p.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
