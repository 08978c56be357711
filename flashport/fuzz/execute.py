"""One fuzz case: build its tensors (NaN in every padding the backend must not read), call the public API,
and check every quantity against the float64 reference under flashport.check's tolerance rule.

    out, lse:     rule_error(..., factor OUT_FACTOR = 2), lse only where the reference's is finite; the
                  lse -inf pattern must match exactly (no NaN, no +inf)
    dq, dk, dv:   rule_error(..., factor GRAD_FACTOR = 3, mag = magnitude(q, k, v, dO))
    determinism:  with deterministic=True, a second backward pass is bitwise equal to the first
    dropout:      checked exactly: the keep-mask the backend exposes (its module's `dropout_mask`) for the
                  same (seed, offset) is handed to the reference
    kvcache:      the appended cache equals the expected one bit for bit, NaN slots past it untouched
A bound that is not finite (the same-dtype math path overflowed) is a generator defect: BADREF.

The reference and the same-dtype math path are flashport.backend.reference.materialized_attention, run
here directly (never through dispatch), on the case's device.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Optional

import torch

import flashport
from ..backend.reference import materialized_attention
from ..check import GRAD_FACTOR, OUT_FACTOR, flash_extras, magnitude, rule_error
from ..dropout import dense_keep_mask, draw_rng_state
from .cases import FuzzCase

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NAN = float("nan")
COMPILED = ("attention", "attention_varlen", "attention_with_kvcache")


class _Compiled:
    """flashport's entry points under torch.compile(fullgraph=True): the custom ops of flashport/ops.py, their
    fake implementations and registered autograd, traced by dynamo and AOTAutograd.  Backend "aot_eager": what
    is checked is the traced path into the ops, not Inductor's code around them.  Each distinct set of
    keyword constants is a new specialisation, so the recompile limits are lifted; buffer donation is off
    because deterministic=True cases run the backward twice (retain_graph), which donation forbids."""

    def __init__(self):
        self._fns: dict = {}

    def __getattr__(self, name):
        if name not in COMPILED:
            return getattr(flashport, name)
        if name not in self._fns:
            import torch._dynamo.config as dcfg
            for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                        "accumulated_recompile_limit"):
                if hasattr(dcfg, key):
                    setattr(dcfg, key, max(getattr(dcfg, key), 1 << 16))
            torch._functorch.config.donated_buffer = False
            self._fns[name] = torch.compile(getattr(flashport, name), fullgraph=True, backend="aot_eager")
        return self._fns[name]


api = flashport   # what the executors call: flashport itself, or _Compiled() (use_compiled)


def use_compiled(on: bool) -> None:
    """Route this process's cases through torch.compile (True) or call flashport eagerly (False)."""
    global api
    api = _Compiled() if on else flashport


class Outcome:
    """What one case found: quantities (name -> (err, bound)), contract problems, status."""

    def __init__(self):
        self.quantities: dict[str, tuple[float, float]] = {}
        self.problems: list[str] = []
        self.badref: list[str] = []
        self.extra: dict[str, float] = {}          # the part of each bound that flash_extras contributes

    def rule(self, name, got, ref64, lowp, dtype, factor, mag=None, extra=0.0):
        try:
            err, bound = rule_error(got, ref64, lowp, dtype, factor, mag, extra)
        except AssertionError as e:         # shape mismatch
            self.problems.append(f"{name}: {e}")
            return
        self.quantities[name] = (err, bound)
        self.extra[name] = factor * extra
        if not math.isfinite(bound):
            self.badref.append(name)

    def problem(self, text: str):
        self.problems.append(text)

    def status(self) -> str:
        """FAIL: a contract problem, a non-finite value (err inf), or err > bound; else BADREF where a
        bound is not finite; else PASS."""
        failed = bool(self.problems)
        for e, b in self.quantities.values():
            if not math.isfinite(e) or (math.isfinite(b) and e > b):
                failed = True
        if failed:
            return "FAIL"
        return "BADREF" if self.badref else "PASS"

    def worst(self):
        """(name, err, bound) of the largest err / bound."""
        best, ratio = None, -1.0
        for n, (e, b) in self.quantities.items():
            r = e / b if b > 0 else (0.0 if e == 0 else math.inf)
            if not math.isfinite(b):
                r = -0.5                     # a BADREF quantity is never the worst failure
            if r > ratio:
                best, ratio = (n, e, b), r
        return best


