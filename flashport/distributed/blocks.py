"""Which part of one (query run, key run) pair is visible, as a flashport call on the pair.

The global rule is self-attention's (DESIGN.md, Sq = Sk so no bottom-right shift): query i sees key j iff
i - left <= j <= i + right (-1 = unbounded; causal is right = 0).  A rank's shard is made of runs of
consecutive global positions (layout.segments), so every pair of a query run and a key run is one rectangle
of the global score matrix.  On a rectangle the rule is a band; `pair_call` trims the rectangle to the rows
and keys the band touches and re-expresses the band as flashport's bottom-right-aligned window on the
trimmed rectangle, whose bounds are then never below 0:

    query run [qg, qg + Lq), key run [kg, kg + Lk):  local row a sees local key c
        iff a + d - left <= c <= a + d + right,   d = qg - kg
    flashport on [Lq', Lk'] sees iff a + (Lk' - Lq') - left' <= c <= a + (Lk' - Lq') + right'
        so left' = left - shift, right' = right + shift, shift = d' - (Lk' - Lq') after trimming.

Trimming keeps every bound >= 0: the last trimmed row sees some trimmed key (left' >= 0) and the last
trimmed key is seen by some row (right' >= 0).  A bound that every row and key satisfies becomes -1, so a
fully visible rectangle is a call with no mask at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Call:
    """One flashport call of a ring step, in local coordinates: q rows [q0, q1) of this rank's shard against
    k/v rows [k0, k1) of the block in hand, with window (left, right) on that rectangle."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int = -1
    right: int = -1

    @property
    def full(self) -> bool:
        return self.left < 0 and self.right < 0


def pair_call(q_off: int, q_start: int, q_len: int, k_off: int, k_start: int, k_len: int,
              left: int, right: int) -> Optional[Call]:
    """The call for query run (local offset q_off, global start q_start, q_len rows) against key run
    (k_off, k_start, k_len), or None where no query of the run sees a key of the other."""
    d = q_start - k_start
    a0 = 0 if right < 0 else max(0, -d - right)
    a1 = q_len if left < 0 else min(q_len, k_len - d + left)
    if a0 >= a1:
        return None
    c0 = 0 if left < 0 else max(0, a0 + d - left)
    c1 = k_len if right < 0 else min(k_len, a1 + d + right)
    if c0 >= c1:
        return None
    lq, lk, d2 = a1 - a0, c1 - c0, d + a0 - c0
    shift = d2 - (lk - lq)
    # every row reaches key 0 (left) / the last key (right): that bound masks nothing on this rectangle
    new_left = -1 if left < 0 or lq - 1 + d2 - left <= 0 else left - shift
    new_right = -1 if right < 0 or d2 + right >= lk - 1 else right + shift
    assert new_left >= -1 and new_right >= -1, (q_start, q_len, k_start, k_len, left, right)
    return Call(q_off + a0, q_off + a1, k_off + c0, k_off + c1, new_left, new_right)


def _merge_once(calls: list) -> bool:
    """Fuse two unmasked calls over adjacent rectangles (same rows and touching keys, or the reverse)."""
    for i, a in enumerate(calls):
        for j, b in enumerate(calls):
            if i == j or not (a.full and b.full):
                continue
            if (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                calls[i] = Call(a.q0, a.q1, a.k0, b.k1)
            elif (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                calls[i] = Call(a.q0, b.q1, a.k0, a.k1)
            else:
                continue
            del calls[j]
            return True
    return False


def step_calls(q_segments, k_segments, left: int, right: int) -> list[Call]:
    """The calls of one ring step: this rank's query runs against the key runs of the block in hand
    (each run: (local offset, global start, length)), unmasked neighbours fused into one call."""
    calls = [c for qs in q_segments for ks in k_segments if (c := pair_call(*qs, *ks, left, right)) is not None]
    while _merge_once(calls):
        pass
    return calls
