"""Hopper (sm_90) attention backward in Gluon, scheduled like FlashAttention-3 (5 matmuls per tile pair).

kernels/attn_bwd.py runs a dK/dV kernel and a separate dQ kernel: S and dP are computed twice, 7 matmuls
per (Q tile, K/V tile) pair.  Here, as in FA3, one kernel per K/V tile also produces dQ: its share of
dQ_j = dS_j K is added to a float32 buffer by TMA reduce-adds, so each pair costs 5 matmuls.  The order of
those adds (and so the last bits of dQ) depends on scheduling: this path only serves calls with
deterministic=False; deterministic=True keeps the Triton kernels (bitwise reproducible).

One program per (128-row K/V tile n, query head h, batch entry b); grid (Sk / 128, B * Hq); three roles:
* a producer (4 warps) TMA-loads the K and V tiles once, then Q_j and dO_j (BLOCK_M = 64 rows each; 128 in the
  m128_s2 variant at D=64, FLASHPORT_HOPPER_BWD_M128) into a
  STAGES-deep shared-memory ring, with Q_j's lse2 and Delta rows (q_ready / do_ready, qdo_empty released by
  both consumers once every matmul reading the stage has retired); it also drains dQ_j: one TMA
  reduce-add (cp.reduce.async.bulk.tensor) per warpgroup half from a shared buffer into dq_accum;
* two consumer warpgroups (240 registers each); warpgroup WG owns K/V rows [64 WG, 64 WG + 64) of the tile
  and their float32 accumulators dK_wg, dV_wg [64, D].  Per Q tile j (transposed scores, as attn_bwd.py):
      S^T  = K_wg Q_j^T,  dP^T = V_wg dO_j^T                     [64 kv, 64 q], both in flight together
      P^T  = exp2(S^T * qk_scale - lse2_j)                       (the causal mask on the 2 diagonal tiles)
      dV  += P^T dO_j                                            (P^T in registers; issued before dP is waited for)
      dS^T = P^T * (dP^T - Delta_j) * softmax_scale              (P^T as rounded for dV; the scale folded in)
      dS^T -> shared buffer ds[i % 2] (the two warpgroups' halves make the tile's [128 kv, 64 q] dS^T)
      dK  += dS^T Q_j                                            (dS^T read back from shared memory)
      after an mbarrier (ds_ready: both halves written) warpgroup WG computes its half of dQ_j's columns,
      dQ_j[:, c] = dS_j K[:, c] for c = [WG D / 2, (WG + 1) D / 2), and stores it into the dQ buffer for the
      producer (_drain_dq).
  ds is double-buffered: a warpgroup rewrites ds[i % 2] at step i + 2 only after waiting on ds_ready of
  step i + 1, which the other warpgroup signals after its dQ matmul of step i (the last reader) retired.
  DQ_FIRST (FLASHPORT_HOPPER_BWD_DQ_FIRST=1, until timed): FA3's and FA4's step end instead -- after ds_ready,
  dQ_j is issued before dK (which reads dS^T from registers), and dK runs while dQ_j is stored.
Causal (Sq == Sk): K/V tile n meets Q tiles 2n, 2n + 1 (masked; with 128-row tiles Q tile n) and the unmasked
ones after; lower n has more work, so programs start with n = 0.  Sliding windows (WINDOW; Sq == Sk;
FLASHPORT_HOPPER_BWD_WINDOW=0 leaves them to the Triton kernels): K/V tile n walks only the Q tiles whose rows see one of its keys
(_q_tiles), and a warpgroup masks a tile only where it crosses the band's edge for its 64 keys.  GQA: dK / dV are
written as float32 partials per query head and summed per group afterwards (as attn_bwd.py), or, with GROUP > 1
(FLASHPORT_HOPPER_BWD_GROUP_LOOP=1; grid (Sk / 128, B * Hkv)), one program walks its K/V head's query heads in turn
and writes the group's sums once; dQ accumulates per query head either way.

Equivalent PyTorch math (per batch entry and query head, s = softmax_scale, K/V of head h // G):
    P = exp(s * Q K^T - lse);  dV = P^T dO;  dP = dO V^T;  Delta = rowsum(dO * O) (- dlse)
    dS = P * (dP - Delta);     dQ = s * dS K;  dK = s * dS^T Q
Inputs: q, do [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D] with D = 64 or 128 (one schedule: the head dim changes
the matmuls' sizes and the shared memory, not the code), or 80 / 96 as two column parts (SPLIT, below);
lse2 = lse / ln 2 and Delta [B, Hq, Sq] float32.

Ragged lengths (RAGGED; e.g. Whisper's 1500 frames): the last tiles of a batch entry reach past its rows, into
the next entry's (or, for the last entry, past the tensor, where TMA fills zeros).  Nothing is copied:
* a query row past Sq reads lse2 = +inf and Delta = 0 (lse2 / Delta padded to whole tiles on the host, a few
  KB), so P = 0 and dS = 0 there: it adds nothing to dK, dV, and zeros to the dQ rows it reaches (adding zero
  to another entry's rows, or past the tensor, where TMA drops the add);
* a key row past Sk gets P = 0 (masked in the entry's last K/V tile), so its dS column adds nothing to dQ,
  and its dK, dV rows are not stored.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from .attn_fwd_hopper import (TILES, _capability, _descriptor, alibi_args,  # shared with the forward
                              feature_reasons, variant_key, window_bounds)
from .. import env
from .launch import DirectLauncher
from .versions import is_tested, tested_text

try:  # Gluon ships with recent Triton; without it (or another version: versions.TESTED_TRITON) it declines
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton._C.libtriton import ir
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

LOG2E = 1.4426950408889634
MAX_GRID_Y = 65535      # CUDA's limit on the grid's second dimension (here batch * heads)
BLOCK_M = 64           # query rows per Q tile (the ring's unit)
BLOCK_N = 128          # K/V rows per program: 64 per consumer warpgroup
WG_N = BLOCK_N // 2
CONSUMER_REGS = 240    # setmaxnreg for the consumer warpgroups (FA3's choice at D = 64 and 128)


class Tiles(NamedTuple):
    stages: int                 # depth of the Q / dO ring
    dq_bufs: int                # dQ_j buffers in shared memory (2: stores of dQ_j overlap the drain of dQ_{j-1})
    head_dims: tuple = (64, 128)   # where it fits: shared memory (sm_90's 227 KiB) and no spills (compile report)
    block_m: int = BLOCK_M      # query rows per Q tile: 128 halves the steps (and their fixed costs) per K/V tile


# Variants: the ring's depth and the number of dQ_j buffers.  The schedule (dQ by the producer's TMA reduce-adds,
# lse2 / Delta staged by it) is the one that won the probe's D=128 runs (PERFLOG rows 19-22); DEFAULT is the
# fastest variant per head dim (rows 22 and 25).
VARIANTS = {"s2_tma_lse": Tiles(2, 1), "s2_tma2_lse": Tiles(2, 2, (64, 80, 96, 128)),
            "s3_tma2_lse": Tiles(3, 2, (64, 80)),   # D=128: 258 KiB of shared memory
            # FA3's and FA4's D=64 tile: 128 query rows per step, so S^T and dP^T are [64 kv, 128 q] per warpgroup
            # (64 + 64 float32 registers) and each step's barriers, lse2 / Delta rows and dQ reduce-adds serve
            # twice the matmul work.  K, V 32 KiB + 2 stages of Q, dO 64 + dS 64 + one dQ buffer 32 = 192 KiB.
            "m128_s2": Tiles(2, 1, (64,), 128)}
DEFAULT = {128: "s2_tma2_lse", 64: "s2_tma_lse", 80: "s2_tma2_lse", 96: "s2_tma2_lse"}   # per head dim
# Head dims that are not a power of two (ViT / DiT heads) run as two column parts, D - SPLIT[D] and SPLIT[D], each a
# power of two as Gluon's tensors must be: the forward's parts (its Tiles.split), so both directions read one table.
# S^T and dP^T sum the parts' products (chained wgmma), dK and dV keep an accumulator per part, and warpgroup 0
# computes dQ_j's first part, warpgroup 1 its second.  Shared memory at D=96: K, V 48 KiB + 2 stages of Q, dO 48 +
# dS 32 + 2 dQ buffers 48 = 176 KiB.  FLASHPORT_HOPPER_BWD_SPLIT=0 leaves them to the Triton kernels (PERFLOG rows 86, 95).
SPLIT = {d: t.split for d, t in TILES.items() if t.split}


def default_variant(d: int) -> str:
    """DEFAULT[d], or the 128-row Q tile at D=64 under FLASHPORT_HOPPER_BWD_M128=1 (until a GPU run times it)."""
    return "m128_s2" if d == 64 and env.flag("FLASHPORT_HOPPER_BWD_M128") else DEFAULT[d]


def enabled() -> bool:
    # Gluon is experimental upstream: only the Triton releases this kernel is tested on (versions.py)
    return (gluon is not None and is_tested(triton.__version__)
            and env.flag("FLASHPORT_HOPPER_BWD"))


def reasons(spec, q, k, v, do, out=None) -> list[str]:
    """Why this kernel cannot serve the backward (empty: it can): spec_reasons, then tensor_reasons."""
    return spec_reasons(spec) or tensor_reasons(*((q, k, v, do) if out is None else (q, k, v, do, out)))


def tensor_reasons(*tensors) -> list[str]:
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return ["q, k, v, dout must be contiguous and 16-byte aligned (TMA)"]
    return []


fallbacks: Counter = Counter()   # gluon backend -> Triton kernels, by reason (see attn_fwd_hopper.fallbacks)


def spec_reasons(spec) -> list[str]:
    """Why this kernel cannot serve the backward's call description (empty: it can; the tensors aside)."""
    if spec.head_dim not in DEFAULT or spec.head_dim_v != spec.head_dim:
        return [f"head dim {' / '.join(map(str, sorted(DEFAULT)))} only (q/k and v alike)"]
    if spec.head_dim in SPLIT and not env.flag("FLASHPORT_HOPPER_BWD_SPLIT"):
        return [f"head dim {spec.head_dim} (two column parts) is switched off: FLASHPORT_HOPPER_BWD_SPLIT=0"]
    if spec.kind != "dense" or spec.device.type != "cuda":
        return ["dense CUDA tensors only"]
    if spec.deterministic:
        return ["deterministic=True: dQ is summed in scheduling order here (the Triton kernels are reproducible)"]
    plain = feature_reasons(spec, windows=env.flag("FLASHPORT_HOPPER_BWD_WINDOW"),
                            alibi=env.flag("FLASHPORT_HOPPER_BWD_ALIBI"))
    if plain:
        return plain
    if min(spec.seqlen_q, spec.seqlen_k) < BLOCK_N:
        return [f"sequence lengths must be at least {BLOCK_N} (one K/V tile; shorter ones would be mostly padding)"]
    if spec.batch == 0 or spec.batch * spec.heads_q > MAX_GRID_Y:
        return [f"batch * heads must be in [1, {MAX_GRID_Y}]"]
    if padded(max(spec.seqlen_q, spec.seqlen_k)) * spec.head_dim >= 2 ** 31:
        return ["sequence length * head dim must fit in int32 (per-head offsets are 32-bit)"]
    if not enabled():
        return [f"Gluon (Triton {tested_text()}) unavailable or FLASHPORT_HOPPER_BWD=0"]
    failed = broken.get(broken_key(spec))
    if failed:
        return ["failed to compile here: " + failed]
    if _capability(spec.device.index if spec.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return ["needs an sm_90 (Hopper) GPU"]
    return []


if gluon is not None:
    from .attn_fwd_hopper import _load   # a tile (and with SPLIT its second column part) onto one barrier

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[tile at coord] += src (shared): TMA's bulk reduce-add.  Triton 3.6 has the op (tl's
        descriptor atomic_add lowers to it) and Gluon's builder makes it, but Gluon's tma module does not
        export it yet."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    _BLOCK_N, _LOG2E = gl.constexpr(BLOCK_N), gl.constexpr(LOG2E)
    _WG_N, _CONSUMER_REGS = gl.constexpr(WG_N), gl.constexpr(CONSUMER_REGS)
    # The ring's depth and the (first) column part's width D0 travel in the shapes (q_smem: [STAGES, BLOCK_M, D0]),
    # so every partition reads them off its shared-memory descriptors; the whole head dim is the HEAD_DIM constexpr.

    @gluon.jit
    def _q_tiles(seqlen_q, win_left, win_right, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                 RAGGED: gl.constexpr, BLOCK_M: gl.constexpr):
        """(first Q tile, number of Q tiles) of this program's K/V tile: the Q tiles with a row that sees one of
        its keys (Sq == Sk for CAUSAL and WINDOW: key kv is seen by rows kv - win_right .. kv + win_left)."""
        j0 = 0
        if CAUSAL:
            j0 = gl.program_id(0) * (_BLOCK_N // BLOCK_M)   # Sq == Sk: the diagonal's first Q tile
        n_tiles = seqlen_q // BLOCK_M
        if RAGGED:
            n_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M
        if WINDOW:
            n0 = gl.program_id(0) * _BLOCK_N
            j0 = gl.maximum(n0 - win_right, 0) // BLOCK_M
            n_tiles = gl.minimum((n0 + _BLOCK_N - 1 + win_left) // BLOCK_M + 1, n_tiles)
        return j0, n_tiles - j0

    @gluon.jit
    def _stats_len(seqlen_q, RAGGED: gl.constexpr):
        """Row length of lse2 / Delta [B, Hq, .]: Sq, or Sq padded to whole 128-row tiles (RAGGED, see backward)."""
        n = seqlen_q
        if RAGGED:
            n = (seqlen_q + _BLOCK_N - 1) // _BLOCK_N * _BLOCK_N
        return n

    @gluon.jit
    def _head_and_tile(i, n_iter, GROUP: gl.constexpr):
        """Step i of a program: (g, t), the t-th of its n_iter Q tiles of its g-th query head (GROUP > 1: the
        program walks its K/V head's group, head by head)."""
        g = 0
        t = i
        if GROUP > 1:
            g = i // n_iter
            t = i - g * n_iter
        return g, t

    @gluon.jit
    def _drain_dq(t, dq_smem, dq1_smem, dq_bars, dq_desc, dq1_desc, h, q_row0, HEAD_DIM: gl.constexpr,
                  DQ_BUFS: gl.constexpr, SPLIT: gl.constexpr, row_t):
        """dq_accum[Q tile row_t of head h] += dQ of the program's step t, from buffer u = t % DQ_BUFS (both
        warpgroups' halves, one TMA reduce-add each), then the buffer is free.

        Handshake (buffer u filled by Q tiles t = u, u + DQ_BUFS, ..., its n-th fill being tile u + n DQ_BUFS):
          dq_full[u]  (dq_bars[u], count 2): each consumer warpgroup arrives once per fill after storing its
                      half of dQ_t; fill n is awaited here with parity n & 1;
          dq_empty[u] (dq_bars[DQ_BUFS + u], count 1): this partition arrives once per fill after dQ_t was
                      read out of the buffer; a consumer waits for fill n - 1's completion (parity (n & 1) ^ 1;
                      for n = 0 the fresh barrier's parity 1 counts as completed) before storing fill n.
        No parity aliases: dq_full[u] cannot complete fill n + 1 before dq_empty[u] completed fill n (both
        halves wait for it), which needs this wait; dq_empty[u] cannot complete fill n before both halves of
        fill n were stored, which is after the consumers' wait for fill n - 1.  Every tile is drained exactly
        once (the producer loop drains t = i - STAGES, its epilogue the last min(STAGES, n) tiles), so the
        producer never exits with a store unread and the consumers never wait for a drain that does not come.
        SPLIT: warpgroup 0's part of buffer u is dq_smem[u] (columns [0, D0)), warpgroup 1's dq1_smem[u] (the rest)."""
        u = t % DQ_BUFS
        mbarrier.wait(dq_bars.index(u), (t // DQ_BUFS) & 1)
        # Without SPLIT, dq_smem [2 DQ_BUFS, BLOCK_M, D / 2]: warpgroup WG's half of buffer u (index 2 u + WG) goes to
        # columns [WG D / 2, (WG + 1) D / 2) of head h.  The consumers fenced their stores for the async proxy; store_wait(0)
        # returns once the copy engine has read both halves (not once the adds landed: only the kernel's end
        # orders those, and nothing reads dq_accum before it).
        row = q_row0 + row_t * dq_smem.shape[1]
        if SPLIT:
            _tma_reduce_add(dq_desc, [row, h * HEAD_DIM], dq_smem.index(u))
            _tma_reduce_add(dq1_desc, [row, h * HEAD_DIM + dq_smem.shape[2]], dq1_smem.index(u))
        else:
            _tma_reduce_add(dq_desc, [row, h * HEAD_DIM], dq_smem.index(2 * u))
            _tma_reduce_add(dq_desc, [row, h * HEAD_DIM + HEAD_DIM // 2], dq_smem.index(2 * u + 1))
        tma.store_wait(0)
        mbarrier.arrive(dq_bars.index(DQ_BUFS + u), count=1)   # (after a barrier of this partition)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q1_desc, k1_desc, v1_desc,
                  do1_desc, k1_smem, v1_smem, q1_smem, do1_smem, kv_ready, q_ready, do_ready, qdo_empty, dq_smem,
                  dq1_smem, dq_bars, dq_desc, dq1_desc, stat_smem, lse_ptr, delta_ptr, sm_scale, seqlen_q, seqlen_k,
                  group, win_left, win_right, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr, SPLIT: gl.constexpr,
                  GROUP: gl.constexpr):
        """TMA issue: K and V once, then Q_j / dO_j into stage i % STAGES once both consumers freed it, with
        Q_j's lse2 and Delta rows into stat_smem (plain loads and stores: 512 bytes per tile).  Also dQ_j's
        reduce-adds (_drain_dq), for tile i - STAGES right after issuing tile i: the qdo_empty wait just
        passed says the consumers are done with tile i - STAGES, so its dQ is (about to be) in dq_smem, and the
        next loads are issued without waiting for the drain of the previous tile.  SPLIT: every tile in two column
        parts (k_smem / k1_smem ...: head columns [0, D0) and [D0, HEAD_DIM)), both on the tile's barrier."""
        STAGES: gl.constexpr = q_smem.shape[0]
        BLOCK_M: gl.constexpr = q_smem.shape[1]
        D0: gl.constexpr = q_smem.shape[2]
        pid_bh = gl.program_id(1)
        b = pid_bh // (HEADS_Q // GROUP)
        h0 = pid_bh % (HEADS_Q // GROUP) * GROUP    # the program's (first) query head
        kv_row = b * seqlen_k + gl.program_id(0) * _BLOCK_N
        kv_col = (h0 // group) * HEAD_DIM
        if SPLIT:   # one arrival: every copy on one barrier
            mbarrier.expect(kv_ready, 2 * (k_desc.block_type.nbytes + k1_desc.block_type.nbytes))
            tma.async_copy_global_to_shared(k1_desc, [kv_row, kv_col + D0], kv_ready, k1_smem)
            tma.async_copy_global_to_shared(v1_desc, [kv_row, kv_col + D0], kv_ready, v1_smem)
        else:
            mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_ready, v_smem)
        j0, n_iter = _q_tiles(seqlen_q, win_left, win_right, CAUSAL, WINDOW, RAGGED, BLOCK_M)
        q_row = b * seqlen_q + j0 * BLOCK_M
        vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        for i in range(GROUP * n_iter):
            g, t = _head_and_tile(i, n_iter, GROUP)
            h = h0 + g
            stats_row = (b * HEADS_Q + h).to(gl.int64) * _stats_len(seqlen_q, RAGGED)
            s = i % STAGES
            # First lap: a fresh barrier's parity 1 counts as completed, so the ring starts empty.
            mbarrier.wait(qdo_empty.index(s), ((i // STAGES) & 1) ^ 1)
            _load(q_desc, q1_desc, q_ready.index(s), q_smem.index(s), q1_smem.index(s), q_row + t * BLOCK_M,
                  h * HEAD_DIM, D0, SPLIT)
            _load(do_desc, do1_desc, do_ready.index(s), do_smem.index(s), do1_smem.index(s), q_row + t * BLOCK_M,
                  h * HEAD_DIM, D0, SPLIT)
            # lse2 / Delta after both copies are issued, so that these loads' latency delays neither
            rows = (j0 + t) * BLOCK_M + gl.arange(0, BLOCK_M, layout=vec_layout)
            stat_smem.index(s).store(gl.load(lse_ptr + stats_row + rows))
            # Delta times softmax_scale: the form dS = P * (dP * scale - Delta * scale) uses
            delta = gl.load(delta_ptr + stats_row + rows) * sm_scale
            stat_smem.index(STAGES + s).store(delta)
            mbarrier.arrive(q_ready.index(s), count=1)   # q_ready's second arrival (after a partition barrier)
            if i >= STAGES:
                gd, td = _head_and_tile(i - STAGES, n_iter, GROUP)
                _drain_dq(i - STAGES, dq_smem, dq1_smem, dq_bars, dq_desc, dq1_desc, h0 + gd, q_row, HEAD_DIM,
                          DQ_BUFS, SPLIT, td)
        n_steps = GROUP * n_iter
        for i in range(gl.maximum(n_steps - STAGES, 0), n_steps):   # the last min(STAGES, n_steps), in order
            gd, td = _head_and_tile(i, n_iter, GROUP)
            _drain_dq(i, dq_smem, dq1_smem, dq_bars, dq_desc, dq1_desc, h0 + gd, q_row, HEAD_DIM, DQ_BUFS, SPLIT, td)

    @gluon.jit
    def _step(i, t, j, dk, dv, dk1, dv1, k_wg, v_wg, k1_wg, v1_wg, k_half, q_smem, do_smem, q1_smem, do1_smem, ds_smem,
              q_ready, do_ready, qdo_empty, ds_ready, dq_smem, dq1_smem, dq_bars, stat_smem, kv_rows, seqlen_k,
              qk_scale, sm_scale, win_left, win_right, slope2, diag, WG: gl.constexpr, MASK: gl.constexpr,
              WINDOW: gl.constexpr, DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr, ALIBI: gl.constexpr,
              SPLIT: gl.constexpr, DQ_FIRST: gl.constexpr):
        """Q tile j (step i of this program, the t-th of its query head): dK, dV updated, this warpgroup's half of
        dQ_j handed to the producer through dq_smem.  SPLIT: S^T and dP^T sum the two column parts' products, dk1 /
        dv1 hold the second part of dK / dV, and this warpgroup's part of dQ_j (k_half's columns) goes to dq_smem
        (WG 0) or dq1_smem (WG 1); without SPLIT dk1 / dv1 come back as they came."""
        dtype: gl.constexpr = q_smem.dtype
        STAGES: gl.constexpr = q_smem.shape[0]
        BLOCK_M: gl.constexpr = q_smem.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        DQ_COLS: gl.constexpr = k_half.shape[1]   # this warpgroup's part of dQ_j
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        s = i % STAGES
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        q1_s = q1_smem.index(s)
        do1_s = do1_smem.index(s)
        cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)    # query rows = columns of S^T
        zero = gl.zeros([_WG_N, BLOCK_M], gl.float32, s_layout)

        mbarrier.wait(q_ready.index(s), (i // STAGES) & 1)
        # lse2_j: the producer's copy (complete with this q_ready phase), read in the layout it is used in, and
        # before the matmuls are issued: their operand reads would queue up ahead of it in shared memory.  Not so
        # with 128-row tiles: there each of lse2 and Delta takes 32 registers per thread, and read early they spill
        # 200-300 bytes (the sm_90a report), so both are read right before their use.
        STATS_EARLY: gl.constexpr = BLOCK_M == 64
        if STATS_EARLY:
            lse2 = stat_smem.index(s).load(col_s)
        s_tok = warpgroup_mma(k_wg, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        if SPLIT:
            s_tok = warpgroup_mma(k1_wg, q1_s.permute((1, 0)), s_tok, is_async=True)
        mbarrier.wait(do_ready.index(s), (i // STAGES) & 1)
        dp_tok = warpgroup_mma(v_wg, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        if SPLIT:
            dp_tok = warpgroup_mma(v1_wg, do1_s.permute((1, 0)), dp_tok, is_async=True)
            s_t = warpgroup_mma_wait(2, deps=[s_tok])             # both parts of dP^T keep running
        else:
            s_t = warpgroup_mma_wait(1, deps=[s_tok])             # dP^T keeps running
        # Causal diagonal (MASK): key kv visible to query row q iff kv <= q, masked at run time on the
        # program's first Q tiles, the ones its diagonal crosses (one loop body: fewer registers for ptxas than a
        # peeled loop).
        if MASK:
            if t < _BLOCK_N // BLOCK_M:
                s_t = gl.where(cols[None, :] >= kv_rows[:, None], s_t, float("-inf"))
        # Window (Sq == Sk): key kv visible to row q iff q - win_left <= kv <= q + win_right, masked at run time
        # only on the tiles that cross the band's edges for this warpgroup's 64 keys.
        if WINDOW:
            q0 = j * BLOCK_M
            kv0 = gl.program_id(0) * _BLOCK_N + WG * _WG_N
            if (kv0 + win_left < q0 + BLOCK_M - 1) | (kv0 + _WG_N - 1 > q0 + win_right):
                seen = (kv_rows[:, None] + win_left >= cols[None, :]) & (kv_rows[:, None] <= cols[None, :] + win_right)
                s_t = gl.where(seen, s_t, float("-inf"))
        # Ragged Sk: rows of this K/V tile past Sk (the next batch entry's keys, or TMA's zero fill) get P = 0,
        # so their dS column adds nothing to dQ.  Only a batch entry's last tile reaches past Sk.
        if RAGGED:
            if (gl.program_id(0) + 1) * _BLOCK_N > seqlen_k:
                s_t = gl.where(kv_rows[:, None] < seqlen_k, s_t, float("-inf"))
        if not STATS_EARLY:
            lse2 = stat_smem.index(s).load(col_s)
        if ALIBI:   # kernels/common.transform_log2's bias, as the forward that wrote lse2 added it.  (Split into a
            # row and a column term under causal, it would subtract two values of ~slope * S: 0.07% error in P at 16k.)
            dist = gl.abs(kv_rows.to(gl.float32)[:, None] - (cols + diag).to(gl.float32)[None, :])
            p_t = gl.exp2(s_t * qk_scale - slope2 * dist - lse2[None, :]).to(dtype)
        else:
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :]).to(dtype)
        dv_tok = warpgroup_mma(gl.convert_layout(p_t, p_layout), do_s, dv, is_async=True)
        if SPLIT:
            p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv1.type.layout, k_width=2)
            dv1_tok = warpgroup_mma(gl.convert_layout(p_t, p1_layout), do1_s, dv1, is_async=True)
        if STATS_EARLY:
            delta = stat_smem.index(STAGES + s).load(col_s)          # already times softmax_scale
        if SPLIT:
            dp_t = warpgroup_mma_wait(2, deps=[dp_tok])           # both parts of dV keep running
        else:
            dp_t = warpgroup_mma_wait(1, deps=[dp_tok])           # dV keeps running
        if not STATS_EARLY:
            delta = stat_smem.index(STAGES + s).load(col_s)
        # dS from the rounded P that dV used (as torch's low-precision math): P fp32 would hold 16 more
        # registers per thread across the dP wait, where this warpgroup peaks at 240.
        ds_t = (p_t.to(gl.float32) * (dp_t * sm_scale - delta[None, :])).to(dtype)

        # dS^T goes through shared memory: dK reads this warpgroup's half (no registers held while it runs),
        # dQ_j = dS_j K both halves, so the warpgroups meet at ds_ready[i % 2] first.
        slot = i % 2
        ds_buf = ds_smem.index(slot)
        ds_wg = ds_buf.slice(WG * _WG_N, _WG_N)
        ds_wg.store(ds_t)
        fence_async_shared()                                      # generic-proxy stores -> wgmma reads
        mbarrier.arrive(ds_ready.index(slot), count=1)            # (after a barrier of this warpgroup)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
        if DQ_FIRST:
            # FA3's and FA4's order: dQ_j issued before dK, so dK's matmul runs while dQ_j goes to shared memory
            # below (retire order: dV, dQ, then dK at the step's end); dK reads dS^T from registers (their
            # Mma_dKV_is_RS: no shared-memory reads of this warpgroup's half, and fewer spills at D=128)
            mbarrier.wait(ds_ready.index(slot), (i // 2) & 1)
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
            dk_tok = warpgroup_mma(gl.convert_layout(ds_t, p_layout), q_s, dk, is_async=True)
            if SPLIT:
                ds1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk1.type.layout, k_width=2)
                dk1_tok = warpgroup_mma(gl.convert_layout(ds_t, ds1_layout), q1_s, dk1, is_async=True)
                dv, dv1 = warpgroup_mma_wait(3, deps=[dv_tok, dv1_tok])
                dq = warpgroup_mma_wait(2, deps=[dq_tok])
            else:
                dv = warpgroup_mma_wait(2, deps=[dv_tok])
                dq = warpgroup_mma_wait(1, deps=[dq_tok])
        else:
            dk_tok = warpgroup_mma(ds_wg, q_s, dk, is_async=True)
            if SPLIT:
                dk1_tok = warpgroup_mma(ds_wg, q1_s, dk1, is_async=True)
                dv, dv1 = warpgroup_mma_wait(2, deps=[dv_tok, dv1_tok])   # frees P^T's registers; dK keeps running
            else:
                dv = warpgroup_mma_wait(1, deps=[dv_tok])             # frees P^T's registers; dK keeps running
            mbarrier.wait(ds_ready.index(slot), (i // 2) & 1)
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
            if SPLIT:
                dk, dk1, dq = warpgroup_mma_wait(0, deps=[dk_tok, dk1_tok, dq_tok])
            else:
                dk, dq = warpgroup_mma_wait(0, deps=[dk_tok, dq_tok])
            mbarrier.arrive(qdo_empty.index(s), count=1)          # Q_j, dO_j no longer read by this warpgroup

        # This warpgroup's half of dQ_j into dq_smem buffer u (the protocol: _drain_dq's docstring).
        u = i % DQ_BUFS
        mbarrier.wait(dq_bars.index(DQ_BUFS + u), ((i // DQ_BUFS) & 1) ^ 1)   # buffer u's previous tile drained
        if SPLIT:
            if WG == 0:
                dq_smem.index(u).store(dq)
            else:
                dq1_smem.index(u).store(dq)
        else:
            dq_smem.index(2 * u + WG).store(dq)
        fence_async_shared()                                      # generic-proxy stores -> the TMA's reads
        mbarrier.arrive(dq_bars.index(u), count=1)                # (after a barrier of this warpgroup)
        if DQ_FIRST:
            if SPLIT:
                dk, dk1 = warpgroup_mma_wait(0, deps=[dk_tok, dk1_tok])
            else:
                dk = warpgroup_mma_wait(0, deps=[dk_tok])
            mbarrier.arrive(qdo_empty.index(s), count=1)          # Q_j, dO_j no longer read by this warpgroup
        return dk, dv, dk1, dv1

    @gluon.jit
    def _consumer(k_smem, v_smem, q_smem, do_smem, k1_smem, v1_smem, q1_smem, do1_smem, ds_smem, kv_ready, q_ready,
                  do_ready, qdo_empty, ds_ready, dq_smem, dq1_smem, dq_bars, stat_smem, dk_ptr, dv_ptr, seqlen_q,
                  seqlen_k, qk_scale, sm_scale, win_left, win_right, slopes_ptr, slope_stride, WG: gl.constexpr,
                  HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr, ALIBI: gl.constexpr, SPLIT: gl.constexpr,
                  DQ_FIRST: gl.constexpr, GROUP: gl.constexpr):
        """Warpgroup WG: K/V rows [64 WG, 64 WG + 64) of the program's tile; dK, dV float32 [64, D] (SPLIT: dk, dv
        the columns [0, D0), dk1, dv1 the rest)."""
        D0: gl.constexpr = q_smem.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, D0, 16])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, q_smem.shape[1], 16])
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // (HEADS_Q // GROUP)
        h0 = pid_bh % (HEADS_Q // GROUP) * GROUP
        kv0 = pid_n * _BLOCK_N + WG * _WG_N
        kv_rows = kv0 + gl.arange(0, _WG_N, layout=gl.SliceLayout(1, s_layout))
        k_wg = k_smem.slice(WG * _WG_N, _WG_N)
        v_wg = v_smem.slice(WG * _WG_N, _WG_N)
        dk = gl.zeros([_WG_N, D0], gl.float32, acc_layout)
        dv = gl.zeros([_WG_N, D0], gl.float32, acc_layout)
        if SPLIT:
            D1: gl.constexpr = q1_smem.shape[2]
            acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                  instr_shape=[16, D1, 16])
            k1_wg = k1_smem.slice(WG * _WG_N, _WG_N)
            v1_wg = v1_smem.slice(WG * _WG_N, _WG_N)
            dk1 = gl.zeros([_WG_N, D1], gl.float32, acc1_layout)
            dv1 = gl.zeros([_WG_N, D1], gl.float32, acc1_layout)
            if WG == 0:   # dQ_j's part: warpgroup 0 the first column part, warpgroup 1 the second
                k_half = k_smem
            else:
                k_half = k1_smem
        else:
            k1_wg, v1_wg, dk1, dv1 = k_wg, v_wg, dk, dv   # not used: the loop hands dk1, dv1 back as they came
            k_half = k_smem.slice(WG * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1)
        j0, n_iter = _q_tiles(seqlen_q, win_left, win_right, CAUSAL, WINDOW, RAGGED, q_smem.shape[1])
        diag = seqlen_k - seqlen_q   # bottom-right alignment: query row r's diagonal key is r + diag
        slope2 = 0.0
        if ALIBI:
            slope2 = gl.load(slopes_ptr + b * slope_stride + h0) * _LOG2E
        mbarrier.wait(kv_ready, 0)
        for i in range(GROUP * n_iter):
            g, t = _head_and_tile(i, n_iter, GROUP)
            if ALIBI:
                if GROUP > 1:
                    slope2 = gl.load(slopes_ptr + b * slope_stride + h0 + g) * _LOG2E
            dk, dv, dk1, dv1 = _step(i, t, j0 + t, dk, dv, dk1, dv1, k_wg, v_wg, k1_wg, v1_wg, k_half, q_smem, do_smem,
                                     q1_smem, do1_smem, ds_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_smem,
                                     dq1_smem, dq_bars, stat_smem, kv_rows, seqlen_k, qk_scale, sm_scale, win_left,
                                     win_right, slope2, diag, WG, CAUSAL, WINDOW, DQ_BUFS, RAGGED, ALIBI, SPLIT,
                                     DQ_FIRST)

        # Epilogue: dK, dV rows of query head h into [B, Sk, Hq, D]: dk / dv themselves without GQA, else
        # float32 partials; GROUP > 1: the group's sums, into dk / dv [B, Sk, Hkv, D] themselves.  The head counts
        # are compile-time constants: with constant row strides the per-thread offsets fold into instruction
        # immediates (as run-time strides they were registers that ptxas spilled); one int64 scalar for the tile.
        row_stride: gl.constexpr = HEADS_Q // GROUP * HEAD_DIM
        tile = (b.to(gl.int64) * seqlen_k + kv0) * row_stride + h0 // GROUP * HEAD_DIM
        _store_rows(dk_ptr, dv_ptr, dk, dv, tile, row_stride, kv0, seqlen_k, RAGGED)
        if SPLIT:
            _store_rows(dk_ptr, dv_ptr, dk1, dv1, tile + D0, row_stride, kv0, seqlen_k, RAGGED)

    @gluon.jit
    def _store_rows(dk_ptr, dv_ptr, dk, dv, tile, row_stride: gl.constexpr, kv0, seqlen_k, RAGGED: gl.constexpr):
        """dk, dv [64, C] into the 64 rows from `tile` (C columns each, rows row_stride apart)."""
        layout: gl.constexpr = dk.type.layout
        rows = gl.arange(0, _WG_N, layout=gl.SliceLayout(1, layout))
        dcols = gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout))
        offs = rows[:, None] * row_stride + dcols[None, :]
        if RAGGED:   # rows past Sk belong to the next batch entry (or past the tensor): not written
            keep = (kv0 + rows)[:, None] < seqlen_k
            gl.store(dk_ptr + tile + offs, dk.to(dk_ptr.dtype.element_ty), mask=keep)
            gl.store(dv_ptr + tile + offs, dv.to(dv_ptr.dtype.element_ty), mask=keep)
        else:
            gl.store(dk_ptr + tile + offs, dk.to(dk_ptr.dtype.element_ty))
            gl.store(dv_ptr + tile + offs, dv.to(dv_ptr.dtype.element_ty))

    @gluon.jit
    def _bwd_body(q_desc, k_desc, v_desc, do_desc, dq_desc, q1_desc, k1_desc, v1_desc, do1_desc, dq1_desc, lse_ptr,
                  delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, group, qk_scale, sm_scale, win_left, win_right,
                  slopes_ptr, slope_stride, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr,
                  ALIBI: gl.constexpr, SPLIT: gl.constexpr, DQ_FIRST: gl.constexpr, GROUP: gl.constexpr):
        """q_desc / do_desc: [BLOCK_M, D0] blocks; k_desc / v_desc: [BLOCK_N, D0]; dq_desc: float32 [BLOCK_M, D / 2]
        (one warpgroup's half of dQ_j), with D0 = HEAD_DIM unless SPLIT: then the *1_desc blocks hold the head's
        other HEAD_DIM - D0 columns, and dq_desc / dq1_desc the two parts of dQ_j (without SPLIT they repeat the
        first descriptors, unused)."""
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        D0: gl.constexpr = q_desc.block_type.shape[1]
        k_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D0], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D0], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D0], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D0], do_desc.layout)
        if SPLIT:
            D1: gl.constexpr = q1_desc.block_type.shape[1]
            k1_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D1], k1_desc.layout)
            v1_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D1], v1_desc.layout)
            q1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D1], q1_desc.layout)
            do1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D1], do1_desc.layout)
        else:
            k1_smem, v1_smem, q1_smem, do1_smem = k_smem, v_smem, q_smem, do_smem   # unused
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, BLOCK_M], ds_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=2)     # the copy engine's bytes + the producer's lse2 / Delta
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(qdo_empty.index(i), count=2)   # one arrive per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)    # both halves of dS^T written
        # dQ_j [64, D] float32 as two [64, D / 2] halves in TMA's layout (the dq_accum descriptor's), per buffer;
        # SPLIT: its [64, D0] and [64, D1] parts, one buffer set each
        if SPLIT:
            dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, D0], dq_desc.layout)
            dq1_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, D1], dq1_desc.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFS, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
            dq1_smem = dq_smem   # unused
        # lse2 rows of stage s at index s, Delta * softmax_scale rows at STAGES + s (a rank-1 layout: the
        # leading dimension only indexes the rows)
        stat_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        dq_bars = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFS, 1], mbarrier.MBarrierLayout())
        for u in gl.static_range(DQ_BUFS):
            mbarrier.init(dq_bars.index(u), count=2)             # dq_full[u]: one arrive per consumer warpgroup
            mbarrier.init(dq_bars.index(DQ_BUFS + u), count=1)   # dq_empty[u]: the producer drained buffer u
        # Argument tuples are written inline: bound to a local first, their constexprs turn into tensors.
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q1_desc, k1_desc, v1_desc,
                         do1_desc, k1_smem, v1_smem, q1_smem, do1_smem, kv_ready, q_ready, do_ready, qdo_empty,
                         dq_smem, dq1_smem, dq_bars, dq_desc, dq1_desc, stat_smem, lse_ptr, delta_ptr, sm_scale,
                         seqlen_q, seqlen_k, group, win_left, win_right, HEADS_Q, HEAD_DIM, CAUSAL, WINDOW, DQ_BUFS,
                         RAGGED, SPLIT, GROUP)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, k1_smem, v1_smem, q1_smem, do1_smem, ds_smem, kv_ready,
                         q_ready, do_ready, qdo_empty, ds_ready, dq_smem, dq1_smem, dq_bars, stat_smem, dk_ptr, dv_ptr,
                         seqlen_q, seqlen_k, qk_scale, sm_scale, win_left, win_right, slopes_ptr, slope_stride, 0,
                         HEADS_Q, HEAD_DIM, CAUSAL, WINDOW, DQ_BUFS, RAGGED, ALIBI, SPLIT, DQ_FIRST, GROUP)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, k1_smem, v1_smem, q1_smem, do1_smem, ds_smem, kv_ready,
                         q_ready, do_ready, qdo_empty, ds_ready, dq_smem, dq1_smem, dq_bars, stat_smem, dk_ptr, dv_ptr,
                         seqlen_q, seqlen_k, qk_scale, sm_scale, win_left, win_right, slopes_ptr, slope_stride, 1,
                         HEADS_Q, HEAD_DIM, CAUSAL, WINDOW, DQ_BUFS, RAGGED, ALIBI, SPLIT, DQ_FIRST, GROUP)),
        ], [4, 4], [_CONSUMER_REGS, _CONSUMER_REGS])

    # Two entry points over one body: without SPLIT the launch carries five descriptors, not ten (Triton's launcher
    # encodes every descriptor on every call).  The window bounds are compared, never indexed with: no
    # specialisation (1 and multiples of 16 would each be a compile of their own).
    @gluon.jit(do_not_specialize=["win_left", "win_right"])
    def _attn_bwd_hopper(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seqlen_q,
                         seqlen_k, group, qk_scale, sm_scale, win_left, win_right, slopes_ptr, slope_stride,
                         HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                         STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr, ALIBI: gl.constexpr,
                         DQ_FIRST: gl.constexpr, GROUP: gl.constexpr):
        _bwd_body(q_desc, k_desc, v_desc, do_desc, dq_desc, q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr,
                  delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, group, qk_scale, sm_scale, win_left, win_right,
                  slopes_ptr, slope_stride, HEADS_Q, HEAD_DIM, CAUSAL, WINDOW, STAGES, DQ_BUFS, RAGGED, ALIBI, False,
                  DQ_FIRST, GROUP)

    @gluon.jit(do_not_specialize=["win_left", "win_right"])
    def _attn_bwd_hopper_split(q_desc, k_desc, v_desc, do_desc, dq_desc, q1_desc, k1_desc, v1_desc, do1_desc,
                               dq1_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, group, qk_scale,
                               sm_scale, win_left, win_right, slopes_ptr, slope_stride, HEADS_Q: gl.constexpr,
                               HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                               STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, RAGGED: gl.constexpr, ALIBI: gl.constexpr,
                               DQ_FIRST: gl.constexpr, GROUP: gl.constexpr):
        _bwd_body(q_desc, k_desc, v_desc, do_desc, dq_desc, q1_desc, k1_desc, v1_desc, do1_desc, dq1_desc, lse_ptr,
                  delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, group, qk_scale, sm_scale, win_left, win_right,
                  slopes_ptr, slope_stride, HEADS_Q, HEAD_DIM, CAUSAL, WINDOW, STAGES, DQ_BUFS, RAGGED, ALIBI, True,
                  DQ_FIRST, GROUP)

    _launch = DirectLauncher(_attn_bwd_hopper)
    _launch_split = DirectLauncher(_attn_bwd_hopper_split)


