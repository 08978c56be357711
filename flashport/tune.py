"""`flashport tune`: measure every eligible backend on this card and write the auto-selection table; and the
auto-vs-best check of `flashport bench --auto-vs-best` (the same measurement, plus backend=None).

Per shape of the chosen suites (flashport/bench/shapes.py; dense shapes only), for every backend that
auto-selection may take for the call: the forward without grad, and -- where the shape trains -- the
backward of that backend's own pair (an "lse" backend's backward costs the same whichever forward saved
(out, lse)).  Medians from triton.testing.do_bench on a GPU, from perf_counter on a CPU.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import dispatch, table
from .api import attention
from .spec import dense_spec


def _ms(fn, device) -> float:
    if device.type == "cuda":
        from .bench.timing import gpu_ms
        return gpu_ms(fn)
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _spec(q, k, v, causal: bool, needs_grad: bool):
    return dense_spec(q if needs_grad else q.detach(), k if needs_grad else k.detach(),
                      v if needs_grad else v.detach(), causal=causal, softmax_scale=None, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]


def measure_shape(shape, device, with_auto: bool = False) -> dict:
    """{"bucket", "fwd": {backend: ms}, "bwd": {backend: ms}, "errors": {...}} and, with_auto, the plan that
    backend=None takes and its times ("auto": {"plan_fwd", "plan_bwd", "fwd", "bwd"})."""
    from .bench import peers
    train = "bwd" in shape.modes
    q, k, v = peers.make_inputs(shape, device, requires_grad=train)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    spec_f = _spec(q, k, v, shape.causal, False)
    res = {"label": shape.label(), "bucket": table.bucket(spec_f), "fwd": {}, "bwd": {}, "errors": {}}
    # PyTorch-op-speed backends (blockwise) never win on a GPU: not timed there (tens of ms per cell)
    slow = {n for n, b in dispatch._REGISTRY.items() if b.slow_on_gpu} if device.type == "cuda" else set()
    names = [p.fwd.name for p in dispatch.options(spec_f) if p.fwd.name not in slow]
    if train:
        spec_b = _spec(q, k, v, shape.causal, True)
        bwd_names = {p.bwd.name for p in dispatch.options(spec_b)}
    for name in dict.fromkeys(names):
        try:
            res["fwd"][name] = _ms(lambda: attention(qd, kd, vd, causal=shape.causal, backend=name), device)
            if train and name in bwd_names:
                out = attention(q, k, v, causal=shape.causal, backend=name)
                do = torch.randn_like(out)
                res["bwd"][name] = _ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device)
                del out
        except Exception as e:  # noqa: BLE001 - recorded; the backend is then not a candidate in this bucket
            res["errors"][name] = f"{type(e).__name__}: {e}"[:300]
    if with_auto:
        auto = {"plan_fwd": dispatch.select(spec_f).name}
        auto["fwd"] = _ms(lambda: attention(qd, kd, vd, causal=shape.causal), device)
        if train:
            auto["plan_bwd"] = dispatch.select(spec_b).name
            out = attention(q, k, v, causal=shape.causal)
            do = torch.randn_like(out)
            auto["bwd"] = _ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device)
            del out
        res["auto"] = auto
    del q, k, v, qd, kd, vd
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def tune(shapes, device, path=None, tick=lambda: None) -> tuple[str, list[dict]]:
    """Measure `shapes` and write the table (merged into the existing one at `path`, if any)."""
    device = torch.device(device)
    rows = []
    path = path or table.user_path(device)
    # measurements of this machine already there are kept (merged per bucket); table._read says which count
    old, _ = table._read(Path(path), table.machine_key(device)) if Path(path).exists() else (None, None)
    buckets = old.buckets if old is not None else {}
    for shape in shapes:
        if shape.kind != "dense":
            continue
        r = measure_shape(shape, device)
        rows.append(r)
        entry = buckets.setdefault(r["bucket"], {"fwd": {}, "bwd": {}})
        for role in ("fwd", "bwd"):
            entry[role].update(r[role])
        # saved after every shape: a run cut short keeps what it measured
        table.save(path, device, buckets, meta={"shapes": [x["label"] for x in rows]})
        tick()
    return str(path), rows


def auto_vs_best(rows: list[dict]) -> list[dict]:
    """Per measured cell and direction: the best eligible backend, auto's plan, and best_ms / auto_ms."""
    out = []
    for r in rows:
        auto = r.get("auto") or {}
        for role in ("fwd", "bwd"):
            if not r[role] or role not in auto:
                continue
            best = min(r[role], key=r[role].get)
            plan = auto[f"plan_{role}"]
            chosen = plan.split("/")[0 if role == "fwd" else -1]   # the backend that ran this direction
            out.append({"label": r["label"], "mode": role, "best": best, "best_ms": r[role][best],
                        "auto_plan": plan, "auto_ms": auto[role],
                        # auto timed on its own (includes run-to-run noise), and the choice judged by the
                        # same measurement that found the best (the selection's quality alone)
                        "ratio": r[role][best] / auto[role],
                        "choice_ratio": r[role][best] / r[role][chosen] if chosen in r[role] else None,
                        "measured": dict(r[role])})
    return out
