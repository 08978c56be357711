"""The conformance suite shared by every backend and tier (CPU, interpreter, GPU).

Tolerance rule (FlashAttention's, DESIGN.md): the error of a backend against an exact float64
reference is at most FACTOR x the error of the same-dtype PyTorch math path (which materialises
QK^T, softmax and PV with every operation in the input dtype), plus rounding noise; factor 2 for
the output, 3 for gradients.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

import flashport
from flashport.backend.reference import materialized_attention
from flashport.check import assert_within_rule, magnitude, noise  # noqa: F401  (the rule lives there, shared with `flashport check`)


@dataclass(frozen=True)
class Case:
    b: int = 2
    sq: int = 17
    sk: int = 17
    hq: int = 4
    hkv: int = 2
    d: int = 32
    dv: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None   # None | "head" | "batch_head"
    dtype: torch.dtype = torch.float32
    noncontig: bool = False
    scale: Optional[float] = None
    deterministic: bool = False

    def __str__(self):
        parts = [f"b{self.b}", f"sq{self.sq}", f"sk{self.sk}", f"h{self.hq}/{self.hkv}", f"d{self.d}"]
        if self.dv:
            parts.append(f"dv{self.dv}")
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.alibi:
            parts.append(f"alibi_{self.alibi}")
        if self.noncontig:
            parts.append("strided")
        parts.append(str(self.dtype).replace("torch.", ""))
        return "-".join(parts)

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """Same values, non-contiguous storage (only the last dim keeps stride 1)."""
    big = torch.full((*x.shape[:-2], x.shape[-2] * 2, x.shape[-1] + 8), float("nan"), dtype=x.dtype, device=x.device)
    big[..., ::2, 3:3 + x.shape[-1]] = x
    return big[..., ::2, 3:3 + x.shape[-1]]


def make_inputs(case: Case, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = case.dv or case.d

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(case.dtype).to(device)

    q = rnd(case.b, case.sq, case.hq, case.d)
    k = rnd(case.b, case.sk, case.hkv, case.d)
    v = rnd(case.b, case.sk, case.hkv, dv)
    do = rnd(case.b, case.sq, case.hq, dv)
    slopes = None
    if case.alibi == "head":
        slopes = (torch.rand(case.hq, generator=g) * 0.5 + 0.05).to(device)
    elif case.alibi == "batch_head":
        slopes = (torch.rand(case.b, case.hq, generator=g) * 0.5 + 0.05).to(device)
    if case.noncontig:
        q, k, v = _strided(q), _strided(k), _strided(v)
    return q, k, v, do, slopes


def kwargs_of(case: Case, slopes):
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes,
                softmax_scale=case.scale)


def _math(q, k, v, case: Case, slopes, compute_dtype):
    left, right = case.window
    if case.causal:
        right = 0
    scale = case.scale if case.scale is not None else q.shape[-1] ** -0.5
    alibi = None if slopes is None else (slopes.expand(q.shape[0], -1) if slopes.dim() == 1 else slopes)
    return materialized_attention(q, k, v, scale=scale, softcap=case.softcap, alibi=alibi, left=left, right=right,
                                  compute_dtype=compute_dtype)


def needs_sm90():
    """The skip marker of the Hopper kernels' GPU tests.  A function, so that the CUDA capability is read only
    by the modules that use it (every tier imports this module)."""
    import pytest
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.skipif(not hopper, reason="needs an sm_90 GPU")


def rejecting_launcher():
    """A Gluon kernel's launcher whose compiler rejects the kernel (`RuntimeError: ptxas: unsupported`): the
    safe-fallback tests put it in place of a Hopper kernel's `_launch`.  (Imports the kernels: call it inside a
    test, not at collection.)"""
    from flashport.kernels.launch import DirectLauncher

    class Rejecting:
        def warmup(self, *a, **kw):
            raise RuntimeError("ptxas: unsupported")
    return DirectLauncher(Rejecting())


def check_served_with(switches: dict, case: Case, served: list, monkeypatch, device="cuda", backend=None) -> None:
    """check_dense on `backend` (default backend=None; gradients included) with these environment switches set, and
    the kernel that `served` counts (served_calls) must have served the call: a variant behind a switch is checked
    where it runs.  The selection table is off (FLASHPORT_TABLE=off): a measured bucket nearby may send the call to
    a peer."""
    for name, value in {"FLASHPORT_TABLE": "off", **switches}.items():
        monkeypatch.setenv(name, value)
    check_dense(backend, case, device, grads=True)
    assert served, f"the kernel behind {', '.join(switches)} did not serve {case}"


def served_calls(monkeypatch, module, name: str) -> list:
    """Wrap module.name (a kernel entry that returns None when it declines at compile time and the
    Triton kernels run instead) so that the spec of every call it actually served is recorded."""
    calls = []
    real = getattr(module, name)

    def spy(*a, **kw):
        result = real(*a, **kw)
        if result is not None:
            calls.append(a[0])
        return result
    monkeypatch.setattr(module, name, spy)
    return calls


def check_dense(backend: str, case: Case, device="cpu", grads=True, seed=0):
    """Output, LSE and (optionally) dq/dk/dv of `backend` under the tolerance rule."""
    q, k, v, do, slopes = make_inputs(case, device, seed)
    leaves = [t.detach().requires_grad_(grads) for t in (q, k, v)]
    out, lse = flashport.attention(*leaves, **kwargs_of(case, slopes), deterministic=case.deterministic,
                                   return_lse=True, backend=backend)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    ref_leaves = [t.detach().double().requires_grad_(grads) for t in (q, k, v)]
    ref, ref_lse = _math(*ref_leaves, case, slopes, torch.float64)
    low_leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    low, low_lse = _math(*low_leaves, case, slopes, case.dtype)
    assert_within_rule(f"{backend} out {case}", out, ref, low, case.dtype, 2)
    finite = torch.isfinite(ref_lse).cpu()
    assert torch.equal(torch.isfinite(lse).cpu(), finite), f"{backend} lse -inf pattern {case}"
    assert_within_rule(f"{backend} lse {case}", lse.cpu()[finite], ref_lse.cpu()[finite],
                       low_lse.cpu()[finite], case.dtype, 2)
    if not grads:
        return
    got_g = torch.autograd.grad(out, leaves, do)
    ref_g = torch.autograd.grad(ref, ref_leaves, do.double())
    low_g = torch.autograd.grad(low, low_leaves, do)
    mag = magnitude(*ref_leaves, do)  # gradient noise scales with the inputs (flashport.check.magnitude)
    for name, a, r, l in zip(("dq", "dk", "dv"), got_g, ref_g, low_g):
        assert_within_rule(f"{backend} {name} {case}", a, r, l, case.dtype, 3, mag)


# A grid with odd sizes on purpose; tiers pick subsets (the interpreter runs a small one).
BASE_CASES = [
    Case(),
    Case(b=1, sq=1, sk=1, hq=1, hkv=1, d=16),
    Case(b=1, sq=3, sk=113, hq=2, hkv=1, d=40, causal=True),
    Case(b=2, sq=113, sk=3, hq=2, hkv=2, d=80, causal=True),           # rows that see no key
    Case(b=1, sq=127, sk=257, hq=4, hkv=1, d=64, dv=32),               # MQA, Dv != D
    Case(b=1, sq=65, sk=65, hq=3, hkv=3, d=96, window=(7, 3)),
    Case(b=1, sq=33, sk=47, hq=2, hkv=1, d=32, window=(5, -1)),
    Case(b=1, sq=40, sk=40, hq=2, hkv=2, d=64, softcap=5.0, causal=True),
    Case(b=2, sq=19, sk=29, hq=4, hkv=2, d=32, alibi="head"),
    Case(b=2, sq=29, sk=19, hq=2, hkv=1, d=32, alibi="batch_head", causal=True),
    Case(b=2, sq=17, sk=33, hq=4, hkv=2, d=48, noncontig=True, window=(-1, 4)),
]
