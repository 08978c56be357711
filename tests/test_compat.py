"""flashport.compat: FlashAttention-2's API (flash-attn 2.8.x, flash_attn/flash_attn_interface.py).

Signatures are checked against FA2's written out here; outputs, lse and gradients against flashport's
native entry points (the same numbers: the compat layer only maps arguments) and against a plain PyTorch
float64 reference under the tolerance rule; FA2's reading of its arguments (causal overrides the right
window bound, bounds < 0 or >= Sk are unbounded, softcap <= 0 is off), its return conventions, the
KV-cache extras (rotary against a plain PyTorch rotary, cache_batch_idx, num_splits) and the refusals."""
import inspect
import math

import pytest
import torch

import flashport
from flashport import compat
from flashport.check import assert_within_rule, magnitude
from flashport.compat import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                              flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                              flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

I32 = torch.int32
NAN = float("nan")
_ = inspect.Parameter.empty

# ----------------------------------------------------------------------------- FA2's signatures (v2.8.3)
_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
         ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FA2 = {
    "flash_attn_func": [("q", _), ("k", _), ("v", _)] + _TAIL,
    "flash_attn_qkvpacked_func": [("qkv", _)] + _TAIL,
    "flash_attn_kvpacked_func": [("q", _), ("kv", _)] + _TAIL,
    "flash_attn_varlen_func": [("q", _), ("k", _), ("v", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _),
                               ("max_seqlen_q", _), ("max_seqlen_k", _)] + _TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _), ("cu_seqlens", _), ("max_seqlen", _)] + _TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", _), ("kv", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _),
                                        ("max_seqlen_q", _), ("max_seqlen_k", _)] + _TAIL,
    "flash_attn_with_kvcache": [
        ("q", _), ("k_cache", _), ("v_cache", _), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", sorted(FA2))
def test_signature_is_fa2s(name):
    params = list(inspect.signature(getattr(compat, name)).parameters.values())
    got = [(p.name, p.default, type(p.default)) for p in params]
    assert got == [(n, d, type(d)) for n, d in FA2[name]]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert name in compat.__all__


# ----------------------------------------------------------------------------- plain PyTorch reference
def plain_attention(q, k, v, *, dtype, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """Materialised attention with every operation in `dtype`: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D|Dv]
    -> (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]).  FA2's rule: bottom-right alignment, window bounds < 0 are
    unbounded, causal means right = 0, ALiBi -slope * |i + Sk - Sq - j|.  A row with no key: 0, lse -inf."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(hq // hkv, 2), vf.repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    diag = i + sk - sq
    if slopes is not None:
        sl = slopes.expand(b, hq) if slopes.dim() == 1 else slopes
        s = s - sl.to(dtype)[:, :, None, None] * (diag - j).abs().to(dtype)
    left, right = window
    right = 0 if causal else right
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    filled = s.masked_fill(~vis, -1e300 if dtype == torch.float64 else max(-1e30, torch.finfo(dtype).min))
    m = filled.amax(-1, keepdim=True).detach() if sk else s.new_zeros(b, hq, sq, 1)
    e = torch.exp(filled - m) * vis
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))),
                      torch.full_like(l, -math.inf)).squeeze(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype), lse


def rnd(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def check_rule(name, got, grads, inputs, do, **kw):
    """out (and, with grads, dq/dk/dv of inputs) against float64 under the rule, the math path in inputs' dtype."""
    dtype = inputs[0].dtype
    r64, l64 = leaves(*(t.double() for t in inputs)), leaves(*inputs)
    ref, _ = plain_attention(*r64, dtype=torch.float64, **kw)
    low, _ = plain_attention(*l64, dtype=dtype, **kw)
    assert_within_rule(f"{name} out", got, ref, low, dtype, 2)
    if grads is None:
        return
    ref_g = torch.autograd.grad(ref, r64, do.double())
    low_g = torch.autograd.grad(low, l64, do)
    mag = magnitude(*inputs, do)
    for n, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        assert_within_rule(f"{name} {n}", g, r, lo, dtype, 3, mag)


B, SQ, SK, HQ, HKV, D = 2, 5, 7, 4, 2, 16

DENSE_CASES = [
    dict(),
    dict(causal=True),
    dict(window_size=(2, 1)),
    dict(softcap=3.0, softmax_scale=0.4),
    dict(alibi="head", causal=True),
    dict(alibi="batch_head"),
    dict(dtype=torch.bfloat16, causal=True, window_size=(3, 3)),
    dict(dtype=torch.float16, softcap=4.0),
]


def _slopes(kind, b=B, h=HQ):
    if kind is None:
        return None
    shape = (h,) if kind == "head" else (b, h)
    return torch.rand(*shape, generator=torch.Generator().manual_seed(7)) * 0.5 + 0.1


def _ref_kw(kw, slopes):
    return dict(scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0), slopes=slopes)


# ----------------------------------------------------------------------------- dense
@pytest.mark.parametrize("kw", DENSE_CASES, ids=str)
def test_flash_attn_func_matches_native_and_reference(kw):
    kw = dict(kw)
    slopes = _slopes(kw.pop("alibi", None))
    dt = kw.pop("dtype", torch.float32)
    q, k, v, do = (rnd(*shape, seed=s, dtype=dt) for s, shape in
                   enumerate(((B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D), (B, SQ, HQ, D)), 1))
    a = leaves(q, k, v)
    out = flash_attn_func(*a, alibi_slopes=slopes, **kw)
    grads = torch.autograd.grad(out, a, do)
    if kw.get("causal"):   # FA2 reads causal=True with a right bound as right = 0 (native flashport raises)
        kw["window_size"] = (kw.get("window_size", (-1, -1))[0], 0)
    n = leaves(q, k, v)
    native = flashport.attention(*n, alibi_slopes=slopes, **kw)
    assert torch.equal(out, native)
    for g, h in zip(grads, torch.autograd.grad(native, n, do)):
        assert torch.equal(g, h)
    assert out.dtype == dt
    check_rule(f"flash_attn_func {kw}", out, grads, (q, k, v), do, **_ref_kw(kw, slopes))


def test_return_attn_probs_convention():
    q, k, v = rnd(B, SQ, HQ, D, seed=1), rnd(B, SK, HKV, D, seed=2), rnd(B, SK, HKV, D, seed=3)
    plain = flash_attn_func(q, k, v)
    assert isinstance(plain, torch.Tensor)
    res = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(res[0], out) and torch.equal(res[1], lse)
    assert res[1].shape == (B, HQ, SQ) and res[1].dtype == torch.float32
    _, ref_lse = plain_attention(q, k, v, dtype=torch.float64, causal=True)
    torch.testing.assert_close(res[1].double(), ref_lse, atol=1e-5, rtol=1e-5)
    for fn, args in ((flash_attn_qkvpacked_func, (torch.stack((q, q, q), 2),)),
                     (flash_attn_kvpacked_func, (q, torch.stack((k, v), 2)))):
        assert isinstance(fn(*args), torch.Tensor)
        r = fn(*args, return_attn_probs=True)
        assert len(r) == 3 and r[2] is None and r[1].shape == (B, HQ, SQ) and r[1].dtype == torch.float32


def test_rows_without_keys_have_lse_minus_inf():
    # causal with Sq > Sk: the first Sq - Sk rows see no key (FA2 writes +inf there; flashport -inf, documented)
    q, k, v = rnd(1, 6, 2, D, seed=1), rnd(1, 2, 2, D, seed=2), rnd(1, 2, 2, D, seed=3)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_qkvpacked_is_unbound_views_with_packed_gradient(monkeypatch):
    q, k, v, do = (rnd(B, SQ, HQ, D, seed=s) for s in (1, 2, 3, 4))
    qkv = torch.stack((q, k, v), 2).requires_grad_()
    seen = []
    real = compat.attention

    def spy(q_, k_, v_, **kw):
        seen.append([t.data_ptr() for t in (q_, k_, v_)])
        return real(q_, k_, v_, **kw)
    monkeypatch.setattr(compat, "attention", spy)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    assert seen == [[qkv[:, :, i].data_ptr() for i in range(3)]]     # views into qkv: no copy
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    assert dqkv.shape == qkv.shape
    n = leaves(q, k, v)
    native = flashport.attention(*n, causal=True)
    assert torch.equal(out, native)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(native, n, do), 2))
    check_rule("qkvpacked", out, dqkv.unbind(2), (q, k, v), do, causal=True)


