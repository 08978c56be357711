"""The guard: the rollout and rollback path.  A sampled fraction of calls is checked again against the exact
float64 math on a few query rows; a backend whose error exceeds the tolerance is quarantined, and later
calls go to the next eligible backend.

    flashport.guard(sample_rate=0.01)              # process-wide from here on
    with flashport.guard(sample_rate=1.0): ...     # inside the block only (the previous setting returns)

Without a guard() call, FLASHPORT_GUARD (environment or config file) gives the sample rate.  Sampling is
deterministic: every 1/sample_rate-th call is checked (an accumulator, not a coin).

A check takes one batch entry, one KV head with its group of query heads and up to ROWS query rows,
recomputes them in float64 and in the input dtype (the contract's rule: error <= 2 x the same-dtype
math path's error + the flash rounding + noise, as in flashport.check), and compares the call's output
rows.  On a GPU it runs on a side stream and its verdict is copied to pinned host memory; the hot path
never waits: verdicts are collected at later calls (when their event has completed) and by stats() /
quarantined(), which wait.  Calls with dropout (the keep-mask lives in the kernel) and calls whose
checked keys would exceed MAX_KEY_ELEMENTS are counted as guard_skipped.  The varlen and KV-cache checks
find their sequence on the device (no host sync).
"""
from __future__ import annotations

import logging
import math
import random
import threading
from collections import deque

import torch

from . import env, monitor

log = logging.getLogger("flashport")

ROWS = 4
MAX_KEY_ELEMENTS = 1 << 25     # keys x head dim of one checked head (float64: 256 MiB for K and V together)
MAX_PENDING = 32               # checks in flight on the device; beyond that a sample is skipped
COMPUTE_EPS = torch.finfo(torch.float32).eps

_lock = threading.Lock()
_setting: list = [None]        # (sample_rate, tolerance) set by guard(); None: FLASHPORT_GUARD
_acc = [0.0]
_pending: deque = deque()
_quarantined: dict = {}
_streams: dict = {}
_rng = random.Random(0)


class _Handle:
    """What guard() returns: the setting is already in force; leaving a `with` block restores the previous."""

    def __init__(self, previous):
        self._previous = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        collect(wait=True)
        _setting[0] = self._previous
        return False


def guard(sample_rate: float = 0.01, tolerance: float | None = None) -> _Handle:
    """Check `sample_rate` of the calls against the exact math.  tolerance: the largest allowed max |error|
    of an output (None: the contract's rule for the call's dtype)."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or \
            not 0.0 <= float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must be a number in [0, 1], got {sample_rate!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not float(tolerance) > 0 or math.isnan(float(tolerance))):
        raise ValueError(f"tolerance must be None or a positive number, got {tolerance!r}")
    previous = _setting[0]
    _setting[0] = (float(sample_rate), None if tolerance is None else float(tolerance))
    return _Handle(previous)


def configured() -> tuple[float, float | None]:
    """(rate, tolerance) from the switches (FLASHPORT_GUARD...), ignoring flashport.guard()'s setting."""
    rate, tol = env.raws(("FLASHPORT_GUARD", "FLASHPORT_GUARD_TOLERANCE"))
    rate, tol = rate or env.SWITCHES["FLASHPORT_GUARD"].default, tol or ""
    try:
        r = float(rate)
        t = float(tol) if tol else None
        if not 0.0 <= r <= 1.0 or (t is not None and not t > 0):
            raise ValueError
    except ValueError:
        _warn_once(f"FLASHPORT_GUARD={rate!r} / FLASHPORT_GUARD_TOLERANCE={tol!r}: not a rate in [0, 1] and a "
                   f"positive tolerance; the guard stays off")
        return 0.0, None
    return r, t


_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("flashport: %s", msg)


def sampled(switches: tuple | None = None) -> tuple[bool, float | None]:
    """(check this call?, tolerance).  Also collects the verdicts that have finished.  switches: configured()'s
    value where the caller has it already (serve.Launch)."""
    rate, tol = _setting[0] or switches or configured()
    if _pending:
        collect(wait=False)
    if rate <= 0.0:
        return False, tol
    with _lock:
        _acc[0] += rate
        if _acc[0] >= 1.0:
            _acc[0] -= 1.0
            return True, tol
    return False, tol


# ----------------------------------------------------------------------------- quarantine
def quarantined() -> dict[str, str]:
    """Backend name -> why the guard took it out (verdicts in flight are collected first)."""
    collect(wait=True)
    return dict(_quarantined)


def is_quarantined(name: str) -> str | None:
    return _quarantined.get(name)


