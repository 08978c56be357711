"""FlashAttention-2's Python API on flashport: switch with one import line.

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashport.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The functions of `flash_attn/flash_attn_interface.py` (flash-attn 2.8.x) with the same parameter names,
order, defaults and return conventions, mapped onto flashport's entry points:

    flash_attn_func(q, k, v, ...)                          -> flashport.attention
    flash_attn_qkvpacked_func(qkv [B, S, 3, H, D], ...)    -> flashport.attention on qkv.unbind(2)
    flash_attn_kvpacked_func(q, kv [B, Sk, 2, Hkv, D], ...)-> flashport.attention on kv.unbind(2)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, ...)     -> flashport.attention_varlen
    flash_attn_varlen_qkvpacked_func(qkv [total, 3, H, D], cu_seqlens, max_seqlen, ...)
    flash_attn_varlen_kvpacked_func(q, kv [total_k, 2, Hkv, D], ...)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)-> flashport.attention_with_kvcache

Packed tensors are unbound into views (no copy); their gradient arrives in the packed layout. Masking,
scaling, softcap, ALiBi, GQA and the layouts are FA2's, and so is FA2's reading of its arguments:
`causal=True` sets the right window bound to 0 whatever window_size[1] says (native flashport raises
on that contradiction), a window bound < 0 or >= the key length is unbounded, `softcap <= 0` is off.

What differs from FA2 (everything else is the same):
- `return_attn_probs=True` returns `(out, softmax_lse, None)`: flashport never materialises the
  probabilities, so the third element is None (FA2 returns an empty tensor unless dropout_p > 0, and
  documents S_dmask as testing-only). softmax_lse is FA2's: float32 [B, H, Sq], varlen [H, total_q].
- A query row that sees no key has lse = -inf (the logsumexp of nothing); FA2's kernels write +inf.
- Dropout keeps with probability 1 - p and scales by 1/(1 - p) as FA2 does, but the random mask is
  flashport's (reproducible under torch.manual_seed), not bitwise FA2's.
- `flash_attn_with_kvcache`: `num_splits` is a performance hint of FA2's kernel and is ignored
  (flashport's backends choose their own split); `cache_leftpad` raises ValueError; `cache_batch_idx`
  is served without a copy (the dense cache is read as a paged cache, one page per batch row); the
  rotary embedding (`rotary_cos`/`rotary_sin`) is applied in PyTorch to q and the new k before the
  append, in float32, as FA2 does. As in FA2 the call has no backward: it runs under torch.no_grad().
- `flash_attn_varlen_func(block_table=...)` (paged keys for varlen queries) raises ValueError; use
  `flash_attn_with_kvcache(block_table=...)` for a paged cache.
- Malformed input raises ValueError/TypeError naming the argument, where FA2 raises RuntimeError.
  flashport accepts more than FA2 (fp32/fp64 inputs, any head dim its backends serve, any page size,
  any even rotary_dim), and `flashport.use_backend` / `FLASHPORT_BACKEND` choose the backend.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .api import attention, attention_varlen, attention_with_kvcache
from .spec import _is_int, _is_real, content_checks_enabled

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


# ----------------------------------------------------------------------------- FA2's reading of arguments
def _window(window_size, causal, seqlen_k):
    """FA2's window normalisation (flash_api.cpp): a bound < 0 or >= seqlen_k is unbounded (-1), and causal
    forces right = 0.  Anything malformed passes through untouched, so flashport's checks name it."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or seqlen_k is None:
        return window_size
    left, right = window_size
    if not (_is_int(left) and _is_int(right)):
        return window_size
    left = -1 if left < 0 or left >= seqlen_k else int(left)
    right = -1 if right < 0 or right >= seqlen_k else int(right)
    if causal is True:
        right = 0
    return left, right


def _softcap(softcap):
    # FA2 applies a softcap only when it is > 0; flashport rejects a negative one.
    return 0.0 if _is_real(softcap) and softcap <= 0 else softcap


