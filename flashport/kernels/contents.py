"""Index contents made safe on the device, without a host sync: clamping kernels and the masked KV append.

On a GPU flashport does not read cu_seqlens, cache_seqlens or block_table on the host (that would
synchronise every call; FLASHPORT_CHECKS=1 does it).  Instead, before any attention kernel runs:

* `clamp_varlen`: cu_seqlens_q / cu_seqlens_k -> copies clamped into [0, total] (a decreasing pair gives a
  negative length, which every kernel treats as empty), flags for entries out of range and for lengths
  past max_seqlen.
* `clamp_kvcache`: cache_seqlens + S_new -> the valid key counts clamped into [0, capacity]; block_table
  -> a copy with every entry clamped into [0, num_blocks), flagging only the entries a valid length uses
  (unused tail entries may hold anything, e.g. -1 padding).
* `append_kv`: writes the new tokens only at positions inside the capacity and through in-range table
  entries, and copies the slots it overwrites, so a call that fails after the append can put them back.

So no kernel reads or writes outside its tensors, whatever the contents; each flag names the argument and
flashport.check_errors() raises it (flashport/errors.py).  Equivalent PyTorch math:
    cu' = cu.clamp(0, total);  seqlens_k = (cache_seqlens + S_new).clamp(0, capacity);
    block_table' = block_table.clamp(0, num_blocks - 1)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import contents as errors
from .common import block_dim, cdiv
from .launch import DirectLauncher

BLOCK = 256


@triton.jit
def _clamp_cu(Cu, Out, Flags, n_entries, total, max_len, FLAG_RANGE: tl.constexpr, FLAG_MAX: tl.constexpr,
              BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_entries
    c = tl.load(Cu + offs, mask=ok, other=0).to(tl.int64)
    prev = tl.load(Cu + offs - 1, mask=ok & (offs > 0), other=0).to(tl.int64)
    first = offs == 0
    bad = ok & ((c < 0) | (c > total) | (first & (c != 0)) | (~first & (c < prev)))
    long = ok & ~first & (c - prev > max_len)
    tl.store(Out + offs, tl.minimum(tl.maximum(c, 0), total).to(tl.int32), mask=ok)
    one = tl.full([BLOCK], 1, tl.int32)
    tl.store(Flags + FLAG_RANGE + offs * 0, one, mask=bad)   # every flagging lane stores the same 1
    tl.store(Flags + FLAG_MAX + offs * 0, one, mask=long)


@triton.jit
def _clamp_varlen(CuQ, CuK, OutQ, OutK, Flags, n_entries, total_q, total_k, max_q, max_k, BLOCK: tl.constexpr,
                  FLAG_CU_Q: tl.constexpr, FLAG_CU_K: tl.constexpr, FLAG_MAX_Q: tl.constexpr,
                  FLAG_MAX_K: tl.constexpr):
    """Program axis 1 picks the tensor: 0 = cu_seqlens_q, 1 = cu_seqlens_k."""
    if tl.program_id(1) == 0:
        _clamp_cu(CuQ, OutQ, Flags, n_entries, total_q, max_q, FLAG_CU_Q, FLAG_MAX_Q, BLOCK)
    else:
        _clamp_cu(CuK, OutK, Flags, n_entries, total_k, max_k, FLAG_CU_K, FLAG_MAX_K, BLOCK)


@triton.jit
def _clamp_kvcache(CacheSeqlens, SeqlensOut, Bt, BtOut, Flags, s_new, capacity, n_cols, stride_bt, num_blocks,
                   HAS_LENS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                   FLAG_LENS: tl.constexpr, FLAG_BT: tl.constexpr):
    """Program (b, column block): the valid key count of batch entry b and one block of its table row."""
    b = tl.program_id(0)
    n_keys = capacity
    if HAS_LENS:
        n = tl.load(CacheSeqlens + b).to(tl.int64) + s_new
        n_keys = tl.minimum(tl.maximum(n, 0), capacity)
        if tl.program_id(1) == 0:
            tl.store(SeqlensOut + b, n_keys.to(tl.int32))
            bad = (n < s_new) | (n > capacity)
            tl.store(Flags + FLAG_LENS, 1, mask=bad)
    if PAGED:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        row = b.to(tl.int64) * stride_bt
        e = tl.load(Bt + row + cols, mask=ok, other=0)
        used = ok & (cols < (n_keys + PAGE_SIZE - 1) // PAGE_SIZE)
        tl.store(BtOut + row + cols, tl.minimum(tl.maximum(e, 0), num_blocks - 1), mask=ok)
        tl.store(Flags + FLAG_BT + cols * 0, tl.full([BLOCK], 1, tl.int32), mask=used & ((e < 0) | (e >= num_blocks)))


@triton.jit
def _append_rows(New, Cache, Saved, b64, h64, t, t_ok, row, ok, stride_nb, stride_ns, stride_nh, stride_ch,
                 stride_sb, stride_ss, stride_sh, D: tl.constexpr, BLOCK_D: tl.constexpr, SAVE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    dst = Cache + row[:, None] + h64 * stride_ch + offs_d[None, :]
    if SAVE:
        old = tl.load(dst, mask=ok[:, None] & d_ok, other=0.0)
        keep = Saved + b64 * stride_sb + t[:, None].to(tl.int64) * stride_ss + h64 * stride_sh + offs_d[None, :]
        tl.store(keep, old, mask=t_ok[:, None] & d_ok)
    src = New + b64 * stride_nb + t[:, None].to(tl.int64) * stride_ns + h64 * stride_nh + offs_d[None, :]
    x = tl.load(src, mask=t_ok[:, None] & d_ok, other=0.0)
    tl.store(dst, x, mask=ok[:, None] & d_ok)


@triton.jit
def _append_kv(K, V, KC, VC, SK, SV, CacheSeqlens, Bt, s_new, capacity, num_blocks,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
               stride_skb, stride_sks, stride_skh, stride_svb, stride_svs, stride_svh, stride_bt,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SAVE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (b, token block, kv head h): cache[b, cache_seqlens[b] + t, h] = new[b, t, h] for the positions
    inside the capacity (paged: through in-range table entries); with SAVE the overwritten rows go to SK / SV."""
    b64 = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    h64 = tl.program_id(2).to(tl.int64)
    t_ok = t < s_new
    pos = tl.load(CacheSeqlens + b64).to(tl.int64) + t
    ok = t_ok & (pos >= 0) & (pos < capacity)
    if PAGED:
        blk = tl.load(Bt + b64 * stride_bt + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        slot = pos % PAGE_SIZE
        k_row = blk * stride_kcb + slot * stride_kcs
        v_row = blk * stride_vcb + slot * stride_vcs
    else:
        k_row = b64 * stride_kcb + pos * stride_kcs
        v_row = b64 * stride_vcb + pos * stride_vcs
    _append_rows(K, KC, SK, b64, h64, t, t_ok, k_row, ok, stride_kb, stride_ks, stride_kh, stride_kch,
                 stride_skb, stride_sks, stride_skh, D, BLOCK_D, SAVE)
    _append_rows(V, VC, SV, b64, h64, t, t_ok, v_row, ok, stride_vb, stride_vs, stride_vh, stride_vch,
                 stride_svb, stride_svs, stride_svh, DV, BLOCK_DV, SAVE)


_launchers = {f: DirectLauncher(f) for f in (_clamp_varlen, _clamp_kvcache, _append_kv)}


def _launch(kernel, grid, args, meta, device: torch.device) -> None:
    # Direct launches on a GPU (these run on every call, kernels/launch.py); the interpreter runs CPU tensors.
    if device.type == "cuda":
        _launchers[kernel](grid, args, meta)
    else:
        kernel[grid](*args, **meta)


def clamp_varlen(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int, max_k: int):
    """-> (cu_q', cu_k') clamped into [0, total_q] / [0, total_k]; flags bad entries and lengths past max."""
    out_q, out_k = torch.empty_like(cu_q), torch.empty_like(cu_k)
    n = cu_q.shape[0]
    args = (cu_q, cu_k, out_q, out_k, errors.flags(cu_q.device), n, total_q, total_k, max_q, max_k)
    meta = dict(BLOCK=BLOCK, FLAG_CU_Q=errors.CU_Q, FLAG_CU_K=errors.CU_K, FLAG_MAX_Q=errors.MAX_Q,
                FLAG_MAX_K=errors.MAX_K, num_warps=4)
    _launch(_clamp_varlen, (cdiv(n, BLOCK), 2), args, meta, cu_q.device)
    return out_q, out_k


def clamp_kvcache(cache_seqlens, s_new: int, capacity: int, block_table, num_blocks: int, page: int):
    """-> (seqlens_k, block_table'): (cache_seqlens + s_new) clamped into [0, capacity] (None when
    cache_seqlens is None) and the table with entries clamped into [0, num_blocks) (None when not paged)."""
    ref = cache_seqlens if cache_seqlens is not None else block_table
    device = ref.device
    seqlens = torch.empty_like(cache_seqlens) if cache_seqlens is not None else None
    bt_out = torch.empty_like(block_table) if block_table is not None else None
    b = ref.shape[0]
    n_cols = block_table.shape[1] if block_table is not None else 0
    args = (cache_seqlens, seqlens, block_table, bt_out, errors.flags(device), s_new, capacity, n_cols,
            block_table.stride(0) if block_table is not None else 0, num_blocks)
    meta = dict(HAS_LENS=cache_seqlens is not None, PAGED=block_table is not None, PAGE_SIZE=max(page, 1),
                BLOCK=BLOCK, FLAG_LENS=errors.CACHE_SEQLENS, FLAG_BT=errors.BLOCK_TABLE, num_warps=4)
    _launch(_clamp_kvcache, (b, max(cdiv(n_cols, BLOCK), 1)), args, meta, device)
    return seqlens, bt_out


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None, save: bool = True):
    """Write k / v [B, S_new, Hkv, D|Dv] into the cache at cache_seqlens (dense) or through block_table
    (paged), skipping positions past the capacity and out-of-range table entries.  Returns the overwritten
    rows (saved_k, saved_v) shaped like k / v when `save` (for `restore_kv`), else None."""
    b, s_new, hkv = k.shape[:3]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    saved = (torch.empty_like(k), torch.empty_like(v)) if save else (k, v)   # unused pointers when not saving
    block_t = min(64, max(16, 1 << (s_new - 1).bit_length()))
    bt = block_table if paged else cache_seqlens
    args = (k, v, k_cache, v_cache, saved[0], saved[1], cache_seqlens, bt, s_new, capacity, k_cache.shape[0],
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            *saved[0].stride()[:3], *saved[1].stride()[:3], bt.stride(0))
    meta = dict(D=k.shape[-1], DV=v.shape[-1], BLOCK_D=block_dim(k.shape[-1]), BLOCK_DV=block_dim(v.shape[-1]),
                PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1, SAVE=save, BLOCK_T=block_t, num_warps=4)
    _launch(_append_kv, (b, cdiv(s_new, block_t), hkv), args, meta, k.device)
    return saved if save else None


def restore_kv(k_cache, v_cache, saved, cache_seqlens, block_table=None) -> None:
    """Undo `append_kv`: write its saved rows back to the same slots."""
    append_kv(k_cache, v_cache, saved[0], saved[1], cache_seqlens, block_table, save=False)
