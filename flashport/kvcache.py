"""In-place append of new k/v tokens into a dense or paged KV cache (no host synchronisation).

On a GPU the append is flashport.kernels.contents.append_kv: positions past the capacity and out-of-range
block_table entries are skipped (and flagged by flashport.contents.guard), never written.  On a CPU the
host checks of flashport.spec already ran, and PyTorch indexing does it (also on a GPU without Triton)."""
from __future__ import annotations

import torch

from .contents import device_kernels


def cache_positions(cache_seqlens: torch.Tensor, s_new: int) -> torch.Tensor:
    """[B, S_new] int64 positions where the new tokens land (lengths are before the append)."""
    return cache_seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=cache_seqlens.device)


def _slots(k_cache, block_table, cache_seqlens, s_new):
    """Index tuple of the [B, S_new] cache slots the new tokens go to, and which of them exist (a position
    inside the capacity, through an in-range table entry; all of them once the host checks ran)."""
    pos = cache_positions(cache_seqlens, s_new)
    b = cache_seqlens.shape[0]
    if block_table is None:
        ok = (pos >= 0) & (pos < k_cache.shape[1])
        return (torch.arange(b, device=pos.device)[:, None].expand(b, s_new), pos), ok
    page = k_cache.shape[1]
    ok = (pos >= 0) & (pos < block_table.shape[1] * page)
    blocks = torch.gather(block_table.to(torch.int64), 1, torch.where(ok, pos, 0) // page)
    ok = ok & (blocks >= 0) & (blocks < k_cache.shape[0])
    return (blocks, pos % page), ok


def _torch_index(k_cache, block_table, cache_seqlens, s_new):
    """(slots, rows of the new tokens that land) for the PyTorch append.  On a GPU without Triton (the
    only GPU case that takes this path) bad contents are dropped here, which costs a host sync: the
    device-side assert of an out-of-range index would kill the CUDA context."""
    idx, ok = _slots(k_cache, block_table, cache_seqlens, s_new)
    if not k_cache.is_cuda:
        return idx, None          # the host checks of flashport.spec ran: every slot exists
    return tuple(i[ok] for i in idx), ok


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None, save: bool = False):
    """Write k/v [B, S_new, Hkv, D] into the cache at cache_seqlens (dense) or via block_table (paged).
    save: return the overwritten slots' previous contents (for `restore_kv`); else None."""
    if k is None or k.shape[1] == 0:
        return None
    kernels = device_kernels() if k.is_cuda else None
    if kernels is not None:
        return kernels.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, save=save)
    idx, ok = _torch_index(k_cache, block_table, cache_seqlens, k.shape[1])
    saved = (k_cache[idx].clone(), v_cache[idx].clone()) if save else None
    k_cache[idx] = k if ok is None else k[ok]
    v_cache[idx] = v if ok is None else v[ok]
    return saved


def restore_kv(k_cache, v_cache, saved, cache_seqlens, block_table=None) -> None:
    """Put back the slots `append_kv(..., save=True)` overwrote (a call that failed after its append)."""
    if saved is None:
        return
    kernels = device_kernels() if saved[0].is_cuda else None
    if kernels is not None:
        kernels.restore_kv(k_cache, v_cache, saved, cache_seqlens, block_table)
        return
    idx, _ = _torch_index(k_cache, block_table, cache_seqlens, saved[0].shape[1])
    k_cache[idx] = saved[0]
    v_cache[idx] = saved[1]


def sequence_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, b: int, n: int):
    """Batch entry b's first n cached keys and values as [1, n, H, D] (a view of a dense cache; of a paged one, a
    copy of the pages they fill: block_table[b, :ceil(n / page)])."""
    if block_table is None:
        return k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
    blocks = block_table[b, :-(-n // k_cache.shape[1])].to(torch.int64)
    return tuple(c[blocks].reshape(1, -1, *c.shape[2:])[:, :n] for c in (k_cache, v_cache))


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Paged cache [num_blocks, page, H, D] -> dense view-copy [B, max_blocks * page, H, D]."""
    b, nblk = block_table.shape
    g = cache[block_table.to(torch.int64).reshape(-1)]  # [B * nblk, page, H, D]
    return g.reshape(b, nblk * cache.shape[1], *cache.shape[2:])
