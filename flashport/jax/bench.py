"""The JAX frontend in the benchmark harness: `flashport bench --suite standard --frontend jax`.

Each JAX backend that serves the platform (GPU: cudnn, blockwise, xla; TPU: pallas-tpu, pallas-tpu-flash,
blockwise, xla; CPU: xla, blockwise) is timed on the standard suite's shapes, beside the torch frontend's
backend=None ("flashport", timed by the torch harness exactly as in `--suite standard`) in the same process
on the same card.  One entry per (shape, mode, implementation) in the harness's format (flashport/bench/
gpu.py), so report.gpu_table / plot_gpu read them; TFLOP/s by FlashAttention's convention (bench/shapes.flops:
fwd 4*B*H*Sq*Sk*D, halved causal, bwd 2.5x fwd); `vs_torch` = torch ms / JAX ms (> 1: the JAX backend is
faster).

Timing.  JAX: the jitted call, wall clock around jax.block_until_ready, median of `reps` after `warmup`
calls; the backward alone is the jitted pullback of jax.vjp (its residuals computed once, outside the timed
region), like the torch harness's backward (autograd.grad of a kept graph).  The torch rows use the torch
harness's timer (triton's do_bench, L2 flushed between runs); at the suite's sizes attention is compute-bound,
so the flush changes little, but the JSON names both timers.  A backend that refuses a shape (its declared
capabilities), an `xla` call whose materialised scores would not fit in memory, an out-of-memory or a failure
is an entry with its status and reason; the run goes on.

On a CPU the standard sizes are out of reach: the suite is scaled down (B=1, fp32, D=64, H=4; --quick: two
S=128/256 shapes) so that the command, the JSON and the plot still work.
"""
from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp

from ..bench.shapes import Shape, flops, gpu_suite, standard
from . import attention, registry
from . import select as jax_select

SUITE = "standard"
XLA_BUFFERS = 6          # score-sized float32 buffers alive in xla's forward + backward (residuals and grads)
XLA_MEMORY_FRACTION = 0.6


def platform() -> str:
    return jax.default_backend()


def suite_shapes(plat: str, quick: bool = False) -> list[Shape]:
    """The standard suite (quick: its smoke subset), or on a CPU a scaled-down version of it."""
    if plat == "cpu":
        if quick:
            return [Shape("standard-cpu", 1, 128, 128, 2, 2, 64, dtype="float32"),
                    Shape("standard-cpu", 1, 256, 256, 2, 2, 64, causal=True, dtype="float32")]
        return [Shape("standard-cpu", 1, s, s, 4, 4, 64, causal=c, dtype="float32")
                for c in (False, True) for s in (512, 1024, 2048)]
    if quick:
        return gpu_suite(SUITE, True)
    # every standard shape, in an order that covers the suite early: a run cut by its time limit (the JSON is
    # rewritten after each shape) has every head dim and mask at S = 4096 and 16384 before the other lengths
    order = {s: i for i, s in enumerate((4096, 16384, 1024, 8192, 2048, 512))}
    return sorted(gpu_suite(SUITE), key=lambda x: (order.get(x.sq, len(order)), x.d, x.causal))


def default_backends(plat: str) -> list[str]:
    """Every available backend auto-selectable on this platform, plus xla and blockwise (anywhere)."""
    from . import backends_for
    names = [b.name for b in backends_for(plat)]
    return names + [n for n in ("xla", "blockwise") if n not in names]


def impl_name(backend: str) -> str:
    return f"jax-{backend}"


def memory_budget() -> int:
    """Bytes the xla rows may plan on: a fraction of the device's limit (of RAM on a CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    if not limit:
        try:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        except (ValueError, OSError, AttributeError):
            limit = 8 << 30
    return int(limit * XLA_MEMORY_FRACTION)


def xla_bytes(shape: Shape) -> int:
    return XLA_BUFFERS * 4 * shape.b * shape.hq * shape.sq * shape.sk


def median_s(fn, *args, reps: int = 10, warmup: int = 3) -> float:
    """Median wall seconds of fn(*args) to completion (jax.block_until_ready)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _first_s(fn, *args):
    t0 = time.perf_counter()
    r = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, r


