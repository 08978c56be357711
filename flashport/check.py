"""Conformance of every available backend against `reference` (`flashport check`), and the
tolerance rule shared with the test suite (tests/conformance.py imports it from here).

Tolerance rule (FlashAttention's): a backend's max error against an exact float64 reference is at
most FACTOR x the max error of the same-dtype math path (QK^T, softmax and PV materialised with
every operation in the input dtype) plus rounding noise; FACTOR is 2 for out and lse, 3 for the
gradients.  Every backend is run on the grid below as strictly as it allows: with gradients and
lse where it supports them, otherwise forward only / without lse, and SKIP with its own reasons
where it supports neither.  `flash_extras` (used by flashport.fuzz) adds to the math path's error the
rounding every flash implementation has and the materialising path lacks (Delta = rowsum(dO * O) from
the rounded O, probabilities recomputed in float32): without it, a row that sees one key has an exactly
zero math-path error and the bound would be noise alone.  Padding (varlen tails, cache slots past the valid length, unused
pages) is poisoned with NaN in the backend's inputs: reading it shows up as a FAIL.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import flashport
from . import dispatch
from .backend.reference import materialized_attention
from .kvcache import append_kv, gather_pages
from .spec import dense_spec, kvcache_spec, varlen_spec

OUT_FACTOR, GRAD_FACTOR = 2.0, 3.0


# ----------------------------------------------------------------------------- the rule
def noise(dtype: torch.dtype, ref: torch.Tensor, mag: Optional[float] = None) -> float:
    """Rounding noise of one cast to `dtype` at the reference's magnitude (or at `mag`, when given)."""
    if mag is None:
        mag = ref.abs().max().item() if ref.numel() else 0.0
    return 2 * torch.finfo(dtype).eps * max(1.0, mag)


def magnitude(*ts: torch.Tensor) -> float:
    """Largest |value| over tensors: the scale of a gradient's rounding noise is that of the inputs
    (dO counts as an input), not only its own -- an exactly-zero gradient (one visible key) comes
    out of a fused backward as a cancellation dP - rowsum(dO * O) of input-sized terms."""
    return max((t.detach().abs().max().item() for t in ts if t.numel()), default=0.0)


def rule_error(got: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype, factor: float,
               mag: Optional[float] = None, extra: float = 0.0):
    """-> (max |got - ref64|, bound = factor * (max |lowp - ref64| + extra) + noise); inf error if non-finite.
    `mag` raises the noise's magnitude above the reference's own (see `magnitude`); `extra` is rounding the
    flash algorithm has and the math path lacks (see `flash_extras`; 0 unless given)."""
    # on the reference's device (float64 differences and maxima are exact, so the same numbers as on a CPU)
    ref64 = ref64.detach().double()
    got64 = got.detach().to(ref64.device, torch.float64)
    if got64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(got64.shape)} != {tuple(ref64.shape)}")
    own = ref64.abs().max().item() if ref64.numel() else 0.0
    nz = noise(dtype, ref64, max(own, mag or 0.0))
    if not ref64.numel():
        return 0.0, nz
    err = (got64 - ref64).abs().max().item() if torch.isfinite(got64).all() else float("inf")
    base = (lowp.detach().to(ref64.device, torch.float64) - ref64).abs().max().item()
    return err, factor * (base + extra) + nz


COMPUTE_EPS = torch.finfo(torch.float32).eps   # kernels compute scores, exponentials and sums in float32


