"""Timers and measured ceilings.

GPU: medians from `triton.testing.do_bench` (it flushes L2 between runs), CUDA events otherwise.
CPU: wall-clock medians with time.perf_counter.  Ceilings are measured in the same run on the same
card: a bf16 8192^3 matmul (TFLOP/s, the MFU denominator) and a device-to-device copy (GB/s,
bytes read + written, the decode denominator).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def gpu_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_s(fn: Callable[[], object], device) -> tuple[float, object]:
    """(seconds, result) of one synchronised call: the first call includes compilation/autotuning."""
    sync(device)
    t0 = time.perf_counter()
    r = fn()
    sync(device)
    return time.perf_counter() - t0, r


def cpu_median_s(fn: Callable[[], object], first_s: float, budget_s: float = 2.0, max_runs: int = 5) -> tuple[float, int]:
    """Median seconds over repeated runs, counting an already-timed first run, until the budget is
    spent or max_runs is reached -> (median, runs)."""
    times = [first_s]
    while sum(times) < budget_s and len(times) < max_runs:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def matmul_tflops(device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = gpu_ms(lambda: a @ b)
    del a, b
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def copy_gbps(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = gpu_ms(lambda: dst.copy_(src))
    del src, dst
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def ceilings(device) -> dict:
    out = {}
    for key, fn in (("matmul_bf16_tflops", matmul_tflops), ("copy_gbps", copy_gbps)):
        try:
            out[key] = round(fn(device), 1)
        except Exception as e:  # a ceiling that fails is reported, not fatal
            out[key] = None
            out[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
    torch.cuda.empty_cache()
    return out
