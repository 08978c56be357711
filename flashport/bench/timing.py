"""Timers and measured ceilings.

GPU: medians from `triton.testing.do_bench` (it flushes L2 between runs), CUDA events otherwise; `host_us`
is the host time of one call (what an eager call costs before its kernels can start);
`gpu_graph_ms` times the same call replayed from a CUDA graph (no Python, launcher or allocator work
per call: what a serving loop that captures its decode step pays), also with L2 flushed per replay.
CPU: wall-clock medians with time.perf_counter.  Ceilings are measured in the same run on the same
card: a bf16 8192^3 matmul (TFLOP/s, the MFU denominator) and a device-to-device copy (GB/s,
bytes read + written, the decode denominator).
"""
from __future__ import annotations

import contextlib
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


_FLUSH_BYTES = 256 << 20   # larger than any L2 (H200: 60 MiB), as do_bench uses
_flush: dict = {}


def _l2_flush(device) -> torch.Tensor:
    key = str(device)
    if key not in _flush:
        _flush[key] = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=device)
    return _flush[key]


def gpu_graph_ms(fn: Callable[[], object], warmup: int = 3, rep_ms: float = 100.0,
                 max_replays: int = 1000, clean_flush: bool = False) -> tuple[float, str | None]:
    """Median milliseconds of fn() replayed from a CUDA graph -> (ms, None).

    fn is warmed up on a side stream (compilation, lazy init, allocator pools), captured once, and
    each replay is timed alone with CUDA events after an L2 flush, like do_bench.  do_bench's flush
    writes 256 MiB, which leaves L2 full of dirty lines that are written back while the timed call
    runs (tens of MB of DRAM writes: several microseconds inside a 50 us decode step);
    clean_flush=True reads the buffer after writing it, so the timed call starts from an L2 of clean
    lines, as after the matmuls that precede attention in a model.  If capture fails
    (an op that syncs with the host, a library that cannot be captured) the result is the eager
    median of gpu_ms with the reason: (ms, "graph capture failed: ...")."""
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any capture failure is reported, the timing goes on eagerly
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        reason = f"graph capture failed: {type(e).__name__}: {e}".replace("\n", " ")[:300]
        return gpu_ms(fn), reason
    flush = _l2_flush(device)

    def timed_replay() -> float:
        flush.zero_()
        if clean_flush:
            flush.view(torch.float32).sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    first = statistics.median(timed_replay() for _ in range(5))
    n = int(min(max_replays, max(10, rep_ms / max(first, 1e-3))))
    ms = statistics.median(timed_replay() for _ in range(n))
    del graph
    return ms, None


_CYCLES_PER_US: list = []


def _cycles_per_us() -> float:
    """The rate of torch.cuda._sleep (a spin for N clock cycles), measured once per process."""
    if not _CYCLES_PER_US:
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_US.append(2_000_000 / max(start.elapsed_time(end) * 1e3, 1.0))
    return _CYCLES_PER_US[0]


def paired_ms(fns: dict, iters: int, device) -> dict:
    """{name: [ms per iteration]} for several callables timed side by side: each iteration runs every fn once,
    in an order rotated by one per iteration, each after an L2 flush and between its own CUDA events (the
    events are read after the last iteration, so the host never waits).  Clock, thermal and host drift then
    fall on every fn alike, and their ratio is steadier than that of separate do_bench runs (which drift
    5-10% apart on a sub-millisecond H200 cell).  On a CPU, wall-clock per call.

    On CUDA each timed call is preceded by a spin kernel (NVBench's "blocking kernel") as long as that fn's
    last host time plus a margin: the host then enqueues the whole call while the GPU spins, and the events
    time the device's work alone.  Without it, a call whose host time exceeds the flush reads the host's
    hiccups as device time (the same kernel read 0.214 and 0.285 ms in one run).  Host time per call is
    measured on its own (`host_us`)."""
    names = list(fns)
    cuda = torch.device(device).type == "cuda"
    out: dict = {n: [] for n in names}
    if not cuda:
        for i in range(iters):
            for n in names[i % len(names):] + names[:i % len(names)]:
                t0 = time.perf_counter()
                fns[n]()
                out[n].append((time.perf_counter() - t0) * 1e3)
        return out
    flush = _l2_flush(torch.device("cuda", torch.cuda.current_device()))
    rate = _cycles_per_us()
    host_us = {n: 1000.0 for n in names}      # until measured: 1 ms covers any one call's launches
    events = []
    for i in range(iters):
        for n in names[i % len(names):] + names[:i % len(names)]:
            torch.cuda._sleep(int(rate * min(1.25 * host_us[n] + 20.0, 50_000.0)))
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fns[n]()
            end.record()
            host_us[n] = (time.perf_counter() - t0) * 1e6
            events.append((n, start, end))
    torch.cuda.synchronize()
    for n, start, end in events:
        out[n].append(start.elapsed_time(end))
    return out


HOST_BOUND_MS = 5.0   # cells longer than this are GPU-bound whatever the host does: host time not measured


def host_us(fn: Callable[[], object], calls: int = 10, batches: int = 3) -> float:
    """Host microseconds per call: the median over `batches` of the wall time of `calls` back-to-back calls
    without a sync, divided by `calls`.  The GPU runs behind (a few launches per call stay far from the
    driver's queue limit), so this is the host's own work.  do_bench's L2 flush (~85 us on an H200) hides host
    time only up to its own length: a cell whose host time is longer reads the excess as GPU time."""
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
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


def cpu_best_s(fn: Callable[[], object], first_s: float, runs: int = 3) -> tuple[float, float, int]:
    """Best and median seconds of `runs` timed runs after an untimed first one (first_s: its time) ->
    (best, median, runs).  The best of a few is the CPU job's number: on a shared machine other processes only
    ever add time."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), len(times)


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
