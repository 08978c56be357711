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
* Paged caches are read through block_table with a per-key page lookup (page = pos // PAGE_SIZE),
  correct for any page size, whether or not BLOCK_N divides it.

With NUM_SPLITS = 1 the kernel writes the final output directly; otherwise flashport.kernels.merge
combines the splits exactly (lse-weighted).  Equivalent PyTorch math: backend/reference.py's
materialized_attention(q, k_cache[:, :seqlens_k[b]], ...) with bottom-right alignment at seqlens_k[b].
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .common import LOG2E, score_log2
from .merge import merge_partials
from .splitkv import choose_config, choose_num_splits, device_facts, interpreting, sm_count, smem_limit

MAX_HEAD_DIM = 256


@triton.jit
def _kvcache_split_kernel(
    Q, K, V, SEQLENS_K, BLOCK_TABLE, SLOPES, OUT, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,          # dense: (batch, position); paged: (block, slot in page)
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ab, stride_ah,                     # ALiBi slopes [B, Hq] (stride_ab = 0 for [Hq])
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lq,
    seqlen_q, heads_kv, num_splits,
    qk_scale, cap_in, cap_out, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
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
    lo = seqlen_k * 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(lo, i_first + diag - window_left)
    if HAS_RIGHT:
        hi = tl.minimum(hi, i_last + diag + window_right + 1)
    lo = (lo // BLOCK_N) * BLOCK_N                              # lo >= 0: tiles start on multiples
    n_tiles = tl.where(hi > lo, (hi - lo + BLOCK_N - 1) // BLOCK_N, 0)
    tiles_per_split = (n_tiles + num_splits - 1) // num_splits
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
                           True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI)
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
def _allow_tf32() -> bool:
    return os.environ.get("FLASHPORT_ALLOW_TF32", "0") == "1"


def kvcache_supports(spec) -> list[str]:
    """Reasons the Triton KV-cache kernel cannot serve `spec` (empty list = it can)."""
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
        if not interpreting():
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (Triton interpreter)")
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            reasons.append("CUDA is not available")
        else:
            _, smem, cap = device_facts(dev)
            if cap < (8, 0):
                reasons.append(f"compute capability {cap[0]}.{cap[1]} < 8.0")
            elif not reasons and _config(spec, smem) is None:
                reasons.append(f"no tile configuration fits in {smem} bytes of shared memory")
    else:
        reasons.append(f"device type {dev.type!r} unsupported (CUDA, or CPU under TRITON_INTERPRET=1)")
    return reasons


def _config(spec, smem, block_m=None, block_n=None):
    return choose_config(spec.group_size * spec.seqlen_q, spec.head_dim, spec.head_dim_v, spec.dtype.itemsize,
                         smem, interpreting(), block_m=block_m, block_n=block_n)


def kvcache_attention(spec, inputs, *, num_splits: int | None = None, block_m: int | None = None,
                      block_n: int | None = None):
    """q [B, Sq, Hq, D] against the cache in `inputs` -> (out [B, Sq, Hq, Dv] q.dtype, lse [B, Hq, Sq] f32).

    inputs.k / inputs.v: dense [B, capacity, Hkv, D|Dv] or paged [num_blocks, page, Hkv, D|Dv] with
    inputs.block_table int32 [B, max_blocks]; inputs.seqlens_k int32 [B] valid lengths (None = the
    whole capacity).  num_splits / block_m / block_n override the heuristics (tests use them).
    Never synchronises with the host."""
    q, k_cache, v_cache = inputs.q, inputs.k, inputs.v
    bsz, sq, hq, _ = q.shape
    hkv, dv = spec.heads_kv, spec.head_dim_v
    out = torch.empty(bsz, sq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lse.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if spec.seqlen_k == 0:                 # an empty cache: every row sees no key
        return out.zero_(), lse.fill_(float("-inf"))
    seqlens = inputs.seqlens_k
    if seqlens is None:
        seqlens = torch.full((bsz,), spec.seqlen_k, dtype=torch.int32, device=q.device)

    cfg = _config(spec, smem_limit(q.device), block_m, block_n)
    if cfg is None:
        raise ValueError("no Triton tile configuration fits this device's shared memory")
    group = spec.group_size
    m_blocks = triton.cdiv(sq * group, cfg.BLOCK_M)
    if num_splits is None:
        num_splits = choose_num_splits(bsz * hkv * m_blocks, triton.cdiv(spec.seqlen_k, cfg.BLOCK_N),
                                       sm_count(q.device), min_tiles=1 if interpreting() else 2)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")

    if num_splits == 1:
        o_buf, l_buf = out, lse
        o_strides, l_strides = (0, *out.stride()[:3]), (0, *lse.stride())
    else:  # fp32 partials: the merge reads each split's normalised output and lse
        o_buf = torch.empty(num_splits, bsz, sq, hq, dv, dtype=torch.float32, device=q.device)
        l_buf = torch.empty(num_splits, bsz, hq, sq, dtype=torch.float32, device=q.device)
        o_strides, l_strides = o_buf.stride()[:4], l_buf.stride()

    paged = inputs.block_table is not None
    block_table = inputs.block_table if paged else seqlens
    slopes = inputs.alibi_slopes
    if slopes is not None:
        a_strides = (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()
    else:
        slopes, a_strides = q, (0, 0)
    softcap = spec.softcap
    qk_scale = spec.softmax_scale * LOG2E
    cap_in = spec.softmax_scale / softcap if softcap > 0 else 0.0
    cap_out = softcap * LOG2E
    precision = "ieee" if q.dtype == torch.float32 and not _allow_tf32() else "tf32"

    grid = (bsz * hkv, m_blocks, num_splits)
    with _device_guard(q.device):
        _kvcache_split_kernel[grid](
            q, k_cache, v_cache, seqlens, block_table, slopes, o_buf, l_buf,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0),
            *a_strides, *o_strides, *l_strides,
            sq, hkv, num_splits,
            qk_scale, cap_in, cap_out, spec.window_left, spec.window_right,
            GROUP=group, HEAD_DIM=spec.head_dim, HEAD_DIM_V=dv,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=cfg.BLOCK_D, BLOCK_DV=cfg.BLOCK_DV,
            PAGED=paged, PAGE_SIZE=spec.page_block_size if paged else 1,
            HAS_LEFT=spec.window_left >= 0, HAS_RIGHT=spec.window_right >= 0,
            SOFTCAP=softcap > 0, ALIBI=inputs.alibi_slopes is not None, DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if num_splits > 1:
            merge_partials(o_buf, l_buf, out, lse)
    return out, lse


def _device_guard(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