def _dim(x, d):
    return x.shape[d] if isinstance(x, torch.Tensor) and x.dim() > d else None


def _result(res, return_attn_probs):
    if not return_attn_probs:
        return res
    out, lse = res
    return out, lse, None  # no S_dmask: the probabilities are never materialised


def _unpack(t, name, rank, count, layout):
    """Views of a packed tensor along its packing dimension (rank - 3): no copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank or t.shape[rank - 3] != count:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t.unbind(rank - 3)


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    res = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                    window_size=_window(window_size, causal, _dim(k, 1)), softcap=_softcap(softcap),
                    alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                    return_lse=bool(return_attn_probs))
    return _result(res, return_attn_probs)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    # FA2 clamps the window against max_seqlen_k, not against each sequence's length.
    seqlen_k = max_seqlen_k if _is_int(max_seqlen_k) else None
    res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                           softmax_scale=softmax_scale, window_size=_window(window_size, causal, seqlen_k),
                           softcap=_softcap(softcap), alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                           deterministic=deterministic, return_lse=bool(return_attn_probs))
    return _result(res, return_attn_probs)


# ----------------------------------------------------------------------------- dense
def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv [B, S, 3, H, D] -> out [B, S, H, D]; with return_attn_probs (out, lse [B, H, S] float32, None).
    Equivalent to flash_attn_func(*qkv.unbind(2), ...); the gradient comes back as dqkv [B, S, 3, H, D]."""
    q, k, v = _unpack(qkv, "qkv", 5, 3, "[B, S, 3, H, D]")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q [B, Sq, Hq, D], kv [B, Sk, 2, Hkv, D] -> out [B, Sq, Hq, D] (GQA: Hq % Hkv == 0); with
    return_attn_probs (out, lse [B, Hq, Sq] float32, None).  Equivalent to flash_attn_func(q, *kv.unbind(2))."""
    k, v = _unpack(kv, "kv", 5, 2, "[B, Sk, 2, Hkv, D]")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, Hq, D]; with return_attn_probs
    (out, softmax_lse [B, Hq, Sq] float32, None).

    Per batch b and query head h (kv head g = h // (Hq // Hkv)), in PyTorch:
        s = softmax_scale * q[b, :, h] @ k[b, :, g].T      (softcap, ALiBi, bottom-right causal/window mask)
        out[b, :, h] = softmax(s, -1) @ dropout(v[b, :, g])
    """
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


