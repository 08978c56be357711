"""A user's own mask_mod read as the built-in band it is (flashport/mask_rules.py): the rules it reads hold at every
position (against the mask evaluated densely, and for random masks of the accepted grammar), what it cannot prove
stays a mask_mod, and backend=None runs a recognised lambda as the built-in call, exactly."""
from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashport
from flashport import mask_rules, mods
from flashport.masks import Visibility

try:   # FlexAttention's combinators start from b.new_ones(()) / b.new_zeros(())
    from torch.nn.attention.flex_attention import and_masks as flex_and_masks, or_masks as flex_or_masks
except ImportError:   # torch without FlexAttention: mods' own combinators stand in
    flex_and_masks, flex_or_masks = mods.and_masks, mods.or_masks

N = 72   # positions evaluated densely: past every breakpoint below


def _dense(mask_mod, n=N):
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    return mask_mod(torch.zeros(()), torch.zeros(()), i, j).expand(n, n)


def _band_mask(rule, n=N):
    """The built-in rule's own visibility (Sq = Sk: top-left and bottom-right positions agree)."""
    _, left, right = rule
    return Visibility(n, n, left, right).sees(torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)).expand(n, n)


W = 30
BANDS = [
    (lambda b, h, q, kv: q >= kv, ("band", -1, 0)),
    (lambda b, h, q, kv: kv <= q, ("band", -1, 0)),
    (lambda b, h, q, kv: ~(kv > q), ("band", -1, 0)),
    (lambda b, h, q, kv: (q >= kv) & (q - kv <= W), ("band", W, 0)),                    # FlexAttention's docs
    (lambda b, h, q, kv: torch.logical_and(q >= kv, q - kv < W), ("band", W - 1, 0)),
    (lambda b, h, q, kv: q >= kv - 5, ("band", -1, 5)),
    (lambda b, h, q, kv: (q - kv).abs() <= 3, ("band", 3, 3)),
    (lambda b, h, q, kv: 2 * q >= 2 * kv - 3, ("band", -1, 1)),
    (lambda b, h, q, kv: q <= kv, ("band", 0, -1)),
    (lambda b, h, q, kv: (q - kv <= 4) & (kv - q <= 2), ("band", 4, 2)),
    (mods.and_masks(mods.causal, lambda b, h, q, kv: q - kv <= 9), ("band", 9, 0)),
    (flex_and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: q - kv <= 9), ("band", 9, 0)),
    (flex_or_masks(lambda b, h, q, kv: q == kv, lambda b, h, q, kv: (q - kv).abs() <= 2), ("band", 2, 2)),
]
NOT_BANDS = [
    lambda b, h, q, kv: q > kv,                                  # the diagonal hidden
    lambda b, h, q, kv: q >= 5,                                  # a position, not a difference
    lambda b, h, q, kv: (q >= kv) & (b == 0),                    # the batch index
    lambda b, h, q, kv: (q - kv).abs() % 3 == 0,                 # an op outside the grammar
    lambda b, h, q, kv: ((q - kv).abs() <= 2) | (q - kv == 10),  # two runs
    lambda b, h, q, kv: torch.where(q >= kv, True, False),
    lambda b, h, q, kv: (q >= kv) & (q < 1 << 22),               # past MAX_REACH
    lambda b, h, q, kv: q * (1 << 40) >= kv * (1 << 40),         # past MAX_SCALE (int64 math that may wrap)
    lambda b, h, q, kv: q + (1 << 62) >= kv + (1 << 62),
    mods.prefix_lm(10),
    mods.document(torch.tensor([0, 0, 1, 1])),                   # a captured tensor
]


@pytest.mark.parametrize("mask_mod,rule", BANDS)
def test_band_of_reads_the_band_a_lambda_is(mask_mod, rule):
    assert mask_rules.band_of(mask_mod) == rule
    assert torch.equal(_dense(mask_mod), _band_mask(rule))


@pytest.mark.parametrize("mask_mod", NOT_BANDS)
def test_band_of_leaves_what_it_cannot_prove(mask_mod):
    assert mask_rules.band_of(mask_mod) is None


_CMPS = [operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne]


