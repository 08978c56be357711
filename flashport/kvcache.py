"""In-place append of new k/v tokens into a dense or paged KV cache (no host synchronisation)."""
from __future__ import annotations

import torch


def cache_positions(cache_seqlens: torch.Tensor, s_new: int) -> torch.Tensor:
    """[B, S_new] int64 positions where the new tokens land (lengths are before the append)."""
    return cache_seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=cache_seqlens.device)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write k/v [B, S_new, Hkv, D] into the cache at cache_seqlens (dense) or via block_table (paged)."""
    if k is None or k.shape[1] == 0:
        return
    b, s_new = k.shape[:2]
    pos = cache_positions(cache_seqlens, s_new)
    if block_table is None:
        rows = torch.arange(b, device=k.device)[:, None].expand(b, s_new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page = k_cache.shape[1]
        blocks = torch.gather(block_table.to(torch.int64), 1, pos // page)
        k_cache[blocks, pos % page] = k
        v_cache[blocks, pos % page] = v


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Paged cache [num_blocks, page, H, D] -> dense view-copy [B, max_blocks * page, H, D]."""
    b, nblk = block_table.shape
    g = cache[block_table.to(torch.int64).reshape(-1)]  # [B * nblk, page, H, D]
    return g.reshape(b, nblk * cache.shape[1], *cache.shape[2:])
