"""The CPU main job: flashport (backend=None) against its peers on a CPU, fp32: torch's own
F.scaled_dot_product_attention (its CPU flash kernel: exact, linear memory -- the peer to beat), naive
materialised attention, and flashport's `blockwise` named (the path for what SDPA cannot serve).  Rows:
forward non-causal over S, and at one size forward causal, forward+backward causal, a sliding window and packed
documents through a mask_mod (SDPA has neither without an S x S mask: its cells are "not-served" with the reason).
The thread count is recorded per cell.

Each (S, implementation) runs in a fresh subprocess so that its peak memory is its own: the
worker makes its inputs, runs the call once (timed as first_s: a compile lands there), resets the process's
high-water mark (clear_refs) and reports the peak resident set (VmHWM) of a second call over the resident set
before it -- the call's working memory including its output.  Large allocations come straight from mmap and go
back to the OS on free, so earlier work does not hide a peak.  The
naive path is skipped, and reported as "OOM-skipped", where its two S x S float32 buffers would not fit
in half the available memory.  Errors: against float64 exact math for small S, and the two
implementations against each other for every S where both ran.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

from .shapes import CPU_IMPLS, CpuConfig, cpu_rows

_KB = 1024  # ru_maxrss is in KiB on Linux


def doc_ids(cfg: CpuConfig):
    """The packed-documents row's document of each position: `docs` equal runs (the last one takes the rest)."""
    import torch
    return (torch.arange(cfg.s) // (cfg.s // cfg.docs)).clamp(max=cfg.docs - 1)


def naive_attention(q, k, v, scale: float, causal: bool = False, window=(-1, -1), docs=None):
    """Materialised attention, fp32: softmax(scale * q @ k^T + mask) @ v on [B, S, H, D] tensors (S x S scores);
    docs: [S] document ids of a causal document mask, or None."""
    import torch
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    s = (qh * scale) @ kh.transpose(-1, -2)
    if docs is not None:
        d = docs[: q.shape[1]]   # the warm-up call runs a shorter S
        s = s.masked_fill((d[:, None] != d[None, :]) | torch.ones_like(s[0, 0], dtype=torch.bool).triu(1),
                          float("-inf"))
    left, right = window
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        from flashport.masks import Visibility
        n = q.shape[1]
        vis = Visibility(n, k.shape[1], left, right)
        s = s.masked_fill(~vis.sees(torch.arange(n)[:, None], torch.arange(k.shape[1])[None, :]), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)


def sdpa_reasons(cfg: CpuConfig) -> list[str]:
    """Why torch's SDPA cannot serve a cell exactly in linear memory (empty: it can)."""
    if tuple(cfg.window) != (-1, -1):
        return ["sliding window: SDPA has no window argument (an additive S x S mask would be O(S^2) memory "
                "and leave its flash kernel)"]
    if cfg.docs:
        return ["packed documents: SDPA takes no mask_mod (an additive S x S mask would be O(S^2) memory)"]
    return []


def _mods_kw(cfg: CpuConfig) -> dict:
    if not cfg.docs:
        return {}
    from flashport import mods
    return {"mask_mod": mods.document(doc_ids(cfg))}


def _impl(cfg: CpuConfig, scale: float):
    import torch.nn.functional as F

    import flashport
    kw = dict(causal=cfg.causal, window_size=tuple(cfg.window), **_mods_kw(cfg))
    if cfg.impl == "naive":
        docs = doc_ids(cfg) if cfg.docs else None
        return lambda q, k, v: naive_attention(q, k, v, scale, cfg.causal, tuple(cfg.window), docs)
    if cfg.impl == "sdpa-cpu":   # Sq == Sk here, so SDPA's top-left is_causal is flashport's causal
        return lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=cfg.causal).transpose(1, 2)
    backend = "blockwise" if cfg.impl == "blockwise" else None
    return lambda q, k, v: flashport.attention(q, k, v, backend=backend, **kw)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    """The process's peak resident set (VmHWM; getrusage's ru_maxrss carries a vforked parent's peak across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * _KB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KB


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: clear_refs 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(cfg: CpuConfig, out_path: str) -> dict:
    """Runs inside the subprocess; returns the record printed as JSON."""
    import torch

    from flashport import dispatch
    from flashport.backend.reference import materialized_attention
    from flashport.spec import dense_spec

    from .timing import cpu_best_s

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    scale = cfg.d ** -0.5
    impl = _impl(cfg, scale)
    train = cfg.mode == "fwd+bwd"

    def inputs(s):
        g = torch.Generator().manual_seed(s)
        return [torch.randn(cfg.b, s, cfg.h, cfg.d, generator=g).requires_grad_(train) for _ in range(3)]

    def run_step(fn, q, k, v, do):
        if not train:
            with torch.no_grad():
                return fn(q, k, v)
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
        return out.detach()

    def step(q, k, v, do):
        return run_step(impl, q, k, v, do)

    rec = {"backend": {"naive": "naive-materialised", "sdpa-cpu": "torch-sdpa"}.get(cfg.impl, cfg.impl)}
    step(*inputs(256), torch.randn(cfg.b, 256, cfg.h, cfg.d))    # warm-up: libraries, thread pool, lazy init
    q, k, v = inputs(cfg.s)
    if cfg.impl == "flashport":   # the real size: a window that reaches every key of a short call is causal
        spec = dense_spec(q, k, v, causal=cfg.causal, softmax_scale=None, window_size=tuple(cfg.window),
                          softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False,
                          **_mods_kw(cfg))[0]
        rec["backend"] = dispatch.select(spec).name
    do = torch.randn(cfg.b, cfg.s, cfg.h, cfg.d, generator=torch.Generator().manual_seed(1))
    rss0, max0 = _rss(), _maxrss()
    t0 = time.perf_counter()
    out = step(q, k, v, do)
    first = time.perf_counter() - t0
    max1 = _maxrss()
    rec.update(peak_extra_mb=(max1 - rss0) / 2**20, rss_before_mb=rss0 / 2**20,
               maxrss_before_mb=max0 / 2**20, maxrss_after_mb=max1 / 2**20)
    rec["first_s"] = first
    # The first call may compile (blockwise's CPU tile steps): its peak includes the compiler's own memory.  The
    # call's working memory is the second call's peak, from a reset high-water mark.
    rss1 = _rss()
    if _reset_peak():
        step(q, k, v, do)
        rec["first_call_peak_extra_mb"] = rec["peak_extra_mb"]
        rec["peak_extra_mb"] = (_maxrss() - rss1) / 2**20
    rec["time_s"], rec["median_s"], rec["runs"] = cpu_best_s(lambda: step(q, k, v, do), first)
    if cfg.impl in ("flashport", "blockwise") and not sdpa_reasons(cfg):
        # The ratio to SDPA-CPU from runs alternated in this one process: separate processes minutes apart see
        # different loads on a shared machine (the same kernel measured 0.5x-1.3x of itself that way).
        peer = _impl(replace(cfg, impl="sdpa-cpu"), scale)
        mine, theirs = [], []
        # alternated rounds until each side has run ~1 s (at least 5, at most 25), the order swapped every round (the
        # second of a pair runs on the caches and clocks the first left): the minimum of many short runs, and the
        # median of the rounds' own ratios beside it
        while len(mine) < 5 or (len(mine) < 25 and sum(mine) + sum(theirs) < 2.0):
            pair = ((impl, mine), (peer, theirs))
            for fn, acc in pair if len(mine) % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                run_step(fn, q, k, v, do)
                acc.append(time.perf_counter() - t0)
        rec["paired"] = {"self_s": min(mine), "sdpa_cpu_s": min(theirs), "vs_sdpa_cpu": min(theirs) / min(mine),
                         "median_round_ratio": statistics.median(t / m for m, t in zip(mine, theirs)),
                         "rounds": len(mine)}
    if cfg.s <= cfg.fp64_check_max_s:
        left, right = cfg.window
        prog = None
        if cfg.docs:
            from flashport.programmable import build
            prog = build(None, _mods_kw(cfg)["mask_mod"], None, None, batch=cfg.b, heads_q=cfg.h, sq=cfg.s,
                         sk=cfg.s, device="cpu")
        ref, _ = materialized_attention(q.detach(), k.detach(), v.detach(), scale=scale, left=left,
                                        right=0 if cfg.causal else right, compute_dtype=torch.float64, prog=prog)
        rec["max_err_vs_fp64"] = (out.double() - ref.double()).abs().max().item()
    torch.save(out.contiguous(), out_path)
    rec["threads"] = torch.get_num_threads()
    rec["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    if cfg.impl in ("flashport", "blockwise"):
        from flashport.backend import tile_steps
        rec["cpu_compile"] = tile_steps.status()
    return rec


def _spawn(cfg: CpuConfig, out_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real CPU path, not the interpreter
    env.pop("FLASHPORT_BACKEND", None)
    # OpenMP threads that spin at barriers stall each other when another process holds a core: on a shared
    # 2-core machine that made blockwise's many small ops 4x slower (PERFLOG).  Sleeping waiters cost the one
    # big SDPA kernel nothing.  A caller's own setting wins; the JSON records it.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = [sys.executable, "-m", "flashport.bench.cpu", json.dumps(asdict(cfg)), out_path]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        status = "oom" if p.returncode in (-9, 137) else "failed"
        return {"status": status, "error": (lines[-1] if lines else f"exit {p.returncode}")[:400]}
    return {"status": "ok", **json.loads(p.stdout.strip().splitlines()[-1])}


_SPAWN_S = 3.0  # a worker's start (python, torch, flashport) and warm-up, roughly


def _predict_s(last: dict | None, s: int) -> float:
    """Expected wall time of a worker at size s from the last size of the same kind that ran: O(S^2) work for
    the first run and the three timed ones, plus the process start."""
    if last is None:
        return 0.0
    return 4 * last["time_s"] * (s / last["s"]) ** 2 + _SPAWN_S


def run_cpu(sizes, heads: int, tick, mem_fraction: float = 0.5, budget_s: float = 170.0,
            threads: int = 0, quick: bool = False) -> list[dict]:
    """Every (row, impl) of cpu_rows in a fresh worker.  A configuration whose predicted time would overrun the
    job's wall-clock budget is recorded as "time-skipped" (with the prediction), never dropped; one SDPA cannot
    serve as "not-served" with the reason.  Each entry carries speedup_vs {peer: peer time / its time}."""
    import psutil
    import torch

    entries, last = [], {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashport-bench-") as tmp:
        for row in cpu_rows(sizes, quick):
            outs, cells = {}, []
            for impl in CPU_IMPLS:
                cfg = CpuConfig(impl=impl, h=heads, threads=threads, **row)
                e = {"suite": "cpu", "impl": impl, "s": cfg.s, "label": cfg.label(), "mode": cfg.mode,
                     "causal": cfg.causal, "window": list(cfg.window), "docs": cfg.docs, "config": asdict(cfg),
                     "flops": cfg.flops()}
                budget = psutil.virtual_memory().available * mem_fraction
                key = (impl, cfg.mode, cfg.causal, tuple(cfg.window), cfg.docs)
                predicted, left = _predict_s(last.get(key), cfg.s), budget_s - (time.perf_counter() - start)
                why = sdpa_reasons(cfg) if impl == "sdpa-cpu" else []
                if why:
                    e.update(status="not-served", error="; ".join(why))
                elif impl == "naive" and cfg.naive_peak_bytes() > budget:
                    e.update(status="OOM-skipped", error=f"needs ~{cfg.naive_peak_bytes() / 2**30:.1f} GiB for "
                             f"scores + softmax, over {mem_fraction:.0%} of available {budget / mem_fraction / 2**30:.1f} GiB")
                elif predicted > left:
                    e.update(status="time-skipped", predicted_s=round(predicted, 1),
                             error=f"predicted {predicted:.0f} s > {max(left, 0):.0f} s left of the {budget_s:.0f} s budget")
                else:
                    path = os.path.join(tmp, f"{impl}_{len(entries)}.pt")
                    e.update(_spawn(cfg, path))
                    if e["status"] == "ok":
                        outs[impl] = path
                        e["gflops"] = e["flops"] / e["time_s"] / 1e9
                        last[key] = e
                entries.append(e)
                cells.append(e)
                tick()
            _compare(cells, outs, torch)
    return entries


def _compare(cells: list[dict], outs: dict, torch) -> None:
    """Within one row: each implementation's time ratio to every peer that ran, and its output's max difference
    from naive's (where naive ran)."""
    ok = {e["impl"]: e for e in cells if e["status"] == "ok"}
    for e in ok.values():
        e["speedup_vs"] = {p: round(o["time_s"] / e["time_s"], 3) for p, o in ok.items() if p != e["impl"]}
    if "naive" in outs:
        ref = torch.load(outs["naive"])
        for impl, path in outs.items():
            diff = (torch.load(path) - ref).abs().max().item()
            ok[impl]["max_diff_vs_naive"] = diff
            if impl == "flashport":   # the field's old name, kept for readers of earlier JSON
                for x in ok.values():
                    x["max_diff_flashport_vs_naive"] = diff


