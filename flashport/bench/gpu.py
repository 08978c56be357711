"""GPU suites: flashport's triton backend against its peers on the same card, in the same process.

Per (shape, mode, implementation) one entry: median ms (do_bench), host µs per call (for cells under
HOST_BOUND_MS, where host time can show in the eager timing), TFLOP/s by FlashAttention's
convention (or GB/s of K+V read for decode, timed both eagerly and replayed from a CUDA graph,
every peer alike), MFU against the matmul ceiling measured in the same run, the wall time of the
first call (compilation / autotuning), peak extra device memory, the max |difference| to the first
implementation that ran, and flashport's speedup over each peer.
Anything that raises (UnsupportedError, a missing kernel, OOM, a compile failure) becomes an entry
with its status and reason; the run goes on.
"""
from __future__ import annotations

import torch

from . import peers
from .peers import NotApplicable
from .shapes import Shape, flops, kv_bytes
from .timing import HOST_BOUND_MS, gpu_graph_ms, gpu_ms, host_us, wall_s

FLASHPORT = "flashport-triton"
# Issue [8]'s bar: the best of these that serves a cell (FA4, when installed, is also in vs_best_peer)
BAR_PEERS = ("sdpa-cudnn", "sdpa-fa2", "sdpa-efficient", "flex")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:400]