# ----------------------------------------------------------------------------- tensors
def _gen(case: FuzzCase) -> torch.Generator:
    return torch.Generator().manual_seed(case.data_seed)


def eff_scale(case: FuzzCase) -> float:
    return case.scale if case.scale is not None else case.d ** -0.5


def _amp(case: FuzzCase) -> float:
    """q and k entries ~ N(0, amp^2) give scores scale * q.k of std `logit`."""
    s = abs(eff_scale(case))
    return 1.0 if s == 0 else math.sqrt(case.logit / (s * math.sqrt(case.d)))


def _rand(g, shape, dtype, device, amp: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=g, dtype=torch.float32)
    if amp != 1.0:
        x = x * amp
    return x.to(dtype).to(device)


def lay_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values in the requested memory layout; the last dim keeps stride 1.  "padded8" / "padded16": rows
    padded to D + 8 / D + 16 elements (NaN in the gap); "transposed": dims 0..-2 stored in reverse order
    (heads outer)."""
    if layout == "contiguous" or x.dim() < 2:
        return x
    if layout.startswith("padded"):
        pad = int(layout[len("padded"):] or 8)
        big = torch.full((*x.shape[:-1], x.shape[-1] + pad), NAN, dtype=x.dtype, device=x.device)
        big[..., : x.shape[-1]] = x
        return big[..., : x.shape[-1]]
    perm = list(range(x.dim() - 1))[::-1] + [x.dim() - 1]
    return x.permute(*perm).contiguous().permute(*perm)


def _slopes(case: FuzzCase, batch: int, g, device) -> Optional[torch.Tensor]:
    if case.alibi is None:
        return None
    shape = (case.hq,) if case.alibi == "head" else (batch, case.hq)
    return (torch.rand(*shape, generator=g) * 0.5 + 0.05).to(device)


def _bh(slopes, batch):
    return None if slopes is None else (slopes.expand(batch, -1) if slopes.dim() == 1 else slopes)


def _math_kw(case: FuzzCase) -> dict:
    left, right = case.window
    return dict(scale=eff_scale(case), softcap=case.softcap, left=left, right=0 if case.causal else right)


def _api_kw(case: FuzzCase, slopes, backend) -> dict:
    return dict(causal=case.causal, softmax_scale=case.scale, window_size=tuple(case.window), softcap=case.softcap,
                alibi_slopes=slopes, return_lse=case.return_lse, backend=backend)


def _mask_fn(served: Optional[str]):
    """The dense keep-mask function of the backend that served the call (its module's `dropout_mask`)."""
    mod = sys.modules.get(f"flashport.backend.{served}") if served else None
    return getattr(mod, "dropout_mask", None) or dense_keep_mask


def _grads(outputs, leaves, grad_outputs, retain=False):
    gs = torch.autograd.grad(outputs, leaves, grad_outputs, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, leaves)]


def _check_lse(o: Outcome, lse, ref_lse, low_lse, dtype, shape, extra=0.0):
    if lse is None:
        o.problem("lse missing with return_lse=True")
        return
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(shape):
        o.problem(f"lse {lse.dtype} {tuple(lse.shape)}, expected float32 {tuple(shape)}")
        return
    got, ref = lse.detach(), ref_lse.detach().to(lse.device)
    if torch.isnan(got).any() or torch.isposinf(got).any():
        o.problem("lse has NaN or +inf")
        return
    if not torch.equal(torch.isneginf(got), torch.isneginf(ref)):
        n = (torch.isneginf(got) != torch.isneginf(ref)).sum().item()
        o.problem(f"lse -inf pattern differs from the reference in {n} rows")
        return
    fin = torch.isfinite(ref)
    o.rule("lse", got[fin], ref[fin], low_lse.detach().to(lse.device)[fin], dtype, OUT_FACTOR, extra=extra)


def _check_out(o: Outcome, out, ref, low, dtype, shape, extra=0.0):
    if out.dtype != dtype or tuple(out.shape) != tuple(shape):
        o.problem(f"out {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(shape)}")
        return
    o.rule("out", out, ref, low, dtype, OUT_FACTOR, extra=extra)


