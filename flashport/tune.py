"""`flashport tune`: measure every eligible backend on this card and write the auto-selection table; and the
auto-vs-best check of `flashport bench --auto-vs-best` (the same measurement, plus backend=None).

Per shape of the chosen suites (flashport/bench/shapes.py; dense and packed-varlen shapes), for every backend that
auto-selection may take for the call: the forward without grad, and -- where the shape trains -- the
backward of that backend's own pair (an "lse" backend's backward costs the same whichever forward saved
(out, lse)).  Medians over interleaved rounds (see `interleaved`) of triton.testing.do_bench on a GPU,
of perf_counter on a CPU.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import dispatch, table
from .api import attention, attention_varlen
from .bench.shapes import cu_seqlens
from .spec import dense_spec, varlen_spec


TUNED_KINDS = ("dense", "varlen")   # the calls a bench shape describes completely (KV-cache calls depend on the cache)


def _spec(shape, q, k, v, needs_grad: bool):
    """The call's spec: dense [B, S, H, D], or varlen over the packed q[0] (one sequence per document)."""
    q, k, v = (t if needs_grad else t.detach() for t in (q, k, v))
    opts = dict(causal=shape.causal, softmax_scale=None, window_size=shape.window_size, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    if shape.kind == "varlen":
        cu, n = cu_seqlens(shape, q.device), max(shape.docs)
        return varlen_spec(q[0], k[0], v[0], cu, cu, n, n, **opts)[0]
    return dense_spec(q, k, v, **opts)[0]


def _caller(shape, device):
    """call(q, k, v, backend) -> out: the shape's entry point with its mask."""
    mask = dict(causal=shape.causal, window_size=shape.window_size)
    if shape.kind == "varlen":
        cu, n = cu_seqlens(shape, device), max(shape.docs)
        return lambda q, k, v, name: attention_varlen(q[0], k[0], v[0], cu, cu, n, n, **mask, backend=name)
    return lambda q, k, v, name: attention(q, k, v, **mask, backend=name)


CLOSE = 1.15           # later rounds time only the contenders within 15% of the best so far, and auto
ROUND_MS = (100.0, 400.0)   # device time per round: the first (every name) and each later one
ITERS = ((3, 10), (5, 100))  # iterations per round, at least / at most: (first round), (later rounds)


def _one_call_ms(fn, device) -> float:
    from .bench.timing import sync
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def interleaved(makers: dict, device, rounds: int, errors: dict, timer=None) -> tuple[dict, dict]:
    """Median ms per name -> ({name: median}, {name: [ms per sample]}).

    makers[name]() builds the timed callable; each is called once first (compilation, autotuning, and
    a failure there drops the name, its error kept in `errors`).  Round 1 times every name side by side
    (timing.paired_ms: a few iterations, each running every name after an L2 flush, order rotated);
    later rounds time only the contenders within CLOSE of the best and the names starting with "auto",
    with many more iterations.  Separate do_bench runs of one kernel drift 5-10% apart on a sub-millisecond
    cell; side-by-side samples put the drift on every name alike."""
    if timer is None:
        from .bench.timing import paired_ms
        timer = lambda fns, iters: paired_ms(fns, iters, device)  # noqa: E731
    built, est = {}, {}
    for name, make in makers.items():
        try:
            fn = make()
            fn()
            est[name] = max(_one_call_ms(fn, device), 1e-3)
            built[name] = fn
        except Exception as e:  # noqa: BLE001 - recorded; the backend is then not a candidate here
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    samples: dict = {n: [] for n in built}
    for r in range(max(1, rounds)):
        med = {n: statistics.median(t) for n, t in samples.items() if t}
        top = min((m for n, m in med.items() if not n.startswith("auto")), default=None)
        live = [n for n in built if r == 0 or n.startswith("auto") or (n in med and med[n] <= CLOSE * top)]
        if not live or (r > 0 and len(live) < 2):
            break
        lo, hi = ITERS[min(r, 1)]
        iters = int(min(hi, max(lo, ROUND_MS[min(r, 1)] / sum(est[n] for n in live))))
        try:
            if r == 0:   # a discarded pass first: clocks ramp and caches settle (one transient once cost a
                timer({n: built[n] for n in live}, lo)   # 3x-too-slow first round and dropped the best)
            for n, t in timer({n: built[n] for n in live}, iters).items():
                samples[n] += t
        except Exception as e:  # noqa: BLE001 - a failure mid-round: the round's names are reported
            for n in live:
                errors.setdefault(n, f"timing: {type(e).__name__}: {e}"[:300])
            break
    built.clear()
    samples = {n: t for n, t in samples.items() if t and n not in errors}
    return {n: statistics.median(t) for n, t in samples.items()}, samples


def measure_shape(shape, device, with_auto: bool = False, rounds: int = 2) -> dict:
    """{"bucket", "fwd", "fwd_train", "bwd": {backend: ms}, "plans", "samples", "errors"} and, with_auto, the
    plans backend=None takes and their times, measured side by side with the backends ("auto": {"plan_fwd",
    "fwd", "plan_bwd", "fwd_train", "bwd"}).  fwd: inference forward; fwd_train: the forward with grads."""
    from .bench import peers
    train = "bwd" in shape.modes
    q, k, v = peers.make_inputs(shape, device, requires_grad=train)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    spec_f = _spec(shape, q, k, v, False)
    res = {"label": shape.label(), "bucket": table.bucket(spec_f), "fwd": {}, "fwd_train": {}, "bwd": {},
           "samples": {}, "errors": {}}
    # PyTorch-op-speed backends (blockwise) never win on a GPU: not timed there (tens of ms per cell)
    slow = {n for n, b in dispatch._REGISTRY.items() if b.slow_on_gpu} if device.type == "cuda" else set()
    names = list(dict.fromkeys(p.fwd.name for p in dispatch.options(spec_f) if p.fwd.name not in slow))

    call = _caller(shape, device)

    def fwd(name):
        return lambda: (lambda: call(qd, kd, vd, name))

    def bwd(name):
        def make():
            out = call(q, k, v, name)
            do = torch.randn_like(out)
            return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return make

    def fwd_train(name):
        return lambda: (lambda: call(q, k, v, name))

    auto = {"auto": None} if with_auto else {}
    res["fwd"], res["samples"]["fwd"] = interleaved(
        {n: fwd(n) for n in names} | {a: fwd(None) for a in auto}, device, rounds, res["errors"])
    if train:
        spec_b = _spec(shape, q, k, v, True)
        plans = dispatch.options(spec_b)
        res["plans"] = [[p.fwd.name, p.bwd.name] for p in plans]
        # a training forward may cost more than an inference one (cuDNN's saves its softmax stats)
        f_names = [n for n in dict.fromkeys(p.fwd.name for p in plans) if n in names]
        b_names = [n for n in dict.fromkeys(p.bwd.name for p in plans) if n in names]
        res["fwd_train"], res["samples"]["fwd_train"] = interleaved(
            {n: fwd_train(n) for n in f_names} | {a: fwd_train(None) for a in auto}, device, rounds, res["errors"])
        res["bwd"], res["samples"]["bwd"] = interleaved(
            {n: bwd(n) for n in b_names} | {a: bwd(None) for a in auto}, device, rounds, res["errors"])
    if with_auto:
        res["auto"] = {"plan_fwd": dispatch.select(spec_f).name, "fwd": res["fwd"].pop("auto", None)}
        if train:
            res["auto"].update(plan_bwd=dispatch.select(spec_b).name, bwd=res["bwd"].pop("auto", None),
                               fwd_train=res["fwd_train"].pop("auto", None))
    del q, k, v, qd, kd, vd
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def tune(shapes, device, path=None, tick=lambda: None, rounds: int = 2) -> tuple[str, list[dict]]:
    """Measure `shapes` and write the table (merged into the existing one at `path`, if any)."""
    device = torch.device(device)
    rows = []
    path = path or table.user_path(device)
    # measurements of this machine already there are kept (merged per bucket); table._read says which count.  A
    # table of another card is never overwritten: tables are per card, and this merge would start from none of its
    # buckets, replacing them all with this card's few.
    here = table.machine_key(device)
    theirs = table.card_of(Path(path))
    if theirs is not None and theirs != here.get("gpu"):
        raise ValueError(f"out: {path} holds a selection table measured on {theirs!r}; this is {here.get('gpu')!r}. "
                         f"Tables are per card: write this one elsewhere (default {table.user_path(device)})")
    old, _ = table._read(Path(path), here) if Path(path).exists() else (None, None)
    buckets = old.buckets if old is not None else {}
    for shape in shapes:
        if shape.kind not in TUNED_KINDS:
            continue
        r = measure_shape(shape, device, rounds=rounds)
        rows.append(r)
        entry = buckets.setdefault(r["bucket"], {})
        for role in table.ROLES:
            entry.setdefault(role, {}).update(r.get(role) or {})
        # saved after every shape: a run cut short keeps what it measured
        table.save(path, device, buckets, meta={"shapes": [x["label"] for x in rows]})
        tick()
    return str(path), rows


def _coupled(steps: dict, best_bwd: str, plan: str) -> bool:
    """True where the fastest backward comes only with a training forward that makes the step slower than
    the plan's: the step is then the cell to judge, and the backward alone cannot reach `best`."""
    with_best = [ms for p, ms in steps.items() if p.split("/")[-1] == best_bwd]
    return bool(with_best) and plan in steps and min(with_best) > steps[plan]


def auto_vs_best(rows: list[dict]) -> list[dict]:
    """Per measured cell: the best eligible backend, auto's plan, and ratio = best_ms / auto_ms.

    Modes: "fwd" (inference forward), "bwd" (the training plan's backward) and, where the shape trains,
    "step" (forward + backward: a training plan is chosen for the sum, and a backend that keeps its own
    forward state can only run its own backward, so the best backward alone may not be on offer).
    auto_ms is backend=None timed in the same interleaved rounds as the backends; choice_ratio judges
    the choice by the backends' own times (the selection's quality without dispatch or timing noise)."""
    out = []
    for r in rows:
        auto = r.get("auto") or {}
        ftr = r.get("fwd_train") or {}
        steps = {f if f == b else f"{f}/{b}": ftr[f] + r["bwd"][b] for f, b in r.get("plans", [])
                 if f in ftr and b in r["bwd"]}
        for role in ("fwd", "bwd"):
            if not r[role] or auto.get(role) is None:
                continue
            best = min(r[role], key=r[role].get)
            plan = auto[f"plan_{role}"]
            chosen = plan.split("/")[0 if role == "fwd" else -1]   # the backend that ran this direction
            out.append({"label": r["label"], "mode": role, "best": best, "best_ms": r[role][best],
                        "auto_plan": plan, "auto_ms": auto[role], "ratio": r[role][best] / auto[role],
                        "choice_ratio": r[role][best] / r[role][chosen] if chosen in r[role] else None,
                        "measured": dict(r[role])})
            if role == "bwd":
                out[-1]["coupled"] = _coupled(steps, best, auto[f"plan_{role}"])
        if steps and auto.get("bwd") is not None and auto.get("fwd_train") is not None:
            best = min(steps, key=steps.get)
            plan = auto["plan_bwd"]
            auto_ms = auto["fwd_train"] + auto["bwd"]
            out.append({"label": r["label"], "mode": "step", "best": best, "best_ms": steps[best],
                        "auto_plan": plan, "auto_ms": auto_ms, "ratio": steps[best] / auto_ms,
                        "choice_ratio": steps[best] / steps[plan] if plan in steps else None,
                        "measured": steps})
    return out
