"""The visibility rule, in one place.  Kernels (Triton, blockwise) and the reference all follow it.

Query row i (0-based within its sequence of length Sq) sees key j (within Sk keys) iff

    i + Sk - Sq - left  <=  j  <=  i + Sk - Sq + right          (bottom-right alignment)

with left/right = -1 meaning unbounded (causal is right = 0).  ALiBi adds -slope * |i + Sk - Sq - j|.

`Visibility` answers every question a tiled kernel asks of the rule, as FlashAttention-4's
flash_attn/cute/block_info.py does there: which keys a query tile sees (its loop bounds), which of
them it sees whole (tiles that need no mask), which query rows a key tile reaches (the backward's
loop bounds), and the mask's kind, which tuning keys and kernel gates branch on.  The Triton kernels
carry jit twins of the range methods in kernels/common.py (key_range, full_key_range, query_range,
full_query_range, key_tiles, query_tiles: same names, same formulas), because a jit function cannot
call the host.  tests/test_visibility.py holds the methods to a dense mask and the twins to each other.

A new mask kind: its rule in `sees` and in the range methods, its name in `kind`, and the kernels'
hooks (the jit twins and `visible` in kernels/common.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MASK_KINDS = ("none", "causal", "window")


@dataclass(frozen=True, slots=True)
class Visibility:
    """The rule for one sequence: Sq query rows, Sk keys, window (left, right) with -1 = unbounded.

    Ranges are half-open (lo, hi) pairs clipped to the sequence; lo >= hi means empty.  They take
    row ranges 0 <= m0 < m1 <= Sq and key ranges 0 <= n0 < n1 <= Sk.  From a varlen or KV-cache
    spec, Sq / Sk are the maxima / the cache capacity: the kind and the bounds hold for every
    sequence, the ranges need a sequence's own lengths."""

    sq: int
    sk: int
    left: int = -1
    right: int = -1

    @classmethod
    def from_spec(cls, spec) -> "Visibility":
        return cls(spec.seqlen_q, spec.seqlen_k, spec.window_left, spec.window_right)

    @property
    def kind(self) -> str:
        """One of MASK_KINDS: "none" (every key), "causal" (right = 0, no left bound) or "window"
        (any other bound).  A function of (left, right) only, however the caller spelled it:
        window (-1, 0) is "causal" as much as causal=True is."""
        if self.left < 0 and self.right < 0:
            return "none"
        if self.left < 0 and self.right == 0:
            return "causal"
        return "window"

    @property
    def has_left(self) -> bool:
        """A left bound (the kernels' HAS_LEFT constexpr)."""
        return self.left >= 0

    @property
    def has_right(self) -> bool:
        """A right bound (the kernels' HAS_RIGHT constexpr)."""
        return self.right >= 0

    @property
    def diag(self) -> int:
        """Sk - Sq: row i's diagonal key is i + diag (bottom-right alignment)."""
        return self.sk - self.sq

    def sees(self, i, j):
        """Whether row i sees key j, for ints or broadcasting tensors (here sq / sk may be tensors too:
        the reference passes per-entry cache lengths)."""
        diag = i + (self.sk - self.sq)
        ok = j < self.sk
        if self.left >= 0:
            ok = ok & (j >= diag - self.left)
        if self.right >= 0:
            ok = ok & (j <= diag + self.right)
        return ok

    def key_range(self, m0: int, m1: int) -> tuple[int, int]:
        """Keys that some row of [m0, m1) sees: a query tile's loop bounds."""
        lo, hi = 0, self.sk
        if self.left >= 0:
            lo = max(lo, m0 + self.diag - self.left)
        if self.right >= 0:
            hi = min(hi, (m1 - 1) + self.diag + self.right + 1)
        return lo, hi

    def full_key_range(self, m0: int, m1: int) -> tuple[int, int]:
        """Keys that every row of [m0, m1) sees: key tiles inside it need no mask."""
        lo, hi = 0, self.sk
        if self.left >= 0:
            lo = max(lo, (m1 - 1) + self.diag - self.left)
        if self.right >= 0:
            hi = min(hi, m0 + self.diag + self.right + 1)
        return lo, hi

    def query_range(self, n0: int, n1: int) -> tuple[int, int]:
        """Rows that see some key of [n0, n1): a key tile's loop bounds in the backward."""
        lo, hi = 0, self.sq
        if self.right >= 0:  # j <= i + diag + right  ->  i >= j - diag - right
            lo = max(lo, n0 - self.diag - self.right)
        if self.left >= 0:  # j >= i + diag - left  ->  i <= j - diag + left
            hi = min(hi, (n1 - 1) - self.diag + self.left + 1)
        return lo, hi

    def full_query_range(self, n0: int, n1: int) -> tuple[int, int]:
        """Rows that see every key of [n0, n1): query tiles inside it need no mask."""
        lo, hi = 0, self.sq
        if self.right >= 0:
            lo = max(lo, (n1 - 1) - self.diag - self.right)
        if self.left >= 0:
            hi = min(hi, n0 - self.diag + self.left + 1)
        return lo, hi

    def tile_is_full(self, m0: int, m1: int, n0: int, n1: int) -> bool:
        """Every row of [m0, m1) sees every key of [n0, n1): the tile needs no mask."""
        lo, hi = self.full_key_range(m0, m1)
        return lo <= n0 and n1 <= hi

    def row_sees_nothing(self, i: int) -> bool:
        """Row i sees no key (its output is 0 and its lse -inf)."""
        lo, hi = self.key_range(i, i + 1)
        return lo >= hi

    # Host twins of the kernels' tile walks (kernels/common.py key_tiles / query_tiles), clamps and
    # all: the kernels' integer division truncates towards zero, so they clamp at 0 before dividing.
    def key_tiles(self, start_m: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
        """(lo, hi, full_lo, full_hi) for the query tile at start_m: key tiles start at lo + k * block_n
        below hi (lo a multiple of block_n); those starting in [full_lo, full_hi) are seen whole by every
        row of the tile below Sq, and lo <= full_lo <= full_hi <= hi split the walk into masked, unmasked
        and masked parts whenever lo < hi."""
        m_end = min(start_m + block_m, self.sq)
        lo, hi = self.key_range(start_m, m_end)
        lo = lo // block_n * block_n
        lo_full, hi_full = self.full_key_range(start_m, m_end)
        full_lo = lo
        if self.left >= 0:
            full_lo = max(-(-lo_full // block_n) * block_n, lo)
        full_hi = max(hi_full, 0) // block_n * block_n
        full_lo = min(full_lo, hi)
        full_hi = min(max(full_hi, full_lo), hi)
        return lo, hi, full_lo, full_hi

    def query_tiles(self, start_n: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
        """(lo, hi, full_lo, full_hi) for the key tile at start_n, as key_tiles with rows and keys swapped;
        full query tiles lie below Sq, and a key tile cut short by Sk has none (its keys past Sk need
        the mask)."""
        n_end = min(start_n + block_n, self.sk)
        lo, hi = self.query_range(start_n, n_end)
        lo = lo // block_m * block_m
        lo_full, hi_full = self.full_query_range(start_n, n_end)
        full_lo = lo
        if self.right >= 0:
            full_lo = max(-(-lo_full // block_m) * block_m, lo)
        full_hi = max(hi_full, 0) // block_m * block_m
        full_lo = hi if n_end - start_n < block_n else min(full_lo, hi)
        full_hi = min(max(full_hi, full_lo), hi)
        return lo, hi, full_lo, full_hi


def visible(i: torch.Tensor, j: torch.Tensor, sq, sk, left: int, right: int) -> torch.Tensor:
    """Bool mask of (i, j) pairs that may attend (Visibility.sees); i, j, sq, sk broadcast (sq/sk may be
    tensors)."""
    return Visibility(sq, sk, left, right).sees(i, j)


def alibi_bias(slopes: torch.Tensor, i: torch.Tensor, j: torch.Tensor, sq, sk) -> torch.Tensor:
    """-slope * |i + Sk - Sq - j| (float32), broadcasting slopes against the (i, j) grid."""
    return -slopes * (i + (sk - sq) - j).abs().to(torch.float32)