def _check_forward(o: Outcome, case, out, lse, ref, ref_lse, low, low_lse, dtype, out_shape, lse_shape, extras):
    _check_out(o, out, ref, low, dtype, out_shape, extras["out"])
    if case.return_lse:
        _check_lse(o, lse, ref_lse, low_lse, dtype, lse_shape, extras["lse"])


def _check_backward(o: Outcome, case, got, second, ref, ref_lse, ref_leaves, low, low_lse, low_leaves, do, dlse,
                    dtype):
    """Gradients of the float64 reference (its graph kept for flash_extras) and of the math path -> the rule."""
    outs, gos = ([ref, ref_lse], [do.double(), dlse]) if case.dlse else ([ref], [do.double()])
    ref_g = _grads(outs, ref_leaves, gos, retain=True)
    extras = flash_extras(ref, ref_lse, ref_leaves, do, dtype, eff_scale(case), case.dropout_p, ref_g)
    low_g = _grads([low, low_lse] if case.dlse else [low], low_leaves, [do, dlse] if case.dlse else [do])
    _check_grads(o, got, ref_g, low_g, dtype, magnitude(*ref_leaves, do), second, extras)
    return extras


def _check_grads(o: Outcome, got, ref, low, dtype, mag, second=None, extras=None):
    for name, a, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        o.rule(name, a, r, lo, dtype, GRAD_FACTOR, mag, (extras or {}).get(name, 0.0))
    if second is not None:
        same = [torch.equal(a, b) for a, b in zip(got, second)]
        o.quantities["det"] = (0.0 if all(same) else 1.0, 0.0)
        if not all(same):
            o.problem("deterministic=True: a second backward differs bitwise in "
                      + ", ".join(n for n, s in zip(("dq", "dk", "dv"), same) if not s))


# ----------------------------------------------------------------------------- entry points
def _dense(case: FuzzCase, device, backend, rec, o: Outcome):
    dt, g = DTYPES[case.dtype], _gen(case)
    amp = _amp(case)
    b, sq, sk, hq, hkv, d, dv = case.b, case.sq, case.sk, case.hq, case.hkv, case.d, case.dv
    q = _rand(g, (b, sq, hq, d), dt, device, amp)
    k = _rand(g, (b, sk, hkv, d), dt, device, amp)
    v = _rand(g, (b, sk, hkv, dv), dt, device)
    do = _rand(g, (b, sq, hq, dv), dt, device)
    dlse = torch.randn(b, hq, sq, generator=g).to(device) if case.dlse else None
    slopes = _slopes(case, b, g, device)
    q, k, v, do = (lay_out(t, case.layout) for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_(case.grads) for t in (q, k, v)]
    rng_seed = case.data_seed % (2 ** 31)
    second = None
    with rec.capture() as hits:
        if case.dropout_p:
            torch.manual_seed(rng_seed)
        r = api.attention(*leaves, **_api_kw(case, slopes, backend), dropout_p=case.dropout_p,
                                deterministic=case.deterministic)
        out, lse = r if case.return_lse else (r, None)
        if case.grads:
            outs, gos = ([out, lse], [do, dlse]) if case.dlse else ([out], [do])
            got = _grads(outs, leaves, gos, retain=case.deterministic)
            if case.deterministic:
                second = _grads(outs, leaves, gos)
    keep = None
    if case.dropout_p:
        torch.manual_seed(rng_seed)
        keep = _mask_fn(hits.served)(draw_rng_state(q.device), case.dropout_p, b, hq, sq, sk)

    def math_path(cd):
        ls = [t.detach().to(cd).requires_grad_(case.grads) for t in (q, k, v)]
        ref, ref_lse = materialized_attention(*ls, alibi=_bh(slopes, b), keep=keep, dropout_p=case.dropout_p,
                                              compute_dtype=cd, **_math_kw(case))
        return ref, ref_lse, ls

    ref, ref_lse, ref_leaves = math_path(torch.float64)
    low, low_lse, low_leaves = math_path(dt)
    extras = flash_extras(ref, ref_lse, ref_leaves, do, dt, eff_scale(case), case.dropout_p)
    _check_forward(o, case, out, lse, ref, ref_lse, low, low_lse, dt, (b, sq, hq, dv), (b, hq, sq), extras)
    if case.grads:
        _check_backward(o, case, got, second, ref, ref_lse, ref_leaves, low, low_lse, low_leaves, do, dlse, dt)
    return hits


