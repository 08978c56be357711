"""FlashAttention-2 backward in Triton: no N x N tensor in memory, no atomics (bitwise deterministic).

Kernels:
  1. `_bwd_preprocess`: Delta = rowsum(dO * O)                      [per query row, float32]
  2. `_bwd_dkdv`: one program per (K/V tile, query head, batch entry).  K and V (of the query head's
     kv head: never expanded in memory) stay on chip while the Q tiles that can see the tile stream
     through, accumulating dK, dV in registers.  With GQA each program writes float32 partials for
     its query head, summed over the group afterwards in a fixed order (`backward`).
  3. `_bwd_dq`: one program per (Q tile, query head, batch entry) streaming K/V tiles.
No addition depends on scheduling, so every backward here is bitwise reproducible.  FlashAttention-2
instead adds dQ from the dK/dV kernel with float32 atomics (5 matmuls per tile pair instead of 7); that
variant was built and measured here and lost: docs/PERFLOG.md row 5.  (On sm_90 with deterministic=False,
`backward` hands D=64 and D=128 calls to kernels/attn_bwd_hopper.py: FA3's schedule, dQ summed with
TMA reduce-adds.)
All recompute P = exp2(s2 - lse2) from the saved LSE.  Equivalent PyTorch math:
    dV = (P * Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - Delta) * dsoftcap,
    dQ = scale * dS K,   dK = scale * dS^T Q     (the kernels fold scale into dS)
with Z = keep / (1 - dropout_p) and dsoftcap = 1 - tanh^2 (1 without softcap).
As in the forward, tiles the mask hides are skipped and only boundary tiles apply the mask.  With a score_mod,
dS is chained through its generated derivative (dS *= d score_mod / d score, 0 where P is); mask_mod and block
masks as in the forward.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import attn_bwd_hopper
from .. import env
from .common import (LN2_K, LOG2E_K, KernelArgs, block_dim, cdiv, dropout_keep, head_scalars, head_strides, key_tiles,
                     load_head_tile, load_tile, mask_scores, offset, query_tiles, seq_bounds, stride_align, live_row, tile_state,
                     tile_part, transform_log2)
from .launch import DirectLauncher, triton_direct
from .tuning import INTERPRETER_CONFIG, interpreting, launch_with_fallback


@triton.jit(do_not_specialize=["seqlen_q"])
def _bwd_preprocess(Out, DO, Delta, CuQ, DQacc, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                    stride_lb, stride_lh, stride_ab, stride_as, stride_ah, seqlen_q, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, IS_VARLEN: tl.constexpr, ALIGN: tl.constexpr,
                    ZERO_DQ: tl.constexpr):
    """Delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] (float32; laid out like lse).
    ZERO_DQ: also zero the rows' float32 dQ accumulator DQacc [B, Sq, Hq, DV] (the Hopper backward adds dQ
    into it; D == Dv there): one launch instead of a separate torch.zeros memset."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, sq, _, _ = seq_bounds(b, CuQ, CuQ, seqlen_q, seqlen_q, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= sq:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    b64, h64, row0 = tl.cast(b, tl.int64), tl.cast(h, tl.int64), q_start + start_m
    o = load_head_tile(Out, b64, h64, row0, stride_ob, stride_oh, stride_os, start_m, sq, BLOCK_M, DV, BLOCK_DV, ALIGN)
    do = load_head_tile(DO, b64, h64, row0, stride_dob, stride_doh, stride_dos, start_m, sq, BLOCK_M, DV, BLOCK_DV,
                        ALIGN)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_lb + h64 * stride_lh + tl.cast(q_start, tl.int64) + offs_m, delta, mask=offs_m < sq)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_DV)
        rows = tl.cast(q_start + offs_m, tl.int64)
        a_ptr = DQacc + b64 * stride_ab + h64 * stride_ah + rows[:, None] * stride_as + offs_d[None, :]
        tl.store(a_ptr, tl.zeros([BLOCK_M, BLOCK_DV], tl.float32), mask=(offs_m[:, None] < sq) & (offs_d[None, :] < DV))


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qs, stride_dos, lo, hi,
                full_lo, full_hi, offs_n, sq, sk, diag, left, right, qk_scale, cap_in, cap_out, slope2, seed,
                rng_offset, bh, drop_threshold, drop_scale, sm_scale, b, h, mods, skip_base, skip_step, D: tl.constexpr,
                DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                DROPOUT: tl.constexpr, PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr, gcap=None, CAP_GRAD: tl.constexpr = None):
    """Accumulate dK, dV over Q tiles [lo, hi) of one query head; q_ptr / do_ptr at row lo, lse_ptr /
    delta_ptr at row 0; Q tiles in [full_lo, full_hi) need no mask (MASK == 2).  Works on transposed
    scores s^T [BLOCK_N, BLOCK_M].  dS carries softmax_scale, so dK needs no epilogue scaling.  Mods as in
    attn_fwd._fwd_tiles; SCORE_GRAD = d SCORE_MOD / d score chains dS through the score_mod.  BLOCK_SKIP as in
    _fwd_tiles, over Q tiles.  CAP_GRAD (mod_codegen's cap_grad_fn): adds dY * d score_mod / d value into the
    gradient buffers in `gcap` of the tensors the mod reads, dY = P * (dP - Delta) the gradient of the mod's output
    (this kernel visits every visible pair once)."""
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_offs = offs_mb[:, None] * stride_qs + offs_d[None, :]
    do_offs = offs_mb[:, None] * stride_dos + offs_dv[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        state = tile_state(skip_base, start_m, BLOCK_M, skip_step, BLOCK_SKIP)
        if state != 0:   # a tile the block mask leaves empty: skipped
            offs_m = start_m + offs_mb
            q = load_tile(q_ptr + q_offs, offs_m[:, None], sq, offs_d[None, :], D, MASK != 0, D != BLOCK_D)
            do = load_tile(do_ptr + do_offs, offs_m[:, None], sq, offs_dv[None, :], DV, MASK != 0, DV != BLOCK_DV)
            if MASK != 0:
                # Rows past Sq get lse2 = +inf (as rows without keys already have): P = 0, no NaN.
                lse2 = tl.load(lse_ptr + offs_m, mask=offs_m < sq, other=float("inf"))
                delta = tl.load(delta_ptr + offs_m, mask=offs_m < sq, other=0.0)
            else:
                lse2 = tl.load(lse_ptr + offs_m)
                delta = tl.load(delta_ptr + offs_m)
            qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            s_t, t_t = transform_log2(qk_t, offs_m[None, :], offs_n[:, None], diag, qk_scale, cap_in, cap_out, slope2,
                                  SOFTCAP, ALIBI, PRECISION == "ieee")
            if SCORE_MOD is not None:   # natural units around the mod, as in the forward
                g_t = SCORE_GRAD(s_t, b, h, offs_m[None, :], offs_n[:, None], mods)
                if CAP_GRAD is not None:
                    s_in_t = s_t
                s_t = SCORE_MOD(s_t, b, h, offs_m[None, :], offs_n[:, None], mods) * LOG2E_K
            s_t = mask_scores(s_t, offs_m[None, :], offs_n[:, None], sk, diag, left, right,
                              (start_m < full_lo) | (start_m >= full_hi), MASK, HAS_LEFT, HAS_RIGHT)
            if MASK_MOD is not None:
                if state != 2:   # a FULL tile: mask_mod is true everywhere
                    s_t = tl.where(MASK_MOD(b, h, offs_m[None, :], offs_n[:, None], mods), s_t, float("-inf"))
            p_t = tl.exp2(s_t - lse2[None, :])
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            if DROPOUT:
                keep = dropout_keep(seed, rng_offset, bh, offs_m[None, :], offs_n[:, None], drop_threshold)
                pz_t = tl.where(keep, p_t * drop_scale, 0.0)
                dp_t = tl.where(keep, dp_t * drop_scale, 0.0)
            else:
                pz_t = p_t
            dv += tl.dot(pz_t.to(do.dtype), do, input_precision=PRECISION)
            if CAP_GRAD is not None:
                live_t = p_t != 0.0
                CAP_GRAD(s_in_t, b, h, offs_m[None, :], offs_n[:, None], mods,
                         tl.where(live_t, p_t * (dp_t - delta[None, :]), 0.0), live_t, gcap)
            # scale * P * (dP - Delta) with the scale inside one FMA: dS already holds d(score) / d(qk).
            ds_t = p_t * (dp_t * sm_scale - (delta * sm_scale)[None, :])
            if SCORE_MOD is not None:
                # 0 where p is: a hidden pair's derivative may be anything (inf, NaN), and must not reach dK
                ds_t = tl.where(p_t == 0.0, 0.0, ds_t * g_t)
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
        q_ptr += BLOCK_M * stride_qs
        do_ptr += BLOCK_M * stride_dos
    return dk, dv


@triton.jit
def _dkdv_head(dk, dv, k, v, Q, DO, Lse, Delta, Slopes, Rng, b, b64, h, n_heads, pid_n, q_start, sq, sk, diag, lo, hi,
               full_lo, full_hi, offs_n, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb,
               stride_lh, stride_slope_b, left, right, qk_scale, cap_in, cap_out, drop_threshold, drop_scale, sm_scale,
               mods, skip, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
               ALIGN: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
               BLOCK_SKIP: tl.constexpr, gcap, CAP_GRAD: tl.constexpr):
    """dK, dV of one K/V tile accumulated over query head h's Q tiles [lo, hi)."""
    slope2, seed, rng_offset, bh = head_scalars(Slopes, Rng, b, h, n_heads, stride_slope_b, ALIBI, DROPOUT)
    if SCORE_MOD is not None:
        slope2 = slope2 * LN2_K   # natural units before a score_mod
    skip_base, skip_step = live_row(skip, b, h, pid_n, False, BLOCK_SKIP)
    h64, q0 = tl.cast(h, tl.int64), tl.cast(q_start, tl.int64)
    q_ptr = Q + offset(b64, h64, q0, stride_qb, stride_qh, stride_qs, ALIGN)
    do_ptr = DO + offset(b64, h64, q0, stride_dob, stride_doh, stride_dos, ALIGN)
    lse_ptr = Lse + b64 * stride_lb + h64 * stride_lh + q0
    delta_ptr = Delta + b64 * stride_lb + h64 * stride_lh + q0
    # SPLIT: boundary Q tiles (masked), full tiles (no mask code), boundary tiles again; otherwise one
    # loop masking behind a run-time branch (see kernels/common.py).
    for part in tl.static_range(3 if SPLIT else 1):
        p_lo, p_hi = tile_part(lo, hi, full_lo, full_hi, part, SPLIT)
        r = tl.cast(p_lo, tl.int64)
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_ptr + r * stride_qs, do_ptr + r * stride_dos, lse_ptr, delta_ptr, stride_qs,
            stride_dos, p_lo, p_hi, full_lo, full_hi, offs_n, sq, sk, diag, left, right, qk_scale, cap_in, cap_out,
            slope2, seed, rng_offset, bh, drop_threshold, drop_scale, sm_scale, b, h, mods, skip_base, skip_step, D, DV,
            BLOCK_M, BLOCK_D, BLOCK_DV, (0 if part == 1 else 1) if SPLIT else 2, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
            DROPOUT, PRECISION, SCORE_MOD, SCORE_GRAD, MASK_MOD, BLOCK_SKIP, gcap, CAP_GRAD)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "left", "right"])