def inputs(shape: Shape, seed: int = 0):
    dt = jnp.dtype(shape.dtype)
    ks = jax.random.split(jax.random.key(seed), 4)
    dims = ((shape.b, shape.sq, shape.hq, shape.d), (shape.b, shape.sk, shape.hkv, shape.d),
            (shape.b, shape.sk, shape.hkv, shape.head_dim_v), (shape.b, shape.sq, shape.hq, shape.head_dim_v))
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dt) for kk, s in zip(ks, dims))


def _kwargs(shape: Shape) -> dict:
    return dict(causal=shape.causal, window_size=shape.window_size)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:400]


def _status(e: BaseException) -> str:
    from ..dispatch import UnsupportedError
    if isinstance(e, UnsupportedError):
        return "n/a"
    text = f"{type(e).__name__} {e}"
    return "oom" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else "failed"


def time_backend(name: str, shape: Shape, x, reps: int = 10, warmup: int = 3) -> dict:
    """Forward and backward of one JAX backend on one shape -> {"fwd": {...}, "bwd": {...}, "out": out}.
    Raises flashport.UnsupportedError (with the reasons) where the backend refuses the call."""
    q, k, v, do = x
    kw = _kwargs(shape)
    jax_select(q, k, v, backend=name, **kw)            # refuses (UnsupportedError) before compiling anything
    fwd = jax.jit(lambda q, k, v: attention(q, k, v, backend=name, **kw))
    first, out = _first_s(fwd, q, k, v)
    res = {"fwd": dict(ms=1e3 * median_s(fwd, q, k, v, reps=reps, warmup=warmup), first_call_s=first), "out": out}
    if "bwd" in shape.modes:
        _, pullback = jax.vjp(fwd, q, k, v)             # the forward and its residuals, outside the timed region
        bwd = jax.jit(lambda pb, do: pb(do))
        first_b, _ = _first_s(bwd, pullback, do)
        res["bwd"] = dict(ms=1e3 * median_s(bwd, pullback, do, reps=reps, warmup=warmup), first_call_s=first_b)
        del pullback
    return res


def _torch_device(plat: str):
    """The torch device that sits beside JAX's platform (None on a TPU, or a GPU torch cannot see)."""
    import torch
    if plat == "gpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if plat == "cpu":
        return torch.device("cpu")
    return None