def _varlen(case: FuzzCase, device, backend, rec, o: Outcome):
    dt, g = DTYPES[case.dtype], _gen(case)
    amp = _amp(case)
    lq, lk = [s[0] for s in case.seqs], [s[1] for s in case.seqs]
    nb, hq, hkv, d, dv = len(case.seqs), case.hq, case.hkv, case.d, case.dv
    cq = torch.tensor([0] + [sum(lq[: i + 1]) for i in range(nb)], dtype=torch.int32, device=device)
    ck = torch.tensor([0] + [sum(lk[: i + 1]) for i in range(nb)], dtype=torch.int32, device=device)
    nq, nk = sum(lq), sum(lk)
    tq, tk = nq + case.tail, nk + case.tail
    q = _rand(g, (tq, hq, d), dt, device, amp)
    k = _rand(g, (tk, hkv, d), dt, device, amp)
    v = _rand(g, (tk, hkv, dv), dt, device)
    do = _rand(g, (tq, hq, dv), dt, device)
    dlse = torch.randn(hq, tq, generator=g).to(device) if case.dlse else None
    slopes = _slopes(case, nb, g, device)
    for t, n in ((q, nq), (k, nk), (v, nk)):
        t[n:] = NAN                               # never read: past cu_seqlens[-1]
    q, k, v, do = (lay_out(t, case.layout) for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_(case.grads) for t in (q, k, v)]
    mq, mk = max(lq) + case.max_extra, max(lk) + case.max_extra
    rng_seed = case.data_seed % (2 ** 31)
    second = None
    with rec.capture() as hits:
        if case.dropout_p:
            torch.manual_seed(rng_seed)
        r = api.attention_varlen(*leaves, cq, ck, mq, mk, **_api_kw(case, slopes, backend),
                                       dropout_p=case.dropout_p, deterministic=case.deterministic)
        out, lse = r if case.return_lse else (r, None)
        if case.grads:
            outs, gos = ([out, lse], [do, dlse]) if case.dlse else ([out], [do])
            got = _grads(outs, leaves, gos, retain=case.deterministic)
            if case.deterministic:
                second = _grads(outs, leaves, gos)
    keep = None
    if case.dropout_p:
        torch.manual_seed(rng_seed)
        keep = _mask_fn(hits.served)(draw_rng_state(q.device), case.dropout_p, nb, hq, max(lq),
                                     max(lk))
    al = _bh(slopes, nb)

    def math_path(cd):
        # the reference reads zeros where the backend reads NaN padding (those rows are excluded anyway)
        ls = [torch.nan_to_num(t.detach(), nan=0.0).to(cd).requires_grad_(case.grads) for t in (q, k, v)]
        qx, kx, vx = ls
        outs, lses = [], []
        for i in range(nb):
            q0, q1, k0, k1 = sum(lq[:i]), sum(lq[: i + 1]), sum(lk[:i]), sum(lk[: i + 1])
            o_, l_ = materialized_attention(
                qx[q0:q1][None], kx[k0:k1][None], vx[k0:k1][None], alibi=None if al is None else al[i:i + 1],
                keep=None if keep is None else keep[i:i + 1, :, : q1 - q0, : k1 - k0], dropout_p=case.dropout_p,
                compute_dtype=cd, **_math_kw(case))
            outs.append(o_[0])
            lses.append(l_[0])
        outs.append(qx.new_zeros(case.tail, hq, dv))
        lses.append(torch.full((hq, case.tail), float("-inf"), device=device))
        return torch.cat(outs, 0), torch.cat(lses, 1), ls

    ref, ref_lse, ref_leaves = math_path(torch.float64)
    low, low_lse, low_leaves = math_path(dt)
    extras = flash_extras(ref, ref_lse, ref_leaves, do, dt, eff_scale(case), case.dropout_p)
    _check_forward(o, case, out, lse, ref, ref_lse, low, low_lse, dt, (tq, hq, dv), (hq, tq), extras)
    if case.grads:
        _check_backward(o, case, got, second, ref, ref_lse, ref_leaves, low, low_lse, low_leaves, do, dlse, dt)
    return hits


