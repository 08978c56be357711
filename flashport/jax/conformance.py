"""Conformance of the JAX backends against the float64 reference under flashport's tolerance rule
(flashport/check.py): out, lse and dq, dk, dv (with an lse cotangent where lse is served), each within
FACTOR x the same-dtype math path's error plus rounding noise.  Used by tests/test_jax*.py,
`flashport.jax.check()` (`flashport check --frontend jax`) and tools/gpu/jax_check.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..check import GRAD_FACTOR, OUT_FACTOR, Result, flash_extras, magnitude, rule_error
from . import reference, registry
from .spec import validate


@dataclass(frozen=True)
class Case:
    name: str
    b: int = 1
    sq: int = 37
    sk: int = 53
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dv: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    segments: Optional[str] = None     # None, "shared" (Sq == Sk, with an absent id) or "pair" (rows with no key)

    def kwargs(self):
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)


def grid(platform: str = "cpu") -> list[Case]:
    """Odd sizes on purpose; every mask kind, Sq != Sk both ways (bottom-right), GQA / MQA, softcap, Dv != D,
    one-key rows, segments with an empty segment, rows that see no key."""
    g = [Case("plain", b=2, hkv=4),
         Case("causal-sq<sk", causal=True),
         Case("causal-sq>sk-empty-rows", sq=53, sk=37, causal=True),
         Case("window", window=(5, 3)),
         Case("window-left-empty-rows", sq=64, sk=17, window=(2, 0)),
         Case("softcap-gqa-causal", sq=40, sk=40, hq=6, hkv=2, causal=True, softcap=5.0),
         Case("mqa-dv", hq=4, hkv=1, d=16, dv=24),
         Case("one-key", sq=29, sk=29, window=(0, 0), d=40),
         Case("segments-causal", b=2, sq=48, sk=48, causal=True, segments="shared"),
         Case("segments-pair-window", sq=33, sk=45, window=(8, 8), segments="pair")]
    if platform != "cpu":
        g += [Case("causal-d128", b=2, sq=257, sk=257, hq=8, hkv=2, d=128, causal=True),
              Case("d64-1023", sq=1023, sk=1023, hq=4, hkv=4, d=64),
              Case("window-d128", sq=512, sk=512, hq=4, hkv=1, d=128, window=(64, 0)),
              # the sizes cuDNN's kernels are used at (tools/gpu/jax_check.py had them; `check --frontend jax` too)
              Case("causal-gqa-d64-1024", b=2, sq=1024, sk=1024, hq=8, hkv=2, d=64, causal=True),
              Case("d128-2048", sq=2048, sk=2048, hq=4, hkv=4, d=128),
              Case("causal-window-d128-2048", sq=2048, sk=2048, hq=4, hkv=2, d=128, window=(256, 0)),
              Case("causal-gqa-d128-4096", sq=4096, sk=4096, hq=2, hkv=1, d=128, causal=True)]
    return g


def pallas_grid() -> list[Case]:
    """Splash / flash need Sq, Sk multiples of 128: small shapes for the interpret mode."""
    return [Case("tpu-plain", sq=128, sk=256, hq=2, hkv=2, d=32),
            Case("tpu-causal-gqa-softcap", sq=256, sk=256, hq=4, hkv=2, d=32, causal=True, softcap=4.0),
            Case("tpu-causal-sq>sk-empty-rows", sq=256, sk=128, hq=2, hkv=1, d=32, causal=True),
            Case("tpu-window-segments", sq=256, sk=256, hq=2, hkv=2, d=32, window=(40, 8), segments="shared"),
            Case("tpu-causal-segments-mha", sq=256, sk=256, hq=2, hkv=2, d=32, causal=True, segments="shared")]


def _segment_ids(case: Case, rng: np.random.Generator):
    if case.segments is None:
        return None, None
    if case.segments == "shared":
        rows = []
        for _ in range(case.b):   # ids 0, 1, 3, 4 in runs: id 2 is an empty segment
            cuts = np.sort(rng.choice(np.arange(1, case.sq), size=3, replace=False))
            rows.append(np.repeat(np.array([0, 1, 3, 4]), np.diff(np.concatenate([[0], cuts, [case.sq]]))))
        ids = np.stack(rows).astype(np.int32)
        return ids, ids
    q_ids = rng.integers(0, 3, size=(case.b, case.sq)).astype(np.int32)
    q_ids[:, :4] = 7                                      # id 7 has no key: these rows see nothing
    kv_ids = rng.integers(0, 3, size=(case.b, case.sk)).astype(np.int32)
    return q_ids, kv_ids


def inputs(case: Case, seed: int = 0) -> dict:
    """Float32 numpy inputs (cast to the dtype under test by the caller), dO, dlse and segment ids."""
    rng = np.random.default_rng(seed)
    dv = case.dv or case.d
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q_ids, kv_ids = _segment_ids(case, rng)
    return dict(q=n(case.b, case.sq, case.hq, case.d), k=n(case.b, case.sk, case.hkv, case.d),
                v=n(case.b, case.sk, case.hkv, dv), do=n(case.b, case.sq, case.hq, dv),
                dlse=n(case.b, case.hq, case.sq), q_ids=q_ids, kv_ids=kv_ids)


def segment_arg(case: Case, x: dict):
    if case.segments is None:
        return None
    if case.segments == "shared":
        return jnp.asarray(x["q_ids"])
    return jnp.asarray(x["q_ids"]), jnp.asarray(x["kv_ids"])


def _reference(case: Case, x: dict, dtype: torch.dtype, with_lse: bool, grads: bool, lse_for_cot=None,
               low_dtype: torch.dtype = torch.float32):
    leaves = [reference.to_torch(x[n], torch.float32).to(dtype).requires_grad_(grads) for n in ("q", "k", "v")]
    left, right = case.window
    segs = {}
    if case.segments is not None:
        segs = dict(q_seg=torch.from_numpy(x["q_ids"]), kv_seg=torch.from_numpy(x["kv_ids"]))
    out, lse = reference.attention(*leaves, scale=case.d ** -0.5, softcap=case.softcap, left=left,
                                   right=0 if case.causal else right, compute_dtype=dtype, **segs)
    g, extras = None, {}
    if dtype == torch.float64 and grads:
        # rounding every flash implementation has and the math path lacks (check.flash_extras), e.g. the
        # backward's Delta from the rounded O where a row sees one key and the math path is exact
        extras = flash_extras(out, lse, leaves, reference.to_torch(x["do"], torch.float64), low_dtype,
                              case.d ** -0.5, ref_grads=_grads(out, lse, leaves, x, with_lse, lse_for_cot, True))
    if grads:
        g = _grads(out, lse, leaves, x, with_lse, lse_for_cot, False)
    return out.detach(), lse.detach(), g, leaves, extras


_REF_CACHE: dict = {}
REF_CACHE_SIZE = 8


def _cached_reference(case: Case, seed: int, x: dict, dtype, with_lse: bool, grads: bool, lse_for_cot=None,
                      low_dtype=torch.float32):
    """_reference, kept for the last few (case, seed, dtype, ...): every backend of one case and dtype is checked
    against the same float64 and same-dtype math paths (the inputs are a function of case and seed), so they
    are computed once, not once per backend (flashport.jax.check runs the backends of a case one after another).
    The results are read, never written, by check_case."""
    key = (case, seed, dtype, with_lse, grads, lse_for_cot is not None, low_dtype)
    if key not in _REF_CACHE:
        while len(_REF_CACHE) >= REF_CACHE_SIZE:
            _REF_CACHE.pop(next(iter(_REF_CACHE)))
        _REF_CACHE[key] = _reference(case, x, dtype, with_lse, grads, lse_for_cot, low_dtype)
    return _REF_CACHE[key]


def clear_cache() -> None:
    _REF_CACHE.clear()


def _grads(out, lse, leaves, x, with_lse, lse_for_cot, retain):
    dtype = out.dtype
    do = reference.to_torch(x["do"], dtype)
    outs, cots = [out], [do]
    if with_lse:
        dlse = torch.from_numpy(x["dlse"]).to(dtype)
        fin = torch.isfinite(lse if lse_for_cot is None else lse_for_cot)
        outs.append(torch.where(fin, lse, torch.zeros_like(lse)))
        cots.append(torch.where(fin, dlse, torch.zeros_like(dlse)))
    g = torch.autograd.grad(outs, leaves, cots, allow_unused=True, retain_graph=retain)
    return [torch.zeros_like(t) if gi is None else gi for gi, t in zip(g, leaves)]


def check_case(backend: str, case: Case, dtype: str = "float32", seed: int = 0, grads: bool = True) -> Result:
    """One backend on one case, as strictly as it allows (with lse where served): PASS / FAIL / SKIP."""
    t0 = time.perf_counter()
    label = f"{case.name}-{dtype}"
    x = inputs(case, seed)
    jd = jnp.dtype(dtype)
    q, k, v = (jnp.asarray(x[n]).astype(jd) for n in ("q", "k", "v"))
    seg = segment_arg(case, x)
    impl = registry.get(backend)
    with_lse = True
    why = impl.availability()
    if not why:
        spec = validate(q, k, v, softmax_scale=None, segment_ids=seg, return_lse=True, **case.kwargs())[0]
        why = impl.supports(spec)
        if why:
            spec = replace(spec, return_lse=False)
            with_lse = False
            why = impl.supports(spec)
    if why:
        return Result(backend, label, "SKIP", note="; ".join(why))
    from . import attention
    try:
        def f(q, k, v):
            return attention(q, k, v, segment_ids=seg, return_lse=with_lse, backend=backend, **case.kwargs())
        res, pullback = jax.vjp(f, q, k, v)
        out, lse = res if with_lse else (res, None)
        td = getattr(torch, dtype)
        ref, ref_lse, ref_g, ref_leaves, extras = _cached_reference(case, seed, x, torch.float64, with_lse, grads,
                                                                    low_dtype=td)
        low, low_lse, low_g, _, _ = _cached_reference(case, seed, x, td, with_lse, grads, lse_for_cot=ref_lse)
        got_out = reference.to_torch(out, torch.float64)
        items = [("out", got_out, ref, low, OUT_FACTOR, None)]
        extras = extras or {}
        fin = torch.isfinite(ref_lse)
        if with_lse:
            got_lse = reference.to_torch(lse, torch.float64)
            if not torch.equal(torch.isfinite(got_lse), fin):
                return Result(backend, label, "FAIL", "out lse", note="lse -inf pattern differs from reference",
                              seconds=time.perf_counter() - t0)
            items.append(("lse", got_lse[fin], ref_lse[fin], low_lse.double()[fin], OUT_FACTOR, None))
        if grads:
            do = jnp.asarray(x["do"]).astype(jd)
            cot = (do, jnp.where(jnp.asarray(fin.numpy()), jnp.asarray(x["dlse"]), 0.0)) if with_lse else do
            got_g = [reference.to_torch(t, torch.float64) for t in pullback(cot)]
            mag = magnitude(*ref_leaves, torch.from_numpy(x["do"]))
            items += [(n, a, r, lo, GRAD_FACTOR, mag) for n, a, r, lo in zip(("dq", "dk", "dv"), got_g, ref_g, low_g)]
    except Exception as e:  # noqa: BLE001 - a backend that accepted the call must serve it
        return Result(backend, label, "FAIL", note=f"{type(e).__name__}: {e}".splitlines()[0][:200],
                      seconds=time.perf_counter() - t0)
    worst, worst_ratio, status = ("-", float("nan"), float("nan")), -1.0, "PASS"
    for name, got, r, lo, factor, mag in items:
        try:
            err, bound = rule_error(got, r, lo, td, factor, mag, extras.get(name, 0.0) if mag is not None else 0.0)
        except AssertionError as e:
            return Result(backend, label, "FAIL", note=f"{name}: {e}", seconds=time.perf_counter() - t0)
        ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
        if ratio > worst_ratio:
            worst, worst_ratio = (name, err, bound), ratio
        if not err <= bound:
            status = "FAIL"
    notes = ([] if with_lse else ["lse not served"]) + ([] if grads else ["forward only"])
    return Result(backend, label, status, " ".join(n for n, *_ in items), worst[1], worst[2], "; ".join(notes),
                  time.perf_counter() - t0, worst[0])
