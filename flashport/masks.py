"""The visibility rule, in one place.  Kernels (Triton, blockwise) and the reference all follow it.

Query row i (0-based within its sequence of length Sq) sees key j (within Sk keys) iff

    i + Sk - Sq - left  <=  j  <=  i + Sk - Sq + right          (bottom-right alignment)

with left/right = -1 meaning unbounded (causal is right = 0).  ALiBi adds -slope * |i + Sk - Sq - j|.
"""
from __future__ import annotations

import torch


def visible(i: torch.Tensor, j: torch.Tensor, sq, sk, left: int, right: int) -> torch.Tensor:
    """Bool mask of (i, j) pairs that may attend; i, j, sq, sk broadcast (sq/sk may be tensors)."""
    diag = i + (sk - sq)
    ok = j < sk
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def alibi_bias(slopes: torch.Tensor, i: torch.Tensor, j: torch.Tensor, sq, sk) -> torch.Tensor:
    """-slope * |i + Sk - Sq - j| (float32), broadcasting slopes against the (i, j) grid."""
    return -slopes * (i + (sk - sq) - j).abs().to(torch.float32)


def key_range(m_start: int, m_end: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range [lo, hi) of keys that rows [m_start, m_end) can see; lo >= hi means none.

    Used to skip tiles that the mask hides entirely."""
    lo, hi = 0, sk
    if left >= 0:
        lo = max(lo, m_start + sk - sq - left)
    if right >= 0:
        hi = min(hi, (m_end - 1) + sk - sq + right + 1)
    return lo, hi


def query_range(n_start: int, n_end: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range [lo, hi) of query rows that can see some key in [n_start, n_end)."""
    lo, hi = 0, sq
    if right >= 0:  # row i sees j only if j <= i + sk - sq + right  ->  i >= j - sk + sq - right
        lo = max(lo, n_start - sk + sq - right)
    if left >= 0:  # j >= i + sk - sq - left  ->  i <= j - sk + sq + left
        hi = min(hi, (n_end - 1) - sk + sq + left + 1)
    return lo, hi