def quarantine(name: str, why: str) -> None:
    from . import dispatch
    if name in _quarantined:
        return
    _quarantined[name] = why
    dispatch.clear_cache()
    log.warning("flashport: backend %r quarantined by the guard: %s; later calls go to the next eligible "
                "backend (flashport.release_quarantine(%r) takes it back)", name, why, name)


def release_quarantine(name: str | None = None) -> None:
    """Take back one quarantined backend (or all of them)."""
    from . import dispatch
    if name is None:
        _quarantined.clear()
    else:
        _quarantined.pop(name, None)
    dispatch.clear_cache()


# ----------------------------------------------------------------------------- the check
def _host_to(values, dtype, device) -> torch.Tensor:
    """A small host list on `device` without blocking the host (pinned, non_blocking)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _rows(n: int, device) -> torch.Tensor:
    return _host_to(sorted(_rng.sample(range(n), min(ROWS, n))), torch.int64, device)


def _slice(spec, inputs, out):
    """(q rows [1, R, G, D], k [1, Sk, 1, D], v [1, Sk, 1, Dv], got [1, R, G, Dv], rows, seqlen_q, seqlens_k,
    alibi [1, G] | None, valid rows [R] bool | None), all on the call's device, or None (skip)."""
    g = spec.group_size
    h = _rng.randrange(spec.heads_kv)
    heads = slice(h * g, (h + 1) * g)
    dev = inputs.q.device
    b = _rng.randrange(max(spec.batch, 1))
    alibi = None
    if inputs.alibi_slopes is not None:
        a = inputs.alibi_slopes
        alibi = (a[b:b + 1] if a.dim() == 2 else a[None])[:, heads].float()
    if spec.kind == "dense":
        if spec.seqlen_q == 0 or spec.batch == 0:
            return None
        rows = _rows(spec.seqlen_q, dev)
        q = inputs.q[b:b + 1, rows, heads]
        k, v = inputs.k[b:b + 1, :, h:h + 1], inputs.v[b:b + 1, :, h:h + 1]
        return q, k, v, out[b:b + 1, rows, heads], rows, spec.seqlen_q, None, alibi, None
    if spec.kind == "kvcache":
        if spec.batch == 0 or spec.seqlen_q == 0:
            return None
        k, v = inputs.k, inputs.v
        if spec.paged:
            from .kvcache import gather_pages
            k = gather_pages(k, inputs.block_table[b:b + 1])
            v = gather_pages(v, inputs.block_table[b:b + 1])
        else:
            k, v = k[b:b + 1], v[b:b + 1]
        rows = _rows(spec.seqlen_q, dev)
        sk = None if inputs.seqlens_k is None else inputs.seqlens_k[b:b + 1]
        return (inputs.q[b:b + 1, rows, heads], k[:, :, h:h + 1], v[:, :, h:h + 1], out[b:b + 1, rows, heads],
                rows, spec.seqlen_q, sk, alibi, None)
    # varlen: sequence b's rows and keys, found on the device
    cq, ck = inputs.cu_seqlens_q.to(torch.int64), inputs.cu_seqlens_k.to(torch.int64)
    q0, lq = cq[b], cq[b + 1] - cq[b]
    k0, lk = ck[b], ck[b + 1] - ck[b]
    frac = _host_to([_rng.random() for _ in range(ROWS)], torch.float64, dev)
    pos = (frac * lq).to(torch.int64).clamp(max=torch.clamp(lq - 1, min=0))          # positions in the sequence
    valid = pos < lq
    total_q, total_k = inputs.q.shape[0], inputs.k.shape[0]
    if total_q == 0 or total_k == 0 or spec.seqlen_k == 0:
        return None
    qi = (q0 + pos).clamp(max=total_q - 1)
    kj = (k0 + torch.arange(spec.seqlen_k, device=dev)).clamp(max=total_k - 1)
    q = inputs.q[qi][None, :, heads]
    k, v = inputs.k[kj][None, :, h:h + 1], inputs.v[kj][None, :, h:h + 1]
    return q, k, v, out[qi][None, :, heads], pos, lq.view(1, 1, 1, 1), lk.view(1), alibi, valid


