"""Block masks: which (query tile, key tile) pairs of a mask_mod are empty, full or partial.

`create_block_mask` evaluates the mask_mod once, vectorised over the tile grid, and keeps one int8 per
tile and (batch, head): EMPTY tiles are skipped, FULL tiles need no per-element mask, PARTIAL tiles apply
the mask_mod.  Built once and reused across calls and layers, like FlexAttention's; a
`torch.nn.attention.flex_attention.BlockMask` is accepted and converted (`as_block_mask`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2
# Elements of the mask_mod evaluated at once while building (a bool each): bounded whatever the shape.
EVAL_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class BlockMask:
    """state: int8 [B or 1, H or 1, ceil(Sq / q_block), ceil(Sk / kv_block)] of EMPTY / PARTIAL / FULL.
    A batch or head dimension of 1 applies to every batch entry or query head."""

    state: torch.Tensor
    seq_lengths: tuple
    block_size: tuple            # (q_block, kv_block)
    mask_mod: Optional[Callable] = None

    @property
    def shape(self) -> tuple:
        return tuple(self.state.shape)

    def sparsity(self) -> float:
        """Fraction of tiles that are empty (work a kernel skips)."""
        return float((self.state == EMPTY).float().mean()) if self.state.numel() else 0.0

    def check(self, batch: int, heads_q: int, sq: int, sk: int, device) -> None:
        b, h, nq, nk = self.state.shape
        qb, kb = self.block_size
        if (sq, sk) != tuple(self.seq_lengths) or nq != -(-sq // qb) or nk != -(-sk // kb):
            raise ValueError(f"block_mask was built for (Sq, Sk)={tuple(self.seq_lengths)}, the call has ({sq}, {sk})")
        if b not in (1, batch) or h not in (1, heads_q):
            raise ValueError(f"block_mask has batch x heads {b} x {h}; the call needs 1 or {batch} x 1 or {heads_q}")
        if self.state.device != torch.device(device):
            raise ValueError(f"block_mask is on {self.state.device}, the call on {device}")

    def _summary(self):
        # per (query tile, key tile) over every batch entry and head, on the host: read by tile loops
        s = self.__dict__.get("_host")
        if s is None:
            st = self.state.cpu()
            s = ((st != EMPTY).flatten(0, 1).any(0), (st == FULL).flatten(0, 1).all(0))
            object.__setattr__(self, "_host", s)
        return s

    def state_of(self, m0: int, m1: int, n0: int, n1: int) -> str:
        """"empty", "full" or "partial" for rows [m0, m1) x keys [n0, n1), over every batch entry and head."""
        qb, kb = self.block_size
        any_, all_ = self._summary()
        rows, cols = slice(m0 // qb, (m1 - 1) // qb + 1), slice(n0 // kb, (n1 - 1) // kb + 1)
        if not bool(any_[rows, cols].any()):
            return "empty"
        return "full" if bool(all_[rows, cols].all()) else "partial"

    def tile_visible(self, b, h, i, j) -> torch.Tensor:
        """Whether the tile holding (b, h, i, j) (broadcasting index tensors) is not empty."""
        qb, kb = self.block_size
        bb = b if self.state.shape[0] > 1 else torch.zeros_like(b)
        hh = h if self.state.shape[1] > 1 else torch.zeros_like(h)
        return self.state[bb, hh, i // qb, j // kb] != EMPTY


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Sq: int, Sk: int,
                      device=None, block_size=128) -> BlockMask:
    """Evaluate mask_mod(b, h, q_idx, kv_idx) -> bool on the whole grid, once, in bounded chunks, and
    classify every tile.  B / H None: the mask does not depend on them (one entry for all).
    block_size: an int or (q_block, kv_block)."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    qb, kb = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for n, name in ((Sq, "Sq"), (Sk, "Sk"), (qb, "block_size"), (kb, "block_size")):
        if not isinstance(n, int) or isinstance(n, bool) or n < (1 if name == "block_size" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'block_size' else 'non-negative'} int, got {n!r}")
    b, h = B or 1, H or 1
    device = torch.device(device if device is not None else "cpu")
    nq, nk = -(-Sq // qb), -(-Sk // kb)
    state = torch.full((b, h, nq, nk), EMPTY, dtype=torch.int8, device=device)
    bi = torch.arange(b, device=device).view(b, 1, 1, 1)
    hi = torch.arange(h, device=device).view(1, h, 1, 1)
    # a chunk of whole key tiles per row tile, within EVAL_ELEMENTS
    tiles_k = max(1, min(nk, EVAL_ELEMENTS // max(1, b * h * qb * kb)))
    for t in range(nq):
        i = torch.arange(t * qb, min((t + 1) * qb, Sq), device=device)
        for c0 in range(0, nk, tiles_k):
            c1 = min(c0 + tiles_k, nk)
            j = torch.arange(c0 * kb, min(c1 * kb, Sk), device=device)
            m = mask_mod(bi, hi, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)).to(torch.bool)
            m = torch.broadcast_to(m, (b, h, i.numel(), j.numel()))
            pad = (c1 - c0) * kb - j.numel()   # keys past Sk: neither visible nor masking
            anyv = torch.nn.functional.pad(m, (0, pad), value=False).view(b, h, i.numel(), c1 - c0, kb).any(-1).any(2)
            allv = torch.nn.functional.pad(m, (0, pad), value=True).view(b, h, i.numel(), c1 - c0, kb).all(-1).all(2)
            state[:, :, t, c0:c1] = torch.where(allv, FULL, torch.where(anyv, PARTIAL, EMPTY)).to(torch.int8)
    return BlockMask(state, (Sq, Sk), (qb, kb), mask_mod)


def _is_noop(fn) -> bool:
    return fn is None or getattr(fn, "__name__", "") == "noop_mask"


def as_block_mask(bm) -> BlockMask:
    """A flashport BlockMask, or one converted from torch's flex_attention BlockMask."""
    if isinstance(bm, BlockMask):
        return bm
    if not all(hasattr(bm, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths")):
        raise TypeError(f"block_mask must come from flashport.create_block_mask or torch's create_block_mask, "
                        f"got {type(bm).__name__}")
    qb, kb = bm.BLOCK_SIZE
    sq, sk = bm.seq_lengths
    nq, nk = -(-sq // qb), -(-sk // kb)
    b, h = bm.kv_num_blocks.shape[:2]
    state = torch.zeros((b, h, nq, nk + 1), dtype=torch.int8, device=bm.kv_num_blocks.device)

    def mark(num, idx, value):
        live = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        cols = torch.where(live, idx.long(), nk)[..., :nq, :]       # dead slots land in the dropped column
        state.scatter_(3, cols, torch.full_like(cols, value, dtype=torch.int8))

    mark(bm.kv_num_blocks[..., :nq], bm.kv_indices, PARTIAL)
    if getattr(bm, "full_kv_num_blocks", None) is not None:
        mark(bm.full_kv_num_blocks[..., :nq], bm.full_kv_indices, FULL)
    mask_mod = None if _is_noop(getattr(bm, "mask_mod", None)) else bm.mask_mod
    if mask_mod is None:
        state = torch.where(state == PARTIAL, FULL, state)   # without a mask_mod a listed tile is seen whole
    return BlockMask(state[..., :nk].contiguous(), (sq, sk), (qb, kb), mask_mod)