def exponent_noise(scale: float, head_dim: int, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float:
    """Relative error of a probability exp(s - lse) that a flash kernel rescales (forward) or recomputes
    (backward) in float32: the exponent carries the float32 rounding of the score (a length-D dot product,
    |scale| * sqrt(D) * max|q| * max|k| in size) and of lse.  The materialising math path rounds the same
    exponent but never recomputes it, so where its probabilities are exact by structure (one visible key:
    p = e / e = 1) its error is 0 and the rule's bound would be noise alone."""
    fin = lse.detach()[torch.isfinite(lse.detach())]
    lse_max = fin.abs().max().item() if fin.numel() else 0.0
    return COMPUTE_EPS * (1.0 + lse_max + abs(scale) * math.sqrt(head_dim) * magnitude(q) * magnitude(k))


def flash_extras(ref_out, ref_lse, leaves64, do, dtype, scale: float, dropout_p: float = 0.0,
                 ref_grads=None, more=()) -> dict:
    """The `extra` of `rule_error` per quantity: rounding every FlashAttention implementation has and the
    materialising math path does not (both are exact zero-error structures there when a row sees one key).

    out, lse:  exponent_noise (delta) x max|v| / (1 - dropout_p), and delta itself for lse.
    dq, dk:    the backward's Delta = rowsum(dO * O) reads O rounded to `dtype` and sums in float32; an error
               e_i in Delta acts exactly as an lse gradient of -e_i (dS = P * (dP - Delta + dlse)), so its
               effect is autograd.grad(ref_lse, (q, k), E) with E_i = eps(dtype) / 2 * ||dO_i * O_i||_2 (O's
               rounding: at most eps / 2 per element, random in sign) + eps(float32) * ||dO_i * O_i||_1 (the
               float32 sum), plus delta x max|g_ref|.
    dv:        delta x max (P^T |dO|): each P = exp(s - lse) recomputed with relative error delta.
    ref_out / ref_lse: the float64 reference's outputs, still attached to leaves64 = (q, k, v) (float64,
    requires_grad; the graph is used, not freed, so call this before a last backward without retain_graph);
    ref_grads: the float64 dq, dk, dv, when gradients are checked (then followed by those of `more`).
    more: further leaves of the reference's graph (attn_bias, a score_mod's captured table), whose gradients
    take Delta's error the way dq and dk do: extras["more"] lists their terms in order."""
    q, k, v = leaves64
    delta = exponent_noise(scale, q.shape[-1], ref_lse, q, k)
    extras = {"out": delta * magnitude(v) / (1.0 - dropout_p), "lse": delta}
    if ref_grads is None:
        return extras
    prod = do.detach().double() * ref_out.detach().double()             # [..., S, Hq, Dv] like out
    err = (0.5 * torch.finfo(dtype).eps * prod.pow(2).sum(-1).sqrt() + COMPUTE_EPS * prod.abs().sum(-1)).movedim(-1, -2)
    err = torch.where(torch.isfinite(ref_lse.detach()), err.to(ref_lse.dtype), torch.zeros_like(ref_lse))
    gq, gk, *gm = torch.autograd.grad(ref_lse, (q, k, *more), err, retain_graph=True, allow_unused=True)
    (pv,) = torch.autograd.grad(ref_out, (v,), do.detach().to(ref_out.dtype).abs(), retain_graph=True,
                                allow_unused=True)
    for name, g, g_ref in (("dq", gq, ref_grads[0]), ("dk", gk, ref_grads[1])):
        extras[name] = magnitude(*([g] if g is not None else [])) + delta * magnitude(g_ref)
    extras["dv"] = delta * magnitude(*([pv] if pv is not None else []))
    extras["more"] = [magnitude(*([g] if g is not None else [])) + delta * magnitude(g_ref)
                      for g, g_ref in zip(gm, ref_grads[3:])]
    return extras


def assert_within_rule(name: str, got: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype, factor: float,
                       mag: Optional[float] = None):
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(got.detach().double().cpu()).all(), f"{name}: non-finite values"
    err, bound = rule_error(got, ref64, lowp, dtype, factor, mag)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} ({factor} x math-path error + noise)"


# ----------------------------------------------------------------------------- the grid
@dataclass(frozen=True)
class GridCase:
    """One conformance case.  varlen: `seqs` are (len_q, len_k) per sequence and `tail` padding rows
    follow cu_seqlens[-1].  kvcache: `seqs` are cache lengths before the append of `new` tokens,
    `sk` is the capacity, `page` > 0 makes the cache paged with that block size."""

    name: str
    kind: str = "dense"
    b: int = 1
    sq: int = 17
    sk: int = 17
    hq: int = 2
    hkv: int = 2
    d: int = 32
    dv: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    seqs: tuple = ()
    tail: int = 0
    new: int = 0
    page: int = 0


