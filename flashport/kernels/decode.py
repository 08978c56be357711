"""KV-cache attention in Triton (decode, chunked prefill, speculative verification): dense or paged
cache, split-KV flash-decoding, GQA packing.

One program per (batch b, KV head g, block of packed query rows, key split s):

* GQA packing: the Sq * G query rows that share KV head g (G = Hq // Hkv) form one tile, row
  r = i * G + (h - g * G) for query position i and head h.  Every K/V tile is read once for all G
  heads of the group, which is what decides decode bandwidth.
* The visible key range [lo, hi) of the row block (bounded by seqlens_k[b], read on the device, and
  the window) is cut into NUM_SPLITS chunks of whole BLOCK_N tiles; split s streams its chunk with
  the online softmax (exp2, log2-domain scores) and writes its partial (acc / l_i, lse).  A split
  past the end of its sequence writes lse = -inf, so the host never needs the lengths.
* Paged caches are read through block_table: one lookup per tile when BLOCK_N divides the page
  size (a tile never straddles pages), otherwise one per key (page = pos // PAGE_SIZE), correct
  for any page size.

With NUM_SPLITS = 1 the kernel writes the final output directly; otherwise flashport.kernels.merge
combines the splits exactly (lse-weighted).  Equivalent PyTorch math: backend/reference.py's
materialized_attention(q, k_cache[:, :seqlens_k[b]], ...) with bottom-right alignment at seqlens_k[b].
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda.gdc_launch_dependents)

from .. import env
from . import splitkv
from .common import LOG2E, device_guard, key_range, score_log2
from .merge import merge_partials
from .splitkv import (DecodeConfig, choose_config, choose_num_splits, device_facts, interpreting, sm_count,
                      smem_limit)

MAX_HEAD_DIM = 256


@triton.jit(do_not_specialize=["chunk_tiles"])
def _kvcache_split_kernel(
    Q, K, V, SEQLENS_K, BLOCK_TABLE, SLOPES, OUT, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,          # dense: (batch, position); paged: (block, slot in page)
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ab, stride_ah,                     # ALiBi slopes [B, Hq] (stride_ab = 0 for [Hq])
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lq,
    seqlen_q, heads_kv, num_splits, chunk_tiles,
    qk_scale, cap_in, cap_out, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # the merge kernel may be scheduled once every split program has started
        tl.extra.cuda.gdc_launch_dependents()
    pid_bg = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bg // heads_kv
    g = pid_bg % heads_kv
    b64 = b.to(tl.int64)
    seqlen_k = tl.load(SEQLENS_K + b)
    diag = seqlen_k - seqlen_q                                  # bottom-right alignment

    # Packed rows of this program: query position i, query head h.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen_q * GROUP
    i = rows // GROUP
    h = g * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    # Keys the row block can see, cut into whole tiles and dealt out to the splits.
    i_first = (pid_m * BLOCK_M) // GROUP
    i_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    lo, hi = key_range(i_first, i_last + 1, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    lo = (lo // BLOCK_N) * BLOCK_N                              # lo >= 0: tiles start on multiples
    n_tiles = tl.where(hi > lo, (hi - lo + BLOCK_N - 1) // BLOCK_N, 0)
    # chunk_tiles > 0 (FLASHPORT_DECODE_FIXED_CHUNKS=1): every sequence in chunks of one size, the capacity's share
    # per split, so a short sequence of a ragged batch runs a few full programs and leaves its other splits empty
    # (lse -inf) instead of cutting its few tiles into num_splits slivers; num_splits * chunk_tiles covers the
    # capacity, so no sequence's keys are left over.  0: each sequence's tiles shared out over the splits.
    tiles_per_split = tl.where(chunk_tiles > 0, chunk_tiles, (n_tiles + num_splits - 1) // num_splits)
    n_start = lo + split * tiles_per_split * BLOCK_N
    n_end = tl.minimum(hi, n_start + tiles_per_split * BLOCK_N)

    q_ptrs = (Q + b64 * stride_qb + i[:, None].to(tl.int64) * stride_qs + h[:, None] * stride_qh
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if ALIBI:
        slope2 = tl.load(SLOPES + b64 * stride_ab + h * stride_ah, mask=row_ok, other=0.0) * 1.4426950408889634
    else:
        slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)

    k_head = K + g.to(tl.int64) * stride_kh
    v_head = V + g.to(tl.int64) * stride_vh
    bt_row = BLOCK_TABLE + b64 * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < n_end                                 # never read past the split or Sk
        if PAGED:
            if TILE_IN_PAGE:
                # BLOCK_N divides the page and tiles start on multiples of BLOCK_N, so the whole tile
                # lies in one page: one scalar lookup, and the keys are one strided run as in a
                # dense cache (start_n < n_end <= capacity keeps the lookup inside the table row).
                page = tl.load(bt_row + start_n // PAGE_SIZE).to(tl.int64)
                slot = (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
            else:
                page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
                slot = (offs_n % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kb + slot * stride_ks
            v_off = page * stride_vb + slot * stride_vs
        else:
            pos = offs_n.to(tl.int64)
            k_off = b64 * stride_kb + pos * stride_ks
            v_off = b64 * stride_vb + pos * stride_vs
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None],
                    mask=key_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)   # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        # n_end stands in for Sk in the mask: keys past this split's chunk belong to another split.
        s2, _ = score_log2(qk, i[:, None], offs_n[None, :], n_end, diag, window_left, window_right,
                           qk_scale, cap_in, cap_out, slope2[:, None],
                           True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION == "ieee")
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet
        p = tl.math.exp2(s2 - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + v_off[:, None] + offs_dv[None, :],
                    mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0                                            # rows with no visible key: 0, -inf
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    split64 = split.to(tl.int64)
    o_ptrs = (OUT + split64 * stride_os + b64 * stride_ob + i[:, None].to(tl.int64) * stride_oq
              + h[:, None] * stride_oh + offs_dv[None, :])
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + split64 * stride_ls + b64 * stride_lb + h * stride_lh + i * stride_lq, lse, mask=row_ok)


# ----------------------------------------------------------------------------- host side
# Page lookups once per BLOCK_N tile (instead of once per key) wherever BLOCK_N divides the page size.
# A switch only so that tools/gpu/gpu_decode_probe.py can time both forms of the kernel.
TILE_PAGE_LOOKUP = True
# Programmatic dependent launch of the merge (sm_90+): its launch overlaps the split kernel's last
# programs instead of following them; only up to PDL_MAX_SPLITS, where it measured faster (PERFLOG row 12).
PDL = True
PDL_MAX_SPLITS = 48


def _allow_tf32() -> bool:
    return env.flag("FLASHPORT_ALLOW_TF32")


def kvcache_supports(spec) -> list[str]:
    """Reasons the Triton KV-cache kernel cannot serve `spec` (empty list = it can)."""
    return list(_supports(spec, interpreting()))


@functools.lru_cache(maxsize=256)
def _supports(spec, interpreter: bool) -> tuple[str, ...]:
    # Memoised per spec: every fact it reads is static for the process (the interpreter switch, an
    # environment variable read at each call, is part of the key).
    reasons = []
    if spec.kind != "kvcache":
        reasons.append(f"kvcache kernel serves kind 'kvcache', not {spec.kind!r}")
    if spec.dropout_p > 0:
        reasons.append("dropout is not supported (KV-cache attention is inference-only)")
    if spec.needs_grad:
        reasons.append("no backward (KV-cache attention is inference-only)")
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {spec.dtype} unsupported (float16, bfloat16, float32 only)")
    if max(spec.head_dim, spec.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(f"head dim {max(spec.head_dim, spec.head_dim_v)} > {MAX_HEAD_DIM} unsupported")
    dev = spec.device
    if dev.type == "cpu":
        if not interpreter:
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (Triton interpreter)")
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            reasons.append("CUDA is not available")
        else:
            _, smem, cap = device_facts(dev)
            if cap < (8, 0):
                reasons.append(f"compute capability {cap[0]}.{cap[1]} < 8.0")
            elif not reasons and _config(spec, smem, interpreter) is None:
                reasons.append(f"no tile configuration fits in {smem} bytes of shared memory")
    else:
        reasons.append(f"device type {dev.type!r} unsupported (CUDA, or CPU under TRITON_INTERPRET=1)")
    return tuple(reasons)


def _config(spec, smem, interpreter, block_m=None, block_n=None, num_stages=None, num_warps=None):
    return choose_config(spec.group_size * spec.seqlen_q, spec.head_dim, spec.head_dim_v, spec.dtype.itemsize,
                         smem, interpreter, block_m=block_m, block_n=block_n, num_stages=num_stages,
                         num_warps=num_warps)


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """Everything about a launch that follows from the spec and the device, decided once per spec."""

    cfg: DecodeConfig
    m_blocks: int
    num_splits: int
    qk_scale: float
    cap_in: float
    cap_out: float
    constexprs: dict           # the kernel's tl.constexpr arguments, num_warps and num_stages
    pdl: bool = False          # merge launched by programmatic dependent launch
    chunk_tiles: int = 0       # > 0: every sequence in key chunks of this many tiles (FLASHPORT_DECODE_FIXED_CHUNKS)


@functools.lru_cache(maxsize=512)
def launch_plan(spec, sms: int, smem: int, interpreter: bool, tf32: bool, num_splits=None, block_m=None,
                block_n=None, num_stages=None, waves: int = splitkv.WAVES, min_tiles: int = 2,
                tile_page_lookup: bool = True, num_warps=None, pdl: bool = False,
                max_keys: int = splitkv.MAX_KEYS_PER_SPLIT, fixed_chunks: bool = False) -> LaunchPlan | None:
    """Tiles, split count and constexprs for `spec` (None: no tile configuration fits `smem`).

    A pure function of its arguments, memoised: the per-call host work of a decode step is then the
    allocations and the two launches.  waves / min_tiles are splitkv's waves_for() / MIN_TILES_PER_SPLIT,
    passed in so that a retune of those constants reaches the cache key."""
    cfg = _config(spec, smem, interpreter, block_m, block_n, num_stages, num_warps)
    if cfg is None:
        return None
    m_blocks = triton.cdiv(spec.seqlen_q * spec.group_size, cfg.BLOCK_M)
    if num_splits is None:
        n_tiles = triton.cdiv(spec.seqlen_k, cfg.BLOCK_N)
        num_splits = choose_num_splits(spec.batch * spec.heads_kv * m_blocks, n_tiles, sms, min_tiles=min_tiles,
                                       waves=waves)
        if spec.paged:   # and no split longer than max_keys (ragged batches: splitkv.MAX_KEYS_PER_SPLIT; measured paged)
            num_splits = max(num_splits, min(splitkv.MAX_SPLITS, n_tiles // max(1, min_tiles),
                                             triton.cdiv(spec.seqlen_k, max_keys)))
    softcap = spec.softcap
    pdl = pdl and 1 < num_splits <= PDL_MAX_SPLITS     # only with a merge, and where it measured faster
    tile_in_page = bool(spec.paged and tile_page_lookup and spec.page_block_size % cfg.BLOCK_N == 0)
    constexprs = dict(
        GROUP=spec.group_size, HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.head_dim_v,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=cfg.BLOCK_D, BLOCK_DV=cfg.BLOCK_DV,
        PAGED=spec.paged, PAGE_SIZE=spec.page_block_size if spec.paged else 1, TILE_IN_PAGE=tile_in_page,
        HAS_LEFT=spec.visibility.has_left, HAS_RIGHT=spec.visibility.has_right,
        SOFTCAP=softcap > 0, ALIBI=spec.alibi is not None,
        DOT_PRECISION="ieee" if spec.dtype == torch.float32 and not tf32 else "tf32",
        LAUNCH_DEPENDENTS=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fixed_chunks: the capacity's share per split, so num_splits chunks cover any sequence (the kernel's comment)
    chunk_tiles = 0
    if fixed_chunks and num_splits > 1:
        chunk_tiles = triton.cdiv(triton.cdiv(spec.seqlen_k, cfg.BLOCK_N), num_splits)
    return LaunchPlan(cfg, m_blocks, num_splits, qk_scale=spec.softmax_scale * LOG2E,
                      cap_in=spec.softmax_scale / softcap if softcap > 0 else 0.0, cap_out=softcap * LOG2E,
                      constexprs=constexprs, pdl=pdl, chunk_tiles=chunk_tiles)


def plan_for(spec, device: torch.device, *, num_splits=None, block_m=None, block_n=None,
             num_stages=None, num_warps=None) -> LaunchPlan | None:
    """launch_plan with this process's current settings (device facts, env switches, tuning constants)."""
    interp = interpreting()
    return launch_plan(spec, sm_count(device), smem_limit(device), interp, _allow_tf32(), num_splits, block_m,
                       block_n, num_stages, splitkv.waves_for(spec.paged),
                       1 if interp else splitkv.MIN_TILES_PER_SPLIT,
                       TILE_PAGE_LOOKUP, num_warps,
                       PDL and device.type == "cuda" and not interp and device_facts(device)[2] >= (9, 0),
                       splitkv.MAX_KEYS_PER_SPLIT, env.flag("FLASHPORT_DECODE_FIXED_CHUNKS"))


