"""Skipping a block mask's empty tiles in the attention kernels.

A kernel tile (BLOCK_M x BLOCK_N, set by the launch config) need not match the block mask's tiles (q_block x
kv_block).  `live_tiles` marks each kernel tile that overlaps a non-empty block of the mask; the kernels visit only
those (their BLOCK_SKIP branch).  Inside a visited tile the per-element rule (the element's block is not empty AND
mask_mod) is the generated mask function's (backend/triton.py composes it), evaluated only where the tile is not
entirely in FULL blocks (mask_mod is true on every pair there).  Equivalent PyTorch math:

    blocks = state[b, h, r, c] for block rows r overlapping rows [t*BM, (t+1)*BM) and block columns c overlapping
             keys [u*BN, (u+1)*BN)
    live[b, h, t, u] = 0 if all(blocks == EMPTY) else 2 if all(blocks == FULL) else 1
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..block_mask import EMPTY, FULL

# per block mask: {(BLOCK_M, BLOCK_N): the kernels' `skip` tuple}; built once and reused across calls and layers
_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _covered(n_tiles: int, tile: int, block: int, n_blocks: int, device) -> tuple:
    """Per kernel tile, the block indices [lo, hi) it overlaps."""
    t = torch.arange(n_tiles, device=device)
    lo = (t * tile) // block
    hi = torch.clamp(((t + 1) * tile - 1) // block, max=n_blocks - 1) + 1
    return lo, hi


def live_tiles(bm, sq: int, sk: int, block_m: int, block_n: int) -> torch.Tensor:
    """int8 [Bb, Hb, ceil(Sq / BLOCK_M), ceil(Sk / BLOCK_N)]: 0 where the kernel tile overlaps only empty blocks,
    2 where it overlaps only FULL ones (no per-element mask needed), else 1 (Bb, Hb: the block mask's own batch and
    head sizes, 1 where it applies to all)."""
    state = bm.state
    qb, kb = bm.block_size
    nq, nk = state.shape[-2:]
    r0, r1 = _covered(-(-sq // block_m), block_m, qb, nq, state.device)
    c0, c1 = _covered(-(-sk // block_n), block_n, kb, nk, state.device)

    def count(blocks: torch.Tensor) -> torch.Tensor:
        # 2-D prefix sums: the count over any rectangle of blocks in four reads
        prefix = F.pad(blocks.to(torch.int32).cumsum(-2).cumsum(-1), (1, 0, 1, 0))
        return (prefix[..., r1[:, None], c1[None, :]] - prefix[..., r0[:, None], c1[None, :]]
                - prefix[..., r1[:, None], c0[None, :]] + prefix[..., r0[:, None], c0[None, :]])

    covered = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    full = count(state == FULL) == covered
    return torch.where(count(state != EMPTY) == 0, 0, torch.where(full, 2, 1)).to(torch.int8).contiguous()


def skip_args(bm, sq: int, sk: int, block_m: int, block_n: int) -> tuple:
    """The kernels' `skip` argument: (live table, stride of b, of h, of Q tiles, of K tiles), a stride 0 where the
    block mask applies to every batch entry or head."""
    per_mask = _tables.setdefault(bm, {})
    key = (block_m, block_n)
    if key not in per_mask:
        live = live_tiles(bm, sq, sk, block_m, block_n)
        strides = tuple(0 if n == 1 else st for n, st in zip(live.shape[:2], live.stride()[:2]))
        per_mask[key] = (live, *strides, live.stride(2), live.stride(3))
    return per_mask[key]