def _bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DVt, Slopes, CuQ, CuK, Rng,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
              stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
              stride_dvb, stride_dvs, stride_dvh, stride_lb, stride_lh,
              stride_slope_b, seqlen_q, seqlen_k, group, left, right, qk_scale, cap_in, cap_out, drop_threshold,
              drop_scale, sm_scale, mods, skip, gcap, q_chunks, stride_dkc, stride_dvc, D: tl.constexpr,
              DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              SPLIT: tl.constexpr, ALIGN: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
              MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr, CAP_GRAD: tl.constexpr, GROUP_LOOP: tl.constexpr):
    """GROUP_LOOP: one program per (K/V tile, kv head, batch entry) accumulates dK, dV over every query head of the
    kv head's GQA group (K and V read once, dK and dV written once in their own dtype); otherwise one program per
    query head, writing dK, dV of that head alone (float32 partials under GQA, summed by `backward`).
    q_chunks > 1: q_chunks programs share each K/V tile, each over its own run of the tile's Q tiles, writing float32
    partials at DK + chunk * stride_dkc (summed by `backward`; see q_chunks())."""
    pid_n = tl.program_id(0)
    chunk = 0
    if q_chunks > 1:
        chunk = pid_n % q_chunks
        pid_n = pid_n // q_chunks
    pid_h = tl.program_id(1)   # the query head (its K/V from kv head pid_h // G), or with GROUP_LOOP the kv head
    b = tl.program_id(2)
    if GROUP_LOOP:
        kvh = pid_h
        n_heads = tl.num_programs(1) * group
    else:
        kvh = pid_h // group
        n_heads = tl.num_programs(1)
    q_start, sq, k_start, sk = seq_bounds(b, CuQ, CuK, seqlen_q, seqlen_k, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= sk:
        return
    diag = sk - sq
    offs_nb = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_nb
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64, row0 = tl.cast(b, tl.int64), k_start + start_n
    k = load_head_tile(K, b64, kvh, row0, stride_kb, stride_kh, stride_ks, start_n, sk, BLOCK_N, D, BLOCK_D, ALIGN)
    v = load_head_tile(V, b64, kvh, row0, stride_vb, stride_vh, stride_vs, start_n, sk, BLOCK_N, DV, BLOCK_DV, ALIGN)

    # Q tiles with a row that sees this key tile [lo, hi), of which [full_lo, full_hi) need no mask.
    lo, hi, full_lo, full_hi = query_tiles(start_n, sq, sk, diag, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if q_chunks > 1:   # this program's run of Q tiles; its full tiles are the full tiles inside it
        per = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M), q_chunks) * BLOCK_M
        c_lo = tl.minimum(lo + chunk * per, hi)
        c_hi = tl.minimum(c_lo + per, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, c_lo), c_hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), c_hi)
        lo = c_lo
        hi = c_hi
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if GROUP_LOOP:
        for hg in range(0, group):
            dk, dv = _dkdv_head(
                dk, dv, k, v, Q, DO, Lse, Delta, Slopes, Rng, b, b64, pid_h * group + hg, n_heads, pid_n, q_start, sq,
                sk, diag, lo, hi, full_lo, full_hi, offs_n, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos,
                stride_doh, stride_lb, stride_lh, stride_slope_b, left, right, qk_scale, cap_in, cap_out,
                drop_threshold, drop_scale, sm_scale, mods, skip, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, PRECISION, SPLIT, ALIGN, SCORE_MOD, SCORE_GRAD, MASK_MOD,
                BLOCK_SKIP, gcap, CAP_GRAD)
    else:
        dk, dv = _dkdv_head(
            dk, dv, k, v, Q, DO, Lse, Delta, Slopes, Rng, b, b64, pid_h, n_heads, pid_n, q_start, sq, sk, diag, lo, hi,
            full_lo, full_hi, offs_n, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb,
            stride_lh, stride_slope_b, left, right, qk_scale, cap_in, cap_out, drop_threshold, drop_scale, sm_scale,
            mods, skip, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT, PRECISION,
            SPLIT, ALIGN, SCORE_MOD, SCORE_GRAD, MASK_MOD, BLOCK_SKIP, gcap, CAP_GRAD)

    row_mask = offs_n[:, None] < sk
    h64 = tl.cast(pid_h, tl.int64)   # the head dK / dV are written to: the program's own
    c64 = tl.cast(chunk, tl.int64)
    dk_ptr = DK + c64 * stride_dkc + offset(b64, h64, row0, stride_dkb, stride_dkh, stride_dks, ALIGN)
    tl.store(dk_ptr + offs_nb[:, None] * stride_dks + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=row_mask & (offs_d[None, :] < D))
    dv_ptr = DVt + c64 * stride_dvc + offset(b64, h64, row0, stride_dvb, stride_dvh, stride_dvs, ALIGN)
    tl.store(dv_ptr + offs_nb[:, None] * stride_dvs + offs_dv[None, :], dv.to(DVt.dtype.element_ty),
             mask=row_mask & (offs_dv[None, :] < DV))


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_ks, stride_vs, lo, hi, full_lo, full_hi, offs_m, sk, diag,
              left, right,
              qk_scale, cap_in, cap_out, slope2, seed, rng_offset, bh, drop_threshold, drop_scale, b, h, mods,
              skip_base, skip_step, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr):
    """Accumulate dS K over key tiles [lo, hi); k_ptr / v_ptr at key row lo; key tiles in
    [full_lo, full_hi) need no mask (MASK == 2).  Mods as in _dkdv_tiles."""
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_offs = offs_nb[:, None] * stride_ks + offs_d[None, :]
    v_offs = offs_nb[:, None] * stride_vs + offs_dv[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        state = tile_state(skip_base, start_n, BLOCK_N, skip_step, BLOCK_SKIP)
        if state != 0:   # a tile the block mask leaves empty: skipped
            offs_n = start_n + offs_nb
            k = load_tile(k_ptr + k_offs, offs_n[:, None], sk, offs_d[None, :], D, MASK != 0, D != BLOCK_D)
            v = load_tile(v_ptr + v_offs, offs_n[:, None], sk, offs_dv[None, :], DV, MASK != 0, DV != BLOCK_DV)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s, t = transform_log2(qk, offs_m[:, None], offs_n[None, :], diag, qk_scale, cap_in, cap_out, slope2,
                                  SOFTCAP, ALIBI, PRECISION == "ieee")
            if SCORE_MOD is not None:   # natural units around the mod, as in the forward
                g = SCORE_GRAD(s, b, h, offs_m[:, None], offs_n[None, :], mods)
                s = SCORE_MOD(s, b, h, offs_m[:, None], offs_n[None, :], mods) * LOG2E_K
            s = mask_scores(s, offs_m[:, None], offs_n[None, :], sk, diag, left, right,
                            (start_n < full_lo) | (start_n >= full_hi), MASK, HAS_LEFT, HAS_RIGHT)
            if MASK_MOD is not None:
                if state != 2:   # a FULL tile: mask_mod is true everywhere
                    s = tl.where(MASK_MOD(b, h, offs_m[:, None], offs_n[None, :], mods), s, float("-inf"))
            p = tl.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            if DROPOUT:
                keep = dropout_keep(seed, rng_offset, bh, offs_m[:, None], offs_n[None, :], drop_threshold)
                dp = tl.where(keep, dp * drop_scale, 0.0)
            ds = p * (dp - delta[:, None])
            if SCORE_MOD is not None:
                ds = tl.where(p == 0.0, 0.0, ds * g)   # as in _dkdv_tiles
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "left", "right"])
def _bwd_dq(Q, K, V, DO, Lse, Delta, DQ, Slopes, CuQ, CuK, Rng,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
            stride_slope_b, seqlen_q, seqlen_k, group, left, right, qk_scale, cap_in, cap_out, drop_threshold,
            drop_scale, sm_scale, mods, skip, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            DROPOUT: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr, ALIGN: tl.constexpr,
            SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, BLOCK_SKIP: tl.constexpr):
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
    offs_d = tl.arange(0, BLOCK_D)
    b64, h64, row0 = tl.cast(b, tl.int64), tl.cast(h, tl.int64), q_start + start_m
    q = load_head_tile(Q, b64, h64, row0, stride_qb, stride_qh, stride_qs, start_m, sq, BLOCK_M, D, BLOCK_D, ALIGN)
    do = load_head_tile(DO, b64, h64, row0, stride_dob, stride_doh, stride_dos, start_m, sq, BLOCK_M, DV, BLOCK_DV,
                        ALIGN)
    row_stats = b64 * stride_lb + h64 * stride_lh + tl.cast(q_start, tl.int64)
    # lse2 is +inf for rows that see no key, and rows past Sq read +inf: P = 0 there, never NaN.
    lse2 = tl.load(Lse + row_stats + offs_m, mask=offs_m < sq, other=float("inf"))
    delta = tl.load(Delta + row_stats + offs_m, mask=offs_m < sq, other=0.0)

    # Same key tiles as the forward.
    lo, hi, full_lo, full_hi = key_tiles(start_m, sq, sk, diag, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    slope2, seed, rng_offset, bh = head_scalars(Slopes, Rng, b, h, n_heads, stride_slope_b, ALIBI, DROPOUT)
    if SCORE_MOD is not None:
        slope2 = slope2 * LN2_K   # natural units before a score_mod
    skip_base, skip_step = live_row(skip, b, h, pid_m, True, BLOCK_SKIP)
    k_base = K + offset(b64, kvh, k_start, stride_kb, stride_kh, stride_ks, ALIGN)
    v_base = V + offset(b64, kvh, k_start, stride_vb, stride_vh, stride_vs, ALIGN)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in tl.static_range(3 if SPLIT else 1):  # as in the forward (common.py's SPLIT note)
        p_lo, p_hi = tile_part(lo, hi, full_lo, full_hi, part, SPLIT)
        r = tl.cast(p_lo, tl.int64)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_base + r * stride_ks, v_base + r * stride_vs, stride_ks, stride_vs,
                       p_lo, p_hi, full_lo, full_hi, offs_m, sk, diag, left, right, qk_scale, cap_in, cap_out, slope2,
                       seed, rng_offset, bh, drop_threshold, drop_scale, b, h, mods, skip_base, skip_step, D, DV,
                       BLOCK_N, BLOCK_D, BLOCK_DV, (0 if part == 1 else 1) if SPLIT else 2, HAS_LEFT, HAS_RIGHT,
                       SOFTCAP, ALIBI, DROPOUT, PRECISION, SCORE_MOD, SCORE_GRAD, MASK_MOD, BLOCK_SKIP)
    dq_ptr = DQ + offset(b64, h64, row0, stride_dqb, stride_dqh, stride_dqs, ALIGN)
    tl.store(dq_ptr + offs_mb[:, None] * stride_dqs + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < sq) & (offs_d[None, :] < D))