def grid(device: torch.device) -> list[GridCase]:
    """Odd sizes on purpose; small enough that every backend on a 2-core CPU runs it in seconds."""
    g = [
        GridCase("basic-gqa", b=2, hq=4, hkv=2),
        GridCase("single", sq=1, sk=1, hq=1, hkv=1, d=16),
        GridCase("causal-sq<sk", sq=13, sk=37, hq=2, hkv=1, d=40, causal=True),
        GridCase("causal-sq=sk", sq=33, sk=33, hq=4, hkv=4, d=64, causal=True),
        GridCase("causal-sq>sk", b=2, sq=37, sk=13, d=32, causal=True),            # rows see no key
        GridCase("window", sq=45, sk=45, hq=3, hkv=3, d=48, window=(7, 3)),
        GridCase("window-left", sq=33, sk=47, hq=2, hkv=1, window=(5, -1)),
        GridCase("softcap-causal", sq=40, sk=40, d=64, softcap=5.0, causal=True),
        GridCase("alibi", b=2, sq=19, sk=29, hq=4, hkv=2, alibi="head"),
        GridCase("alibi-bh-causal", b=2, sq=29, sk=19, hq=2, hkv=1, alibi="batch_head", causal=True),
        GridCase("mqa-dv", sq=31, sk=57, hq=4, hkv=1, d=64, dv=32),
        GridCase("odd-d80", sq=113, sk=127, d=80),
        GridCase("varlen", kind="varlen", hq=4, hkv=2, seqs=((5, 7), (0, 3), (17, 17), (1, 1)), tail=3),
        GridCase("varlen-causal", kind="varlen", hq=2, hkv=1, d=40, causal=True,
                 seqs=((9, 20), (13, 13), (4, 0)), tail=2),
        GridCase("varlen-window-alibi", kind="varlen", window=(4, 2), alibi="head", seqs=((11, 11), (6, 9))),
        GridCase("kvcache-decode", kind="kvcache", b=3, sq=1, sk=48, hq=4, hkv=1, seqs=(0, 20, 45), new=1),
        GridCase("kvcache-prefill", kind="kvcache", b=2, sq=5, sk=40, hq=4, hkv=2, seqs=(3, 30), new=5,
                 causal=True),
        GridCase("kvcache-nonew", kind="kvcache", b=2, sq=3, sk=32, seqs=(17, 32), softcap=3.0),
        GridCase("paged-decode", kind="kvcache", b=2, sq=1, sk=64, hq=4, hkv=2, d=64, seqs=(33, 9), new=1,
                 page=16),
        GridCase("paged-window-alibi", kind="kvcache", b=2, sq=4, sk=48, seqs=(20, 40), new=2, page=16,
                 causal=True, window=(9, 0), alibi="batch_head"),
    ]
    if device.type == "cuda":  # cheap there: cross several kernel tiles and the large head dims
        g += [GridCase("tiles-causal-d128", b=2, sq=300, sk=300, hq=4, hkv=2, d=128, causal=True),
              GridCase("tiles-d256", sq=257, sk=1023, d=256, window=(64, 64)),
              GridCase("varlen-tiles", kind="varlen", hq=4, hkv=2, d=128, causal=True,
                       seqs=((200, 300), (127, 127), (0, 64), (513, 513)), tail=5),
              GridCase("paged-256", kind="kvcache", b=2, sq=1, sk=1024, hq=8, hkv=2, d=128, seqs=(700, 1),
                       new=1, page=256)]
    return g


def default_dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32]


# ----------------------------------------------------------------------------- one case
@dataclass
class Result:
    backend: str
    case: str
    status: str                      # PASS | FAIL | SKIP
    checked: str = ""                # what was compared, e.g. "out lse dq dk dv"
    err: float = float("nan")        # of the worst quantity (largest err / bound)
    bound: float = float("nan")
    note: str = ""
    seconds: float = 0.0
    worst: str = ""