def summary(entries: list[dict]) -> dict:
    """The job's verdict: per row, backend=None's and blockwise's speed relative to SDPA-CPU (> 1: faster; from
    runs alternated with SDPA in the same process, the separate-process ratio alongside), and the minima over the
    rows SDPA serves."""
    rows = {}
    for e in entries:
        rows.setdefault(e["label"], {})[e["impl"]] = e
    table, auto, block = [], [], []
    for label, r in rows.items():
        sd, fp, bw = r.get("sdpa-cpu", {}), r.get("flashport", {}), r.get("blockwise", {})
        cell = {"label": label, "flashport_backend": fp.get("backend"), "sdpa_status": sd.get("status")}
        if sd.get("status") == "ok":
            # the paired ratio (alternated runs in one process) where measured; the separate processes' otherwise
            for key, e, acc in (("auto_vs_sdpa", fp, auto), ("blockwise_vs_sdpa", bw, block)):
                if e.get("status") != "ok":
                    continue
                cell[key] = round(e["paired"]["vs_sdpa_cpu"] if "paired" in e else sd["time_s"] / e["time_s"], 3)
                cell[key + "_separate"] = round(sd["time_s"] / e["time_s"], 3)
                acc.append(cell[key])
        else:
            cell["sdpa_reason"] = sd.get("error")
        table.append(cell)
    threads = sorted({e["threads"] for e in entries if "threads" in e})
    return {"rows": table, "min_auto_vs_sdpa": min(auto, default=None),
            "min_blockwise_vs_sdpa": min(block, default=None), "threads": threads}


if __name__ == "__main__":
    _cfg = CpuConfig(**json.loads(sys.argv[1]))
    print(json.dumps(worker(_cfg, sys.argv[2])))