def test_kvpacked_gqa_views_with_packed_gradient(monkeypatch):
    q, k, v, do = rnd(B, SQ, HQ, D, seed=1), rnd(B, SK, HKV, D, seed=2), rnd(B, SK, HKV, D, seed=3), \
        rnd(B, SQ, HQ, D, seed=4)
    qa = q.clone().requires_grad_()
    kv = torch.stack((k, v), 2).requires_grad_()
    seen = []
    real = compat.attention

    def spy(q_, k_, v_, **kw):
        seen.append([t.data_ptr() for t in (k_, v_)])
        return real(q_, k_, v_, **kw)
    monkeypatch.setattr(compat, "attention", spy)
    out = flash_attn_kvpacked_func(qa, kv, window_size=(3, 0), softcap=2.0)
    assert seen == [[kv[:, :, 0].data_ptr(), kv[:, :, 1].data_ptr()]]
    dq, dkv = torch.autograd.grad(out, (qa, kv), do)
    assert dkv.shape == kv.shape
    check_rule("kvpacked", out, (dq, *dkv.unbind(2)), (q, k, v), do, window=(3, 0), softcap=2.0)


def test_every_argument_reaches_the_native_call(monkeypatch):
    calls = []
    monkeypatch.setattr(compat, "attention", lambda *a, **kw: calls.append(kw) or (a[0], None))
    monkeypatch.setattr(compat, "attention_varlen", lambda *a, **kw: calls.append(kw) or (a[0], None))
    q, k = rnd(B, SQ, HQ, D), rnd(B, SK, HKV, D)
    slopes = _slopes("head")
    flash_attn_func(q, k, k, 0.25, 0.5, False, (2, 3), 1.5, slopes, True, True)
    expect = dict(causal=False, softmax_scale=0.5, window_size=(2, 3), softcap=1.5, alibi_slopes=slopes,
                  dropout_p=0.25, deterministic=True, return_lse=True)
    assert calls[-1] == expect
    cu = torch.tensor([0, 2, 5], dtype=I32)
    flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 3, 3, 0.25, 0.5, True, (1, -1), 1.5, slopes, True, True)
    assert calls[-1] == dict(expect, causal=True, window_size=(1, 0))