def _status(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "oom"
    if isinstance(e, peers.NotInstalled):
        return "not installed"
    if isinstance(e, NotApplicable):
        return "n/a"
    return "failed"


def _peak_mb(fn, device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    r = fn()
    torch.cuda.synchronize(device)
    del r
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _entry(suite, shape: Shape, impl, mode, **kw) -> dict:
    return dict(suite=suite, label=shape.label(), shape=shape.as_dict(), impl=impl, mode=mode, **kw)


def _dense(suite: str, shape: Shape, impls, device, ceil: dict, tick) -> list[dict]:
    train = "bwd" in shape.modes
    q, k, v = peers.make_inputs(shape, device, requires_grad=train)
    entries, ref_out = [], None
    for impl in impls:
        out = None
        try:
            with peers.context(impl):
                fn = peers.dense_fn(impl, shape, q, k, v)
                first_s, out = wall_s(lambda: peers.run_once(fn), device)
                ms = gpu_ms(fn)
                host = host_us(fn) if ms < HOST_BOUND_MS else None
                diff = None if ref_out is None else (out.detach().float() - ref_out).abs().max().item()
                if ref_out is None:
                    ref_out = out.detach().float()
                peak = _peak_mb(fn, device)
                f = flops(shape, "fwd")
                entries.append(_entry(suite, shape, impl, "fwd", status="ok", ms=ms, tflops=f / ms / 1e9, host_us=host,
                                      first_call_s=first_s, peak_mem_mb=peak, max_abs_diff=diff))
                if train:
                    do = torch.randn_like(out)
                    bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                    first_b, _ = wall_s(bwd, device)
                    ms_b = gpu_ms(bwd)
                    host_b = host_us(bwd) if ms_b < HOST_BOUND_MS else None
                    entries.append(_entry(suite, shape, impl, "bwd", status="ok", ms=ms_b, host_us=host_b,
                                          tflops=flops(shape, "bwd") / ms_b / 1e9, first_call_s=first_b))
        except Exception as e:  # recorded, never fatal
            done = {x["mode"] for x in entries if x["impl"] == impl}
            for mode in shape.modes:
                if mode not in done:
                    entries.append(_entry(suite, shape, impl, mode, status=_status(e), error=_err(e)))
        finally:
            del out
            torch.cuda.empty_cache()
            tick()
    return entries


def _decode(suite: str, shape: Shape, impls, device, ceil: dict, tick) -> list[dict]:
    q, kc, vc, lens, table = peers.make_cache(shape, device)
    entries, ref_out = [], None
    for impl in impls:
        try:
            with peers.context(impl):
                fn = peers.decode_fn(impl, shape, q, kc, vc, lens, table)
                first_s, out = wall_s(lambda: peers.run_once(fn), device)
                diff = None if ref_out is None else (out.float() - ref_out).abs().max().item()
                if ref_out is None:
                    ref_out = out.float()
                entries.append(_entry(suite, shape, impl, "fwd", status="ok", first_call_s=first_s,
                                      max_abs_diff=diff, **decode_timings(fn, shape, ceil)))
        except Exception as e:
            entries.append(_entry(suite, shape, impl, "fwd", status=_status(e), error=_err(e)))
        finally:
            torch.cuda.empty_cache()
            tick()
    return entries


def _rate(shape: Shape, ms: float, copy) -> tuple[float, float | None]:
    gbps = kv_bytes(shape) / (ms * 1e-3) / 1e9
    return gbps, (gbps / copy if copy else None)


def decode_timings(fn, shape: Shape, ceil: dict) -> dict:
    """Eager median (do_bench: ms, gbps, frac_of_copy) and CUDA-graph replay median (graph_ms,
    graph_gbps, graph_frac_of_copy; graph_fallback says why when capture failed and the eager
    timing stands in) of one decode call, GB/s counting the K+V bytes read."""
    ms = gpu_ms(fn)
    graph_ms, fallback = gpu_graph_ms(fn)
    (gbps, frac), (g_gbps, g_frac) = (_rate(shape, t, ceil.get("copy_gbps")) for t in (ms, graph_ms))
    timings = dict(ms=ms, gbps=gbps, frac_of_copy=frac, graph_ms=graph_ms, graph_gbps=g_gbps,
                   graph_frac_of_copy=g_frac)
    if fallback:
        timings["graph_fallback"] = fallback
    return timings


def add_ratios(entries: list[dict], ceil: dict) -> None:
    """MFU against the matmul ceiling, and flashport's speedup over each peer (peer ms / flashport ms)."""
    mm = ceil.get("matmul_bf16_tflops")
    by_key: dict = {}
    for e in entries:
        if e["status"] == "ok":
            by_key.setdefault((e["label"], e["mode"]), {})[e["impl"]] = e
            if mm and "tflops" in e:
                e["mfu"] = e["tflops"] / mm
    for group in by_key.values():
        peers_ms = {n: e["ms"] for n, e in group.items() if not n.startswith("flashport") and e.get("ms")}
        bar_ms = [ms for n, ms in peers_ms.items() if n in BAR_PEERS]
        for n, e in group.items():   # per flashport impl: the best peer that serves the cell
            if n.startswith("flashport") and peers_ms and e.get("ms"):
                e["vs_best_peer"] = min(peers_ms.values()) / e["ms"]
                e["best_peer"] = min(peers_ms, key=peers_ms.get)
                if bar_ms:
                    e["vs_best_bar_peer"] = min(bar_ms) / e["ms"]
        fp = group.get(FLASHPORT)
        if fp:
            fp["speedup_vs"] = {n: e["ms"] / fp["ms"] for n, e in group.items() if n != FLASHPORT}
            if fp.get("graph_ms") and not fp.get("graph_fallback"):   # graph against graph only
                fp["graph_speedup_vs"] = {n: e["graph_ms"] / fp["graph_ms"] for n, e in group.items()
                                          if n != FLASHPORT and e.get("graph_ms") and not e.get("graph_fallback")}


def run_suite(suite: str, shapes: list[Shape], impls, device, ceil: dict, tick, checkpoint=None) -> list[dict]:
    """Time every shape x implementation; checkpoint(entries) after each shape (the CLI rewrites the
    JSON then, so a run cut short by a time limit keeps what it measured)."""
    entries = []
    for shape in shapes:
        runner = _decode if shape.kind == "decode" else _dense
        use = [i for i in impls if shape.kind != "decode" or i in peers.DECODE]
        try:
            entries += runner(suite, shape, use, device, ceil, tick)
        except Exception as e:  # e.g. OOM while making the inputs themselves (no implementation ran)
            entries += [_entry(suite, shape, i, m, status=_status(e), error=_err(e)) for i in use for m in shape.modes]
            for _ in use:
                tick()
        torch.cuda.empty_cache()
        if checkpoint is not None:
            add_ratios(entries, ceil)
            checkpoint(entries)
    add_ratios(entries, ceil)
    return entries