@dataclass
class _Prepared:
    """One case's inputs (with NaN padding) behind four closures, and dO for the gradients."""
    run: Callable        # (backend, leaves, with_lse) -> (out, lse or None) through the public API
    spec_of: Callable    # (grads, with_lse) -> AttnSpec, to ask a backend what it supports
    leaves_of: Callable  # grads -> fresh leaf tensors (q, k, v) for `run`
    ref: Callable        # (compute_dtype, grads) -> (out, lse, leaves) of the materialised math path
    grads_possible: bool
    do: Optional[torch.Tensor] = None


def _rnd(g, shape, dtype, device):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def _slopes(case: GridCase, b: int, g, device):
    if case.alibi is None:
        return None
    shape = (case.hq,) if case.alibi == "head" else (b, case.hq)
    return (torch.rand(*shape, generator=g) * 0.5 + 0.05).to(device)


def _bh(slopes, b):
    return None if slopes is None else (slopes.expand(b, -1) if slopes.dim() == 1 else slopes)


def _kw(case: GridCase, slopes):
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)


def _math_kw(case: GridCase, d: int):
    left, right = case.window
    return dict(scale=d ** -0.5, softcap=case.softcap, left=left, right=0 if case.causal else right)


def _prepare_dense(case: GridCase, dtype, device, g) -> _Prepared:
    dv = case.dv or case.d
    q, k, v = (_rnd(g, s, dtype, device) for s in ((case.b, case.sq, case.hq, case.d),
                                                     (case.b, case.sk, case.hkv, case.d),
                                                     (case.b, case.sk, case.hkv, dv)))
    do = _rnd(g, (case.b, case.sq, case.hq, dv), dtype, device)
    slopes = _slopes(case, case.b, g, device)
    leaves_of = lambda grads: [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]  # noqa: E731

    def spec_of(grads, lse):
        return dense_spec(*leaves_of(grads), **_kw(case, slopes), softmax_scale=None, dropout_p=0.0,
                          deterministic=False, return_lse=lse)[0]

    def run(name, leaves, lse):
        r = flashport.attention(*leaves, **_kw(case, slopes), return_lse=lse, backend=name)
        return r if lse else (r, None)

    def ref(cd, grads):
        leaves = [t.detach().to(cd).requires_grad_(grads) for t in (q, k, v)]
        out, lse = materialized_attention(*leaves, alibi=_bh(slopes, case.b), compute_dtype=cd,
                                          **_math_kw(case, case.d))
        return out, lse, leaves

    return _Prepared(run, spec_of, leaves_of, ref, True, do)


def _prepare_varlen(case: GridCase, dtype, device, g) -> _Prepared:
    dv = case.dv or case.d
    lq, lk = [s[0] for s in case.seqs], [s[1] for s in case.seqs]
    b = len(case.seqs)
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=device)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=device)
    tq, tk = sum(lq) + case.tail, sum(lk) + case.tail
    q, k, v = (_rnd(g, s, dtype, device) for s in ((tq, case.hq, case.d), (tk, case.hkv, case.d), (tk, case.hkv, dv)))
    for t, n in ((q, sum(lq)), (k, sum(lk)), (v, sum(lk))):
        t[n:] = float("nan")                   # padding past cu_seqlens[-1] must never be read
    do = _rnd(g, (tq, case.hq, dv), dtype, device)
    slopes = _slopes(case, b, g, device)
    mq, mk = max(lq), max(lk)
    leaves_of = lambda grads: [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]  # noqa: E731

    def spec_of(grads, lse):
        return varlen_spec(*leaves_of(grads), cq, ck, mq, mk, **_kw(case, slopes), softmax_scale=None,
                           dropout_p=0.0, deterministic=False, return_lse=lse)[0]

    def run(name, leaves, lse):
        r = flashport.attention_varlen(*leaves, cq, ck, mq, mk, **_kw(case, slopes), return_lse=lse, backend=name)
        return r if lse else (r, None)

    def ref(cd, grads):
        # the reference sees zeros where the backend sees NaN padding (its rows are excluded anyway)
        leaves = [torch.nan_to_num(t.detach(), nan=0.0).to(cd).requires_grad_(grads) for t in (q, k, v)]
        qx, kx, vx = leaves
        outs, lses = [], []
        al = _bh(slopes, b)
        for i in range(b):
            o, l = materialized_attention(qx[cq[i]:cq[i + 1]][None], kx[ck[i]:ck[i + 1]][None],
                                          vx[ck[i]:ck[i + 1]][None], alibi=None if al is None else al[i:i + 1],
                                          compute_dtype=cd, **_math_kw(case, case.d))
            outs.append(o[0])
            lses.append(l[0])
        outs.append(qx.new_zeros(case.tail, case.hq, dv))
        lses.append(torch.full((case.hq, case.tail), float("-inf"), device=device))
        return torch.cat(outs, 0), torch.cat(lses, 1), leaves

    return _Prepared(run, spec_of, leaves_of, ref, True, do)