def test_dropout_is_flashports_seeded_mask():
    q, k, v = rnd(B, SQ, HQ, D, seed=1), rnd(B, SK, HKV, D, seed=2), rnd(B, SK, HKV, D, seed=3)
    torch.manual_seed(11)
    out = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(11)
    native = flashport.attention(q, k, v, dropout_p=0.3, causal=True)
    assert torch.equal(out, native)
    assert not torch.allclose(out, flash_attn_func(q, k, v, causal=True))


# FA2's reading of window_size / causal / softcap (flash_api.cpp), where native flashport is stricter.
def test_causal_overrides_the_right_window_bound():
    q, k, v = rnd(B, SQ, HQ, D, seed=1), rnd(B, SK, HKV, D, seed=2), rnd(B, SK, HKV, D, seed=3)
    with pytest.raises(ValueError, match="causal"):
        flashport.attention(q, k, v, causal=True, window_size=(2, 2))
    out = flash_attn_func(q, k, v, causal=True, window_size=(2, 2))
    assert torch.equal(out, flashport.attention(q, k, v, causal=True, window_size=(2, 0)))
    check_rule("causal+window", out, None, (q, k, v), None, causal=True, window=(2, 0))


def test_window_bounds_below_zero_or_past_sk_are_unbounded():
    q, k, v = rnd(1, 9, 2, D, seed=1), rnd(1, 3, 2, D, seed=2), rnd(1, 3, 2, D, seed=3)
    full = flashport.attention(q, k, v)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-5, -2)), full)
    # right = 3 >= Sk = 3: FA2 drops the bound; flashport's own rule would hide keys from the first rows
    out = flash_attn_func(q, k, v, window_size=(-1, 3))
    assert torch.equal(out, full)
    assert not torch.equal(flashport.attention(q, k, v, window_size=(-1, 3)), full)