def backward(spec, do, q, k, v, out, lse2, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None,
             dlse=None, configs=None, hopper=False, mods=None, block_mask=None):
    """Gradients (dq, dk, dv) shaped like q, k, v, given dO shaped like out and the forward's out and
    lse2 (its log2-domain lse, see attn_fwd.forward), then the gradients of mods.grad_leaves (tensors the score_mod
    reads) where the call needs them.
    dlse: optional gradient of the lse output (d lse / d s = P, so it folds into Delta: Delta - dlse).
    configs: optional {"bwd_dkdv": KernelConfig, "bwd_dq": KernelConfig} to force (autotuning).
    hopper: the gluon backend's call (attn_bwd_hopper, whose spec limits its supports() checked); these kernels
    serve instead when the tensors are not TMA-ready or the Gluon kernel failed to compile here (counted).
    mods, block_mask: as attn_fwd.forward's (the Hopper kernels take neither)."""
    varlen = spec.kind == "varlen"
    if do.stride(-1) != 1:
        do = do.contiguous()
    # Varlen rows past cu_seqlens[-1] are never written by a program: their gradients are zero.
    alloc = torch.zeros if varlen else torch.empty
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0 or spec.batch == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # sm_90, deterministic=False: FlashAttention-3's 5-matmul schedule in Gluon (kernels/attn_bwd_hopper.py),
    # which adds dQ into a float32 buffer that the preprocess zeroes.
    if hopper:
        why = attn_bwd_hopper.tensor_reasons(q, k, v, do)
        if why:
            attn_bwd_hopper.fallbacks[why[0]] += 1
            hopper = False
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if hopper else None
    l_strides = (0, lse2.stride(0)) if varlen else (lse2.stride(0), lse2.stride(1))
    delta = torch.empty_like(lse2)
    _preprocess(spec, out, do, delta, l_strides, cu_seqlens_q if varlen else None, dq_accum)
    if dlse is not None:
        delta.sub_(dlse)
    # None: the Gluon kernel failed to compile here and has switched itself off (the Triton kernels serve).
    if hopper:
        if attn_bwd_hopper.backward(spec, do, q, k, v, out, lse2, delta, dq=dq, dk=dk, dv=dv,
                                    dq_accum=dq_accum, alibi=alibi) is not None:
            return dq, dk, dv
        attn_bwd_hopper.fallbacks["compile failure"] += 1
    hq, hkv = spec.heads_q, spec.heads_kv
    a = KernelArgs(spec, q, k, v, alibi, cu_seqlens_q, cu_seqlens_k, rng_state, mods, block_mask)
    a.cover(do, out, dq, dk, dv)
    do_s = a.strides(do)
    common = (a.slope_stride, a.seqlen_q, a.seqlen_k, a.group, a.left, a.right, a.qk_scale, a.cap_in, a.cap_out,
              a.drop_threshold, a.drop_scale, spec.softmax_scale, a.mods)
    configs = configs or {}

    # GQA: with FLASHPORT_GQA_GROUP_LOOP=1 one program per kv head loops over its group's query heads (K, V read
    # once per tile, dK, dV written once); otherwise each program writes float32 partial dK, dV for its query
    # head, summed per group below in a fixed order (2 x (Hq / Hkv) float32 copies of dK / dV).  Both are
    # bitwise reproducible.
    group_loop = spec.group_size > 1 and env.flag("FLASHPORT_GQA_GROUP_LOOP")
    expand = spec.group_size > 1 and not group_loop
    dk_out, dv_out = dk, dv
    if expand:
        alloc32 = torch.zeros if varlen else torch.empty
        dk_out = alloc32((*k.shape[:-2], hq, k.shape[-1]), dtype=torch.float32, device=k.device)
        dv_out = alloc32((*v.shape[:-2], hq, v.shape[-1]), dtype=torch.float32, device=v.device)
        a.cover(dk_out, dv_out)

    cap_bufs, gcap, cap_grad = [], None, None
    if mods is not None and mods.cap_grad is not None:   # gradients of the tensors the score_mod reads
        cap_bufs, gcap = mods.gcap()
        cap_grad = mods.cap_grad
    direct = triton_direct(q)

    chunked = {}   # the launch's float32 partials over Q chunks, when q_chunks() splits (summed below)

    def launch_dkdv(cfg):
        heads = hkv if group_loop else hq
        chunks = q_chunks(spec, cfg, q.device, cdiv(spec.seqlen_k, cfg.block_n) * heads * spec.batch)
        dk_t, dv_t = dk_out, dv_out
        if chunks > 1:
            alloc32 = torch.zeros if varlen else torch.empty
            dk_t, dv_t = (alloc32((chunks, *t.shape), dtype=torch.float32, device=t.device) for t in (dk_out, dv_out))
            a.cover(dk_t[0], dv_t[0])
        chunked.update(chunks=chunks, dk=dk_t, dv=dv_t)
        grid = (cdiv(spec.seqlen_k, cfg.block_n) * chunks, heads, spec.batch)
        args = (q, k, v, do, lse2, delta, dk_t, dv_t, a.slopes, a.cu_q, a.cu_k, a.rng,
                *a.q_strides, *a.k_strides, *a.v_strides, *do_s, *a.strides(dk_t[0] if chunks > 1 else dk_t),
                *a.strides(dv_t[0] if chunks > 1 else dv_t), *l_strides, *common, a.skip(cfg.block_m, cfg.block_n),
                gcap, chunks, dk_t.stride(0) if chunks > 1 else 0, dv_t.stride(0) if chunks > 1 else 0)
        _dkdv_launch(grid, args, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split,
                                      SCORE_GRAD=a.score_grad, **a.constexprs, CAP_GRAD=cap_grad,
                                      GROUP_LOOP=group_loop, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                     direct=direct)

    def launch_dq(cfg):
        cfg = dq_config_with_mods(cfg, a)
        grid = (cdiv(spec.seqlen_q, cfg.block_m), hq, spec.batch)
        args = (q, k, v, do, lse2, delta, dq, a.slopes, a.cu_q, a.cu_k, a.rng, *a.q_strides, *a.k_strides,
                *a.v_strides, *do_s, *a.strides(dq), *l_strides, *common, a.skip(cfg.block_m, cfg.block_n))
        _dq_launch(grid, args, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split,
                                    SCORE_GRAD=a.score_grad, **a.constexprs, num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages), direct=direct)

    variant = (a.variant, a.constexprs["BLOCK_SKIP"], group_loop)
    launch_with_fallback("bwd_dkdv", spec, q.device, launch_dkdv, configs.get("bwd_dkdv"), variant)
    launch_with_fallback("bwd_dq", spec, q.device, launch_dq, configs.get("bwd_dq"), variant)
    if chunked["chunks"] > 1:   # the Q chunks' partials, summed in chunk order (bitwise reproducible)
        dk_sum, dv_sum = chunked["dk"].sum(0), chunked["dv"].sum(0)
        if expand:
            dk_out, dv_out = dk_sum, dv_sum
        else:
            dk.copy_(dk_sum)
            dv.copy_(dv_sum)
    if expand:  # [..., Hq, D] -> [..., Hkv, G, D] summed over G (query head h belongs to kv head h // G)
        dk.copy_(dk_out.unflatten(-2, (hkv, spec.group_size)).sum(-2))
        dv.copy_(dv_out.unflatten(-2, (hkv, spec.group_size)).sum(-2))
    return (dq, dk, dv, *(buf.to(t.dtype) for buf, t in zip(cap_bufs, mods.grad_leaves if cap_bufs else ())))


