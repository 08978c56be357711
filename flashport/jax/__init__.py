"""flashport.jax: the attention contract in JAX, [B, S, H, D] layout, jit-able and differentiable.

    import flashport.jax as fj
    out = fj.attention(q, k, v, causal=True)                  # q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D|Dv]
    out, lse = fj.attention(q, k, v, segment_ids=ids, return_lse=True)   # lse [B, Hq, Sq] float32

Semantics are the torch side's (DESIGN.md): scores softmax_scale * q.k, softcap * tanh(s / softcap),
bottom-right aligned windows (-1 = unbounded; causal is right = 0), GQA without expanding K/V, rows that
see no key give zeros, lse = -inf and zero gradients.  segment_ids: int32 [B, S] shared by queries and
keys (Sq == Sk), or a pair (q_ids [B, Sq], kv_ids [B, Sk]); a token sees only keys of its own id.

Backends (auto order; `backend=` is strict and raises flashport.UnsupportedError with the reasons):
cudnn (NVIDIA GPU), pallas-tpu (splash), pallas-tpu-flash (TPU; interpret mode elsewhere, named only),
xla (materialising, auto for short sequences), blockwise (lax online softmax, linear memory, anywhere).
`import flashport` never imports jax; this module does.
"""
from __future__ import annotations

from ..dispatch import BackendInfo, UnsupportedError
from . import registry
from .blockwise import BlockwiseBackend
from .cudnn import CudnnBackend
from .pallas_tpu import FlashBackend, SplashBackend
from .spec import empty_result, validate
from .xla import XlaBackend

for _b in (CudnnBackend(), SplashBackend(), FlashBackend(), XlaBackend(), BlockwiseBackend()):
    registry.register(_b)

__all__ = ["attention", "backends", "describe", "environment", "check", "select", "BackendInfo",
           "UnsupportedError"]


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              segment_ids=None, return_lse=False, backend=None):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out [B, Sq, Hq, Dv] in q's dtype; with
    return_lse: (out, lse [B, Hq, Sq] float32).  Equivalent math (per head h, KV head h // (Hq // Hkv)):
        s = softmax_scale * q @ k^T; s = softcap * tanh(s / softcap) if softcap > 0
        s[i, j] = -inf unless i + Sk - Sq - left <= j <= i + Sk - Sq + right (and ids match)
        out = softmax(s) @ v, rows with no visible key -> 0;  lse = logsumexp(s, -1)"""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name or None, got {type(backend).__name__}")
    spec, q, k, v, q_seg, kv_seg = validate(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                            window_size=window_size, softcap=softcap, segment_ids=segment_ids,
                                            return_lse=return_lse)
    if backend is not None:
        registry.get(backend)          # an unknown name fails even for a call with nothing to compute
    if 0 in (spec.batch, spec.seqlen_q, spec.heads_q, spec.seqlen_k):
        out, lse = empty_result(spec, q, v)
    else:
        out, lse = registry.select(spec, backend)(spec, q, k, v, q_seg, kv_seg)
    return (out, lse) if return_lse else out


def select(q, k, v, **kwargs) -> str:
    """The name of the backend a call with these arguments would run on (raises like the call would)."""
    backend = kwargs.pop("backend", None)
    spec = validate(q, k, v, **{**_DEFAULTS, **kwargs})[0]
    return registry.select(spec, backend).name


def backends() -> list[BackendInfo]:
    """Every JAX backend in auto-priority order: name, available, reasons it is not, capabilities."""
    return registry.backends()


def environment() -> dict:
    """jax / jaxlib versions, the default platform and its devices (for `flashport info`)."""
    import jax
    import jaxlib
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": jax.default_backend(),
            "devices": [f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()]}


def describe() -> list[dict]:
    """One dict per backend for `flashport info`: name, available, reasons, auto platforms, capabilities."""
    return [{"name": i.name, "available": i.available, "reasons": i.reasons,
             "auto": registry.get(i.name).auto, "auto_platforms": i.capabilities.get("auto_platforms"),
             "capabilities": i.capabilities} for i in backends()]


def check(backends: list[str] | None = None, dtypes: list[str] | None = None, progress=None,
          match: str | None = None) -> list:
    """Conformance of the JAX backends against the float64 reference (the tolerance rule of flashport.check),
    forward and gradients, on this platform's grid -> list of flashport.check.Result (print them with
    flashport.check.format_table).  Default: every available backend auto-selectable on this platform, plus
    xla and blockwise; pallas-tpu on a CPU (interpret mode, slow) only when named.  match: a regular
    expression; only the grid cases whose name it finds are run (`flashport check --frontend jax --match`)."""
    import re

    import jax
    from . import conformance
    platform = jax.default_backend()
    if backends is None:
        backends = [b.name for b in backends_for(platform)]
    if dtypes is None:
        dtypes = ["float32"] if platform == "cpu" else (["bfloat16"] if platform == "tpu" else ["bfloat16", "float16"])
    runs = []   # (backend, dtype, case): case by case, every backend in turn, so each reference is computed once
    for name in backends:
        cases = conformance.pallas_grid() if name.startswith("pallas-tpu") else conformance.grid(platform)
        runs += [(name, dtype, case) for dtype in dtypes for case in cases
                 if match is None or re.search(match, case.name)]
    order = {run: i for i, run in enumerate(runs)}
    results = {}
    for run in sorted(runs, key=lambda r: (r[1], r[2].name, order[r])):
        name, dtype, case = run
        results[run] = r = conformance.check_case(name, case, dtype)
        if progress:
            progress(r)
    conformance.clear_cache()
    return [results[run] for run in runs]       # grouped by backend, as asked


def backends_for(platform: str) -> list:
    return [b for b in (registry.get(n) for n in registry.names())
            if not b.availability() and (not b.auto_platforms or platform in b.auto_platforms)]


_DEFAULTS = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, segment_ids=None,
                 return_lse=False)