# ----------------------------------------------------------------------------- varlen
def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv [total, 3, H, D], cu_seqlens int32 [B + 1] -> out [total, H, D]; with return_attn_probs
    (out, lse [H, total] float32, None).  Equivalent to flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens,
    cu_seqlens, max_seqlen, max_seqlen, ...)."""
    q, k, v = _unpack(qkv, "qkv", 4, 3, "[total, 3, H, D]")
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q [total_q, Hq, D], kv [total_k, 2, Hkv, D] -> out [total_q, Hq, D]; with return_attn_probs
    (out, lse [Hq, total_q] float32, None).  Equivalent to flash_attn_varlen_func(q, *kv.unbind(1), ...)."""
    k, v = _unpack(kv, "kv", 4, 2, "[total_k, 2, Hkv, D]")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_* int32 [B + 1] -> out [total_q, Hq, D]; with
    return_attn_probs (out, softmax_lse [Hq, total_q] float32, None).  Sequence b is rows
    cu_seqlens[b]:cu_seqlens[b + 1] of q and of k/v, attended as flash_attn_func would attend it alone.
    block_table (paged k/v) is not supported: ValueError."""
    if block_table is not None:
        raise ValueError("flashport.compat.flash_attn_varlen_func does not support block_table (paged keys for "
                         "varlen queries); use flash_attn_with_kvcache(..., block_table=...) for a paged cache")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


# ----------------------------------------------------------------------------- KV cache
def _host_checks(device) -> bool:
    # Contents are checked on the host where flashport checks them (CPU, FLASHPORT_CHECKS=1), never inside a
    # compiled graph (a host read there would break it; the custom op checks when the graph runs).
    return content_checks_enabled(device) and not torch.compiler.is_compiling()


def _batch_idx_table(cache_batch_idx, q, k_cache):
    """cache_batch_idx [B] int32 -> block_table [B, 1]: a dense cache [B_cache, S_cache, Hkv, D] is a paged
    cache of B_cache pages of S_cache slots, and batch row b's only page is cache_batch_idx[b] (no copy)."""
    if not isinstance(cache_batch_idx, torch.Tensor):
        raise TypeError(f"cache_batch_idx must be a torch.Tensor, got {type(cache_batch_idx).__name__}")
    if cache_batch_idx.dtype != torch.int32:
        raise TypeError(f"cache_batch_idx must be int32, got {cache_batch_idx.dtype}")
    batch = _dim(q, 0)
    if cache_batch_idx.dim() != 1 or (batch is not None and cache_batch_idx.shape[0] != batch):
        raise ValueError(f"cache_batch_idx must be [B={batch}], got shape {tuple(cache_batch_idx.shape)}")
    if isinstance(q, torch.Tensor) and cache_batch_idx.device != q.device:
        raise ValueError(f"cache_batch_idx must be on q's device {q.device}, got {cache_batch_idx.device}")
    rows = _dim(k_cache, 0)
    if rows is not None and cache_batch_idx.numel() and _host_checks(cache_batch_idx.device):
        lo, hi = cache_batch_idx.min().item(), cache_batch_idx.max().item()
        if lo < 0 or hi >= rows:
            raise ValueError(f"cache_batch_idx entries must be in [0, {rows}) (rows of k_cache), got [{lo}, {hi}]")
    return cache_batch_idx.view(-1, 1)


def _rotate(x, cos, sin, positions, interleaved):
    """FA2's rotary embedding of x [B, S, H, D] at integer positions [B, S]: the first rotary_dim =
    2 * cos.shape[1] channels of each head are rotated in pairs (2i, 2i + 1) when interleaved, else
    (i, i + rotary_dim / 2) (GPT-NeoX), by the angle whose cos/sin are cos[pos]/sin[pos]:
        (x1, x2) -> (x1 * cos - x2 * sin, x1 * sin + x2 * cos)
    computed in float32 (or wider) and rounded to x's dtype once; channels past rotary_dim are unchanged."""
    half = cos.shape[1]
    if half == 0:
        return x
    cd = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(cd)[positions][:, :, None, :]                     # [B, S, 1, rotary_dim / 2]
    s = sin.to(cd)[positions][:, :, None, :]
    xr = x[..., :2 * half].to(cd)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim, capacity):
    if rotary_cos is None or rotary_sin is None:
        missing = "rotary_sin" if rotary_sin is None else "rotary_cos"
        raise ValueError(f"rotary_cos and rotary_sin must be given together ({missing} is None)")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys: they need k and v (new tokens) as well, "
                         "as in FlashAttention-2")
    for t, n in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{n} must be a floating tensor, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{n} must be [seqlen_ro, rotary_dim / 2], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{n} must be on q's device {q.device}, got {t.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin {tuple(rotary_sin.shape)} must have rotary_cos's shape "
                         f"{tuple(rotary_cos.shape)}")
    if 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {rotary_cos.shape[1]} exceeds the head dim {head_dim}")
    if capacity is not None and rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions, fewer than the KV cache's "
                         f"{capacity} (seqlen_ro must be at least the cache's sequence capacity)")


