"""flashport.masks.Visibility against a brute-force dense mask written from the rule itself:

    row i sees key j  iff  i + Sk - Sq - left <= j <= i + Sk - Sq + right   (-1 = unbounded), 0 <= j < Sk

for many (Sq, Sk, left, right) -- Sq < Sk, Sq > Sk (rows that see nothing), (0, 0), one-sided windows,
empty sequences -- and tile sizes: the exact ranges, tile_is_full, and the tile walks the Triton kernels
take (key_tiles / query_tiles, host twins of kernels/common.py's jit helpers, which
tests/interpreter/test_visibility_twins.py holds to these).  Also the dense mask of masks.py, the mask
kind, and the readers of the kind (tuning keys, Hopper gates)."""
from __future__ import annotations

import itertools

import pytest
import torch

from flashport.masks import MASK_KINDS, Visibility, visible
from flashport.spec import dense_spec

LENGTHS = (0, 1, 7, 16, 33, 64, 100)
BOUNDS = (-1, 0, 1, 5, 40)
TILES = ((16, 16), (16, 64), (64, 16), (32, 32))
CASES = [(sq, sk, left, right) for sq, sk in itertools.product(LENGTHS, LENGTHS) for left in BOUNDS for right in BOUNDS]


def brute(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """[Sq, Sk] bool, one pair at a time from the rule's statement."""
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            d = i + sk - sq
            m[i, j] = (left < 0 or j >= d - left) and (right < 0 or j <= d + right)
    return m


_BRUTE: dict = {}


def dense(sq, sk, left, right) -> torch.Tensor:
    key = (sq, sk, left, right)
    if key not in _BRUTE:
        _BRUTE[key] = brute(*key)
    return _BRUTE[key]


def span(flags: torch.Tensor) -> tuple[int, int] | None:
    """(first, last + 1) of the True entries of a 1-D mask, or None when there are none."""
    idx = flags.nonzero().flatten()
    return None if idx.numel() == 0 else (int(idx[0]), int(idx[-1]) + 1)


def check_exact(got: tuple[int, int], flags: torch.Tensor, what):
    """got is exactly the span of flags (which must be contiguous), or empty when flags has no True."""
    want = span(flags)
    lo, hi = got
    if want is None:
        assert lo >= hi, (what, got)
    else:
        assert (lo, hi) == want, (what, got, want)
        assert bool(flags[lo:hi].all()), (what, "not contiguous")


@pytest.mark.parametrize("sq, sk, left, right", CASES)
def test_sees_and_dense_mask_match_the_rule(sq, sk, left, right):
    m = dense(sq, sk, left, right)
    vis = Visibility(sq, sk, left, right)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    # (without a bound the mask does not depend on i: it broadcasts, as callers expect)
    assert torch.equal(vis.sees(i, j).expand(sq, sk), m)
    assert torch.equal(visible(i, j, sq, sk, left, right).expand(sq, sk), m)
    if sq and sk:
        assert vis.sees(sq - 1, sk - 1) == bool(m[sq - 1, sk - 1])           # plain ints too
    # sk as a per-entry tensor, the way the reference masks a KV cache at each entry's length
    if sq and sk:
        lens = torch.tensor([sk, max(sk - 3, 0)])[:, None, None]
        got = visible(i[None], j[None], sq, lens, left, right).expand(2, sq, sk)
        assert torch.equal(got[0], m)
        assert torch.equal(got[1], torch.nn.functional.pad(dense(sq, max(sk - 3, 0), left, right),
                                                           (0, sk - max(sk - 3, 0))))
    for r in range(sq):
        assert vis.row_sees_nothing(r) == (not bool(m[r].any())), r


@pytest.mark.parametrize("sq, sk, left, right", CASES)
def test_exact_ranges_and_full_tiles(sq, sk, left, right):
    m = dense(sq, sk, left, right)
    vis = Visibility(sq, sk, left, right)
    for bm, bn in TILES:
        row_ranges = [(m0, min(m0 + bm, sq)) for m0 in range(0, sq, bm)] + [(r, r + 1) for r in range(sq)]
        for m0, m1 in row_ranges:
            check_exact(vis.key_range(m0, m1), m[m0:m1].any(0), ("key_range", m0, m1))
            check_exact(vis.full_key_range(m0, m1), m[m0:m1].all(0), ("full_key_range", m0, m1))
        key_ranges = [(n0, min(n0 + bn, sk)) for n0 in range(0, sk, bn)] + [(c, c + 1) for c in range(sk)]
        for n0, n1 in key_ranges:
            check_exact(vis.query_range(n0, n1), m[:, n0:n1].any(1), ("query_range", n0, n1))
            check_exact(vis.full_query_range(n0, n1), m[:, n0:n1].all(1), ("full_query_range", n0, n1))
        for m0, n0 in itertools.product(range(0, sq, bm), range(0, sk, bn)):
            m1, n1 = min(m0 + bm, sq), min(n0 + bn, sk)
            assert vis.tile_is_full(m0, m1, n0, n1) == bool(m[m0:m1, n0:n1].all()), (m0, n0)


def check_walk(lo, hi, full_lo, full_hi, step, limit, seen_any, seen_all, what):
    """A kernel's tile walk over one axis (tiles of `step` up to `limit`): every tile holding a visible
    pair is walked, the walk's ends hold one, the full tiles are exactly the tiles seen whole, and the
    SPLIT loops [lo, full_lo), [full_lo, full_hi), [full_hi, hi) partition the walk."""
    assert lo % step == 0 and lo >= 0, what
    starts = list(range(lo, hi, step))
    for t in range(0, limit, step):
        if bool(seen_any(t)):
            assert t in starts, (what, "visible tile skipped", t)
        whole = t + step <= limit and bool(seen_all(t))
        assert (full_lo <= t < full_hi) == whole, (what, "full tiles", t, (full_lo, full_hi))
    if starts:
        assert hi <= limit and bool(seen_any(starts[0])) and bool(seen_any(starts[-1])), (what, "loose walk")
        assert lo <= full_lo <= full_hi <= hi, (what, "split")
        parts = [range(lo, full_lo, step), range(full_lo, full_hi, step), range(full_hi, hi, step)]
        assert [t for p in parts for t in p] == starts, (what, "split loops")


@pytest.mark.parametrize("sq, sk, left, right", CASES)
def test_kernel_tile_walks(sq, sk, left, right):
    """Visibility.key_tiles / query_tiles: what attn_fwd / attn_bwd's programs loop over."""
    m = dense(sq, sk, left, right)
    vis = Visibility(sq, sk, left, right)
    for bm, bn in TILES:
        for start_m in range(0, sq, bm):
            rows = m[start_m:min(start_m + bm, sq)]
            check_walk(*vis.key_tiles(start_m, bm, bn), bn, sk, lambda t: rows[:, t:t + bn].any(),
                       lambda t: rows[:, t:t + bn].all(), ("key_tiles", start_m, bm, bn))
        for start_n in range(0, sk, bn):
            cols = m[:, start_n:min(start_n + bn, sk)]
            complete = start_n + bn <= sk      # a key tile cut short by Sk always needs the mask
            check_walk(*vis.query_tiles(start_n, bm, bn), bm, sq, lambda t: cols[t:t + bm].any(),
                       lambda t: complete and bool(cols[t:t + bm].all()), ("query_tiles", start_n, bm, bn))


@pytest.mark.parametrize("left, right, kind", [((-1), (-1), "none"), (-1, 0, "causal"), (0, 0, "window"),
                                               (5, 0, "window"), (-1, 3, "window"), (4, -1, "window")])
def test_kind_and_bounds(left, right, kind):
    vis = Visibility(8, 8, left, right)
    assert vis.kind == kind and kind in MASK_KINDS
    assert (vis.has_left, vis.has_right) == (left >= 0, right >= 0)


def _spec(causal=False, window=(-1, -1), sq=256, sk=256):
    q = torch.empty(1, sq, 2, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, sk, 2, 64, dtype=torch.bfloat16, device="meta")
    spec, _ = dense_spec(q, k, k, causal=causal, softmax_scale=None, window_size=window, softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    return spec


def test_spec_visibility_is_the_specs_rule():
    spec = _spec(window=(3, 0), sq=100, sk=200)
    assert spec.visibility == Visibility(100, 200, 3, 0) == Visibility.from_spec(spec)
    assert spec.visibility is spec.visibility                      # built once per spec
    assert _spec(causal=True).visibility.kind == "causal"


def test_readers_of_the_kind_treat_both_spellings_of_causal_alike():
    """causal=True and window (-1, 0) are one rule: the tuning keys and the Hopper gates see one kind."""
    pytest.importorskip("triton")
    from flashport.kernels import attn_fwd_hopper, tuning
    causal, window = _spec(causal=True), _spec(window=(-1, 0))
    assert tuning.mask_key(causal) == tuning.mask_key(window) == "causal"
    assert tuning.mask_key(_spec()) == "full" and tuning.mask_key(_spec(window=(8, 0))) == "local"
    assert attn_fwd_hopper.is_causal(causal) and attn_fwd_hopper.is_causal(window)
    assert not attn_fwd_hopper.is_causal(_spec())
    assert attn_fwd_hopper.feature_reasons(causal) == attn_fwd_hopper.feature_reasons(window) == []
    assert "window" in attn_fwd_hopper.feature_reasons(_spec(window=(8, 0)))[0]
    assert "Sq == Sk" in attn_fwd_hopper.feature_reasons(_spec(window=(-1, 0), sk=512))[0]
