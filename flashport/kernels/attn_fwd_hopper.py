"""Hopper (sm_90) attention forward in Gluon, scheduled like FlashAttention-3.

Triton's compiler waits for each QK^T wgmma right after issuing it, so the softmax never overlaps a
matmul (docs/PERFLOG.md row 14).  Gluon (Triton's lower-level dialect) lets the kernel place the waits
itself.  One program per (128-row Q tile, query head, batch entry), three warp roles:

* a producer (4 warps) issues TMA loads: the Q tile once, then K_j / V_j into a 3-stage shared-memory
  ring guarded by mbarriers (k_ready / v_ready filled by the copy engine, kv_empty released by both
  consumers once their P V of that stage has retired);
* two consumer warpgroups (4 warps, 240 registers each) own 64 query rows apiece.  Per key tile j they
  issue S_j = Q K_j^T, then acc += P_{j-1} V_{j-1}, wait for S_j only, run the softmax of S_j on the
  CUDA cores while the P V matmul is still on the tensor cores, then wait for it (FA3's
  intra-warpgroup overlap; the two warpgroups also interleave).

Online softmax in the log2 domain with the scale folded into one FMA (as kernels/attn_fwd.py).  The
kernel serves a deliberately small, common subset (`reasons` says what falls outside it, including
sequences too short to gain); every other call runs the Triton kernel.  FLASHPORT_HOPPER_FWD=0
switches it off (rollback without a release).  Measured on an H200 (bench/gluon_fwd_probe.py,
results/gluon_fwd_probe_h200_run{2,3}.json: this schedule, `gluon_n128_s3_ov`): 606-635 TFLOP/s at
D=128, non-causal, against 477-500 for the Triton forward and 599-609 for SDPA-cuDNN in the same runs.

Equivalent PyTorch math: kernels/attn_fwd.py's (no softcap, ALiBi, dropout or window; causal with
Sq == Sk).  Outputs: out [B, Sq, Hq, D], lse [B, Hq, Sq] (natural log) and lse2 = lse / ln 2 (what the
backward reads; every row sees at least one key here, so both are finite).
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
import triton

try:  # Gluon ships with recent Triton; without it (or another version: TESTED_TRITON) this path declines
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

LOG2E = 1.4426950408889634
HEAD_DIM = 128
BLOCK_M = 64           # query rows per consumer warpgroup; a program's Q tile is 2 * BLOCK_M = 128 rows
BLOCK_N = 128          # keys per tile (= the Q tile, so a causal program's last tile is its diagonal)
STAGES = 3             # K/V ring depth: 3 x 64 KiB + the Q tile = 224 KiB of sm_90's 227 KiB
CONSUMER_REGS = 240    # setmaxnreg for the consumer warpgroups (FA3's choice at D = 128)
TILE = 2 * BLOCK_M
assert BLOCK_N == TILE  # a causal program's last key tile is exactly its diagonal
# Shortest sequences served.  In the one same-run comparison we have (results/bench_standard_d128_h200.json,
# the Hopper kernel serving every D=128 cell, against the Triton kernel's numbers of the previous run,
# results/bench_standard_h200.json) every cell from here up gained (non-causal S=2048 457 -> 635 TF/s,
# causal S=4096 421 -> 557) while shorter ones were mixed: non-causal S=512 gained (232 -> 368) but S=1024
# lost (405 -> 238, out of line with S=512 and not re-measured), causal S=512 and 2048 lost (245 -> 110,
# 374 -> 325).  One 128-row program per SM (a 224 KiB ring) pays its pipeline fill per program, which
# weighs most on short ones.  Conservative floors until a same-run A/B (FLASHPORT_HOPPER_FWD=0) says more;
# Sq is held to the same floor because short-Sq / long-Sk shapes (few programs) were never measured.
MIN_KEYS = 2048
MIN_KEYS_CAUSAL = 4096
TESTED_TRITON = "3.6"   # the Gluon API this kernel is written against (Gluon is experimental upstream)
MAX_GRID_Y = 65535      # CUDA's limit on the grid's second dimension (here batch * heads)


def enabled() -> bool:
    return (gluon is not None and triton.__version__.startswith(TESTED_TRITON)
            and os.environ.get("FLASHPORT_HOPPER_FWD", "1") != "0")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def reasons(spec, q, k, v) -> list[str]:
    """Why this kernel cannot serve the call (empty: it can).  Runs on every forward, so the cheapest
    checks come first and the first failing one is the answer."""
    if spec.head_dim != HEAD_DIM or spec.head_dim_v != HEAD_DIM:
        return [f"head dim {HEAD_DIM} only"]
    if spec.kind != "dense" or spec.device.type != "cuda":
        return ["dense CUDA tensors only"]
    if spec.dtype not in (torch.bfloat16, torch.float16):
        return ["bfloat16 / float16 only"]
    if spec.softcap > 0 or spec.alibi is not None or spec.dropout_p > 0 or spec.softmax_scale <= 0:
        return ["no softcap, ALiBi or dropout; positive softmax scale"]
    if spec.window_left >= 0 or (spec.window_right >= 0 and not spec.causal):
        return ["no sliding window"]
    if spec.causal and spec.seqlen_q != spec.seqlen_k:
        return ["causal needs Sq == Sk"]
    floor = MIN_KEYS_CAUSAL if spec.causal else MIN_KEYS
    if spec.seqlen_q % TILE or spec.seqlen_k % BLOCK_N or min(spec.seqlen_q, spec.seqlen_k) < floor:
        return [f"sequence lengths must be multiples of {TILE} and at least {floor} (shorter: the Triton "
                f"kernel measured as fast or faster)"]
    if spec.batch == 0 or spec.batch * spec.heads_q > MAX_GRID_Y:
        return [f"batch * heads must be in [1, {MAX_GRID_Y}]"]
    if not enabled():
        return [f"Gluon (Triton {TESTED_TRITON}.x) unavailable or FLASHPORT_HOPPER_FWD=0"]
    if (spec.dtype, spec.causal, spec.device) in broken:
        return ["failed to compile here: " + broken[(spec.dtype, spec.causal, spec.device)]]
    if _capability(spec.device.index if spec.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return ["needs an sm_90 (Hopper) GPU"]
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)):
        return ["q, k, v must be contiguous and 16-byte aligned (TMA)"]
    return []


if gluon is not None:
    # The tile constants as compile-time values (a jit function reads only constexpr globals).
    _HEAD_DIM, _BLOCK_M, _BLOCK_N = gl.constexpr(HEAD_DIM), gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
    _STAGES, _CONSUMER_REGS, _TILE = gl.constexpr(STAGES), gl.constexpr(CONSUMER_REGS), gl.constexpr(TILE)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                  seqlen_q, seqlen_k, heads_q, group, CAUSAL: gl.constexpr):
        """TMA issue: the Q tile once, then K_j / V_j into stage j % _STAGES once both consumers freed it."""
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)    # heaviest causal tiles first
        pid_bh = gl.program_id(1)
        b = pid_bh // heads_q
        h = pid_bh % heads_q
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b * seqlen_q + pid_m * _TILE, h * _HEAD_DIM], q_ready, q_smem)
        kv_row = b * seqlen_k
        kv_col = (h // group) * _HEAD_DIM
        n_tiles = seqlen_k // _BLOCK_N
        if CAUSAL:
            n_tiles = pid_m + 1
        for j in range(n_tiles):
            s = j % _STAGES
            # First lap: a fresh barrier's parity 1 counts as completed, so the ring starts empty.
            mbarrier.wait(kv_empty.index(s), ((j // _STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * _BLOCK_N, kv_col], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * _BLOCK_N, kv_col], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _softmax_step(s_ij, m_i, l_i, qk_scale, rows, j, MASKED: gl.constexpr):
        """Online-softmax update of tile j in the log2 domain -> (p fp32, alpha, m_new, l_new).  MASKED:
        the causal diagonal tile (key j * _BLOCK_N + c visible to row r iff it is <= r)."""
        if MASKED:
            cols = j * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_ij.type.layout))
            s_ij = gl.where(cols[None, :] <= rows[:, None], s_ij, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_ij, axis=1) * qk_scale)
        p = gl.exp2(s_ij * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _overlap_step(j, p_prev, acc, alpha, m_i, l_i, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero,
                      qk_scale, rows, MASKED: gl.constexpr):
        """Key tile j: S_j = Q K_j^T and acc += P_{j-1} V_{j-1} in flight together; the softmax of S_j runs
        while the P V matmul is still on the tensor cores.  Returns (acc, P_j as an operand, alpha_j, m, l)."""
        o_layout: gl.constexpr = acc.type.layout
        s = j % _STAGES
        sp = (j - 1) % _STAGES
        mbarrier.wait(k_ready.index(s), (j // _STAGES) & 1)
        s_tok = warpgroup_mma(q_wg, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]   # while S_j runs
        mbarrier.wait(v_ready.index(sp), ((j - 1) // _STAGES) & 1)
        o_tok = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        s_ij = warpgroup_mma_wait(1, deps=[s_tok])          # retire S_j only: the P V keeps running
        p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, j, MASKED)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        # P_j is packed after the wait: it overwrites the registers P_{j-1} V_{j-1} reads.
        p_op = gl.convert_layout(p.to(p_prev.dtype), p_prev.type.layout)
        mbarrier.arrive(kv_empty.index(sp), count=1)
        return acc, p_op, alpha, m_i, l_i

    @gluon.jit
    def _consumer(q_wg, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr, lse2_ptr,
                  seqlen_q, seqlen_k, heads_q, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr):
        """Warpgroup WG: rows [WG * _BLOCK_M, (WG + 1) * _BLOCK_M) of the program's Q tile; acc fp32."""
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        row0 = pid_m * _TILE + WG * _BLOCK_M
        rows = row0 + gl.arange(0, _BLOCK_M, layout=row_s)
        n_tiles = seqlen_k // _BLOCK_N
        n_loop = n_tiles           # tiles 1 .. n_loop - 1 run unmasked in the loop below
        if CAUSAL:
            n_tiles = pid_m + 1
            n_loop = n_tiles - 1   # the causal diagonal (the last tile) is peeled off to carry the mask
        m_i = gl.full([_BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.full([_BLOCK_M], 0.0, gl.float32, row_s)
        acc = gl.zeros([_BLOCK_M, _HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_ready, 0)

        # Tile 0: S_0 and its softmax (no P V in flight yet); it is the diagonal when n_tiles == 1.
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_wg, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_ij = warpgroup_mma_wait(0, deps=[s_tok])
        if CAUSAL:
            if n_tiles == 1:
                cols = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s_ij = gl.where(cols[None, :] <= rows[:, None], s_ij, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, 0, False)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_loop):
            acc, p_op, alpha, m_i, l_i = _overlap_step(j, p_op, acc, alpha, m_i, l_i, q_wg, k_smem, v_smem,
                                                       k_ready, v_ready, kv_empty, s_zero, qk_scale, rows, False)
        if CAUSAL:
            if n_tiles > 1:
                acc, p_op, alpha, m_i, l_i = _overlap_step(n_tiles - 1, p_op, acc, alpha, m_i, l_i, q_wg, k_smem,
                                                           v_smem, k_ready, v_ready, kv_empty, s_zero, qk_scale,
                                                           rows, True)
        # The last P V.
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        sl = (n_tiles - 1) % _STAGES
        mbarrier.wait(v_ready.index(sl), ((n_tiles - 1) // _STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(sl), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(sl), count=1)

        # Epilogue: O = acc / l_i through this warpgroup's (now unused) slice of the Q tile, TMA store.
        b = pid_bh // heads_q
        h = pid_bh % heads_q
        acc = acc * (1.0 / gl.convert_layout(l_i, row_o))[:, None]
        q_wg.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b * seqlen_q + row0, h * _HEAD_DIM], q_wg)
        lse2 = m_i + gl.log2(l_i)
        offs = pid_bh.to(gl.int64) * seqlen_q + rows
        gl.store(lse_ptr + offs, lse2 * 0.6931471805599453)
        gl.store(lse2_ptr + offs, lse2)
        tma.store_wait(0)

    @gluon.jit
    def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, lse_ptr, lse2_ptr, seqlen_q, seqlen_k, heads_q, group,
                         qk_scale, CAUSAL: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [_TILE, _HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, _HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, _HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrive per consumer warpgroup
        # Argument tuples are written inline: bound to a local first, their constexprs turn into tensors.
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         seqlen_q, seqlen_k, heads_q, group, CAUSAL)),
            (_consumer, (q_smem.slice(0, _BLOCK_M), k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, o_desc,
                         lse_ptr, lse2_ptr, seqlen_q, seqlen_k, heads_q, qk_scale, 0, CAUSAL)),
            (_consumer, (q_smem.slice(_BLOCK_M, _BLOCK_M), k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         o_desc, lse_ptr, lse2_ptr, seqlen_q, seqlen_k, heads_q, qk_scale, 1, CAUSAL)),
        ], [4, 4], [_CONSUMER_REGS, _CONSUMER_REGS])