@st.composite
def _masks(draw, depth=2):
    """Random masks of the accepted grammar: comparisons of a * q + c1 against a * kv + c2 (or |q - kv + c| against
    k), or of a position against a constant (no band), joined by & | ^ ~."""
    if depth == 0 or draw(st.booleans()):
        a, c1, c2 = draw(st.integers(-3, 3)), draw(st.integers(-20, 20)), draw(st.integers(-20, 20))
        cmp = draw(st.sampled_from(_CMPS))
        kind = draw(st.sampled_from(["lin", "abs", "pos"]))
        if kind == "abs":
            return lambda b, h, q, kv: cmp((q - kv + c1).abs(), c2)
        if kind == "pos":
            return lambda b, h, q, kv: cmp(q, c2)
        return lambda b, h, q, kv: cmp(a * q + c1, a * kv + c2)
    x, y = draw(_masks(depth=depth - 1)), draw(_masks(depth=depth - 1))
    op = draw(st.sampled_from(["and", "or", "xor", "not"]))
    if op == "not":
        return lambda b, h, q, kv: ~x(b, h, q, kv)
    f = {"and": operator.and_, "or": operator.or_, "xor": operator.xor}[op]
    return lambda b, h, q, kv: f(x(b, h, q, kv), y(b, h, q, kv))


@settings(max_examples=150, deadline=None)
@given(_masks())
def test_a_band_read_off_a_random_mask_holds_at_every_position(mask_mod):
    """Soundness: wherever band_of names a band, the mask is that band at every position (breakpoints are within
    |d| <= 43 here, the grid reaches |d| = N - 1)."""
    rule = mask_rules.band_of(mask_mod)
    if rule is not None:
        assert torch.equal(_dense(mask_mod), _band_mask(rule)), rule


def test_the_memo_follows_defaults_and_closures():
    """A new lambda of the same code is a memo hit only while what it closes over and its defaults are the same."""
    def closing(w):
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= w)

    def defaulting(w):
        return lambda b, h, q, kv, w=w: (q >= kv) & (q - kv <= w)

    for make in (closing, defaulting):
        assert [mask_rules.band_of(make(w)) for w in (300, 700, 300)] == [("band", 300, 0), ("band", 700, 0),
                                                                          ("band", 300, 0)]


def _check(q, k, v, do, mask_mod, rewritten, **builtin):
    flashport.reset_stats()
    out = flashport.attention(q, k, v, mask_mod=mask_mod)
    assert flashport.rewrites()["window"] == rewritten
    ref = flashport.attention(q, k, v, mask_mod=mask_mod, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if builtin:   # the very call the built-in arguments make
        same = flashport.attention(q, k, v, **builtin)
        assert torch.equal(out, same)
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(same, (q, k, v), do)))


def test_backend_none_runs_a_causal_or_window_lambda_as_the_built_in_call():
    """A recognised lambda runs as causal=True / the window would, bitwise with its gradients, and counts as a window
    rewrite.  Its positions are top-left: with Sq < Sk, `q_idx >= kv_idx` hides keys the bottom-right built-in
    rules cannot (it stays a mask_mod), while `q_idx + Sk - Sq >= kv_idx` is bottom-right causal.  A mask that is
    no band keeps its mask_mod.  All match the reference."""
    g = torch.Generator().manual_seed(0)

    def inputs(sq, sk):
        q = torch.randn(2, sq, 4, 16, generator=g, requires_grad=True)
        k, v = (torch.randn(2, sk, 2, 16, generator=g, requires_grad=True) for _ in range(2))
        return q, k, v, torch.randn(2, sq, 4, 16, generator=g)

    q, k, v, do = inputs(40, 40)
    _check(q, k, v, do, lambda b, h, qi, kj: qi >= kj, 1, causal=True)
    _check(q, k, v, do, lambda b, h, qi, kj: (qi >= kj) & (qi - kj <= 7), 1, window_size=(7, 0))
    _check(q, k, v, do, lambda b, h, qi, kj: (qi - kj).abs() <= 5, 1, window_size=(5, 5))
    _check(q, k, v, do, lambda b, h, qi, kj: (qi - kj).abs() % 3 == 0, 0)
    q, k, v, do = inputs(24, 40)
    _check(q, k, v, do, lambda b, h, qi, kj: qi >= kj, 0)
    _check(q, k, v, do, lambda b, h, qi, kj: qi + 16 >= kj, 1, causal=True)