def _kvcache(case: FuzzCase, device, backend, rec, o: Outcome):
    dt, g = DTYPES[case.dtype], _gen(case)
    amp = _amp(case)
    b, sq, cap, hq, hkv, d, dv, new = case.b, case.sq, case.sk, case.hq, case.hkv, case.d, case.dv, case.new
    q = _rand(g, (b, sq, hq, d), dt, device, amp)
    kn = _rand(g, (b, new, hkv, d), dt, device, amp) if new else None
    vn = _rand(g, (b, new, hkv, dv), dt, device) if new else None
    k_all = _rand(g, (b, cap, hkv, d), dt, device, amp)
    v_all = _rand(g, (b, cap, hkv, dv), dt, device)
    slopes = _slopes(case, b, g, device)
    lens = list(case.seqs) if not case.whole_cache else [cap] * b
    pos = torch.arange(cap, device=device)[None, :]
    valid = pos < torch.tensor(lens, device=device)[:, None]                         # [B, cap] before the append
    k_dense = torch.where(valid[..., None, None], k_all, torch.full_like(k_all, NAN))
    v_dense = torch.where(valid[..., None, None], v_all, torch.full_like(v_all, NAN))
    # Expected cache after the append, and the keys each entry sees (the first lens[b] + new positions).
    k_exp, v_exp = k_dense.clone(), v_dense.clone()
    for i in range(b):
        if new:
            k_exp[i, lens[i]:lens[i] + new] = kn[i]
            v_exp[i, lens[i]:lens[i] + new] = vn[i]
    block_table = None
    if case.page:
        nblk = cap // case.page
        pool = b * nblk + case.spare_blocks
        perm = torch.randperm(pool, generator=g)[: b * nblk]
        block_table = perm.view(b, nblk).to(torch.int32).to(device)
        kc = torch.full((pool, case.page, hkv, d), NAN, dtype=dt, device=device)
        vc = torch.full((pool, case.page, hkv, dv), NAN, dtype=dt, device=device)
        idx = block_table.long().reshape(-1)
        kc[idx] = k_dense.reshape(b * nblk, case.page, hkv, d)
        vc[idx] = v_dense.reshape(b * nblk, case.page, hkv, dv)
    else:
        kc, vc = k_dense.clone(), v_dense.clone()
    qx = lay_out(q, case.layout)
    cache_layout = case.layout if case.layout.startswith("padded") else "contiguous"
    kc, vc = lay_out(kc, cache_layout), lay_out(vc, cache_layout)
    seqlens = None if case.whole_cache else torch.tensor(lens, dtype=torch.int32, device=device)
    with rec.capture() as hits, torch.no_grad():
        r = api.attention_with_kvcache(qx, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=block_table,
                                             **_api_kw(case, slopes, backend))
        out, lse = r if case.return_lse else (r, None)
    # The append: bit for bit where keys are valid now, NaN (untouched) past them.
    kb, vb = (kc, vc) if block_table is None else \
        (t[block_table.long().reshape(-1)].reshape(b, cap, *t.shape[2:]) for t in (kc, vc))
    now = pos < (torch.tensor(lens, device=device) + new)[:, None]
    for name, got_c, exp_c in (("k_cache", kb, k_exp), ("v_cache", vb, v_exp)):
        ok = torch.equal(got_c[now], exp_c[now]) and bool(torch.isnan(got_c[~now]).all())
        if not ok:
            o.problem(f"{name} after the append differs from the expected cache")
    o.quantities["append"] = (0.0, 0.0)
    seen = torch.tensor([n + new for n in lens], device=device)

    kx, vx = torch.nan_to_num(k_exp, nan=0.0), torch.nan_to_num(v_exp, nan=0.0)

    def math_path(cd):
        return materialized_attention(q.to(cd), kx.to(cd), vx.to(cd), alibi=_bh(slopes, b), seqlens_k=seen,
                                      compute_dtype=cd, **_math_kw(case))

    ref, ref_lse = math_path(torch.float64)
    low, low_lse = math_path(dt)
    extras = flash_extras(ref, ref_lse, (q, kx, vx), None, dt, eff_scale(case))
    _check_forward(o, case, out, lse, ref, ref_lse, low, low_lse, dt, (b, sq, hq, dv), (b, hq, sq), extras)
    return hits