# Compiled (heads, GQA, the group loop's group, ragged, *broken_key) and the broken_key()s whose compilation failed,
# with the reason: a failure switches this path off for them (one warning), and the Triton kernels serve instead.
_compiled: set = set()
broken: dict = {}


def broken_key(spec, variant: str | None = None) -> tuple:
    """What one compilation stands for: the call's variant_key and what the switches add (the tile variant, the
    GQA group loop, dQ first), so a variant behind a switch that fails to compile leaves the default one on."""
    return (*variant_key(spec), variant or default_variant(spec.head_dim),
            spec.group_size > 1 and env.flag("FLASHPORT_HOPPER_BWD_GROUP_LOOP"),
            env.flag("FLASHPORT_HOPPER_BWD_DQ_FIRST"))


def padded(n: int) -> int:
    """n rows rounded up to whole 128-row tiles (RAGGED: the kernel's K/V tiles and lse2 / Delta rows)."""
    return -(-n // BLOCK_N) * BLOCK_N


def backward(spec, do, q, k, v, out, lse2, delta, dq=None, dk=None, dv=None, variant: str | None = None,
             warmup: bool = False, dq_accum=None, alibi=None):
    """Gradients (dq, dk, dv) shaped like q, k, v for a call `reasons` accepts, given dO, the forward's
    lse2 [B, Hq, Sq] and Delta [B, Hq, Sq] (float32, dlse already folded in); written into dq / dk / dv
    when given (contiguous, q's / k's / v's dtype).  None when the kernel fails to compile here (the
    caller then runs the Triton kernels).  `out` is unused (Delta carries it).  variant: a VARIANTS key
    (default: DEFAULT[D]).  warmup=True compiles without launching and returns the compiled kernel
    (tools/gpu/gluon_bwd_probe.py).  dq_accum: the float32 [B, Sq, Hq, D] buffer dQ is added into, already zeroed
    (attn_bwd's preprocess does it in the launch that computes Delta); default: a fresh torch.zeros.  alibi: the
    float32 slopes [Hq] or [B, Hq] (spec.alibi)."""
    slopes, slope_stride, has_alibi = alibi_args(spec, alibi, lse2)
    b, sq, hq, d = q.shape
    # what the switches choose, read once: the tile variant, the GQA group loop, dQ first (also the compile's key)
    key = broken_key(spec, variant)
    *_, name, looped, dq_first = key
    tiles = VARIANTS[name]
    sk = k.shape[1]
    group = spec.group_size
    ragged = bool(sq % BLOCK_N or sk % BLOCK_N)
    if ragged:   # query rows past Sq read lse2 = +inf, Delta = 0 (the module docstring says why)
        lse2 = F.pad(lse2, (0, padded(sq) - sq), value=float("inf"))
        delta = F.pad(delta, (0, padded(sq) - sq))
    else:
        lse2, delta = lse2.contiguous(), delta.contiguous()
    if dq_accum is None:
        dq_accum = torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
    # GQA: one program per K/V head walks its group's query heads (FLASHPORT_HOPPER_BWD_GROUP_LOOP=1: dK, dV summed
    # in registers and written once), or one per query head writes float32 partials, summed per group below
    loop = group if looped else 1
    if group > 1 and loop == 1:
        dk_out = torch.empty(b, sk, hq, d, dtype=torch.float32, device=k.device)
        dv_out = torch.empty_like(dk_out)
    else:          # written in place
        dk_out = dk if dk is not None else torch.empty_like(k)
        dv_out = dv if dv is not None else torch.empty_like(v)
    grid = (padded(sk) // BLOCK_N, b * hq // loop)
    # dq_accum's descriptor: [BLOCK_M, D / 2] float32 boxes (one warpgroup's half of dQ_j), for the reduce-adds; a split
    # head dim has one descriptor per column part, for q, k, v, dO and dq_accum alike.
    split = SPLIT.get(d, 0)
    parts = [(d - split, d - split), (split, split)] if split else [(d, d // 2)]
    m = tiles.block_m
    descs = [(_descriptor(q, m, c), _descriptor(k, BLOCK_N, c), _descriptor(v, BLOCK_N, c),
              _descriptor(do, m, c), _descriptor(dq_accum, m, dqc)) for c, dqc in parts]
    args = (*(x for part in descs for x in part), lse2, delta, dk_out, dv_out, sq, sk, group,
            spec.softmax_scale * LOG2E, spec.softmax_scale, *window_bounds(spec), slopes, slope_stride)
    # Hq is compiled in (constant strides); one compile per head count, as per dtype and mask kind.
    kind = spec.visibility.kind
    meta = dict(HEADS_Q=hq, HEAD_DIM=d, CAUSAL=kind == "causal", WINDOW=kind == "window", STAGES=tiles.stages,
                DQ_BUFS=tiles.dq_bufs, RAGGED=ragged, ALIBI=has_alibi,
                DQ_FIRST=dq_first, GROUP=loop, num_warps=4)
    launch = _launch_split if split else _launch
    if warmup:
        return launch.compile(grid, args, meta)
    if (hq, group > 1, loop, ragged, *key) not in _compiled:
        try:  # compile only (no launch), so a toolchain that rejects the kernel costs one fallback, not a crash
            launch.compile(grid, args, meta)
        except Exception as e:  # noqa: BLE001 - any compiler failure means "use the Triton kernels"
            broken[key] = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"flashport: the Hopper backward failed to compile for {key} and is switched off "
                          f"for it; the Triton kernels serve instead ({broken[key]})", RuntimeWarning, stacklevel=3)
            return None
        _compiled.add((hq, group > 1, loop, ragged, *key))
    launch(grid, args, meta)
    # dQ already carries softmax_scale (folded into dS): the epilogue is a cast.
    dq = dq.copy_(dq_accum) if dq is not None else dq_accum.to(q.dtype)
    if group > 1 and loop == 1:  # [B, Sk, Hq, D] -> [B, Sk, Hkv, G, D] summed over G (head h reads kv head h // G)
        dk_sum = dk_out.unflatten(2, (spec.heads_kv, group)).sum(3)
        dv_sum = dv_out.unflatten(2, (spec.heads_kv, group)).sum(3)
        dk = dk.copy_(dk_sum) if dk is not None else dk_sum.to(k.dtype)
        dv = dv.copy_(dv_sum) if dv is not None else dv_sum.to(v.dtype)
    else:
        dk, dv = dk_out, dv_out
    return dq, dk, dv