def _verdict(spec, parts, tolerance):
    """max |error| / tolerance of the sliced rows, as a float64 scalar tensor (inf where non-finite)."""
    from .backend.reference import materialized_attention
    q, k, v, got, rows, seqlen_q, seqlens_k, alibi, valid = parts
    kw = dict(scale=spec.softmax_scale, softcap=spec.softcap, alibi=alibi, left=spec.window_left,
              right=spec.window_right, seqlens_k=seqlens_k, rows=rows, seqlen_q=seqlen_q)
    qd, kd, vd, gotd = q.double(), k.double(), v.double(), got.double()
    if valid is not None:       # rows past a varlen sequence's end (an empty one has none) are not checked
        qd = torch.where(valid[None, :, None, None], qd, 0.0)
    if seqlens_k is not None:   # slots past a cache's length may hold garbage (even NaN): out of the magnitudes
        seen = torch.arange(k.shape[1], device=k.device)[None, :] < seqlens_k.to(torch.int64)[:, None]
        seen = seen[..., None, None]
        kd, vd = torch.where(seen, kd, 0.0), torch.where(seen, vd, 0.0)
    ref, lse = materialized_attention(qd, kd, vd, **kw)
    diff = (gotd - ref).abs()
    if valid is not None:
        diff = torch.where(valid[None, :, None, None], diff, torch.zeros_like(diff))
    finite = torch.isfinite(gotd).all() if valid is None else \
        torch.isfinite(torch.where(valid[None, :, None, None], gotd, 0.0)).all()
    err = torch.where(finite, diff.amax() if diff.numel() else diff.new_zeros(()), diff.new_full((), math.inf))
    if tolerance is not None:
        return err / tolerance
    low, _ = materialized_attention(q, k, v, compute_dtype=q.dtype if q.dtype != torch.bfloat16 else
                                    torch.bfloat16, **kw)
    base = (low.double() - ref).abs()
    if valid is not None:
        base = torch.where(valid[None, :, None, None], base, torch.zeros_like(base))
    base = base.amax() if base.numel() else base.new_zeros(())
    fin = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    lse_max = fin.amax().double() if fin.numel() else 0.0
    mq = qd.abs().amax() if q.numel() else 0.0
    mk = kd.abs().amax() if k.numel() else 0.0
    mv = vd.abs().amax() if v.numel() else 0.0
    delta = COMPUTE_EPS * (1.0 + lse_max + abs(spec.softmax_scale) * math.sqrt(spec.head_dim) * mq * mk)
    mag = torch.clamp(ref.abs().amax() if ref.numel() else ref.new_zeros(()), min=1.0)
    bound = 2.0 * (base + delta * mv) + 2 * torch.finfo(q.dtype).eps * mag
    return err / bound


def _side(device) -> torch.cuda.Stream:
    key = str(device)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device)
    return _streams[key]


def check(spec, inputs, out, backend: str, tolerance: float | None) -> None:
    """Schedule one check of `out` (the call's output) for `backend`; never waits for the device."""
    if spec.dropout_p > 0 or spec.mods or spec.kind not in ("dense", "varlen", "kvcache"):
        monitor.add(backend, guard_skipped=1)   # the row check knows neither dropout masks nor user mods
        return
    if spec.seqlen_k * max(spec.head_dim, spec.head_dim_v) > MAX_KEY_ELEMENTS or len(_pending) >= MAX_PENDING:
        monitor.add(backend, guard_skipped=1)
        return
    with torch.no_grad():
        out = out.detach()
        if out.device.type != "cuda":
            parts = _slice(spec, inputs, out)
            _record(backend, None if parts is None else float(_verdict(spec, parts, tolerance)), spec)
            return
        main = torch.cuda.current_stream(out.device)
        side = _side(out.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            parts = _slice(spec, inputs, out)
            if parts is None:
                monitor.add(backend, guard_skipped=1)
                return
            ratio = _verdict(spec, parts, tolerance)
            host = torch.empty((), dtype=torch.float64, pin_memory=True)
            host.copy_(ratio, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # the allocator must not hand these to the main stream before the side stream has read them
        for t in (inputs.q, inputs.k, inputs.v, out, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.seqlens_k,
                  inputs.block_table, inputs.alibi_slopes):
            if t is not None:
                t.record_stream(side)
        _pending.append((done, host, backend, spec))


def _record(backend: str, ratio, spec) -> None:
    if ratio is None:
        monitor.add(backend, guard_skipped=1)
        return
    monitor.guard_result(backend, ratio)
    if not ratio <= 1.0:
        quarantine(backend, f"guard: output error {ratio:.3g}x the tolerance on a {spec.kind} call "
                            f"(D={spec.head_dim}, {str(spec.dtype).replace('torch.', '')}, Sq={spec.seqlen_q}, "
                            f"Sk={spec.seqlen_k})")


def collect(wait: bool = False) -> None:
    """Record the verdicts whose device work has finished (all of them with wait=True)."""
    while _pending:
        done, host, backend, spec = _pending[0]
        if not wait and not done.query():
            return
        done.synchronize()
        _pending.popleft()
        _record(backend, float(host), spec)