def _prepare_kvcache(case: GridCase, dtype, device, g) -> _Prepared:
    dv = case.dv or case.d
    b, cap = case.b, case.sk
    q = _rnd(g, (b, case.sq, case.hq, case.d), dtype, device)
    kn = _rnd(g, (b, case.new, case.hkv, case.d), dtype, device) if case.new else None
    vn = _rnd(g, (b, case.new, case.hkv, dv), dtype, device) if case.new else None
    lens = torch.tensor(case.seqs, dtype=torch.int32, device=device)
    valid = torch.arange(cap, device=device)[None, :] < lens[:, None].long()          # [B, cap] before append
    k_dense = torch.where(valid[..., None, None], _rnd(g, (b, cap, case.hkv, case.d), dtype, device), float("nan"))
    v_dense = torch.where(valid[..., None, None], _rnd(g, (b, cap, case.hkv, dv), dtype, device), float("nan"))
    block_table = None
    if case.page:
        nblk = cap // case.page
        perm = torch.randperm(b * nblk + 2, generator=g)[: b * nblk]               # 2 unused blocks
        block_table = perm.view(b, nblk).to(torch.int32).to(device)
        kc = torch.full((b * nblk + 2, case.page, case.hkv, case.d), float("nan"), dtype=dtype, device=device)
        vc = torch.full((b * nblk + 2, case.page, case.hkv, dv), float("nan"), dtype=dtype, device=device)
        idx = block_table.long().reshape(-1)
        kc[idx] = k_dense.reshape(b * nblk, case.page, case.hkv, case.d)
        vc[idx] = v_dense.reshape(b * nblk, case.page, case.hkv, dv)
    else:
        kc, vc = k_dense, v_dense
    slopes = _slopes(case, b, g, device)
    kw = dict(cache_seqlens=lens if case.seqs else None, block_table=block_table, **_kw(case, slopes))

    def spec_of(grads, lse):
        return kvcache_spec(q, kc.clone(), vc.clone(), kn, vn, softmax_scale=None, return_lse=lse, **kw)[0]

    def run(name, leaves, lse):
        with torch.no_grad():
            r = flashport.attention_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, return_lse=lse, backend=name, **kw)
        return r if lse else (r, None)

    def ref(cd, grads):
        k2, v2 = torch.nan_to_num(kc, nan=0.0), torch.nan_to_num(vc, nan=0.0)
        append_kv(k2, v2, kn, vn, lens, block_table)
        if block_table is not None:
            k2, v2 = gather_pages(k2, block_table), gather_pages(v2, block_table)
        qx, k2, v2 = (t.to(cd) for t in (q, k2, v2))
        out, lse = materialized_attention(qx, k2, v2, alibi=_bh(slopes, b), seqlens_k=lens + case.new,
                                          compute_dtype=cd, **_math_kw(case, case.d))
        return out, lse, []

    return _Prepared(run, spec_of, lambda grads: [], ref, False)


_PREPARE = {"dense": _prepare_dense, "varlen": _prepare_varlen, "kvcache": _prepare_kvcache}