def _merge(case: FuzzCase, device, backend, rec, o: Outcome):
    dt, g = DTYPES[case.dtype], _gen(case)
    amp = _amp(case)
    b, sq, sk, hq, hkv, d, dv = case.b, case.sq, case.sk, case.hq, case.hkv, case.d, case.dv
    q = _rand(g, (b, sq, hq, d), dt, device, amp)
    k = _rand(g, (b, sk, hkv, d), dt, device, amp)
    v = _rand(g, (b, sk, hkv, dv), dt, device)
    order = torch.randperm(sk, generator=g).to(device) if case.split == "subsets" else None
    outs, lses = [], []
    with rec.capture() as hits, torch.no_grad():
        start = 0
        for size in case.parts:
            if size == 0:     # no keys: garbage output, lse -inf; the merge must ignore it
                outs.append(torch.full((b, sq, hq, dv), NAN, dtype=dt, device=device))
                lses.append(torch.full((b, hq, sq), float("-inf"), device=device))
                continue
            end = start + size
            if order is None:
                kp, vp = k[:, start:end], v[:, start:end]
                # keys [start, end) of a causal whole: row i sees j iff j <= i + Sk - Sq, i.e. a window whose
                # right bound is Sk - end in the part's own bottom-right alignment
                window = (-1, sk - end) if case.causal else (-1, -1)
            else:
                kp, vp = k[:, order[start:end]], v[:, order[start:end]]
                window = (-1, -1)
            start = end
            o_p, l_p = flashport.attention(q, kp, vp, softmax_scale=case.scale, window_size=window,
                                           softcap=case.softcap, return_lse=True, backend=backend)
            empty = torch.isneginf(l_p).transpose(1, 2)[..., None]       # rows this part gives nothing
            outs.append(torch.where(empty, torch.full_like(o_p, NAN), o_p))
            lses.append(l_p)
        out, lse = flashport.merge_attention_states(outs, lses)

    def math_path(cd):
        return materialized_attention(q.to(cd), k.to(cd), v.to(cd), compute_dtype=cd, **_math_kw(case))

    ref, ref_lse = math_path(torch.float64)
    low, low_lse = math_path(dt)
    extras = flash_extras(ref, ref_lse, (q, k, v), None, dt, eff_scale(case))
    _check_forward(o, case, out, lse, ref, ref_lse, low, low_lse, dt, (b, sq, hq, dv), (b, hq, sq), extras)
    return hits


_RUN = {"attention": _dense, "varlen": _varlen, "kvcache": _kvcache, "merge": _merge}


def _fatal(e: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (the worker must be replaced)."""
    text = str(e)
    return any(s in text for s in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                   "CUDA error: an illegal", "misaligned address"))


def run_case(case: FuzzCase, device, backend: Optional[str], rec) -> dict:
    """Run and check one case -> a JSON-able result: status PASS | FAIL | SKIP | BADREF, quantities
    {name: [err, bound]}, worst, variants (labels the recorder saw), seconds, note; fatal: True when the
    CUDA context died."""
    t0 = time.perf_counter()
    o = Outcome()
    res = {"index": case.index, "seed": case.seed, "entry": case.entry, "dtype": case.dtype,
           "regime": case.regime, "case": case.to_dict()}
    hits = None
    try:
        hits = _RUN[case.entry](case, device, backend, rec, o)
        status, note = o.status(), "; ".join(o.problems)
    except flashport.UnsupportedError as e:
        status, note = "SKIP", str(e).replace("\n", " ")[:300]
    except Exception as e:  # noqa: BLE001 - a call the backend accepted must be served
        status, note = "FAIL", f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
        res["fatal"] = _fatal(e)
    if hits is None:
        hits = rec.last
    if status == "BADREF":
        note = "same-dtype math path not finite for " + ", ".join(o.badref)
    worst = o.worst()
    res.update(status=status, note=note, seconds=round(time.perf_counter() - t0, 4),
               quantities={n: [e, b] for n, (e, b) in o.quantities.items()},
               extra={n: x for n, x in o.extra.items() if x},
               worst=None if worst is None else {"name": worst[0], "err": worst[1], "bound": worst[2]},
               variants=sorted(hits.labels) if hits is not None else [],
               served=hits.served if hits is not None else None)
    return res