def test_non_positive_softcap_is_off():
    q, k, v = rnd(B, SQ, HQ, D, seed=1), rnd(B, SK, HKV, D, seed=2), rnd(B, SK, HKV, D, seed=3)
    assert torch.equal(flash_attn_func(q, k, v, softcap=-1.0), flashport.attention(q, k, v))


# ----------------------------------------------------------------------------- varlen
LENS_Q, LENS_K, TAIL = [3, 0, 4], [4, 2, 5], 2


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)


def _packed(lens_q, lens_k, hq=HQ, hkv=HKV):
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = rnd(tq + TAIL, hq, D, seed=1), rnd(tk + TAIL, hkv, D, seed=2), rnd(tk + TAIL, hkv, D, seed=3)
    k[tk:], v[tk:] = NAN, NAN       # past cu_seqlens_k[-1]: never read
    return q, k, v, rnd(tq + TAIL, hq, D, seed=4)


def _per_sequence(q, k, v, lens_q, lens_k, dtype, **kw):
    outs, lses = [], []
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for b in range(len(lens_q)):
        o, l = plain_attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                               dtype=dtype, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, -1)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(1, 2), softcap=2.0)], ids=str)
def test_varlen_matches_native_and_reference(kw):
    q, k, v, do = _packed(LENS_Q, LENS_K)
    cq, ck, tq = _cu(LENS_Q), _cu(LENS_K), sum(LENS_Q)
    a = leaves(q, k, v)
    out, lse, probs = flash_attn_varlen_func(*a, cq, ck, max(LENS_Q), max(LENS_K), return_attn_probs=True, **kw)
    assert probs is None and lse.shape == (HQ, q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(out[tq:], torch.zeros_like(out[tq:]))        # rows past cu_seqlens_q[-1]
    n = leaves(q, k, v)
    native, native_lse = flashport.attention_varlen(*n, cq, ck, max(LENS_Q), max(LENS_K), return_lse=True, **kw)
    assert torch.equal(out, native) and torch.equal(lse, native_lse)
    do = do.clone()
    do[tq:] = 0
    grads = torch.autograd.grad(out, a, do)
    for g, h in zip(grads, torch.autograd.grad(native, n, do)):
        assert torch.equal(g, h)
    rkw = _ref_kw(kw, None)
    tk = sum(LENS_K)
    r64 = leaves(q[:tq].double(), k[:tk].double(), v[:tk].double())
    l32 = leaves(q[:tq], k[:tk], v[:tk])
    ref, ref_lse = _per_sequence(*r64, LENS_Q, LENS_K, torch.float64, **rkw)
    low, _ = _per_sequence(*l32, LENS_Q, LENS_K, torch.float32, **rkw)
    assert_within_rule("varlen out", out[:tq], ref, low, torch.float32, 2)
    torch.testing.assert_close(lse[:, :tq].double(), ref_lse, atol=1e-5, rtol=1e-5)
    ref_g = torch.autograd.grad(ref, r64, do[:tq].double())
    low_g = torch.autograd.grad(low, l32, do[:tq])
    mag = magnitude(q[:tq], k[:tk], v[:tk], do)
    for name, g, r, lo, n_ in zip(("dq", "dk", "dv"), grads, ref_g, low_g, (tq, tk, tk)):
        assert_within_rule(f"varlen {name}", g[:n_], r, lo, torch.float32, 3, mag)


def test_varlen_packed_variants_match_varlen_func():
    lens = [3, 1, 4]
    cu, t = _cu(lens), sum(lens)
    q, k, v, do = (rnd(t, HQ, D, seed=s) for s in (1, 2, 3, 4))
    qkv = torch.stack((q, k, v), 1).requires_grad_()
    out, lse, probs = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (HQ, t)
    n = leaves(q, k, v)
    ref, ref_lse, _ = flash_attn_varlen_func(*n, cu, cu, max(lens), max(lens), causal=True, return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(ref, n, do), 1))

    kq = rnd(t, HQ, D, seed=5)
    kvk, kvv = rnd(t, HKV, D, seed=6), rnd(t, HKV, D, seed=7)
    kv = torch.stack((kvk, kvv), 1)
    out = flash_attn_varlen_kvpacked_func(kq, kv, cu, cu, max(lens), max(lens), window_size=(1, 1))
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, flash_attn_varlen_func(kq, kvk, kvv, cu, cu, max(lens), max(lens), window_size=(1, 1)))


