"""FlashAttention forward in Triton: one program per (Q tile, query head, batch entry).

The Q tile [BLOCK_M, D] stays on chip while K/V tiles [BLOCK_N, D] stream through it; an online
softmax (running max m_i and sum l_i, in the log2 domain with exp2) rescales the accumulator acc,
so scores never reach device memory.  Key tiles the mask hides entirely are never visited (the key
range comes from the window / causal diagonal of the Q tile: common.key_tiles, the twin of
flashport.masks.Visibility.key_tiles), and only the boundary tiles pay for the mask (either in
separate loops or behind a run-time branch: the SPLIT note in common.py).  With a positive scale
and no softcap / ALiBi, the scale is folded into the exp2 argument (one FMA per score).

Programmable calls (issue [15]): a score_mod / mask_mod compiled by mod_codegen.py is a constexpr jit
function applied at the score stage in flashport.programmable's order (softcap -> ALiBi -> score_mod in
natural units -> built-in mask AND mask_mod), and a block mask's empty tiles are skipped (block_skip.py).
Without them every such parameter is a constexpr None / False and the kernels are generated as before.

Equivalent PyTorch math (per batch b, query head h, kv head h // G):
    p = softmax(score(q[b, :, h] @ k[b, :, h // G].T), -1)     (score: common.transform_log2, mask_scores)
    out[b, :, h] = (p * keep / (1 - dropout_p)) @ v[b, :, h // G]
    lse[b, h] = logsumexp(score, -1)                           (natural log, float32; -inf if no key)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (LN2_K, LOG2E_K, KernelArgs, cdiv, dropout_keep, head_scalars, key_tiles, load_head_tile, load_tile,
                     mask_scores, offset, seq_bounds, live_row, tile_state, tile_part, transform_log2)
from . import attn_fwd_hopper
from .launch import DirectLauncher, triton_direct
from .tuning import launch_with_fallback


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, lo, hi, full_lo, full_hi, offs_m, sk, diag,
               left, right, qk_scale, cap_in, cap_out, slope2, seed, rng_offset, bh, drop_threshold, b, h, mods,
               skip_base, skip_step, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
               SCALE_FOLD: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr,
               pages=None, stride_kp=0, stride_vp=0, PAGE: tl.constexpr = 0):
    """Key tiles [lo, hi) (lo a multiple of BLOCK_N); k_ptr / v_ptr point at key row lo.  Tiles in
    [full_lo, full_hi) need no mask (used when MASK == 2, see common.mask_scores).  SCORE_MOD / MASK_MOD: the
    generated functions of kernels/mod_codegen.py (None without mods), reading the captured tensors in `mods`;
    b, h: the batch entry and query head they see.  BLOCK_SKIP: key tile t is visited only where
    skip_base[t * skip_step] != 0 (a block mask's live tiles).  PAGE > 0: a paged KV cache, key n in slot n % PAGE
    of page pages[n // PAGE] (page strides stride_kp / stride_vp), looked up once per tile where a page holds whole
    tiles, else once per key; k_ptr / v_ptr then point at the head's row 0 of page 0 and do not move."""
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_offs = offs_nb[:, None] * stride_ks + offs_d[None, :]
    v_offs = offs_nb[:, None] * stride_vs + offs_dv[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        state = tile_state(skip_base, start_n, BLOCK_N, skip_step, BLOCK_SKIP)
        if state != 0:   # a tile the block mask leaves empty: skipped
            offs_n = start_n + offs_nb
            if PAGE > 0 and PAGE % BLOCK_N == 0:   # the tile lies in one page: one page-table entry, contiguous rows
                page = tl.load(pages + start_n // PAGE).to(tl.int64)
                rows = (start_n % PAGE + offs_nb).to(tl.int64)
                k = load_tile(k_ptr + page * stride_kp + rows[:, None] * stride_ks + offs_d[None, :],
                              offs_n[:, None], sk, offs_d[None, :], D, MASK != 0, D != BLOCK_D)
                v_tile = v_ptr + page * stride_vp + rows[:, None] * stride_vs + offs_dv[None, :]
            elif PAGE > 0:   # one page-table entry per key (a tile spans pages); keys past sk read page 0
                page = tl.load(pages + offs_n // PAGE, mask=offs_n < sk, other=0).to(tl.int64)
                slot = offs_n % PAGE
                k = load_tile(k_ptr + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
                              offs_n[:, None], sk, offs_d[None, :], D, MASK != 0, D != BLOCK_D)
                v_tile = v_ptr + (page * stride_vp + slot * stride_vs)[:, None] + offs_dv[None, :]
            else:
                k = load_tile(k_ptr + k_offs, offs_n[:, None], sk, offs_d[None, :], D, MASK != 0, D != BLOCK_D)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            boundary = (start_n < full_lo) | (start_n >= full_hi)
            if SCALE_FOLD:
                # Plain scores with a positive scale: max(qk * c) = max(qk) * c, so the scale joins the
                # subtraction in one FMA (qk * c - m) instead of a separate multiply per score.
                qk = mask_scores(qk, offs_m[:, None], offs_n[None, :], sk, diag, left, right, boundary, MASK, HAS_LEFT,
                                 HAS_RIGHT)
                if MASK_MOD is not None:
                    if state != 2:   # a FULL tile: mask_mod is true everywhere
                        qk = tl.where(MASK_MOD(b, h, offs_m[:, None], offs_n[None, :], mods), qk, float("-inf"))
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                s, t = transform_log2(qk, offs_m[:, None], offs_n[None, :], diag, qk_scale, cap_in, cap_out, slope2,
                                      SOFTCAP, ALIBI, PRECISION == "ieee")
                if SCORE_MOD is not None:
                    # The mod sees natural units (the launcher's constants make s natural here); back to log2 after it.
                    s = SCORE_MOD(s, b, h, offs_m[:, None], offs_n[None, :], mods) * LOG2E_K
                s = mask_scores(s, offs_m[:, None], offs_n[None, :], sk, diag, left, right, boundary, MASK, HAS_LEFT,
                                HAS_RIGHT)
                if MASK_MOD is not None:
                    if state != 2:   # a FULL tile: mask_mod is true everywhere
                        s = tl.where(MASK_MOD(b, h, offs_m[:, None], offs_n[None, :], mods), s, float("-inf"))
                m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_ij
            if MASK != 0 or (SCORE_MOD is not None or MASK_MOD is not None):   # mods hide keys in any tile
                # A row that has seen no visible key yet has m_ij = -inf; a finite stand-in in the subtraction
                # keeps exp2(-inf - m) = 0 instead of NaN.  The stand-in must not become the running max: a
                # later tile's scores below it would be scaled by 2^(s - 0) and underflow (issue [5]: a Q tile
                # taller than the K tile under a narrow window, p << 1 for the one visible key).
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            if SCALE_FOLD:
                p = tl.exp2(qk * qk_scale - m_sub[:, None])
            else:
                p = tl.exp2(s - m_sub[:, None])
            alpha = tl.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                # l_i normalises the undropped probabilities; kept ones are rescaled in the epilogue.
                p = tl.where(dropout_keep(seed, rng_offset, bh, offs_m[:, None], offs_n[None, :], drop_threshold),
                             p, 0.0)
            if PAGE > 0:
                v = load_tile(v_tile, offs_n[:, None], sk, offs_dv[None, :], DV, MASK != 0, DV != BLOCK_DV)
            else:
                v = load_tile(v_ptr + v_offs, offs_n[:, None], sk, offs_dv[None, :], DV, MASK != 0, DV != BLOCK_DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_ij
        if PAGE == 0:
            k_ptr += BLOCK_N * stride_ks
            v_ptr += BLOCK_N * stride_vs
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "left", "right"])
def _attn_fwd(Q, K, V, Out, Lse, Lse2, Slopes, CuQ, CuK, Rng,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
              stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_slope_b,
              seqlen_q, seqlen_k, group, left, right, qk_scale, cap_in, cap_out, drop_threshold, drop_scale, mods,
              skip, Pages, stride_pb, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
              PRECISION: tl.constexpr, SPLIT: tl.constexpr, SCALE_FOLD: tl.constexpr, ALIGN: tl.constexpr,
              SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr, PAGE: tl.constexpr):
    # IS_VARLEN 2 (a KV cache): CuK holds each entry's valid key count; PAGE > 0: the cache is paged, entry b's
    # page table the row Pages + b * stride_pb, and stride_kb / stride_vb are the cache's page strides.
    # Heaviest Q tiles (largest row index: most keys under causal) are scheduled first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    n_heads = tl.num_programs(1)
    q_start, sq, k_start, sk = seq_bounds(b, CuQ, CuK, seqlen_q, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= sq:
        return
    diag = sk - sq
    kvh = h // group
    offs_mb = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_mb
    offs_dv = tl.arange(0, BLOCK_DV)
    # int64 before any multiply by a stride: offsets may pass 2**31 elements.
    b64 = tl.cast(b, tl.int64)
    q = load_head_tile(Q, b64, h, q_start + start_m, stride_qb, stride_qh, stride_qs, start_m, sq, BLOCK_M, D, BLOCK_D,
                       ALIGN)

    # Key tiles some row sees [lo, hi), of which [full_lo, full_hi) need no mask.
    lo, hi, full_lo, full_hi = key_tiles(start_m, sq, sk, diag, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    slope2, seed, rng_offset, bh = head_scalars(Slopes, Rng, b, h, n_heads, stride_slope_b, ALIBI, DROPOUT)
    if SCORE_MOD is not None:
        slope2 = slope2 * LN2_K   # natural units before a score_mod (see _fwd_tiles)
    skip_base, skip_step = live_row(skip, b, h, pid_m, True, BLOCK_SKIP)

    pages = Pages
    if PAGE > 0:
        pages = Pages + b64 * stride_pb
        k_base = K + offset(b64 * 0, kvh, 0, stride_kb, stride_kh, stride_ks, ALIGN)
        v_base = V + offset(b64 * 0, kvh, 0, stride_vb, stride_vh, stride_vs, ALIGN)
    else:
        k_base = K + offset(b64, kvh, k_start, stride_kb, stride_kh, stride_ks, ALIGN)
        v_base = V + offset(b64, kvh, k_start, stride_vb, stride_vh, stride_vs, ALIGN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # SPLIT: boundary tiles (masked), full tiles (no mask code), boundary tiles again; otherwise one
    # pipelined loop masking behind a run-time branch (see kernels/common.py).
    for part in tl.static_range(3 if SPLIT else 1):
        p_lo, p_hi = tile_part(lo, hi, full_lo, full_hi, part, SPLIT)
        r = tl.cast(p_lo, tl.int64)
        if PAGE > 0:   # a paged cache's tiles find their rows themselves
            r = r * 0
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base + r * stride_ks, v_base + r * stride_vs, stride_ks, stride_vs, p_lo, p_hi,
            full_lo, full_hi, offs_m, sk, diag, left, right, qk_scale, cap_in, cap_out, slope2, seed, rng_offset, bh,
            drop_threshold, b, h, mods, skip_base, skip_step, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
            (0 if part == 1 else 1) if SPLIT else 2, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, PRECISION,
            SCALE_FOLD, SCORE_MOD, MASK_MOD, BLOCK_SKIP, pages, stride_kb, stride_vb, PAGE)

    # Epilogue: rows that saw no key (l_i = 0) get out = 0 and lse = -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (drop_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2_K)
    o_ptr = Out + offset(b64, h, q_start + start_m, stride_ob, stride_oh, stride_os, ALIGN)
    tl.store(o_ptr + offs_mb[:, None] * stride_os + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < sq) & (offs_dv[None, :] < DV))
    row_stats = b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + tl.cast(q_start, tl.int64)
    tl.store(Lse + row_stats + offs_m, lse, mask=offs_m < sq)
    # The backward's copy, in the log2 domain (no ln2 round trip in P = exp2(s2 - lse2)) and +inf
    # for rows without keys, so that P = 0 there.
    lse2 = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(Lse2 + row_stats + offs_m, lse2, mask=offs_m < sq)


def forward(spec, q, k, v, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None, config=None,
            hopper=False, mods=None, block_mask=None):
    """Launch the forward.  Dense: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] ->
    out [B, Sq, Hq, Dv] (q's dtype), lse [B, Hq, Sq] float32, lse2 (lse / ln 2, +inf where lse is
    -inf; what the backward reads).  Varlen: q [total_q, Hq, D] etc. -> out [total_q, Hq, Dv],
    lse and lse2 [Hq, total_q]; rows past cu_seqlens_q[-1] are zero with lse -inf.
    config: a tuning.KernelConfig to force (autotuning); default: the table / fallback choice.
    hopper: the gluon backend's call: the Gluon kernel of attn_fwd_hopper (FlashAttention-3's schedule), which
    the backend's supports() already accepted for this spec; these kernels serve instead when the tensors are
    not TMA-ready (strided, misaligned) or the Gluon kernel failed to compile here (counted, see fallbacks).
    mods: the call's kernels.mod_codegen.CompiledMods, or None; block_mask: a flashport BlockMask whose empty tiles
    are skipped (its per-element rule is in mods.mask), or None."""
    varlen = spec.kind == "varlen"
    if hopper:
        why = attn_fwd_hopper.tensor_reasons(q, k, v)
        result = None if why else attn_fwd_hopper.forward(spec, q, k, v, alibi=alibi)
        if result is not None:
            return result
        attn_fwd_hopper.fallbacks[why[0] if why else "compile failure"] += 1
    hq, dv = spec.heads_q, spec.head_dim_v
    if varlen:
        # Rows past cu_seqlens_q[-1] belong to no program: pre-filled here (no host sync needed).
        out = torch.zeros(q.shape[0], hq, dv, dtype=q.dtype, device=q.device)
        lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        o_strides = (0, out.stride(0), out.stride(1))
        l_strides = (0, lse.stride(0))
    else:
        out = torch.empty(spec.batch, spec.seqlen_q, hq, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(spec.batch, hq, spec.seqlen_q, dtype=torch.float32, device=q.device)
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    lse2 = torch.empty_like(lse)
    if out.numel() == 0 or spec.seqlen_q == 0 or spec.batch == 0:
        if not varlen:
            lse.fill_(float("-inf"))
        return out, lse, lse2.fill_(float("inf"))
    a = KernelArgs(spec, q, k, v, alibi, cu_seqlens_q, cu_seqlens_k, rng_state, mods, block_mask)
    _launch(spec, q, k, v, out, lse, lse2, o_strides, l_strides, a, config)
    return out, lse, lse2


def kvcache_forward(spec, q, k_cache, v_cache, seqlens_k, block_table=None, alibi=None, config=None):
    """A KV-cache call with many queries (chunked prefill, speculative verification) on this prefill kernel:
    q [B, Sq, Hq, D] against the first seqlens_k[b] keys of entry b's cache, bottom-right aligned.  Dense cache
    [B, capacity, Hkv, D]; paged [num_blocks, page, Hkv, D] with block_table int32 [B, max_blocks] (spec.paged).
    seqlens_k int32 [B] on the device (never read on the host) -> (out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)."""
    bsz, sq, hq, _ = q.shape
    out = torch.empty(bsz, sq, hq, spec.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or spec.seqlen_k == 0:   # nothing to attend to: 0, -inf
        return out.zero_(), lse.fill_(float("-inf"))
    a = KernelArgs(spec, q, k_cache, v_cache, alibi)
    a.cu_k = seqlens_k
    a.constexprs["IS_VARLEN"] = 2
    pages = (block_table, block_table.stride(0), spec.page_block_size) if spec.paged else (None, 0, 0)
    _launch(spec, q, k_cache, v_cache, out, lse, torch.empty_like(lse), out.stride()[:3], lse.stride()[:2], a, config,
            pages)
    return out, lse


_fwd_launch = DirectLauncher(_attn_fwd)


def _launch(spec, q, k, v, out, lse, lse2, o_strides, l_strides, a: KernelArgs, config, pages=(None, 0, 0)):
    """pages: (block_table, its row stride, page size) of a paged KV cache, else (None, 0, 0)."""
    scale_fold = spec.softmax_scale > 0 and spec.softcap == 0 and a.slopes is None and a.constexprs["SCORE_MOD"] is None
    a.cover(out)
    table, stride_pb, page = pages
    direct = triton_direct(q)

    def launch(cfg):
        grid = (cdiv(spec.seqlen_q, cfg.block_m), spec.heads_q, spec.batch)
        args = (q, k, v, out, lse, lse2, a.slopes, a.cu_q, a.cu_k, a.rng,
                *a.q_strides, *a.k_strides, *a.v_strides, *o_strides, *l_strides, a.slope_stride,
                a.seqlen_q, a.seqlen_k, a.group, a.left, a.right, a.qk_scale, a.cap_in, a.cap_out,
                a.drop_threshold, a.drop_scale, a.mods, a.skip(cfg.block_m, cfg.block_n), table, stride_pb)
        _fwd_launch(grid, args, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split, SCALE_FOLD=scale_fold,
                                     **a.constexprs, PAGE=page, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                    direct=direct)

    launch_with_fallback("fwd", spec, q.device, launch, config, (a.variant, a.constexprs["BLOCK_SKIP"]))
