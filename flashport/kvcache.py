"""In-place append of new k/v tokens into a dense or paged KV cache (no host synchronisation).

On a GPU the append is flashport.kernels.contents.append_kv: positions past the capacity and out-of-range
block_table entries are skipped (and flagged by flashport.contents.guard), never written.  On a CPU the
host checks of flashport.spec already ran, and PyTorch indexing does it."""
from __future__ import annotations

import torch


def cache_positions(cache_seqlens: torch.Tensor, s_new: int) -> torch.Tensor:
    """[B, S_new] int64 positions where the new tokens land (lengths are before the append)."""
    return cache_seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=cache_seqlens.device)


def _slots(k_cache, block_table, cache_seqlens, s_new):
    """Index tuple of the [B, S_new] cache slots the new tokens go to."""
    pos = cache_positions(cache_seqlens, s_new)
    if block_table is None:
        b = cache_seqlens.shape[0]
        return torch.arange(b, device=pos.device)[:, None].expand(b, s_new), pos
    page = k_cache.shape[1]
    return torch.gather(block_table.to(torch.int64), 1, pos // page), pos % page


def _on_gpu(k) -> bool:
    if not k.is_cuda:
        return False
    try:
        from .kernels import contents  # noqa: F401
    except ImportError:   # no Triton in this process
        return False
    return True


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None, save: bool = False):
    """Write k/v [B, S_new, Hkv, D] into the cache at cache_seqlens (dense) or via block_table (paged).
    save: return the overwritten slots' previous contents (for `restore_kv`); else None."""
    if k is None or k.shape[1] == 0:
        return None
    if _on_gpu(k):
        from .kernels.contents import append_kv as append_on_device
        return append_on_device(k_cache, v_cache, k, v, cache_seqlens, block_table, save=save)
    idx = _slots(k_cache, block_table, cache_seqlens, k.shape[1])
    saved = (k_cache[idx].clone(), v_cache[idx].clone()) if save else None
    k_cache[idx] = k
    v_cache[idx] = v
    return saved


def restore_kv(k_cache, v_cache, saved, cache_seqlens, block_table=None) -> None:
    """Put back the slots `append_kv(..., save=True)` overwrote (a call that failed after its append)."""
    if saved is None:
        return
    if _on_gpu(saved[0]):
        from .kernels.contents import restore_kv as restore_on_device
        restore_on_device(k_cache, v_cache, saved, cache_seqlens, block_table)
        return
    idx = _slots(k_cache, block_table, cache_seqlens, saved[0].shape[1])
    k_cache[idx] = saved[0]
    v_cache[idx] = saved[1]


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Paged cache [num_blocks, page, H, D] -> dense view-copy [B, max_blocks * page, H, D]."""
    b, nblk = block_table.shape
    g = cache[block_table.to(torch.int64).reshape(-1)]  # [B * nblk, page, H, D]
    return g.reshape(b, nblk * cache.shape[1], *cache.shape[2:])
