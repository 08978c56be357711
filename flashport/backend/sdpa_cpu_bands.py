"""Row bands for PyTorch's CPU flash kernel: the calls it takes no rule for (sliding windows, ALiBi, mask_mod,
block masks, attn_bias) run as bands of BAND_M query rows, each one kernel call over the keys its rows see with an
additive attn_mask of the band (0 where seen, -inf elsewhere, plus ALiBi and attn_bias).  Memory: one band's mask.
backend/sdpa_cpu.py runs the calls; this module says which keys and which mask each band gets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..masks import Visibility, alibi_bias
from ..programmable import Programmable

_NEG_INF = float("-inf")
# Query rows per kernel call of a windowed or ALiBi call (each call takes the keys its rows see, with a mask).
BAND_M = 256
# A band's keys that every row sees run unmasked, apart from its masked edges, from this many on.
SPLIT_MIN = 512


def additive_mask(seen, dtype, slopes=None, band=None, mods: Optional["Mods"] = None):
    """The kernel's attn_mask in q's dtype (it takes no bool mask) over band = (m0, m1, lo, hi, Sq, Sk): 0 where seen
    and -inf elsewhere (seen [B', H', M, N], B' and H' 1 or the call's), plus ALiBi's -slope * |i + Sk - Sq - j| as
    [B, Hq, M, N] when slopes [B, Hq] are given, plus the mods' attn_bias (both in a float32 or float64 kernel:
    sdpa_cpu._kernel_dtype)."""
    add = None if mods is None else mods.bias(band, dtype)
    if slopes is not None:
        m0, m1, lo, hi, sq, sk = band
        i, j = torch.arange(m0, m1)[:, None], torch.arange(lo, hi)[None, :]
        alibi = alibi_bias(slopes[:, :, None, None], i, j, sq, sk).to(dtype)
        add = alibi if add is None else add + alibi
    if seen is None:
        return add
    hidden = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, _NEG_INF)
    return hidden if add is None else add + hidden


def banded(window, slopes=None, mods=None) -> bool:
    """A window with a left bound, a right bound other than causal's 0, ALiBi or mods: served in row bands with a
    mask."""
    left, right = window
    return left >= 0 or right > 0 or slopes is not None or mods is not None


@dataclass(frozen=True)
class Mods:
    """A programmable call's mask_mod / block mask / attn_bias (no score_mod: SdpaCpuBackend.own_reasons) for one dense problem of
    `batch` entries, the first being entry b0 of the call (a varlen sequence's index)."""
    prog: Programmable
    batch: int
    heads: int
    b0: int = 0

    def index(self, m0: int, m1: int, lo: int, hi: int) -> tuple:
        return (torch.arange(self.b0, self.b0 + self.batch).view(-1, 1, 1, 1), torch.arange(self.heads).view(1, -1, 1, 1),
                torch.arange(m0, m1).view(1, 1, -1, 1), torch.arange(lo, hi).view(1, 1, 1, -1))

    def bias(self, band, dtype):
        """attn_bias over the band [m0, m1) x [lo, hi), as [B', H', M, N] in q's dtype, or None."""
        bias = self.prog.attn_bias
        if bias is None:
            return None
        m0, m1, lo, hi = band[:4]
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))   # it broadcasts from the right
        rows = slice(m0, m1) if bias.shape[2] > 1 else slice(None)
        cols = slice(lo, hi) if bias.shape[3] > 1 else slice(None)
        return bias[:, :, rows, cols].to(dtype)   # dense calls only (b0 = 0): its batch dim is B or 1


def mods_part(vis: Visibility, mods: Mods, m0: int, m1: int, lo: int, hi: int):
    """The band's one part under mods: the built-in rule AND mask_mod AND the block mask, keys trimmed to the columns
    some row of some (batch, head) sees (a packed-document mask leaves each band its own documents) -> (lo, hi,
    seen [B', H', M, N], rows that see nothing [B', H', M]) or None when the band sees no key."""
    idx = mods.index(m0, m1, lo, hi)
    seen = vis.sees(idx[2], idx[3])
    extra = mods.prog.visible(*idx)
    if extra is not None:
        seen = seen & extra
    cols = seen.flatten(0, 2).any(0).nonzero()
    if cols.numel() == 0:
        return None
    a, z = int(cols[0]), int(cols[-1]) + 1
    seen = seen[..., a:z]
    return lo + a, lo + z, seen, ~seen.any(-1)


def bands(sq: int, sk: int, window, split: bool, mods: Optional[Mods] = None):
    """(m0, m1, parts) per band of BAND_M rows; parts: [(lo, hi, seen [B', H', M, N] or None, rows that see none of
    [lo, hi) [B', H', M] or None)] cover the keys some row of the band sees.  One part, masked, in general; with
    `split` (no ALiBi, no mods) and a middle of at least SPLIT_MIN keys that every row of the band sees, three:
    masked edges around an unmasked middle, so that the mask is built and read only where it hides something."""
    vis = Visibility(sq, sk, *window)
    for m0 in range(0, sq, BAND_M):
        m1 = min(m0 + BAND_M, sq)
        lo, hi = vis.key_range(m0, m1)
        lo, hi = max(lo, 0), min(hi, sk)
        if lo >= hi:
            continue
        if mods is not None:
            part = mods_part(vis, mods, m0, m1, lo, hi)
            if part is not None:
                yield m0, m1, [part]
            continue
        flo, fhi = vis.full_key_range(m0, m1)
        flo, fhi = max(flo, lo), min(fhi, hi)
        spans = [(lo, flo), (flo, fhi), (fhi, hi)] if split and fhi - flo >= SPLIT_MIN else [(lo, hi)]
        parts = []
        for a, z in spans:
            if a >= z:
                continue
            if vis.tile_is_full(m0, m1, a, z):
                parts.append((a, z, None, None))
            else:
                seen = vis.sees(torch.arange(m0, m1)[:, None], torch.arange(a, z)[None, :])[None, None]
                parts.append((a, z, seen, ~seen.any(-1)))
        yield m0, m1, parts