def valid_lengths(spec, inputs) -> torch.Tensor:
    """int32 [B] on the device: each entry's valid key count, the whole capacity where the call gave none."""
    if inputs.seqlens_k is not None:
        return inputs.seqlens_k
    return torch.full((spec.batch,), spec.seqlen_k, dtype=torch.int32, device=inputs.q.device)


def kvcache_attention(spec, inputs, *, num_splits: int | None = None, block_m: int | None = None,
                      block_n: int | None = None, num_stages: int | None = None, num_warps: int | None = None):
    """q [B, Sq, Hq, D] against the cache in `inputs` -> (out [B, Sq, Hq, Dv] q.dtype, lse [B, Hq, Sq] f32).

    inputs.k / inputs.v: dense [B, capacity, Hkv, D|Dv] or paged [num_blocks, page, Hkv, D|Dv] with
    inputs.block_table int32 [B, max_blocks]; inputs.seqlens_k int32 [B] valid lengths (None = the
    whole capacity).  num_splits / block_m / block_n / num_stages / num_warps override the heuristics (tests and
    tools/gpu/gpu_decode_probe.py use them).  Never synchronises with the host."""
    q, k_cache, v_cache = inputs.q, inputs.k, inputs.v
    bsz, sq, hq, _ = q.shape
    out = torch.empty(bsz, sq, hq, spec.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lse.numel() == 0 or spec.seqlen_k == 0:   # nothing to attend to: 0, -inf
        return out.zero_(), lse.fill_(float("-inf"))
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    plan = plan_for(spec, q.device, num_splits=num_splits, block_m=block_m, block_n=block_n,
                    num_stages=num_stages, num_warps=num_warps)
    if plan is None:
        raise ValueError("no Triton tile configuration fits this device's shared memory")
    seqlens = valid_lengths(spec, inputs)

    splits = plan.num_splits
    if splits == 1:
        o_buf, l_buf = out, lse
        o_strides, l_strides = (0, *out.stride()[:3]), (0, *lse.stride())
    else:  # fp32 partials: the merge reads each split's normalised output and lse
        o_buf = torch.empty(splits, bsz, sq, hq, spec.head_dim_v, dtype=torch.float32, device=q.device)
        l_buf = torch.empty(splits, bsz, hq, sq, dtype=torch.float32, device=q.device)
        o_strides, l_strides = o_buf.stride()[:4], l_buf.stride()
    block_table = inputs.block_table if spec.paged else seqlens     # any int32 tensor when unused
    slopes = inputs.alibi_slopes
    if slopes is None:
        slopes, a_strides = q, (0, 0)
    else:
        a_strides = (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()

    with device_guard(q.device):
        _kvcache_split_kernel[(bsz * spec.heads_kv, plan.m_blocks, splits)](
            q, k_cache, v_cache, seqlens, block_table, slopes, o_buf, l_buf,
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
            *a_strides, *o_strides, *l_strides,
            sq, spec.heads_kv, splits, plan.chunk_tiles,
            plan.qk_scale, plan.cap_in, plan.cap_out, spec.window_left, spec.window_right,
            **plan.constexprs,
        )
        if splits > 1:
            merge_partials(o_buf, l_buf, out, lse, after_prior=plan.pdl)
    return out, lse
