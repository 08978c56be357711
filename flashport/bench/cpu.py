"""The CPU main job: flashport (auto backend) against naive materialised attention, forward fp32.

Each (S, implementation) runs in a fresh subprocess so that its peak memory is its own: the
worker makes its inputs, reads its resident set size, runs the call once and reports the growth
of the process's peak RSS (getrusage ru_maxrss) over that -- the call's working memory including
its output.  Large allocations come straight from mmap and go back to the OS on free, so earlier
work does not hide a peak; a warm-up on a tiny size happens before the baseline.  The naive
path is skipped, and reported as "OOM-skipped", where its two S x S float32 buffers would not fit
in half the available memory.  Errors: against float64 exact math for small S, and the two
implementations against each other for every S where both ran.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from .shapes import CpuConfig

_KB = 1024  # ru_maxrss is in KiB on Linux


def naive_attention(q, k, v, scale: float):
    """Materialised attention, fp32: softmax(scale * q @ k^T) @ v on [B, S, H, D] tensors."""
    import torch
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    p = torch.softmax((qh * scale) @ kh.transpose(-1, -2), dim=-1)
    return (p @ vh).transpose(1, 2)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KB


def worker(cfg: CpuConfig, out_path: str) -> dict:
    """Runs inside the subprocess; returns the record printed as JSON."""
    import torch

    import flashport
    from flashport import dispatch
    from flashport.backend.reference import materialized_attention
    from flashport.spec import dense_spec

    from .timing import cpu_median_s

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    scale = cfg.d ** -0.5

    def impl(q, k, v):
        if cfg.impl == "naive":
            return naive_attention(q, k, v, scale)
        return flashport.attention(q, k, v)

    def inputs(s):
        g = torch.Generator().manual_seed(s)
        return [torch.randn(cfg.b, s, cfg.h, cfg.d, generator=g) for _ in range(3)]

    rec = {"backend": "naive-materialised"}
    if cfg.impl == "flashport":
        q0, k0, v0 = inputs(8)
        spec = dense_spec(q0, k0, v0, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                          alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
        rec["backend"] = dispatch.select(spec).name
    with torch.no_grad():
        impl(*inputs(256))                    # warm-up: libraries, thread pool, lazy init
        q, k, v = inputs(cfg.s)
        rss0, max0 = _rss(), _maxrss()
        t0 = time.perf_counter()
        out = impl(q, k, v)
        first = time.perf_counter() - t0
        max1 = _maxrss()
        rec.update(peak_extra_mb=(max1 - rss0) / 2**20, rss_before_mb=rss0 / 2**20,
                   maxrss_before_mb=max0 / 2**20, maxrss_after_mb=max1 / 2**20)
        rec["time_s"], rec["runs"] = cpu_median_s(lambda: impl(q, k, v), first)
        if cfg.s <= cfg.fp64_check_max_s:
            ref, _ = materialized_attention(q, k, v, scale=scale, compute_dtype=torch.float64)
            rec["max_err_vs_fp64"] = (out.double() - ref.double()).abs().max().item()
        torch.save(out.contiguous(), out_path)
    rec["threads"] = torch.get_num_threads()
    return rec


def _spawn(cfg: CpuConfig, out_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real CPU path, not the interpreter
    env.pop("FLASHPORT_BACKEND", None)
    cmd = [sys.executable, "-m", "flashport.bench.cpu", json.dumps(asdict(cfg)), out_path]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        status = "oom" if p.returncode in (-9, 137) else "failed"
        return {"status": status, "error": (lines[-1] if lines else f"exit {p.returncode}")[:400]}
    return {"status": "ok", **json.loads(p.stdout.strip().splitlines()[-1])}


_SPAWN_S = 3.0  # a worker's start (python, torch, flashport) and warm-up, roughly


def _predict_s(last: dict | None, s: int) -> float:
    """Expected wall time of a worker at size s from the last size that ran: O(S^2) work, plus the
    repeat runs of cpu_median_s (up to 2 s) and the process start."""
    if last is None:
        return 0.0
    t = last["time_s"] * (s / last["s"]) ** 2
    return max(t, min(2.0, 5 * t)) + _SPAWN_S


def run_cpu(sizes, heads: int, tick, mem_fraction: float = 0.5, budget_s: float = 170.0,
            threads: int = 0) -> list[dict]:
    """Every (S, impl) in a fresh worker.  A configuration whose predicted time would overrun the
    job's wall-clock budget is recorded as "time-skipped" (with the prediction), never dropped."""
    import psutil
    import torch

    entries, last = [], {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashport-bench-") as tmp:
        for s in sizes:
            outs = {}
            for impl in ("flashport", "naive"):
                cfg = CpuConfig(s=s, impl=impl, h=heads, threads=threads)
                e = {"suite": "cpu", "impl": impl, "s": s, "config": asdict(cfg),
                     "flops": 4.0 * cfg.b * cfg.h * s * s * cfg.d}
                budget = psutil.virtual_memory().available * mem_fraction
                predicted, left = _predict_s(last.get(impl), s), budget_s - (time.perf_counter() - start)
                if impl == "naive" and cfg.naive_peak_bytes() > budget:
                    e.update(status="OOM-skipped", error=f"needs ~{cfg.naive_peak_bytes() / 2**30:.1f} GiB for "
                             f"scores + softmax, over {mem_fraction:.0%} of available {budget / mem_fraction / 2**30:.1f} GiB")
                elif predicted > left:
                    e.update(status="time-skipped", predicted_s=round(predicted, 1),
                             error=f"predicted {predicted:.0f} s > {max(left, 0):.0f} s left of the {budget_s:.0f} s budget")
                else:
                    path = os.path.join(tmp, f"{impl}_{s}.pt")
                    e.update(_spawn(cfg, path))
                    if e["status"] == "ok":
                        outs[impl] = path
                        e["gflops"] = e["flops"] / e["time_s"] / 1e9
                        last[impl] = e
                entries.append(e)
                tick()
            if len(outs) == 2:
                a, b = (torch.load(outs[i]) for i in ("flashport", "naive"))
                diff = (a - b).abs().max().item()
                for e in entries[-2:]:
                    e["max_diff_flashport_vs_naive"] = diff
    return entries


if __name__ == "__main__":
    _cfg = CpuConfig(**json.loads(sys.argv[1]))
    print(json.dumps(worker(_cfg, sys.argv[2])))