# ----------------------------------------------------------------------------- KV cache
CAP, SNEW = 12, 2


def _cache(b=B, rows=None, seed=5):
    """Dense caches with random prefixes; every other slot NaN, so that reading past a length shows."""
    rows = b if rows is None else rows
    kc, vc = rnd(rows, CAP, HKV, D, seed=seed), rnd(rows, CAP, HKV, D, seed=seed + 1)
    return kc, vc


def _poison(kc, vc, lens, rows=None):
    for r, n in zip(range(kc.shape[0]) if rows is None else rows, lens):
        kc[r, n:], vc[r, n:] = NAN, NAN


def _expected(q, kc, vc, lens, dtype=torch.float64, **kw):
    """Plain attention per batch row over its first lens[b] cache positions."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, l = plain_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], dtype=dtype, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 0), softcap=2.0),
                                dict(alibi="head", causal=True)], ids=str)
def test_with_kvcache_appends_in_place_and_attends(kw):
    kw = dict(kw)
    slopes = _slopes(kw.pop("alibi", None))
    lens = torch.tensor([3, 6], dtype=I32)
    kc, vc = _cache()
    _poison(kc, vc, lens.tolist())
    q, kn, vn = rnd(B, SNEW, HQ, D, seed=1), rnd(B, SNEW, HKV, D, seed=2), rnd(B, SNEW, HKV, D, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, alibi_slopes=slopes,
                                       return_softmax_lse=True, **kw)
    assert out.shape == (B, SNEW, HQ, D) and lse.shape == (B, HQ, SNEW) and lse.dtype == torch.float32
    for b, n in enumerate(lens.tolist()):   # appended in place at cache_seqlens
        assert torch.equal(kc[b, n:n + SNEW], kn[b]) and torch.equal(vc[b, n:n + SNEW], vn[b])
    native, native_lse = flashport.attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens,
                                                          alibi_slopes=slopes, return_lse=True, **kw)
    assert torch.equal(out, native) and torch.equal(lse, native_lse)
    after = (lens + SNEW).tolist()
    rkw = _ref_kw(kw, slopes)
    ref, ref_lse = _expected(q.double(), kc.double(), vc.double(), after, **rkw)
    low, _ = _expected(q, kc, vc, after, dtype=torch.float32, **rkw)
    assert_within_rule(f"kvcache {kw}", out, ref, low, torch.float32, 2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert isinstance(flash_attn_with_kvcache(q, kc2, vc2, cache_seqlens=lens, **kw), torch.Tensor)


def test_with_kvcache_int_seqlens_bigger_cache_and_num_splits():
    kc, vc = _cache(rows=B + 2)                       # FA2 uses rows 0..B-1 of a bigger cache
    kc[B:], vc[B:] = NAN, NAN
    q, kn, vn = rnd(B, 1, HQ, D, seed=1), rnd(B, 1, HKV, D, seed=2), rnd(B, 1, HKV, D, seed=3)
    ref_kc, ref_vc = kc[:B].clone(), vc[:B].clone()
    expected = flashport.attention_with_kvcache(q, ref_kc, ref_vc, kn, vn, cache_seqlens=4, causal=True)
    for splits in (0, 1, 3):                          # a performance hint: ignored
        kc_s, vc_s = kc.clone(), vc.clone()
        out = flash_attn_with_kvcache(q, kc_s, vc_s, kn, vn, cache_seqlens=4, causal=True, num_splits=splits)
        assert torch.equal(out, expected)
        assert torch.equal(kc_s[:B], ref_kc) and torch.equal(vc_s[:B], ref_vc)
        assert kc_s[B:].isnan().all() and vc_s[B:].isnan().all()


def test_with_kvcache_paged_block_table_passes_through():
    page, nblk = 4, 3
    kc, vc = rnd(8, page, HKV, D, seed=5), rnd(8, page, HKV, D, seed=6)
    table = torch.tensor([[5, 0, 2], [7, 3, 1]], dtype=I32)
    lens = torch.tensor([5, 9], dtype=I32)
    q, kn, vn = rnd(B, SNEW, HQ, D, seed=1), rnd(B, SNEW, HKV, D, seed=2), rnd(B, SNEW, HKV, D, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=True)
    assert torch.equal(out, flashport.attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens,
                                                             block_table=table, causal=True))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    dk = kc[table.long()].reshape(B, nblk * page, HKV, D)
    dv = vc[table.long()].reshape(B, nblk * page, HKV, D)
    after = (lens + SNEW).tolist()
    ref, _ = _expected(q.double(), dk.double(), dv.double(), after, causal=True)
    low, _ = _expected(q, dk, dv, after, dtype=torch.float32, causal=True)
    assert_within_rule("paged", out, ref, low, torch.float32, 2)


def test_with_kvcache_cache_batch_idx_reads_and_writes_the_indexed_rows():
    rows, idx = 4, torch.tensor([3, 1], dtype=I32)
    lens = torch.tensor([2, 5], dtype=I32)
    kc, vc = _cache(rows=rows)
    _poison(kc, vc, lens.tolist(), rows=idx.tolist())
    kc[[0, 2]], vc[[0, 2]] = NAN, NAN                 # rows nobody indexes
    q, kn, vn = rnd(B, SNEW, HQ, D, seed=1), rnd(B, SNEW, HKV, D, seed=2), rnd(B, SNEW, HKV, D, seed=3)
    gk, gv = kc[idx.long()].clone(), vc[idx.long()].clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, causal=True,
                                       return_softmax_lse=True)
    native, native_lse = flashport.attention_with_kvcache(q, gk, gv, kn, vn, cache_seqlens=lens, causal=True,
                                                          return_lse=True)
    assert torch.equal(out, native) and torch.equal(lse, native_lse)
    same = dict(rtol=0, atol=0, equal_nan=True)       # written in place, into the indexed rows
    torch.testing.assert_close(kc[idx.long()], gk, **same)
    torch.testing.assert_close(vc[idx.long()], gv, **same)
    assert kc[[0, 2]].isnan().all() and vc[[0, 2]].isnan().all()
    after = (lens + SNEW).tolist()
    ref, _ = _expected(q.double(), gk.double(), gv.double(), after, causal=True)
    low, _ = _expected(q, gk, gv, after, dtype=torch.float32, causal=True)
    assert_within_rule("cache_batch_idx", out, ref, low, torch.float32, 2)


def test_with_kvcache_has_no_backward_like_fa2():
    kc, vc = _cache()
    q = rnd(B, 1, HQ, D, seed=1).requires_grad_()
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)
    assert not out.requires_grad
    assert torch.equal(out, flashport.attention_with_kvcache(q.detach(), kc, vc, cache_seqlens=3))


# rotary: a plain PyTorch rotary, written independently of flashport.compat's
def _angles(seqlen_ro, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return torch.outer(torch.arange(seqlen_ro, dtype=torch.float64), inv_freq)   # [seqlen_ro, rotary_dim / 2]


def plain_rotary(x, theta, interleaved):
    """x [B, S, H, D] (float64), theta [B, S, rotary_dim / 2] angles of each token's position."""
    r = theta.shape[-1] * 2
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:   # GPT-J: pairs (2i, 2i + 1) as complex numbers
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], r // 2, 2).contiguous())
        z = z * torch.polar(torch.ones_like(theta), theta)[:, :, None, :]
        rot = torch.view_as_real(z).flatten(-2)
    else:             # GPT-NeoX: x * cos + rotate_half(x) * sin
        cos = torch.cat((theta.cos(), theta.cos()), -1)[:, :, None, :]
        sin = torch.cat((theta.sin(), theta.sin()), -1)[:, :, None, :]
        x1, x2 = rot[..., :r // 2], rot[..., r // 2:]
        rot = rot * cos + torch.cat((-x2, x1), -1) * sin
    return torch.cat((rot, rest), -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("mode", ["full", "causal", "local"])
def test_with_kvcache_rotary_matches_plain_rotary(interleaved, mode):
    rdim = 8                                          # < D: the last channels stay as they are
    kw = dict(causal=mode == "causal", window_size=(4, 1) if mode == "local" else (-1, -1))
    lens = torch.tensor([3, 6], dtype=I32)
    angles = _angles(CAP, rdim)
    cos, sin = angles.cos().float(), angles.sin().float()
    kc, vc = _cache()
    _poison(kc, vc, lens.tolist())
    q, kn, vn = rnd(B, SNEW, HQ, D, seed=1), rnd(B, SNEW, HKV, D, seed=2), rnd(B, SNEW, HKV, D, seed=3)
    kc_before = kc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                  rotary_interleaved=interleaved, **kw)
    pos_k = lens.long()[:, None] + torch.arange(SNEW)
    # FA2: queries at their own positions when causal or local, else all at cache_seqlens
    pos_q = pos_k if mode != "full" else lens.long()[:, None].expand(B, SNEW)
    k_rot = plain_rotary(kn.double(), angles[pos_k], interleaved)
    q_rot = plain_rotary(q.double(), angles[pos_q], interleaved)
    for b, n in enumerate(lens.tolist()):             # the cache holds the rotated keys
        torch.testing.assert_close(kc[b, n:n + SNEW].double(), k_rot[b], atol=1e-6, rtol=1e-6)
        assert torch.equal(kc[b, :n], kc_before[b, :n])
    kc64 = kc.double()
    for b, n in enumerate(lens.tolist()):
        kc64[b, n:n + SNEW] = k_rot[b]
    after = (lens + SNEW).tolist()
    rkw = _ref_kw(kw, None)
    ref, _ = _expected(q_rot, kc64, vc.double(), after, **rkw)
    low, _ = _expected(q_rot.float(), kc, vc, after, dtype=torch.float32, **rkw)
    assert_within_rule(f"rotary {mode} interleaved={interleaved}", out, ref, low, torch.float32, 2)
    unrotated = flashport.attention_with_kvcache(q, kc_before.clone(), vc.clone(), kn, vn, cache_seqlens=lens, **kw)
    assert not torch.allclose(out, unrotated)         # the rotary did something


# ----------------------------------------------------------------------------- refusals and bad input
def _kv_call(**over):
    kc, vc = _cache()
    args = dict(q=rnd(B, 1, HQ, D), k_cache=kc, v_cache=vc, k=rnd(B, 1, HKV, D), v=rnd(B, 1, HKV, D),
                cache_seqlens=torch.tensor([1, 2], dtype=I32))
    args.update(over)
    return flash_attn_with_kvcache(**args)


COS = torch.ones(CAP, 4)
REFUSED = [
    ("cache_leftpad", lambda: _kv_call(cache_leftpad=torch.zeros(B, dtype=I32)), ValueError, "cache_leftpad"),
    ("varlen-block_table", lambda: flash_attn_varlen_func(
        rnd(4, HQ, D), rnd(4, HKV, D), rnd(4, HKV, D), _cu([2, 2]), _cu([2, 2]), 2, 2,
        block_table=torch.zeros(2, 1, dtype=I32)), ValueError, "block_table"),
    ("rotary-cos-only", lambda: _kv_call(rotary_cos=COS), ValueError, "rotary_sin"),
    ("rotary-sin-only", lambda: _kv_call(rotary_sin=COS), ValueError, "rotary_cos"),
    ("rotary-without-new-k", lambda: _kv_call(k=None, v=None, rotary_cos=COS, rotary_sin=COS), ValueError,
     "rotary"),
    ("rotary-too-few-positions", lambda: _kv_call(rotary_cos=COS[:CAP - 1], rotary_sin=COS[:CAP - 1]),
     ValueError, "rotary_cos"),
    ("rotary-dim-past-head-dim", lambda: _kv_call(rotary_cos=torch.ones(CAP, D), rotary_sin=torch.ones(CAP, D)),
     ValueError, "rotary_dim"),
    ("rotary-shapes-differ", lambda: _kv_call(rotary_cos=COS, rotary_sin=torch.ones(CAP, 2)), ValueError,
     "rotary_sin"),
    ("rotary-int", lambda: _kv_call(rotary_cos=COS.int(), rotary_sin=COS.int()), TypeError, "rotary_cos"),
    ("batch-idx-with-table", lambda: _kv_call(cache_batch_idx=torch.tensor([0, 1], dtype=I32),
                                              block_table=torch.zeros(B, 1, dtype=I32)), ValueError,
     "cache_batch_idx"),
    ("batch-idx-int64", lambda: _kv_call(cache_batch_idx=torch.tensor([0, 1])), TypeError, "cache_batch_idx"),
    ("batch-idx-range", lambda: _kv_call(cache_batch_idx=torch.tensor([0, 2], dtype=I32)), ValueError,
     "cache_batch_idx"),
    ("batch-idx-shape", lambda: _kv_call(cache_batch_idx=torch.tensor([0], dtype=I32)), ValueError,
     "cache_batch_idx"),
    ("qkv-rank", lambda: flash_attn_qkvpacked_func(rnd(B, SQ, HQ, D)), ValueError, "qkv"),
    ("qkv-not-three", lambda: flash_attn_qkvpacked_func(rnd(B, SQ, 2, HQ, D)), ValueError, "qkv"),
    ("qkv-not-tensor", lambda: flash_attn_qkvpacked_func([1.0]), TypeError, "qkv"),
    ("kv-not-two", lambda: flash_attn_kvpacked_func(rnd(B, SQ, HQ, D), rnd(B, SK, 3, HKV, D)), ValueError, "kv"),
    ("varlen-qkv-rank", lambda: flash_attn_varlen_qkvpacked_func(rnd(B, 4, 3, HQ, D), _cu([4]), 4), ValueError,
     "qkv"),
    ("varlen-kv-rank", lambda: flash_attn_varlen_kvpacked_func(rnd(4, HQ, D), rnd(4, HKV, D), _cu([4]), _cu([4]),
                                                               4, 4), ValueError, "kv"),
    # malformed input reaches flashport's own checks, which name the argument
    ("q-int", lambda: flash_attn_func(torch.ones(B, SQ, HQ, D, dtype=I32), rnd(B, SK, HKV, D), rnd(B, SK, HKV, D)),
     TypeError, "q"),
    ("window-not-pair", lambda: flash_attn_func(rnd(B, SQ, HQ, D), rnd(B, SK, HKV, D), rnd(B, SK, HKV, D),
                                                window_size=(3,)), ValueError, "window_size"),
    ("cache-too-small", lambda: _kv_call(cache_seqlens=torch.tensor([CAP, 0], dtype=I32)), ValueError, "cache"),
    ("cu-seqlens-int64", lambda: flash_attn_varlen_func(rnd(4, HQ, D), rnd(4, HKV, D), rnd(4, HKV, D),
                                                        torch.tensor([0, 4]), _cu([4]), 4, 4), TypeError,
     "cu_seqlens_q"),
]


@pytest.mark.parametrize("call, exc, word", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_and_malformed_arguments_are_named(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


def test_refused_kvcache_call_writes_nothing():
    kc, vc = _cache()
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(rnd(B, 1, HQ, D), kc, vc, rnd(B, 1, HKV, D), rnd(B, 1, HKV, D), cache_seqlens=1,
                                cache_leftpad=torch.zeros(B, dtype=I32))
    with pytest.raises(ValueError, match="rotary"):
        flash_attn_with_kvcache(rnd(B, 1, HQ, D), kc, vc, rnd(B, 1, HKV, D), rnd(B, 1, HKV, D), cache_seqlens=1,
                                rotary_cos=COS[:3], rotary_sin=COS[:3])
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