def q_chunks(spec, cfg, device, programs: int) -> int:
    """How many programs share each K/V tile in the dK/dV kernel, over disjoint runs of its Q tiles.  One program per
    key tile walks every Q tile that sees it; where the key tiles x heads x batch leave most SMs idle and the walk is
    long -- a few keys against many queries: the sink tokens' call of a window with sinks over a long sequence --
    the walk is split, and the float32 partials are summed after.  FLASHPORT_BWD_Q_CHUNKS=N forces
    N (tests, A/B runs)."""
    q_tiles = cdiv(spec.seqlen_q, cfg.block_m)
    forced = env.value("FLASHPORT_BWD_Q_CHUNKS")
    if forced != "auto":
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"FLASHPORT_BWD_Q_CHUNKS must be 'auto' or a positive integer, got {forced!r}")
        return min(int(forced), q_tiles)
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    # A walk of 256 Q tiles (the sinks' call) split: 2.17 -> 1.77 ms; of 64 (cross-attention over 77 keys, 4096
    # queries): 0.96 -> 1.03 ms (H100, 22nd session).  So only walks of at least 128 tiles are split.
    if 2 * programs > sms or q_tiles < 128:
        return 1
    return min(cdiv(2 * sms, programs), q_tiles // 16)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dq_config_with_mods(cfg, a: KernelArgs):
    """dQ's launch config for a programmable call: 8 warps where the table gives 4 with 128-row Q tiles.  A mod keeps
    its tiles (gathered table values, the derivative) live beside dQ's: the sm_90 compile report
    (tools/gpu/compile_report.py's stand-in driver, bf16 D=64, 128x64) gave 1680 bytes of stack at 4 warps for a
    relative-position table + document mask, 16 at 8 warps (the plain kernel: 32 at 4 warps).  Not yet timed."""
    c = a.constexprs
    mods = c["SCORE_MOD"] is not None or c["MASK_MOD"] is not None or c["BLOCK_SKIP"]
    if mods and cfg.num_warps == 4 and cfg.block_m >= 128:
        return replace(cfg, num_warps=8)
    return cfg


_preprocess_launch = DirectLauncher(_bwd_preprocess)
_dkdv_launch = DirectLauncher(_bwd_dkdv)
_dq_launch = DirectLauncher(_bwd_dq)


def _preprocess(spec, out, do, delta, l_strides, cu_q, dq_accum) -> None:
    """Delta = rowsum(dO * O) into `delta`, and dq_accum (when given: [B, Sq, Hq, D] float32) zeroed.
    On a GPU it is launched directly (kernels/launch.py): it runs on every backward."""
    varlen = spec.kind == "varlen"
    st = lambda x: head_strides(x, varlen)  # noqa: E731
    block_m = INTERPRETER_CONFIG.block_m if interpreting() else 64
    tensors = (out, do) if dq_accum is None else (out, do, dq_accum)
    args = (out, do, delta, cu_q, dq_accum, *st(out), *st(do), *l_strides,
            *((0, 0, 0) if dq_accum is None else st(dq_accum)), spec.seqlen_q)
    meta = dict(DV=spec.head_dim_v, BLOCK_M=block_m, BLOCK_DV=block_dim(spec.head_dim_v), IS_VARLEN=varlen,
                ALIGN=stride_align(*tensors), ZERO_DQ=dq_accum is not None, num_warps=4)
    grid = (cdiv(spec.seqlen_q, block_m), spec.heads_q, spec.batch)
    # direct=False: Triton's interpreter (CPU tensors), or tools/gpu/compile_report.py compiling without a GPU
    _preprocess_launch(grid, args, meta, direct=out.is_cuda)