def _descriptor(t: torch.Tensor, rows: int) -> "TensorDescriptor":
    """TMA descriptor over the 2D view [B * S, H * D] of a contiguous [B, S, H, D] tensor: a [rows, D]
    block at (b * S + n, h * D) is one head's tile."""
    b, s, h, d = t.shape
    elem = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], elem)
    return TensorDescriptor.from_tensor(t.view(b * s, h * d), [rows, d], layout)


# Compiled variants (dtype, causal, device) and the ones whose compilation failed, with the reason: a
# failure switches this path off for that variant (one warning), and the Triton kernel serves instead.
_compiled: set = set()
broken: dict = {}


def forward(spec, q, k, v, warmup: bool = False):
    """q [B, Sq, Hq, 128], k / v [B, Sk, Hkv, 128] (a call `reasons` accepts) -> (out, lse, lse2), or None
    when the kernel fails to compile here (the caller then runs the Triton kernel).  warmup=True
    compiles without launching and returns the compiled kernel (bench/compile_report.py)."""
    b, sq, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(lse)
    grid = (sq // TILE, b * hq)
    args = (_descriptor(q, TILE), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(out, BLOCK_M),
            lse, lse2, sq, spec.seqlen_k, hq, spec.group_size, spec.softmax_scale * LOG2E)
    if warmup:
        return _attn_fwd_hopper.warmup(*args, grid=grid, CAUSAL=spec.causal, num_warps=4)
    variant = (q.dtype, spec.causal, q.device)
    if variant not in _compiled:
        try:  # compile only (no launch), so a toolchain that rejects the kernel costs one fallback, not a crash
            _attn_fwd_hopper.warmup(*args, grid=grid, CAUSAL=spec.causal, num_warps=4)
        except Exception as e:  # noqa: BLE001 - any compiler failure means "use the Triton kernel"
            broken[variant] = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"flashport: the Hopper forward failed to compile for {variant} and is switched off "
                          f"for it; the Triton kernel serves instead ({broken[variant]})", RuntimeWarning,
                          stacklevel=3)
            return None
        _compiled.add(variant)
    _attn_fwd_hopper[grid](*args, CAUSAL=spec.causal, num_warps=4)
    return out, lse, lse2