def _plan(backend, prep: _Prepared):
    """The strictest (grads, lse) combination the backend serves, or (None, its reasons)."""
    combos = [(True, True), (True, False), (False, True), (False, False)] if prep.grads_possible else \
        [(False, True), (False, False)]
    impl = dispatch.get(backend)
    reasons = impl.availability()
    if reasons:
        return None, reasons
    for grads, lse in combos:
        reasons = impl.supports(prep.spec_of(grads, lse))
        if not reasons:
            return (grads, lse), []
    return None, reasons


def _grad(out, leaves, do):
    """dq, dk, dv; a leaf the graph never used (every sequence empty) gets zeros."""
    gs = torch.autograd.grad(out, leaves, do, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, leaves)]


def check_case(backend: str, case: GridCase, dtype: torch.dtype, device, seed: int = 0) -> Result:
    device = torch.device(device)
    label = f"{case.name}-{str(dtype).replace('torch.', '')}"
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    prep = _PREPARE[case.kind](case, dtype, device, g)
    plan, reasons = _plan(backend, prep)
    if plan is None:
        return Result(backend, label, "SKIP", note="; ".join(reasons))
    grads, with_lse = plan
    try:
        leaves = prep.leaves_of(grads)
        out, lse = prep.run(backend, leaves, with_lse)
        ref, ref_lse, ref_leaves = prep.ref(torch.float64, grads)
        low, low_lse, low_leaves = prep.ref(dtype, grads)
        items = [("out", out, ref, low, OUT_FACTOR, None)]
        if with_lse:
            fin = torch.isfinite(ref_lse).cpu()
            if not torch.equal(torch.isfinite(lse).cpu(), fin):
                return Result(backend, label, "FAIL", "out lse", note="lse -inf pattern differs from reference",
                              seconds=time.perf_counter() - t0)
            items.append(("lse", lse.cpu()[fin], ref_lse.cpu()[fin], low_lse.cpu()[fin], OUT_FACTOR, None))
        if grads:
            got_g = _grad(out, leaves, prep.do)
            ref_g = _grad(ref, ref_leaves, prep.do.double())
            low_g = _grad(low, low_leaves, prep.do)
            mag = magnitude(*ref_leaves, prep.do)
            items += [(n, a, r, lo, GRAD_FACTOR, mag) for n, a, r, lo in zip(("dq", "dk", "dv"), got_g, ref_g, low_g)]
    except Exception as e:  # a backend that accepted the call must serve it
        return Result(backend, label, "FAIL", note=f"{type(e).__name__}: {e}".splitlines()[0][:200],
                      seconds=time.perf_counter() - t0)
    worst, worst_ratio, status = None, -1.0, "PASS"
    for name, got, r, lo, factor, mag in items:
        try:
            err, bound = rule_error(got, r, lo, dtype, factor, mag)
        except AssertionError as e:
            return Result(backend, label, "FAIL", note=f"{name}: {e}", seconds=time.perf_counter() - t0)
        ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
        if ratio > worst_ratio:
            worst, worst_ratio = (name, err, bound), ratio
        if err > bound:
            status = "FAIL"
    checked = " ".join(n for n, *_ in items)
    notes = ([] if with_lse else ["lse not served"]) + ([] if grads or not prep.grads_possible else ["forward only"])
    return Result(backend, label, status, checked, worst[1], worst[2], "; ".join(notes),
                  time.perf_counter() - t0, worst[0])


# ----------------------------------------------------------------------------- the command
def run_check(backends: Optional[list[str]] = None, device=None, dtypes=None, progress=None) -> list[Result]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    infos = flashport.backends()
    names = [i.name for i in infos if i.available and i.name != "reference"] if not backends else backends
    results = []
    for name in names:
        for dtype in dtypes or default_dtypes(device):
            for case in grid(device):
                r = check_case(name, case, dtype, device)
                results.append(r)
                if progress:
                    progress(r)
    return results


def format_table(results: list[Result]) -> str:
    head = ("backend", "case", "checked", "worst", "max err", "bound", "status", "note")
    rows = [(r.backend, r.case, r.checked, r.worst, f"{r.err:.2e}" if r.err == r.err else "-",
             f"{r.bound:.2e}" if r.bound == r.bound else "-", r.status, r.note[:90]) for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line("-" * w for w in widths)] + [line(r) for r in rows])