def _rotary(q, k, rotary_cos, rotary_sin, cache_seqlens, interleaved, per_token_q, capacity):
    """(q, k) rotated at their positions: new key i of batch row b sits at cache_seqlens[b] + i; the queries
    too when causal or local, else all of them at cache_seqlens[b] (FA2's convention)."""
    _check_rotary(rotary_cos, rotary_sin, q, k, _dim(q, 3), capacity)
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and isinstance(k, torch.Tensor) and k.dim() == 4):
        return q, k  # malformed: flashport's checks name it
    b = q.shape[0]
    if _is_int(cache_seqlens):
        cache_seqlens = torch.full((b,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if not (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
            and tuple(cache_seqlens.shape) == (b,) and cache_seqlens.device == q.device):
        return q, k  # missing or malformed: flashport's checks name cache_seqlens
    start = cache_seqlens.to(torch.int64)[:, None]
    last = rotary_cos.shape[0] - 1
    if _host_checks(q.device) and b:
        top = start.max().item() + max(k.shape[1], q.shape[1] if per_token_q else 1) - 1
        if start.min().item() < 0 or top > last:
            raise ValueError(f"cache_seqlens put rotary positions outside rotary_cos/rotary_sin's "
                             f"{last + 1} positions (up to {top})")
    # Clamped so that a bad cache_seqlens on a GPU (unchecked without a host sync) cannot index past cos/sin;
    # the append of flashport then skips the same out-of-range positions.
    pos_k = (start + torch.arange(k.shape[1], device=q.device)).clamp(0, max(last, 0))
    pos_q = (start + torch.arange(q.shape[1], device=q.device)) if per_token_q else start.expand(b, q.shape[1])
    pos_q = pos_q.clamp(0, max(last, 0))
    return (_rotate(q, rotary_cos, rotary_sin, pos_q, interleaved),
            _rotate(k, rotary_cos, rotary_sin, pos_k, interleaved))


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Inference attention over a KV cache; k/v [B, S_new, Hkv, D] (new tokens) are written into
    k_cache/v_cache *in place* at cache_seqlens first.

    q [B, Sq, Hq, D]; dense cache [B_cache, S_cache, Hkv, D] (rows 0..B-1 are used, or rows
    cache_batch_idx [B] int32), or paged [num_blocks, page_block_size, Hkv, D] with block_table int32
    [B, max_blocks].  cache_seqlens: int or int32 [B], the lengths before the append (None: the whole
    cache is valid).  Batch row b attends to its first cache_seqlens[b] + S_new positions, bottom-right
    aligned.  rotary_cos/rotary_sin [seqlen_ro, rotary_dim / 2] rotate the new k (and q) first.
    num_splits is ignored (a performance hint); cache_leftpad is not supported (ValueError).
    Returns out [B, Sq, Hq, D], or (out, softmax_lse [B, Hq, Sq] float32) with return_softmax_lse.
    Like FA2 it has no backward: the output never requires grad.
    """
    if cache_leftpad is not None:
        raise ValueError("flashport.compat.flash_attn_with_kvcache does not support cache_leftpad (caches whose "
                         "valid keys start past position 0); keep each row's keys from position 0 instead")
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged KV cache), as in "
                             "FlashAttention-2")
        block_table = _batch_idx_table(cache_batch_idx, q, k_cache)
    elif block_table is None and _dim(q, 0) is not None and _dim(k_cache, 0) is not None \
            and _dim(v_cache, 0) is not None and k_cache.shape[0] > q.shape[0]:
        # FA2 reads batch row b of a bigger cache at row b: the leading rows, as views (written in place).
        k_cache, v_cache = k_cache[:q.shape[0]], v_cache[:q.shape[0]]
    capacity = _dim(k_cache, 1)
    if capacity is not None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
        capacity = block_table.shape[1] * capacity
    window = _window(window_size, causal, capacity)
    with torch.no_grad():  # FA2's call has no autograd: inputs requiring grad give an output that does not
        if rotary_cos is not None or rotary_sin is not None:
            # FA2 rotates the queries token by token when the call is causal or local (a bounded window).
            local = isinstance(window, tuple) and len(window) == 2 and all(_is_int(w) for w in window) \
                and max(window) >= 0
            q, k = _rotary(q, k, rotary_cos, rotary_sin, cache_seqlens, bool(rotary_interleaved), local, capacity)
        return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                      block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                      return_lse=bool(return_softmax_lse))