def _torch_cpu(shape: Shape, reps: int, warmup: int) -> list[dict]:
    """The torch frontend's backend=None on a CPU: perf_counter medians of the forward and the backward."""
    import torch

    import flashport
    from ..bench.gpu import _entry
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, shape.dtype)
    q = torch.randn(shape.b, shape.sq, shape.hq, shape.d, generator=g).to(dt).requires_grad_()
    k = torch.randn(shape.b, shape.sk, shape.hkv, shape.d, generator=g).to(dt).requires_grad_()
    v = torch.randn(shape.b, shape.sk, shape.hkv, shape.head_dim_v, generator=g).to(dt).requires_grad_()

    def med(fn):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts), first

    kw = _kwargs(shape)
    with torch.no_grad():
        ms, first = med(lambda: flashport.attention(q, k, v, **kw))
    try:   # which torch backend backend=None runs (the CPU job's way: bench/cpu.py)
        from ..dispatch import select
        from ..spec import dense_spec
        spec = dense_spec(q, k, v, causal=shape.causal, softmax_scale=None, window_size=shape.window_size,
                          softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
        backend = select(spec).name
    except Exception:  # noqa: BLE001 - the name is a note, not the measurement
        backend = None
    out = [_entry(SUITE, shape, "flashport", "fwd", status="ok", ms=ms, tflops=flops(shape, "fwd") / ms / 1e9,
                  first_call_s=first, timer="perf_counter median")]
    if backend:
        out[0]["backend"] = backend
    if "bwd" in shape.modes:
        o = flashport.attention(q, k, v, **kw)
        do = torch.randn_like(o)
        ms_b, first_b = med(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        out.append(_entry(SUITE, shape, "flashport", "bwd", status="ok", ms=ms_b,
                          tflops=flops(shape, "bwd") / ms_b / 1e9, first_call_s=first_b, timer="perf_counter median"))
    return out


def _torch_rows(shape: Shape, device, reps: int, warmup: int) -> list[dict]:
    from ..bench import gpu
    if device is None:
        return []
    try:
        if device.type == "cuda":
            rows = gpu._dense(SUITE, shape, ["flashport"], device, {}, lambda: None)
            for e in rows:
                e["timer"] = "triton do_bench median (L2 flushed)"
            return rows
        return _torch_cpu(shape, reps, warmup)
    except Exception as e:  # noqa: BLE001 - recorded, never fatal
        return [gpu._entry(SUITE, shape, "flashport", m, status="failed", error=_err(e)) for m in shape.modes]


def bench_shape(shape: Shape, backends: list[str], torch_device=None, reps: int = 10, warmup: int = 3,
                tick=None) -> list[dict]:
    """Every JAX backend (and, where a torch device sits beside JAX, torch's backend=None) on one shape."""
    from ..bench.gpu import _entry
    entries, ref = [], None
    x = inputs(shape)
    try:
        auto = jax_select(*x[:3], **_kwargs(shape))    # what flashport.jax's backend=None would run
    except Exception:  # noqa: BLE001
        auto = None
    budget = memory_budget()
    for name in backends:
        impl = impl_name(name)
        try:
            if name == "xla" and xla_bytes(shape) > budget:
                raise _TooBig(f"xla materialises ~{xla_bytes(shape) / 2**30:.1f} GiB of scores for forward + "
                              f"backward, over the {budget / 2**30:.1f} GiB budget")
            r = time_backend(name, shape, x, reps=reps, warmup=warmup)
            diff = None
            out = r.pop("out").astype(jnp.float32)
            if ref is None:
                ref = out
            else:
                diff = float(jnp.max(jnp.abs(out - ref)))
            del out
            for mode in shape.modes:
                e = r[mode]
                entries.append(_entry(SUITE, shape, impl, mode, status="ok", backend=name, ms=e["ms"],
                                      tflops=flops(shape, mode) / e["ms"] / 1e9, first_call_s=e["first_call_s"],
                                      max_abs_diff=diff if mode == "fwd" else None, jax_auto=auto,
                                      timer="wall clock median, jax.block_until_ready"))
        except _TooBig as e:
            entries += [_entry(SUITE, shape, impl, m, status="n/a", backend=name, error=str(e)) for m in shape.modes]
        except Exception as e:  # noqa: BLE001 - a refusal, an OOM or a failure is an entry, not a crash
            entries += [_entry(SUITE, shape, impl, m, status=_status(e), backend=name, error=_err(e))
                        for m in shape.modes]
        if tick:
            tick()
    del x
    entries += _torch_rows(shape, torch_device, reps, warmup)
    if tick:
        tick()
    add_ratios(entries)
    return entries


class _TooBig(Exception):
    pass


def add_ratios(entries: list[dict], ceil: dict | None = None) -> None:
    """vs_torch (torch backend=None ms / JAX ms, > 1: JAX faster) on the JAX entries, shown by the harness's
    table as speedup_vs {"flashport": ...}; MFU against the matmul ceiling where one was measured."""
    mm = (ceil or {}).get("matmul_bf16_tflops")
    torch_ms = {(e["label"], e["mode"]): e["ms"] for e in entries
                if e["impl"] == "flashport" and e["status"] == "ok" and e.get("ms")}
    for e in entries:
        if e["status"] != "ok":
            continue
        if mm and e.get("tflops"):
            e["mfu"] = e["tflops"] / mm
        t = torch_ms.get((e["label"], e["mode"]))
        if e["impl"].startswith("jax-") and t:
            e["vs_torch"] = t / e["ms"]
            e["speedup_vs"] = {"flashport": e["vs_torch"]}


def run(shapes: list[Shape], backends: list[str], torch_device=None, reps: int = 10, warmup: int = 3,
        tick=None, checkpoint=None) -> list[dict]:
    """Every shape in turn; checkpoint(entries) after each (a run cut short keeps what it measured)."""
    entries: list[dict] = []
    for shape in shapes:
        entries += bench_shape(shape, backends, torch_device, reps, warmup, tick)
        if checkpoint is not None:
            checkpoint(entries)
    return entries


def table(entries: list[dict]) -> str:
    """TFLOP/s forward / backward per shape (rows) and implementation (columns), then the reasons of every
    cell that did not run."""
    impls = list(dict.fromkeys(e["impl"] for e in entries))
    labels = list(dict.fromkeys(e["label"] for e in entries))
    by = {(e["label"], e["impl"], e["mode"]): e for e in entries}

    def cell(label, impl):
        parts = []
        for mode in ("fwd", "bwd"):
            e = by.get((label, impl, mode))
            if e is None:
                continue
            parts.append((f"{e['tflops']:.1f}" if e["tflops"] >= 10 else f"{e['tflops']:.3g}")
                         if e["status"] == "ok" else e["status"])
        return " / ".join(parts) or "-"
    rows = [[lab] + [cell(lab, i) for i in impls] for lab in labels]
    head = ["shape (TFLOP/s fwd / bwd)"] + [i if i != "flashport" else "flashport (torch, auto)" for i in impls]
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head, ["-" * w for w in widths]] + rows]
    notes = {}
    for e in entries:
        if e["status"] != "ok":
            notes.setdefault((e["impl"], e["status"], e.get("error", "")), []).append(f"{e['label']} {e['mode']}")
    for (impl, status, why), where in notes.items():
        lines.append(f"  {impl} {status} ({len(where)} cells, e.g. {where[0]}): {why[:200]}")
    return "\n".join(lines)


