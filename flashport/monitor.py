"""What operators see: counters per backend and profiler ranges around every call.

`stats()` counts, per backend: calls (public calls whose forward it served), forward, backward, errors
(exceptions it raised), fallbacks (calls it served because the preferred backend was quarantined, or
because no fast GPU backend could), guard_checks / guard_failures and the guard's error distribution,
FLOPs (FlashAttention's convention, visible pairs only), bytes read (q, k, v and the cache as passed),
and peak_extra_bytes (the largest working memory one call allocated beyond its inputs, by the backend's
own account: `Backend.extra_bytes`).  Varlen and KV-cache calls count FLOPs at their maximum lengths
(the per-sequence lengths live on the device, and reading them would synchronise): an upper bound.

Ranges: `flashport::<entry point>[<backend>]` around the forward and `flashport::<entry
point>_backward[<backend>]` around the backward, as torch.profiler events (only while a profiler
records: the check is one C call) and as NVTX ranges on CUDA (nvtxRangePush is a no-op without a
tool attached).  FLASHPORT_RANGES=0 switches both off, to measure what they cost.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections import defaultdict

import torch

from . import env

ENTRY = {"dense": "attention", "varlen": "attention_varlen", "kvcache": "attention_with_kvcache"}
COUNTERS = ("calls", "forward", "backward", "errors", "fallbacks", "guard_checks", "guard_failures",
            "guard_skipped", "flops", "bytes_read", "peak_extra_bytes")
# The guard's error distribution: max |error| / the tolerance it was judged by, binned; > 1 failed.
GUARD_BINS = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, float("inf"))

_lock = threading.Lock()
_stats: dict = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
_guard_hist: dict = defaultdict(lambda: [0] * (len(GUARD_BINS) - 1))
_guard_max: dict = defaultdict(float)
_guard_sum: dict = defaultdict(float)
# programmable calls that backend=None ran as the built-in call they equal, per rule (programmable.builtin_*)
REWRITE_RULES = ("window", "documents", "prefix", "sinks", "alibi")
_rewrites: dict = defaultdict(int)


def add(backend: str, **counts) -> None:
    with _lock:
        row = _stats[backend]
        for k, n in counts.items():
            row[k] += n


def count_forward(backend: str, fallback: bool, flops: int, nbytes: int, peak_fwd: int, bwd: str | None = None,
                  peak_bwd: int = 0) -> None:
    """One public call's forward: add() and peak() of serve.Launch's numbers under one lock (the hot path's)."""
    with _lock:
        row = _stats[backend]
        row["calls"] += 1
        row["forward"] += 1
        row["fallbacks"] += fallback
        row["flops"] += flops
        row["bytes_read"] += nbytes
        if peak_fwd > row["peak_extra_bytes"]:
            row["peak_extra_bytes"] = peak_fwd
        if bwd is not None:
            row = _stats[bwd]
            row["peak_extra_bytes"] = max(row["peak_extra_bytes"], peak_bwd)


def peak(backend: str, nbytes: int) -> None:
    with _lock:
        row = _stats[backend]
        row["peak_extra_bytes"] = max(row["peak_extra_bytes"], int(nbytes))


def guard_result(backend: str, ratio: float) -> None:
    """One guard check: `ratio` = max |error| / tolerance (inf for a non-finite output)."""
    with _lock:
        row = _stats[backend]
        row["guard_checks"] += 1
        row["guard_failures"] += int(not ratio <= 1.0)
        # the bin [edge_i, edge_i+1) holding ratio; inf and NaN land in the last one
        _guard_hist[backend][min(bisect.bisect_right(GUARD_BINS, ratio), len(GUARD_BINS) - 1) - 1] += 1
        _guard_max[backend] = max(_guard_max[backend], ratio)
        _guard_sum[backend] += ratio


def stats() -> dict[str, dict]:
    """Counters per backend name (only backends that saw a call).  Guard results still in flight are
    collected first, so the numbers include every check that has finished on the device."""
    from . import rollout
    rollout.collect(wait=True)
    with _lock:
        out = {}
        for name, row in _stats.items():
            d = dict(row)
            if d["guard_checks"]:
                d["guard_error_hist"] = {"edges": list(GUARD_BINS), "counts": list(_guard_hist[name])}
                d["guard_max_error_ratio"] = _guard_max[name]
                d["guard_error_ratio_sum"] = _guard_sum[name]
            out[name] = d
        return out


def count_rewrite(rule: str) -> None:
    with _lock:
        _rewrites[rule] += 1


def rewrites() -> dict[str, int]:
    """Programmable calls that backend=None ran as the built-in call they equal, per rule (REWRITE_RULES: a mask
    that is a window, packed documents, prefix-LM, a window with sinks; a score_mod that is ALiBi).  Those calls'
    own counts are in stats(), under the backends that served the built-in calls."""
    with _lock:
        return {rule: _rewrites[rule] for rule in REWRITE_RULES}


def reset_stats() -> None:
    from . import dispatch, rollout
    rollout.collect(wait=True)
    with _lock:
        _stats.clear()
        _guard_hist.clear()
        _guard_max.clear()
        _guard_sum.clear()
        _rewrites.clear()
    dispatch.fallback_counts.clear()


# ----------------------------------------------------------------------------- what a call costs
@functools.lru_cache(maxsize=4096)
def visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """(row, key) pairs the visibility rule lets attend, for one sequence (masks.Visibility, summed)."""
    if sq <= 0 or sk <= 0:
        return 0
    i = torch.arange(sq, dtype=torch.int64)
    diag = sk - sq
    lo = (i + diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + diag + right + 1).clamp(max=sk) if right >= 0 else torch.full_like(i, sk)
    return int((hi - lo).clamp(min=0).sum())


def flops(spec, role: str = "fwd") -> int:
    """Forward 2 (D + Dv) per visible pair and query head (QK^T and PV); backward 2.5x (FlashAttention's)."""
    pairs = visible_pairs(spec.seqlen_q, spec.seqlen_k, spec.window_left, spec.window_right)
    f = 2 * (spec.head_dim + spec.head_dim_v) * pairs * spec.batch * spec.heads_q
    return int(f * 2.5) if role == "bwd" else f


def bytes_read(inputs) -> int:
    return sum(t.numel() * t.element_size() for t in (inputs.q, inputs.k, inputs.v))


# ----------------------------------------------------------------------------- ranges
class _Ranged:
    """One profiler event and NVTX range, entered and left (a class, not a generator: ~2x cheaper)."""

    __slots__ = ("name", "cuda", "handle")

    def __init__(self, name: str, cuda: bool):
        self.name, self.cuda, self.handle = name, cuda, None

    def __enter__(self):
        if _profiling():
            self.handle = _record_enter(self.name, None)
        if self.cuda:
            _nvtx.rangePushA(self.name)

    def __exit__(self, *exc):
        if self.cuda:
            _nvtx.rangePop()
        if self.handle is not None:
            _record_exit(self.handle)
            self.handle = None
        return False


# Whether a PyTorch profiler is recording (one C call); `profiling` for other modules.
_profiling = profiling = torch.autograd._profiler_enabled
_record_enter = torch.ops.profiler._record_function_enter_new
_record_exit = torch.ops.profiler._record_function_exit
try:
    from torch._C import _nvtx     # what torch.cuda.nvtx.range_push calls, without its Python layer
except ImportError:                # a CPU-only build
    class _nvtx:                   # noqa: N801 - the module's stand-in
        rangePushA = rangePop = staticmethod(lambda *a: None)
_OFF = contextlib.nullcontext()


@functools.lru_cache(maxsize=1024)
def _name(kind: str, backend: str, backward: bool) -> str:
    return f"flashport::{ENTRY[kind]}{'_backward' if backward else ''}[{backend}]"


def range_name(spec, backend: str, backward: bool = False) -> str:
    return _name(spec.kind, backend, backward)


def ranged(spec, backend: str, backward: bool = False):
    """The call's profiler / NVTX range (a null context with FLASHPORT_RANGES=0)."""
    return ranged_by(range_args(spec, backend, backward))


def range_args(spec, backend: str, backward: bool = False):
    """What ranged_by() needs, fixed by the call's description: (name, cuda), or None with FLASHPORT_RANGES=0."""
    if not env.flag("FLASHPORT_RANGES"):
        return None
    return _name(spec.kind, backend, backward), spec.device.type == "cuda"


def ranged_by(args):
    """A null context where no range is wanted: off, or on a CPU with no profiler recording (the check is one C call)."""
    if args is None or not (args[1] or _profiling()):
        return _OFF
    return _Ranged(*args)


class _Range:
    """A range opened in one autograd node and closed in another (a backend with its own autograd)."""

    def __init__(self, name: str, cuda: bool, backend: str, flops: int):
        self.name, self.cuda, self.backend, self.flops, self.cm = name, cuda, backend, flops, None
        self.enabled = env.flag("FLASHPORT_RANGES")

    def open(self):
        if self.cm is None:
            add(self.backend, backward=1, flops=self.flops)
            self.cm = _Ranged(self.name, self.cuda) if self.enabled else _OFF
            self.cm.__enter__()

    def close(self):
        if self.cm is not None:
            cm, self.cm = self.cm, None
            cm.__exit__(None, None, None)


class _Open(torch.autograd.Function):
    """On the output: its backward runs first, and opens the range."""

    @staticmethod
    def forward(ctx, rng, out):
        ctx.rng = rng
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        ctx.rng.open()
        return None, g


class _Close(torch.autograd.Function):
    """On the inputs: its backward runs once the backend's backward has produced their gradients."""

    @staticmethod
    def forward(ctx, rng, *xs):
        ctx.rng = rng
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        ctx.rng.close()
        return (None, *gs)


def bracket_inputs(spec, backend: str, q, k, v):
    """For a backend with its own autograd: -> (range, q, k, v) with q, k, v passed through a node whose
    backward closes the backward range; `bracket_output(range, out)` opens it."""
    rng = _Range(range_name(spec, backend, backward=True), spec.device.type == "cuda", backend, flops(spec, "bwd"))
    return (rng, *_Close.apply(rng, q, k, v))


def bracket_output(rng: _Range, out):
    return _Open.apply(rng, out)


def bracket_node(spec, backend: str, node) -> None:
    """For a backend whose own backward is one autograd node (an SDPA fused op's): its range opened and its count
    taken by a hook the engine calls before the node, the range closed by one it calls after -- what
    bracket_inputs / bracket_output do with two Python autograd Functions, which cost more host time per call."""
    rng = _Range(range_name(spec, backend, backward=True), spec.device.type == "cuda", backend, flops(spec, "bwd"))
    node.register_prehook(lambda grad_outputs: rng.open())
    node.register_hook(lambda grad_inputs, grad_outputs: rng.close())


# ----------------------------------------------------------------------------- caches
def _own_objects():
    """(qualified name, object) of everything defined in a loaded flashport module (not what it imports)."""
    import sys
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("flashport") and mod is not None:
            for attr, obj in list(vars(mod).items()):
                if getattr(obj, "__module__", None) == mod_name:
                    yield f"{mod_name}.{attr}", obj


def cache_sizes() -> dict[str, int]:
    """Entries held by every cache flashport owns, by name: the dispatcher's memo, the launch plans, each functools cache
    in a loaded flashport module, and each Triton / Gluon kernel's compiled variants (summed over
    devices) and autotuner choices.  A leak test reads it before and after: every entry must be flat."""
    from . import dispatch, plan_cache
    out = {"dispatch._memo": len(dispatch._memo), "plan_cache._cache": len(plan_cache._cache)}
    for qualname, obj in _own_objects():
        name = qualname.removeprefix("flashport.")
        if hasattr(obj, "cache_info"):
            out[name] = obj.cache_info().currsize
        elif hasattr(obj, "cache") and hasattr(obj, "fn") and isinstance(obj.cache, dict):
            out[name + " (autotune)"] = len(obj.cache)
            obj = obj.fn
        if hasattr(obj, "device_caches"):
            out[name + " (compiled)"] = sum(len(c[0]) for c in list(obj.device_caches.values()))
    return out


def unbounded_caches() -> list[str]:
    """functools caches in loaded flashport modules declared without a size limit."""
    return sorted(name for name, obj in _own_objects()
                  if hasattr(obj, "cache_parameters") and obj.cache_parameters()["maxsize"] is None)
