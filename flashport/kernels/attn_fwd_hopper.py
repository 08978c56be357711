"""Hopper (sm_90) attention forward in Gluon, scheduled like FlashAttention-3.

Triton's compiler waits for each QK^T wgmma right after issuing it, so the softmax never overlaps a
matmul (docs/PERFLOG.md row 14).  Gluon (Triton's lower-level dialect) lets the kernel place the waits
itself.  One program per (128-row Q tile, query head, batch entry), three warp roles:

* a producer (4 warps) issues TMA loads: the Q tile once, then K_j / V_j into a STAGES-deep
  shared-memory ring guarded by mbarriers (k_ready / v_ready filled by the copy engine; v_empty
  released by both consumers once their P V_j has retired, and k_empty (EARLY_K) once their Q K_j^T
  has: as in FA3, K_{j+STAGES} then loads while P_j V_j still runs, which a 2-stage ring (D=256)
  needs to stay fed; without EARLY_K one release frees both tiles, the schedule measured at D=128);
* two consumer warpgroups (4 warps, CONSUMER_REGS registers each) own 64 query rows apiece.  Per key
  tile j they issue S_j = Q K_j^T, then acc += P_{j-1} V_{j-1}, wait for S_j only, run the softmax of
  S_j on the CUDA cores while the P V matmul is still on the tensor cores, then wait for it (FA3's
  intra-warpgroup overlap; the two warpgroups also interleave).  In the SASS that overlap holds only with PIN
  (FLASHPORT_HOPPER_FWD_PIN=1, until timed): ptxas otherwise hoists the wait for P V ahead of the exp2
  (_overlap_step says how the pin keeps it).  PINGPONG (FLASHPORT_HOPPER_FWD_PINGPONG=1, until timed) makes the
  warpgroups take turns issuing their matmuls, FA3's ping-pong (_take_turn).

Head dims 64, 128 and 256 (q/k and v alike) share this one kernel, and 80 and 96 as two power-of-two column
parts (SPLIT; Gluon's tensors must be powers of two); TILES picks BLOCK_N (keys per tile) and the ring depth per
head dim to fit sm_90's 227 KiB of shared memory and the consumers'
registers without spilling (tools/gpu/compile_report.py --hopper-fwd checks both for sm_90a).  Causal:
BLOCK_N divides the 128-row Q tile, and a consumer's 64 rows meet the diagonal in exactly one key
tile (its last, masked); a key tile that lies wholly above a warpgroup's rows (BLOCK_N = 64: the
program's last tile, for the first warpgroup) is not computed, only released to the producer.

Online softmax in the log2 domain with the scale folded into one FMA (as kernels/attn_fwd.py).  The
kernel serves a deliberately small, common subset (`reasons` says what falls outside it, including
sequences too short to gain: MIN_KEYS / MIN_KEYS_CAUSAL per head dim); every other call runs the
Triton kernel.  FLASHPORT_HOPPER_FWD=0 switches it off (rollback without a release).  This schedule
is the fastest of tools/gpu/gluon_fwd_probe.py's variants (docs/PERFLOG.md row 15); the length floors
come from tools/gpu/hopper_fwd_ab.py's same-run A/B (row 18).

Sliding windows (WINDOW; Sq == Sk; FLASHPORT_HOPPER_FWD_WINDOW=0 leaves them to the Triton kernel): a
program's ring holds only the key tiles its 128 rows see (_key_tiles), both warpgroups consume every one, and
a warpgroup masks a tile only where it crosses the band's edge for its 64 rows (_band_edge).  A row whose first
tiles hold no visible key keeps p = alpha = 0 (its max stays -inf); each row sees its own key, so l > 0 at the end.

Equivalent PyTorch math: kernels/attn_fwd.py's (no softcap or dropout; ALiBi, causal and windows with
Sq == Sk).  Outputs: out [B, Sq, Hq, D], lse [B, Hq, Sq] (natural log) and lse2 = lse / ln 2 (what the
backward reads; every row sees at least one key here, so both are finite).
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter
from typing import NamedTuple

import torch
import triton

from .. import env
from .launch import Desc, DirectLauncher
from .versions import is_tested, tested_text

try:  # Gluon ships with recent Triton; without it (or another version: versions.TESTED_TRITON) it declines
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

LOG2E = 1.4426950408889634
BLOCK_M = 64           # query rows per consumer warpgroup; a program's Q tile is 2 * BLOCK_M = 128 rows
TILE = 2 * BLOCK_M


class Tiles(NamedTuple):
    """Per-head-dim tiling.  Shared memory = Q tile (TILE x D) + stages x (K + V tiles, BLOCK_N x D each)."""
    block_n: int        # keys per tile; divides TILE, so the causal diagonal lies on tile boundaries
    stages: int         # K/V ring depth
    consumer_regs: int  # setmaxnreg of each consumer warpgroup (FA3's 240 at every head dim)
    early_k: bool       # release K_j once Q K_j^T retired (its own barrier), not with V_j after P V
    split: int = 0      # a head dim that is not a power of two runs as two parts, D - split and split columns


TILES = {
    64: Tiles(128, 4, 240, False),    # 16 KiB Q + 4 x 32 KiB ring = 144 KiB; acc 32 + S 64 registers / thread
    128: Tiles(128, 3, 240, False),   # 32 KiB Q + 3 x 64 KiB = 224 KiB of 227; acc 64 + S 64
    # 64 KiB Q + 2 x 64 KiB = 192 KiB (BLOCK_N = 128 fits one stage only and spills; a third stage needs
    # 256 KiB); acc 128 + S 32.  Two stages: K_{j+2} can only load early if K_j is released early.
    256: Tiles(64, 2, 240, True),
    # Not powers of two (ViT / DiT heads): two column parts, 64 + 16 and 64 + 32, each a power of two as Gluon's
    # tensors must be; S_j is the sum of the parts' products (chained wgmma) and the output has an accumulator
    # per part, so no dot is padded.  80: 20 KiB Q + 4 x 40 KiB; 96: 24 KiB Q + 3 x 48 KiB.
    # FLASHPORT_HOPPER_FWD_SPLIT=0 leaves them to the Triton kernel (PERFLOG rows 81, 95).
    80: Tiles(128, 4, 240, False, 16),
    96: Tiles(128, 3, 240, False, 32),
}
assert all(TILE % t.block_n == 0 and t.block_n % BLOCK_M == 0 for t in TILES.values())
# Shortest sequences served, per head dim (non-causal / causal): from there on the Gluon kernel beat the Triton
# one in the same-run A/B (tools/gpu/hopper_fwd_ab.py --suggest; PERFLOG row 18).  Sq is held to the same floor.
MIN_KEYS = {64: 16384, 80: 512, 96: 512, 128: 512, 256: 512}        # 80, 96: D=128's, not yet measured
MIN_KEYS_CAUSAL = {64: 16384, 80: 512, 96: 512, 128: 512, 256: 512}
MAX_GRID_Y = 65535      # CUDA's limit on the grid's second dimension (here batch * heads)
ALIBI_HEAD_DIMS = (64, 80, 96, 128)   # D=256 with ALiBi spills 8 bytes on sm_90a (compile report, 22nd session)


def enabled() -> bool:
    # Gluon is experimental upstream: only the Triton releases this kernel is tested on (versions.py)
    return (gluon is not None and is_tested(triton.__version__)
            and env.flag("FLASHPORT_HOPPER_FWD"))


def min_keys(head_dim: int, causal: bool) -> int | None:
    """The length floor (Sq and Sk) from which the kernel serves this head dim; None: at no length (the
    Triton kernel measured faster throughout)."""
    return (MIN_KEYS_CAUSAL if causal else MIN_KEYS)[head_dim]


def _capability(index: int) -> tuple[int, int]:
    return env.capability(torch.device("cuda", index))


def is_causal(spec) -> bool:
    """The kernels' CAUSAL variant: the mask's kind (flashport.masks.Visibility), so window (-1, 0) is
    served as causal=True is."""
    return spec.visibility.kind == "causal"


def window_bounds(spec) -> tuple[int, int]:
    """(win_left, win_right) of a window call for both Hopper kernels (Sq == Sk), an unbounded side as Sq + Sk
    (every key); (0, 0) otherwise (the kernels read them only in their WINDOW variant)."""
    if spec.visibility.kind != "window":
        return 0, 0
    far = spec.seqlen_q + spec.seqlen_k
    return (spec.window_left if spec.window_left >= 0 else far), (spec.window_right if spec.window_right >= 0 else far)


def alibi_args(spec, alibi, stand_in: torch.Tensor) -> tuple:
    """(slopes pointer, batch stride, ALIBI) of both Hopper kernels' launches: the float32 slopes [Hq] or [B, Hq],
    which a call has exactly when spec.alibi says so; stand_in is any tensor the kernel never reads (no ALiBi)."""
    if (alibi is None) != (spec.alibi is None):
        raise ValueError("alibi slopes must be passed exactly when the call has them (spec.alibi)")
    if alibi is None:
        return stand_in, 0, False
    slopes = alibi.contiguous()
    return slopes, slopes.stride(0) if slopes.dim() == 2 else 0, True


def feature_reasons(spec, windows: bool = False, alibi: bool = False) -> list[str]:
    """The call features both Hopper kernels (this forward and kernels/attn_bwd_hopper.py) leave to the
    Triton kernels: the first one present, or [] for a plain bf16/fp16 call, causal only with Sq == Sk.
    windows / alibi: the caller's switch is on (FLASHPORT_HOPPER_{FWD,BWD}_WINDOW, FLASHPORT_HOPPER_{FWD,BWD}_ALIBI),
    so windows with Sq == Sk / ALiBi slopes pass."""
    if spec.dtype not in (torch.bfloat16, torch.float16):
        return ["bfloat16 / float16 only"]
    if spec.softcap > 0 or spec.dropout_p > 0 or spec.softmax_scale <= 0:
        return ["no softcap or dropout; positive softmax scale"]
    if spec.alibi is not None and not alibi:
        return ["ALiBi is switched off here (FLASHPORT_HOPPER_{FWD,BWD}_ALIBI=0)"]
    kind = spec.visibility.kind
    if kind == "window" and not windows:
        return ["sliding windows are switched off here (FLASHPORT_HOPPER_{FWD,BWD}_WINDOW=0)"]
    if kind not in ("none", "causal", "window"):
        return [f"mask kind {kind!r}"]
    if kind != "none" and spec.seqlen_q != spec.seqlen_k:
        return [f"{kind} needs Sq == Sk"]
    return []


def reasons(spec, q, k, v, length_floor: bool = True) -> list[str]:
    """Why this kernel cannot serve the call (empty: it can): spec_reasons, then tensor_reasons."""
    return spec_reasons(spec, length_floor) or tensor_reasons(q, k, v)


def tensor_reasons(*tensors) -> list[str]:
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return ["q, k, v must be contiguous and 16-byte aligned (TMA)"]
    return []


# Fallbacks from the gluon backend's choice to the Triton kernels, by reason (tensors not TMA-ready, a compile
# failure): counted, since each changes which kernel ran.
fallbacks: Counter = Counter()


def spec_reasons(spec, length_floor: bool = True) -> list[str]:
    """Why this kernel cannot serve the call description (empty: it can; the tensors aside).  The first failing
    check is the answer.  length_floor=False leaves out the speed choice (MIN_KEYS / MIN_KEYS_CAUSAL: the gluon
    backend's static preference) and keeps what the kernel needs."""
    d = spec.head_dim
    if d not in TILES or spec.head_dim_v != d:
        return [f"head dim {' / '.join(map(str, TILES))} only (q/k and v alike)"]
    if spec.kind != "dense" or spec.device.type != "cuda":
        return ["dense CUDA tensors only"]
    if TILES[d].split and not env.flag("FLASHPORT_HOPPER_FWD_SPLIT"):
        return [f"head dim {d} (two column parts) is switched off: FLASHPORT_HOPPER_FWD_SPLIT=0"]
    plain = feature_reasons(spec, windows=env.flag("FLASHPORT_HOPPER_FWD_WINDOW"),
                            alibi=env.flag("FLASHPORT_HOPPER_FWD_ALIBI"))
    if plain:
        return plain
    if spec.alibi is not None and d not in ALIBI_HEAD_DIMS:
        return [f"ALiBi at head dims {' / '.join(map(str, ALIBI_HEAD_DIMS))} (at D={d} its registers spill)"]
    floor = min_keys(d, is_causal(spec)) if length_floor else 0
    if floor is None:
        return [f"not at D={d}{' causal' if is_causal(spec) else ''}: the Triton kernel measured as fast or faster "
                f"at every length"]
    if spec.seqlen_q % TILE or spec.seqlen_k % TILE or min(spec.seqlen_q, spec.seqlen_k) < max(floor, TILE):
        return [f"sequence lengths must be multiples of {TILE} and at least {max(floor, TILE)} at D={d} (shorter: "
                f"the Triton kernel measured as fast or faster)"]
    if spec.batch == 0 or spec.batch * spec.heads_q > MAX_GRID_Y:
        return [f"batch * heads must be in [1, {MAX_GRID_Y}]"]
    if not enabled():
        return [f"Gluon (Triton {tested_text()}) unavailable or FLASHPORT_HOPPER_FWD=0"]
    failed = broken.get(variant_key(spec))
    if failed:
        return ["failed to compile here: " + failed]
    if _capability(spec.device.index if spec.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return ["needs an sm_90 (Hopper) GPU"]
    return []


if gluon is not None:
    _BLOCK_M = gl.constexpr(BLOCK_M)   # a jit function reads only constexpr globals
    _LOG2E = gl.constexpr(LOG2E)

    # The per-head-dim sizes travel in the shapes: TILE x HEAD_DIM of the Q tile, STAGES x BLOCK_N x
    # HEAD_DIM of the K/V ring, so every partition reads them off its shared-memory descriptors.

    @gluon.jit
    def _load(desc, desc1, bar, buf, buf1, row, col, D0: gl.constexpr, SPLIT: gl.constexpr):
        """TMA: the tile at (row, col) into buf, and with SPLIT its columns from D0 on through desc1 into buf1; one
        barrier expects every byte."""
        if SPLIT:
            mbarrier.expect(bar, desc.block_type.nbytes + desc1.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row, col], bar, buf)
            tma.async_copy_global_to_shared(desc1, [row, col + D0], bar, buf1)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row, col], bar, buf)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q1_desc, k1_desc, v1_desc, q1_smem, k1_smem,
                  v1_smem, q_ready, k_ready, v_ready, k_empty, v_empty, seqlen_q, seqlen_k, heads_q, group, win_left,
                  win_right, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  EARLY_K: gl.constexpr, SPLIT: gl.constexpr):
        """TMA issue: the Q tile once, then K_j / V_j into stage j % STAGES, each once both consumers freed
        that stage's K (resp. V) tile (EARLY_K; otherwise k_empty is v_empty and one wait covers both).
        WINDOW: the key tiles t0 + j of the Q tile's band (_key_tiles).  SPLIT: each tile in two column parts
        (q_smem / q1_smem ...: head columns [0, D0) and [D0, HEAD_DIM)), both on the tile's one barrier."""
        TILE: gl.constexpr = q_smem.shape[0]
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        D0: gl.constexpr = k_smem.shape[2]
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)    # heaviest causal tiles first
        pid_bh = gl.program_id(1)
        b = pid_bh // heads_q
        h = pid_bh % heads_q
        _load(q_desc, q1_desc, q_ready, q_smem, q1_smem, b * seqlen_q + pid_m * TILE, h * HEAD_DIM, D0, SPLIT)
        kv_row = b * seqlen_k
        kv_col = (h // group) * HEAD_DIM
        n_tiles = seqlen_k // BLOCK_N
        if CAUSAL:
            n_tiles = (pid_m + 1) * (TILE // BLOCK_N)      # every key up to the Q tile's last row
        if WINDOW:
            t0, n_tiles = _key_tiles(pid_m, seqlen_k, win_left, win_right, TILE, BLOCK_N)
            kv_row += t0 * BLOCK_N
        for j in range(n_tiles):
            s = j % STAGES
            row = kv_row + j * BLOCK_N
            # First lap: a fresh barrier's parity 1 counts as completed, so the ring starts empty.
            mbarrier.wait(k_empty.index(s), ((j // STAGES) & 1) ^ 1)
            _load(k_desc, k1_desc, k_ready.index(s), k_smem.index(s), k1_smem.index(s), row, kv_col, D0, SPLIT)
            if EARLY_K:
                mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
            _load(v_desc, v1_desc, v_ready.index(s), v_smem.index(s), v1_smem.index(s), row, kv_col, D0, SPLIT)

    @gluon.jit
    def _key_tiles(pid_m, seqlen_k, win_left, win_right, TILE: gl.constexpr, BLOCK_N: gl.constexpr):
        """(first key tile, number of key tiles) that rows [pid_m TILE, pid_m TILE + TILE) see through a window
        (Sq == Sk: row r sees keys r - win_left .. r + win_right)."""
        t0 = gl.maximum(pid_m * TILE - win_left, 0) // BLOCK_N
        t_end = gl.minimum((pid_m * TILE + TILE - 1 + win_right) // BLOCK_N + 1, seqlen_k // BLOCK_N)
        return t0, t_end - t0

    @gluon.jit
    def _band_edge(row0, kt, win_left, win_right, BLOCK_N: gl.constexpr):
        """Whether key tile kt holds a key that one of the warpgroup's rows [row0, row0 + 64) does not see."""
        return (kt * BLOCK_N + win_left < row0 + _BLOCK_M - 1) | (kt * BLOCK_N + BLOCK_N - 1 > row0 + win_right)

    @gluon.jit
    def _softmax_step(s_ij, m_i, l_i, qk_scale, rows, j, MASKED: gl.constexpr, edge, win_left, win_right,
                      WINDOW: gl.constexpr, slope2, diag, ALIBI: gl.constexpr):
        """Online-softmax update of key tile j in the log2 domain -> (p fp32, alpha, m_new, l_new).  MASKED:
        the causal diagonal tile (key j * BLOCK_N + c visible to row r iff it is <= r).  WINDOW: keys outside
        r - win_left .. r + win_right masked where the tile crosses the band's edge (`edge`), and a row that has
        seen no key yet (max -inf) keeps p = alpha = 0 instead of exp2(-inf + inf).  No defaults: a window call
        that left out `edge` would skip its mask silently.  ALIBI: the log2-domain scores less slope2 * |r + diag
        - c| (kernels/common.transform_log2's formula, so the Triton backward recomputes the same P)."""
        BLOCK_N: gl.constexpr = s_ij.shape[1]
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_ij.type.layout))   # the tile's keys
        if MASKED:
            s_ij = gl.where(cols[None, :] <= rows[:, None], s_ij, float("-inf"))
        if WINDOW:
            if edge:
                seen = (cols[None, :] + win_left >= rows[:, None]) & (cols[None, :] <= rows[:, None] + win_right)
                s_ij = gl.where(seen, s_ij, float("-inf"))
        if ALIBI:   # the bias differs per element: scale first, then the row max
            # |r + diag - c| in float32: exact below 2^24, and one FADD per score instead of integer ops
            dist = gl.abs(cols.to(gl.float32)[None, :] - (rows + diag).to(gl.float32)[:, None])
            s_ij = s_ij * qk_scale - slope2 * dist
            m_new = gl.maximum(m_i, gl.max(s_ij, axis=1))
        else:
            m_new = gl.maximum(m_i, gl.max(s_ij, axis=1) * qk_scale)
        if WINDOW:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if ALIBI:
            p = gl.exp2(s_ij - m_use[:, None])
        else:
            p = gl.exp2(s_ij * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _take_turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG (FA3's warpgroup ping-pong): warpgroup WG issues its k-th group of matmuls only after the other
        warpgroup issued its own k-th (WG 1) or (k-1)-th (WG 0), so one warpgroup's matmuls run while the other
        computes its softmax.  turn[WG] completes a phase per arrival of the other warpgroup (_pass_turn); the
        first wait of warpgroup 0 passes on the fresh barrier (parity 1).  Both warpgroups issue the same number
        of groups (the host enables PINGPONG only where BLOCK_N == TILE), so neither waits for a turn never passed."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _overlap_step(j, p_prev, acc, acc1, alpha, m_i, l_i, q_wg, k_smem, v_smem, q1_wg, k1_smem, v1_smem, k_ready,
                      v_ready, k_empty, v_empty, s_zero, qk_scale, rows, MASKED: gl.constexpr, EARLY_K: gl.constexpr,
                      kt, edge, win_left, win_right, WINDOW: gl.constexpr, SPLIT: gl.constexpr, slope2, diag,
                      ALIBI: gl.constexpr, pin, PIN: gl.constexpr, turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Key tile j of the ring: S_j = Q K_j^T and acc += P_{j-1} V_{j-1} in flight together; the softmax of
        S_j runs while the P V matmul is still on the tensor cores.  Returns (acc, acc1, P_j as an operand,
        alpha_j, m, l).  WINDOW: ring tile j is key tile kt, masked where `edge`.  SPLIT: S_j sums the two
        column parts' products (chained wgmma), and acc1 holds the output's second part (P V1)."""
        STAGES: gl.constexpr = k_smem.shape[0]
        o_layout: gl.constexpr = acc.type.layout
        s = j % STAGES
        sp = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        _take_turn(turn, j, WG, PINGPONG)
        s_tok = warpgroup_mma(q_wg, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if SPLIT:
            s_tok = warpgroup_mma(q1_wg, k1_smem.index(s).permute((1, 0)), s_tok, is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]   # while S_j runs
        if SPLIT:
            acc1 = acc1 * gl.convert_layout(alpha, gl.SliceLayout(1, acc1.type.layout))[:, None]
        mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        if SPLIT:
            p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc1.type.layout, k_width=2)
            o1_tok = warpgroup_mma(gl.convert_layout(p_prev, p1_layout), v1_smem.index(sp), acc1, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        if SPLIT:
            s_ij = warpgroup_mma_wait(2, deps=[s_tok])      # retire S_j only: both P V parts keep running
        else:
            s_ij = warpgroup_mma_wait(1, deps=[s_tok])      # retire S_j only: the P V keeps running
        if EARLY_K:
            mbarrier.arrive(k_empty.index(s), count=1)      # K_j is read: its stage may refill
        if WINDOW:
            p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, kt, False, edge, win_left, win_right,
                                               True, slope2, diag, ALIBI)
        else:
            p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, j, MASKED, False, 0, 0, False, slope2,
                                               diag, ALIBI)
        if PIN:
            # Holds the wait below after the softmax.  Waiting early is always legal, and ptxas hoists the wait into
            # the row max's shuffle latency, leaving every exp2 of S_j after it (no overlap with P V).  ptxas keeps
            # shared-memory accesses and wgmma waits in order, so a store of l_j, which depends on every exp2 of
            # S_j, keeps them before it.  The buffer is never read.
            pin.store(l_i)
        if SPLIT:
            acc, acc1 = warpgroup_mma_wait(0, deps=[o_tok, o1_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        # P_j is packed after the wait: it overwrites the registers P_{j-1} V_{j-1} reads.
        p_op = gl.convert_layout(p.to(p_prev.dtype), p_prev.type.layout)
        mbarrier.arrive(v_empty.index(sp), count=1)
        return acc, acc1, p_op, alpha, m_i, l_i

    @gluon.jit
    def _consumer(q_wg, k_smem, v_smem, q1_wg, k1_smem, v1_smem, q_ready, k_ready, v_ready, k_empty, v_empty, o_desc,
                  o1_desc, lse_ptr, lse2_ptr, seqlen_q, seqlen_k, heads_q, qk_scale, win_left, win_right, slopes_ptr,
                  slope_stride, WG: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, EARLY_K: gl.constexpr, SPLIT: gl.constexpr, ALIBI: gl.constexpr, pin,
                  PIN: gl.constexpr, turn, PINGPONG: gl.constexpr):
        """Warpgroup WG: rows [WG * BLOCK_M, (WG + 1) * BLOCK_M) of the program's Q tile; acc fp32 (SPLIT: acc
        the output's columns [0, D0), acc1 the rest)."""
        dtype: gl.constexpr = o_desc.dtype
        TILE: gl.constexpr = 2 * _BLOCK_M
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        D0: gl.constexpr = k_smem.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D0, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        diag = seqlen_k - seqlen_q   # bottom-right alignment: row r's diagonal key is r + diag
        slope2 = 0.0
        if ALIBI:
            slope2 = gl.load(slopes_ptr + (pid_bh // heads_q) * slope_stride + pid_bh % heads_q) * _LOG2E
        row0 = pid_m * TILE + WG * _BLOCK_M
        rows = row0 + gl.arange(0, _BLOCK_M, layout=row_s)
        n_tiles = seqlen_k // BLOCK_N
        n_loop = n_tiles           # tiles 1 .. n_loop - 1 run unmasked in the loop below
        # Causal: this warpgroup's rows [row0, row0 + 64) see keys [0, row0 + 64): every key tile before the
        # Q tile's own TILE keys, then the first DIAG_TILES key tiles of those.  BLOCK_N is a multiple of 64
        # and divides TILE, so the diagonal falls in exactly one key tile, the last: n_tiles - 1.  The other
        # SKIPPED tiles of the program lie wholly above these rows (BLOCK_N < TILE: the first warpgroup's
        # last tile).  Both counts are compile-time constants.
        DIAG_TILES: gl.constexpr = ((WG + 1) * _BLOCK_M + BLOCK_N - 1) // BLOCK_N
        SKIPPED: gl.constexpr = TILE // BLOCK_N - DIAG_TILES
        if CAUSAL:
            n_tiles = pid_m * (TILE // BLOCK_N) + DIAG_TILES
            n_loop = n_tiles - 1   # the diagonal is peeled off to carry the mask
        t0 = 0
        if WINDOW:   # the program's band (both warpgroups consume every tile of the ring), masked at its edges
            t0, n_tiles = _key_tiles(pid_m, seqlen_k, win_left, win_right, TILE, BLOCK_N)
            n_loop = n_tiles
        m_i = gl.full([_BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.full([_BLOCK_M], 0.0, gl.float32, row_s)
        acc = gl.zeros([_BLOCK_M, D0], gl.float32, o_layout)
        if SPLIT:
            D1: gl.constexpr = k1_smem.shape[2]
            o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, D1, 16])
            acc1 = gl.zeros([_BLOCK_M, D1], gl.float32, o1_layout)
        else:
            acc1 = acc   # not used: the loop hands it back as it came
        s_zero = gl.zeros([_BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_ready, 0)

        # Tile 0: S_0 and its softmax (no P V in flight yet); it is the diagonal when n_tiles == 1.
        mbarrier.wait(k_ready.index(0), 0)
        _take_turn(turn, 0, WG, PINGPONG)
        s_tok = warpgroup_mma(q_wg, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if SPLIT:
            s_tok = warpgroup_mma(q1_wg, k1_smem.index(0).permute((1, 0)), s_tok, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        s_ij = warpgroup_mma_wait(0, deps=[s_tok])
        if EARLY_K:
            mbarrier.arrive(k_empty.index(0), count=1)
        if CAUSAL:
            if n_tiles == 1:
                cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s_ij = gl.where(cols[None, :] <= rows[:, None], s_ij, float("-inf"))
        if WINDOW:
            p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, t0, False,
                                               _band_edge(row0, t0, win_left, win_right, BLOCK_N), win_left,
                                               win_right, True, slope2, diag, ALIBI)
        else:
            p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale, rows, 0, False, False, 0, 0, False, slope2,
                                               diag, ALIBI)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_loop):
            if WINDOW:
                acc, acc1, p_op, alpha, m_i, l_i = _overlap_step(
                    j, p_op, acc, acc1, alpha, m_i, l_i, q_wg, k_smem, v_smem, q1_wg, k1_smem, v1_smem, k_ready,
                    v_ready, k_empty, v_empty, s_zero, qk_scale, rows, False, EARLY_K, t0 + j,
                    _band_edge(row0, t0 + j, win_left, win_right, BLOCK_N), win_left, win_right, True, SPLIT, slope2,
                    diag, ALIBI, pin, PIN, turn, WG, PINGPONG)
            else:
                acc, acc1, p_op, alpha, m_i, l_i = _overlap_step(
                    j, p_op, acc, acc1, alpha, m_i, l_i, q_wg, k_smem, v_smem, q1_wg, k1_smem, v1_smem, k_ready,
                    v_ready, k_empty, v_empty, s_zero, qk_scale, rows, False, EARLY_K, j, False, 0, 0, False, SPLIT,
                    slope2, diag, ALIBI, pin, PIN, turn, WG, PINGPONG)
        if CAUSAL:
            if n_tiles > 1:
                acc, acc1, p_op, alpha, m_i, l_i = _overlap_step(
                    n_tiles - 1, p_op, acc, acc1, alpha, m_i, l_i, q_wg, k_smem, v_smem, q1_wg, k1_smem, v1_smem,
                    k_ready, v_ready, k_empty, v_empty, s_zero, qk_scale, rows, True, EARLY_K, n_tiles - 1, False, 0,
                    0, False, SPLIT, slope2, diag, ALIBI, pin, PIN, turn, WG, PINGPONG)
        # The last P V.
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        sl = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((n_tiles - 1) // STAGES) & 1)
        _take_turn(turn, n_tiles, WG, PINGPONG)
        o_tok = warpgroup_mma(p_op, v_smem.index(sl), acc, is_async=True)
        if SPLIT:
            acc1 = acc1 * gl.convert_layout(alpha, gl.SliceLayout(1, o1_layout))[:, None]
            p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
            o1_tok = warpgroup_mma(gl.convert_layout(p_op, p1_layout), v1_smem.index(sl), acc1, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        if SPLIT:
            acc, acc1 = warpgroup_mma_wait(0, deps=[o_tok, o1_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_empty.index(sl), count=1)
        if CAUSAL:
            # The SKIPPED key tiles are loaded for the other warpgroup; release them without computing.
            # Waiting for the loads first makes the arrives count for this lap of the stage, not the last.
            for i in gl.static_range(SKIPPED):
                j = n_tiles + i
                if EARLY_K:
                    mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
                    mbarrier.arrive(k_empty.index(j % STAGES), count=1)
                mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
                mbarrier.arrive(v_empty.index(j % STAGES), count=1)

        # Epilogue: O = acc / l_i through this warpgroup's (now unused) slice of the Q tile, TMA store.
        b = pid_bh // heads_q
        h = pid_bh % heads_q
        acc = acc * (1.0 / gl.convert_layout(l_i, row_o))[:, None]
        q_wg.store(acc.to(dtype))
        if SPLIT:
            acc1 = acc1 * (1.0 / gl.convert_layout(l_i, gl.SliceLayout(1, o1_layout)))[:, None]
            q1_wg.store(acc1.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b * seqlen_q + row0, h * HEAD_DIM], q_wg)
        if SPLIT:
            tma.async_copy_shared_to_global(o1_desc, [b * seqlen_q + row0, h * HEAD_DIM + D0], q1_wg)
        lse2 = m_i + gl.log2(l_i)
        offs = pid_bh.to(gl.int64) * seqlen_q + rows
        gl.store(lse_ptr + offs, lse2 * 0.6931471805599453)
        gl.store(lse2_ptr + offs, lse2)
        tma.store_wait(0)

    @gluon.jit
    def _fwd_body(q_desc, k_desc, v_desc, o_desc, q1_desc, k1_desc, v1_desc, o1_desc, lse_ptr, lse2_ptr, seqlen_q,
                  seqlen_k, heads_q, group, qk_scale, win_left, win_right, slopes_ptr, slope_stride,
                  HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, EARLY_K: gl.constexpr, SPLIT: gl.constexpr, ALIBI: gl.constexpr,
                  PIN: gl.constexpr, PINGPONG: gl.constexpr):
        """q_desc: [TILE, D0] blocks; k_desc / v_desc: [BLOCK_N, D0]; o_desc: [BLOCK_M, D0], with D0 = HEAD_DIM
        unless SPLIT: then the *1_desc blocks hold the head's other HEAD_DIM - D0 columns (a head dim that is not
        a power of two, as two power-of-two parts; without SPLIT they repeat the first ones, unused)."""
        dtype: gl.constexpr = q_desc.dtype
        TILE: gl.constexpr = q_desc.block_type.shape[0]
        D0: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(dtype, [TILE, D0], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], v_desc.layout)
        if SPLIT:
            D1: gl.constexpr = q1_desc.block_type.shape[1]
            q1_smem = gl.allocate_shared_memory(dtype, [TILE, D1], q1_desc.layout)
            k1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
            v1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], v1_desc.layout)
        else:
            q1_smem, k1_smem, v1_smem = q_smem, k_smem, v_smem   # unused
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if EARLY_K:
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        else:
            k_empty = v_empty   # one release (after P V) frees the stage's K and V tiles together
        if PIN:   # each consumer's row sums, written before its wait for P V and never read (_overlap_step)
            pin = gl.allocate_shared_memory(gl.float32, [2 * _BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        else:
            pin = q_smem   # unused
        if PINGPONG:   # _take_turn: turn[WG] completes a phase per arrival of the other warpgroup
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
        else:
            turn = v_empty   # unused
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)   # one arrive per consumer warpgroup
            if EARLY_K:
                mbarrier.init(k_empty.index(i), count=2)
        # Argument tuples are written inline: bound to a local first, their constexprs turn into tensors.
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q1_desc, k1_desc, v1_desc, q1_smem,
                         k1_smem, v1_smem, q_ready, k_ready, v_ready, k_empty, v_empty, seqlen_q, seqlen_k, heads_q,
                         group, win_left, win_right, HEAD_DIM, CAUSAL, WINDOW, EARLY_K, SPLIT)),
            (_consumer, (q_smem.slice(0, _BLOCK_M), k_smem, v_smem, q1_smem.slice(0, _BLOCK_M), k1_smem, v1_smem,
                         q_ready, k_ready, v_ready, k_empty, v_empty, o_desc, o1_desc, lse_ptr, lse2_ptr, seqlen_q,
                         seqlen_k, heads_q, qk_scale, win_left, win_right, slopes_ptr, slope_stride, 0, HEAD_DIM,
                         CAUSAL, WINDOW, EARLY_K, SPLIT, ALIBI, pin.slice(0, _BLOCK_M), PIN, turn, PINGPONG)),
            (_consumer, (q_smem.slice(_BLOCK_M, _BLOCK_M), k_smem, v_smem, q1_smem.slice(_BLOCK_M, _BLOCK_M),
                         k1_smem, v1_smem, q_ready, k_ready, v_ready, k_empty, v_empty, o_desc, o1_desc, lse_ptr,
                         lse2_ptr, seqlen_q, seqlen_k, heads_q, qk_scale, win_left, win_right, slopes_ptr,
                         slope_stride, 1, HEAD_DIM, CAUSAL, WINDOW, EARLY_K, SPLIT, ALIBI,
                         pin.slice(_BLOCK_M, _BLOCK_M), PIN, turn, PINGPONG)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    # Two entry points over one body: without SPLIT the launch carries four descriptors, not eight (each costs host
    # time: Triton's launcher encodes every descriptor on every call).  The window bounds are compared, never
    # indexed with: no specialisation (1 and multiples of 16 would each be a compile of their own).
    @gluon.jit(do_not_specialize=["win_left", "win_right"])
    def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, lse_ptr, lse2_ptr, seqlen_q, seqlen_k, heads_q, group,
                         qk_scale, win_left, win_right, slopes_ptr, slope_stride, HEAD_DIM: gl.constexpr,
                         CAUSAL: gl.constexpr, WINDOW: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         EARLY_K: gl.constexpr, ALIBI: gl.constexpr, PIN: gl.constexpr, PINGPONG: gl.constexpr):
        _fwd_body(q_desc, k_desc, v_desc, o_desc, q_desc, k_desc, v_desc, o_desc, lse_ptr, lse2_ptr, seqlen_q,
                  seqlen_k, heads_q, group, qk_scale, win_left, win_right, slopes_ptr, slope_stride, HEAD_DIM, CAUSAL,
                  WINDOW, STAGES, CONSUMER_REGS, EARLY_K, False, ALIBI, PIN, PINGPONG)

    @gluon.jit(do_not_specialize=["win_left", "win_right"])
    def _attn_fwd_hopper_split(q_desc, k_desc, v_desc, o_desc, q1_desc, k1_desc, v1_desc, o1_desc, lse_ptr, lse2_ptr,
                               seqlen_q, seqlen_k, heads_q, group, qk_scale, win_left, win_right, slopes_ptr,
                               slope_stride, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EARLY_K: gl.constexpr,
                               ALIBI: gl.constexpr, PIN: gl.constexpr, PINGPONG: gl.constexpr):
        _fwd_body(q_desc, k_desc, v_desc, o_desc, q1_desc, k1_desc, v1_desc, o1_desc, lse_ptr, lse2_ptr, seqlen_q,
                  seqlen_k, heads_q, group, qk_scale, win_left, win_right, slopes_ptr, slope_stride, HEAD_DIM, CAUSAL,
                  WINDOW, STAGES, CONSUMER_REGS, EARLY_K, True, ALIBI, PIN, PINGPONG)

    _launch = DirectLauncher(_attn_fwd_hopper)
    _launch_split = DirectLauncher(_attn_fwd_hopper_split)


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=256)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    # Built once per tile shape: constructing it costs ~6 us of host time, four times per call.
    return gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None) -> Desc:
    """TMA descriptor over the 2D view [B * S, H * D] of a contiguous [B, S, H, D] tensor: a [rows, D]
    block at (b * S + n, h * D) is one head's tile (the backward's too); cols < D: a part of a head's row.
    (Arguments only, for kernels/launch.py: the JIT path builds and validates the TensorDescriptor.)"""
    b, s, h, d = t.shape
    cols = d if cols is None else cols
    return Desc(t, [b * s, h * d], [h * d, 1], (rows, cols), _smem_layout(rows, cols, t.dtype))


# Compiled variants (variant_key, the pin and ping-pong) and the variants whose compilation failed, with the reason: a
# failure switches this path off for that variant (one warning), and the Triton kernel serves.
_compiled: set = set()
broken: dict = {}


def variant_key(spec) -> tuple:
    """What one compile of this kernel covers (the compile-failure bookkeeping's key; the head count, GQA and
    tiles aside): dtype, head dim, mask kind, ALiBi, device."""
    return spec.dtype, spec.head_dim, spec.visibility.kind, spec.alibi is not None, spec.device


def launch_args(spec, q, k, v, out, lse, lse2, alibi=None) -> tuple:
    """(grid, args, meta) of the kernel's launch for a call `reasons` accepts, writing out, lse and lse2; alibi:
    the float32 slopes [Hq] or [B, Hq] (spec.alibi)."""
    slopes, slope_stride, has_alibi = alibi_args(spec, alibi, lse)
    b, sq, hq, d = q.shape
    tiles = TILES[d]
    d0 = d - tiles.split
    parts = [(_descriptor(q, TILE, c), _descriptor(k, tiles.block_n, c), _descriptor(v, tiles.block_n, c),
              _descriptor(out, BLOCK_M, c)) for c in ((d0, tiles.split) if tiles.split else (d0,))]
    kind = spec.visibility.kind
    args = (*(p for part in parts for p in part), lse, lse2, sq, spec.seqlen_k, hq, spec.group_size,
            spec.softmax_scale * LOG2E, *window_bounds(spec), slopes, slope_stride)
    meta = dict(HEAD_DIM=d, CAUSAL=kind == "causal", WINDOW=kind == "window", STAGES=tiles.stages,
                CONSUMER_REGS=tiles.consumer_regs, EARLY_K=tiles.early_k, ALIBI=has_alibi,
                PIN=env.flag("FLASHPORT_HOPPER_FWD_PIN"),
                # both warpgroups issue the same number of matmul groups only where a key tile spans the Q tile
                PINGPONG=env.flag("FLASHPORT_HOPPER_FWD_PINGPONG") and tiles.block_n == TILE, num_warps=4)
    return (sq // TILE, b * hq), args, meta


def launcher(spec):
    """The kernel entry point of the call: two-part head dims (Tiles.split) carry a second set of descriptors."""
    return _launch_split if TILES[spec.head_dim].split else _launch


def forward(spec, q, k, v, warmup: bool = False, alibi=None):
    """q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D], D in TILES (a call `reasons` accepts; the length floor
    aside, which is a speed choice) -> (out, lse, lse2), or None when the kernel fails to compile here
    (the caller then runs the Triton kernel).  warmup=True compiles without launching and returns the
    compiled kernel (tools/gpu/compile_report.py)."""
    b, sq, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(lse)
    grid, args, meta = launch_args(spec, q, k, v, out, lse, lse2, alibi)
    launch = launcher(spec)
    if warmup:
        return launch.compile(grid, args, meta)
    variant = variant_key(spec)
    if (variant, meta["PIN"], meta["PINGPONG"]) not in _compiled:
        try:  # compile only (no launch), so a toolchain that rejects the kernel costs one fallback, not a crash
            launch.compile(grid, args, meta)
        except Exception as e:  # noqa: BLE001 - any compiler failure means "use the Triton kernel"
            broken[variant] = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"flashport: the Hopper forward failed to compile for {variant} and is switched off "
                          f"for it; the Triton kernel serves instead ({broken[variant]})", RuntimeWarning,
                          stacklevel=3)
            return None
        _compiled.add((variant, meta["PIN"], meta["PINGPONG"]))
    launch(grid, args, meta)
    return out, lse, lse2