def environment() -> dict:
    from . import environment as jax_env
    return jax_env()


def run_cli(args) -> int:
    """`flashport bench --frontend jax` (the CLI set XLA_PYTHON_CLIENT_PREALLOCATE=false before jax loaded)."""
    import re

    from ..bench import _progress, report
    from . import describe
    if args.suite not in ("auto", SUITE):
        print(f"flashport bench --frontend jax: only --suite standard (got {args.suite!r})")
        return 2
    t0, load0 = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    plat = platform()
    known = registry.names()
    names = [s.strip() for s in args.peers.split(",")] if args.peers else default_backends(plat)
    bad = [n for n in names if n not in known]
    if bad:
        print(f"flashport bench --frontend jax: unknown JAX backend(s) {bad}; known: {', '.join(known)}")
        return 2
    shapes = suite_shapes(plat, args.quick)
    if args.match:
        shapes = [s for s in shapes if re.search(args.match, s.label())]
    tdev = _torch_device(plat)
    import torch
    device = tdev if tdev is not None else torch.device("cpu")
    ceil = {}
    if device.type == "cuda":
        from ..bench.timing import ceilings
        ceil = ceilings(device)
    reps, warmup = (10, 3) if plat != "cpu" else (3, 1)
    stem = "bench_standard_jax" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    json_path, png_path = (os.path.join(args.out, stem + ext) for ext in (".json", ".png"))
    bar, tick = _progress(len(shapes) * (len(names) + 1), f"standard, jax on {plat}: {', '.join(names)} + torch")

    def doc_of(entries):
        add_ratios(entries, ceil)
        doc = report.document(SUITE, device, entries, ceil, time.perf_counter() - t0)
        doc["environment"]["loadavg_at_start"] = load0
        doc.update(frontend="jax", jax=environment(), jax_backends=describe(), jax_platform=plat,
                   jax_backends_timed=names, torch_beside=str(tdev) if tdev is not None else None,
                   timers={"jax-*": f"wall clock median of {reps} after {warmup} warm-up calls "
                                    "(jax.block_until_ready); bwd = the jitted pullback of jax.vjp",
                           "flashport": "the torch harness's (bench/gpu.py: do_bench median, L2 flushed)"
                           if device.type == "cuda" else f"perf_counter median of {reps}"},
                   flop_convention="fwd 4*B*H*Sq*Sk*D (halved causal), bwd 2.5x fwd")
        if plat == "cpu":
            doc["note"] = "CPU: the standard suite scaled down (B=1, fp32, D=64); not the standard sizes"
        return doc

    def checkpoint(done):
        part = doc_of(done)
        part["partial"] = f"{len({e['label'] for e in done})} of {len(shapes)} shapes; the run stopped before the rest"
        report.write_json(part, json_path)

    entries = run(shapes, names, tdev, reps, warmup, tick, checkpoint)
    if bar is not None:
        bar.close()
    doc = doc_of(entries)
    report.write_json(doc, json_path)
    wrote = json_path
    try:
        report.plot_gpu(doc, png_path)
        wrote += f" and {png_path}"
    except Exception as e:  # noqa: BLE001 - no plot is not a failed benchmark
        print(f"no plot: {_err(e)}")
    print(f"jax {doc['jax']['jax']} on {plat} ({', '.join(doc['jax']['devices'])}); torch beside it: {tdev}")
    print(table(entries))
    if ceil:
        print("ceilings: " + ", ".join(f"{k}={v}" for k, v in ceil.items()))
    print(f"wrote {wrote} ({doc['wall_s']} s)")
    return 0
