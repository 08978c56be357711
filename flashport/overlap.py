"""Do two strided tensors share a byte of memory?  (Used to refuse in-place writes into aliased caches.)

torch's own helper (`torch._C._overlaps`, at::get_overlap_status) answers "too hard", hence overlap,
for any tensor that is not dense, so it rejects the legal interleaved cache layout
(kv = torch.empty(B, S, 2, H, D); k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]).  Here the question is
decided exactly as an integer problem: is there an index i of `a` and j of `b` with

    |(addr_a + sum_d i_d * stride_a_d) - (addr_b + sum_e j_e * stride_b_e)| < the element sizes

(bytes).  Dimensions of both tensors become one list of (stride, coefficient range) -- a's indices
count up, b's count down -- merged where strides are equal and searched from the largest stride down,
keeping only the coefficients whose remainder the smaller strides can still reach.  For the usual
nested layouts (each stride larger than what the smaller ones span) that leaves two or three
candidates per dimension.  The search is exact whenever it finishes; past a node budget (a pathological
layout) it answers "overlap", the safe side for a caller that would otherwise write through an alias.
"""
from __future__ import annotations

import functools

import torch

_BUDGET = 20_000  # search nodes before giving up (answering "overlap")


class _TooHard(Exception):
    pass


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) byte addresses spanned by a non-empty tensor (torch strides are never negative)."""
    lo = t.data_ptr()
    return lo, lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when some element of `a` and some element of `b` share a byte of memory (exact; see above)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (alo, ahi), (blo, bhi) = _extent(a), _extent(b)
    if ahi <= blo or bhi <= alo:  # disjoint address ranges: separate allocations end here
        return False
    ia, ib = a.element_size(), b.element_size()
    dims = tuple((n, s * ia) for n, s in zip(a.shape, a.stride())) + \
        tuple((-n, s * ib) for n, s in zip(b.shape, b.stride()))
    # addr_a + A - (addr_b + B) in (-ia, ib)  <=>  A - B in [delta - ia + 1, delta + ib - 1]
    delta = b.data_ptr() - a.data_ptr()
    return _solvable(dims, delta - ia + 1, delta + ib - 1)


@functools.lru_cache(maxsize=256)
def _solvable(dims: tuple, target_lo: int, target_hi: int) -> bool:
    """Is sum_d c_d * w_d in [target_lo, target_hi] for some integer coefficients in the dims' ranges?

    dims: (n, w) pairs: n > 0 a dimension of a (c in [0, n-1]), n < 0 one of b (c in [n+1, 0]).
    Memoised: a decode loop asks the same question (same shapes, strides, offset) on every call."""
    merged: dict = {}
    for n, w in dims:
        if w == 0 or abs(n) == 1:
            continue  # contributes nothing
        lo, hi = merged.get(w, (0, 0))
        merged[w] = (lo, hi + n - 1) if n > 0 else (lo + n + 1, hi)
    order = sorted(merged.items(), reverse=True)
    # reach[k]: the [lo, hi] sums the dims after position k can make (a relaxation: every sum lies in it)
    reach, lo_sum, hi_sum = [], 0, 0
    for w, (lo, hi) in reversed(order):
        reach.append((lo_sum, hi_sum))
        lo_sum, hi_sum = lo_sum + lo * w, hi_sum + hi * w
    reach.reverse()
    dims_ = [(w, lo, hi, *reach[k]) for k, (w, (lo, hi)) in enumerate(order)]
    try:
        return _search(dims_, 0, target_lo, target_hi, [_BUDGET])
    except _TooHard:
        return True


def _search(dims: list, k: int, tlo: int, thi: int, budget: list) -> bool:
    if k == len(dims):
        return tlo <= 0 <= thi
    w, lo, hi, rest_lo, rest_hi = dims[k]
    # c is a candidate iff [tlo - c*w, thi - c*w] meets [rest_lo, rest_hi], the smaller dims' reach
    cmin = max(lo, -((rest_hi - tlo) // w))   # ceil((tlo - rest_hi) / w)
    cmax = min(hi, (thi - rest_lo) // w)
    for c in range(cmin, cmax + 1):
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooHard
        if _search(dims, k + 1, tlo - c * w, thi - c * w, budget):
            return True
    return False
