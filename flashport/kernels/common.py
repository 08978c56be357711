"""Shared @triton.jit helpers of the attention kernels: sequence bounds, tile loads, the score
transform (scale, softcap, ALiBi, visibility mask) and the dropout keep-mask.

Scores live in the log2 domain inside the kernels: `s2 = s * log2(e)`, so the online softmax uses
`exp2` and `softmax_scale * log2(e)` is folded into one multiply.  The equivalent PyTorch math of
`transform_log2` + `mask_scores` (together: `score_log2`) for one (query row i, key j) pair is

    s = scale * (q_i . k_j)
    s = softcap * tanh(s / softcap)              if softcap > 0
    s = s - slope * |i + Sk - Sq - j|            with ALiBi
    s = -inf  unless  i + Sk - Sq - left <= j <= i + Sk - Sq + right  and  j < Sk
    s2 = s * log2(e)

`dropout_keep` reproduces flashport.dropout.keep_mask bit for bit (tests check it).

Tile loops take MASK in {0, 1, 2} (see `mask_scores`) and the kernels a SPLIT flag from the launch
config: SPLIT runs boundary tiles and full tiles in separate loops (no mask code in the main
loop), otherwise one loop masks boundary tiles behind a run-time branch (no pipeline restart
between the loops, which costs most when a program sees few tiles, e.g. causal at S = 1024).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import env
from ..dropout import threshold24

LOG2E = 1.4426950408889634  # host side
# Kernel-side constants (globals used inside @triton.jit must be constexpr).
LOG2E_K = tl.constexpr(1.4426950408889634)
LN2_K = tl.constexpr(0.6931471805599453)


def device_guard(device: torch.device):
    """The context that makes `device` current for a launch: torch.cuda.device(device), unless it is already
    current or not CUDA.  Entering that context costs host time on every call (PERFLOG row 26), and most
    calls are on the current device already."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@triton.jit
def seq_bounds(b, CuQ, CuK, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, Sq, k_start, Sk) of batch entry b: packed offsets from cu_seqlens (IS_VARLEN 1), dense queries
    against a KV cache whose valid length CuK[b] varies per entry (IS_VARLEN 2: CuK is seqlens_k), or the dense
    sizes (0)."""
    if IS_VARLEN == 2:
        q_start = b * 0
        sq = seqlen_q + b * 0
        k_start = b * 0
        sk = tl.load(CuK + b)
    elif IS_VARLEN:
        q_start = tl.load(CuQ + b)
        sq = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        sk = tl.load(CuK + b + 1) - k_start
    else:
        q_start = b * 0
        sq = seqlen_q + b * 0
        k_start = b * 0
        sk = seqlen_k + b * 0
    return q_start, sq, k_start, sk


@triton.jit
def offset(b64, h, row, stride_b, stride_h, stride_s, ALIGN: tl.constexpr):
    """Element offset of (batch b, head h, row) in int64, declared a multiple of ALIGN elements.

    Triton proves 16-byte alignment only for strides divisible by 16; a head dim like 72 or 40
    gives a head stride that is a multiple of 8 but not 16, and without the hint every tile load
    falls back to scalar 2-byte loads with no asynchronous copies (seen in the sm_90a SASS)."""
    # Each product is hinted (not the sum): a term that folds to zero (row 0 of a dense tensor) takes
    # its add, and any hint on it, with it.
    return (tl.multiple_of(b64 * stride_b, ALIGN) + tl.multiple_of(tl.cast(h, tl.int64) * stride_h, ALIGN)
            + tl.multiple_of(tl.cast(row, tl.int64) * stride_s, ALIGN))


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a [R, C] tile, masking only the dimensions that can run past the tensor (zeros there).
    rows [R, 1] / cols [1, C] are indices compared against n_rows / n_cols."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows < n_rows) & (cols < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def load_head_tile(X, b64, h, row0, stride_b, stride_h, stride_s, start, n_rows, BLOCK_R: tl.constexpr,
                   N_COLS: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr):
    """The [BLOCK_R, BLOCK_C] tile of head h of batch entry b whose first row sits at row0 of X (rows
    start .. start + BLOCK_R of the sequence, zeros past n_rows and past N_COLS columns)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    ptrs = X + offset(b64, h, row0, stride_b, stride_h, stride_s, ALIGN) + offs_r[:, None] * stride_s + offs_c[None, :]
    return load_tile(ptrs, start + offs_r[:, None], n_rows, offs_c[None, :], N_COLS, True, N_COLS != BLOCK_C)


@triton.jit
def head_scalars(Slopes, Rng, b, h, n_heads, stride_slope_b, ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """Per (batch entry b, query head h): the ALiBi slope in the log2 domain, the dropout seed and
    offset, and b * Hq + h, the head coordinate of the dropout counter (0 for features not in use)."""
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(Slopes + b * stride_slope_b + h) * LOG2E_K
    seed = 0
    rng_offset = 0
    if DROPOUT:
        seed = tl.load(Rng)
        rng_offset = tl.load(Rng + 1).to(tl.int32)
    return slope2, seed, rng_offset, b * n_heads + h


# ----------------------------------------------------------------------------- visibility
# The jit twins of flashport.masks.Visibility's range methods (same names, same formulas), with diag =
# Sk - Sq and HAS_LEFT / HAS_RIGHT = Visibility.has_left / has_right; tests/test_visibility.py holds
# them to the host methods.  Triton's integer division truncates towards zero: operands are clamped
# at 0 before any division.


@triton.jit
def key_range(m0, m1, sk, diag, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.key_range: keys [lo, hi) that some row of [m0, m1) sees."""
    lo = 0
    hi = sk
    if HAS_LEFT:
        lo = tl.maximum(m0 + diag - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(m1 + diag + right, sk)
    return lo, hi


@triton.jit
def full_key_range(m0, m1, sk, diag, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.full_key_range: keys [lo, hi) that every row of [m0, m1) sees."""
    lo = 0
    hi = sk
    if HAS_LEFT:
        lo = tl.maximum(m1 - 1 + diag - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(m0 + diag + right + 1, sk)
    return lo, hi


@triton.jit
def query_range(n0, n1, sq, diag, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.query_range: rows [lo, hi) that see some key of [n0, n1)."""
    lo = 0
    hi = sq
    if HAS_RIGHT:
        lo = tl.maximum(n0 - diag - right, 0)
    if HAS_LEFT:
        hi = tl.minimum(n1 + left - diag, sq)
    return lo, hi


@triton.jit
def full_query_range(n0, n1, sq, diag, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.full_query_range: rows [lo, hi) that see every key of [n0, n1)."""
    lo = 0
    hi = sq
    if HAS_RIGHT:
        lo = tl.maximum(n1 - 1 - diag - right, 0)
    if HAS_LEFT:
        hi = tl.minimum(n0 - diag + left + 1, sq)
    return lo, hi


@triton.jit
def key_tiles(start_m, sq, sk, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.key_tiles: key tiles of the Q tile [start_m, start_m + BLOCK_M), (lo, hi, full_lo, full_hi).

    [lo, hi) are the keys some row can see (key_range), lo rounded down to a tile; tiles in
    [full_lo, full_hi) are seen whole by every (valid) row (full_key_range): no mask needed there."""
    m_end = tl.minimum(start_m + BLOCK_M, sq)
    lo, hi = key_range(start_m, m_end, sk, diag, left, right, HAS_LEFT, HAS_RIGHT)
    lo = (lo // BLOCK_N) * BLOCK_N
    lo_full, hi_full = full_key_range(start_m, m_end, sk, diag, left, right, HAS_LEFT, HAS_RIGHT)
    full_lo = lo
    if HAS_LEFT:
        full_lo = tl.maximum(tl.cdiv(lo_full, BLOCK_N) * BLOCK_N, lo)
    full_hi = (tl.maximum(hi_full, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, hi, full_lo, full_hi


@triton.jit
def query_tiles(start_n, sq, sk, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.query_tiles: Q tiles of the key tile [start_n, start_n + BLOCK_N), (lo, hi, full_lo, full_hi).

    [lo, hi) are the rows that see some key of the tile (query_range), lo rounded down to a tile; Q tiles
    in [full_lo, full_hi) have only valid rows, each seeing every key of a complete key tile
    (full_query_range): no mask needed there."""
    n_end = tl.minimum(start_n + BLOCK_N, sk)
    lo, hi = query_range(start_n, n_end, sq, diag, left, right, HAS_LEFT, HAS_RIGHT)
    lo = (lo // BLOCK_M) * BLOCK_M
    lo_full, hi_full = full_query_range(start_n, n_end, sq, diag, left, right, HAS_LEFT, HAS_RIGHT)
    full_lo = lo
    if HAS_RIGHT:
        full_lo = tl.maximum(tl.cdiv(lo_full, BLOCK_M) * BLOCK_M, lo)
    full_hi = (tl.maximum(hi_full, 0) // BLOCK_M) * BLOCK_M
    full_lo = tl.where(n_end - start_n < BLOCK_N, hi, tl.minimum(full_lo, hi))
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, hi, full_lo, full_hi


@triton.jit
def tile_part(lo, hi, full_lo, full_hi, part: tl.constexpr, SPLIT: tl.constexpr):
    """Tile range [p_lo, p_hi) of loop `part`: with SPLIT, part 0 = boundary tiles before the full ones,
    1 = the full tiles, 2 = boundary tiles after them; without SPLIT one loop covers [lo, hi).  The
    loops' MASK modes (see mask_scores) are `(0 if part == 1 else 1) if SPLIT else 2`: the full tiles
    need none, the boundary loops always mask, the single loop masks behind a run-time branch."""
    p_lo = lo
    p_hi = hi
    if SPLIT:
        if part == 0:
            p_hi = full_lo
        elif part == 1:
            p_lo = full_lo
            p_hi = full_hi
        else:
            p_lo = full_hi
    return p_lo, p_hi


@triton.jit
def tanh(x, PRECISE: tl.constexpr):
    """tanh in float32 without libdevice (it runs in the interpreter too): 1 - 2 / (e^{2x} + 1), exact at
    both tails.  Near 0 that form cancels (its error stays ~1 ulp of 1 as tanh(x) -> 0, i.e. softcap * eps
    on every small score: below the rounding of 16-bit inputs, but over the fp32 rule, which the fuzz caught
    in lse).  PRECISE (fp32 inputs with IEEE dots) uses there, for |x| < 1.5, the Pade [7/6] approximant
    (a convergent of Lambert's continued fraction), within 3.4 ulp everywhere:
    x (x^6 + 378 x^4 + 17325 x^2 + 135135) / (28 x^6 + 3150 x^4 + 62370 x^2 + 135135)."""
    t = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
    if PRECISE:
        x2 = x * x
        p = ((x2 + 378.0) * x2 + 17325.0) * x2 + 135135.0
        q = ((28.0 * x2 + 3150.0) * x2 + 62370.0) * x2 + 135135.0
        t = tl.where(tl.abs(x) < 1.5, x * p / q, t)
    return t


@triton.jit
def visible(i, j, sk, diag, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Visibility.sees (flashport.masks) with diag = Sk - Sq; i and j broadcast ([M, 1] x [1, N] or transposed)."""
    ok = j < sk
    if HAS_LEFT:
        ok = ok & (j >= i + diag - left)
    if HAS_RIGHT:
        ok = ok & (j <= i + diag + right)
    return ok


@triton.jit
def transform_log2(qk, i, j, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                   PRECISE: tl.constexpr):
    """Raw dot products qk -> (s2, t): scores in the log2 domain before masking and, with softcap,
    t = tanh(scale * qk / softcap) for the backward (else t is s2, unused).

    qk_scale = scale * log2(e); cap_in = scale / softcap; cap_out = softcap * log2(e);
    slope2 = ALiBi slope * log2(e); PRECISE: the accurate tanh (see `tanh`), for fp32 inputs with IEEE dots."""
    if SOFTCAP:
        t = tanh(qk * cap_in, PRECISE)
        s = t * cap_out
    else:
        s = qk * qk_scale
        t = s
    if ALIBI:
        s = s - slope2 * tl.abs(i + diag - j).to(tl.float32)
    return s, t


@triton.jit
def mask_scores(s, i, j, sk, diag, left, right, boundary, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr):
    """-inf where key j is hidden from row i.  MASK 0: the tile is known fully visible (nothing to
    do); 1: always mask; 2: mask only when the run-time flag `boundary` says the tile crosses the
    window / causal diagonal / end of keys (one pipelined loop over all tiles, the branch uniform
    across the program)."""
    if MASK == 1:
        s = tl.where(visible(i, j, sk, diag, left, right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    elif MASK == 2:
        if boundary:
            s = tl.where(visible(i, j, sk, diag, left, right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    return s


@triton.jit
def score_log2(qk, i, j, sk, diag, left, right, qk_scale, cap_in, cap_out, slope2,
               MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PRECISE: tl.constexpr):
    """transform_log2 then, when MASK, the visibility mask: (s2 with -inf where hidden, t)."""
    s, t = transform_log2(qk, i, j, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI, PRECISE)
    if MASK:
        s = tl.where(visible(i, j, sk, diag, left, right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    return s, t


@triton.jit
def dropout_keep(seed, rng_offset, bh, i, j, drop_threshold):
    """Keep-mask of flashport.dropout for positions i (query) and j (key), broadcast to one block:
    Philox-4x32-10 with key = seed (int64) and counter (j, i, b * Hq + h, offset); keep iff the top 24
    bits of the first word are >= drop_threshold (= threshold24(p))."""
    zero = i * 0 + j * 0
    c0 = j + zero
    c1 = i + zero
    c2 = zero + bh
    c3 = zero + rng_offset
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    return (w0 >> 8).to(tl.int32) >= drop_threshold


# ----------------------------------------------------------------------------- host side
class KernelArgs:
    """The launch arguments shared by the forward and backward kernels, derived from an AttnSpec and
    its tensors: strides (batch stride 0 for packed varlen tensors), sizes, window, the folded score
    constants, dropout threshold and the compile-time feature flags."""

    def __init__(self, spec, q, k, v, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None, mods=None,
                 block_mask=None):
        varlen = self.varlen = spec.kind == "varlen"
        self.q_strides, self.k_strides, self.v_strides = self.strides(q), self.strides(k), self.strides(v)
        self.seqlen_q, self.seqlen_k = spec.seqlen_q, spec.seqlen_k
        self.group = spec.group_size
        self.left, self.right = spec.window_left, spec.window_right
        scale = spec.softmax_scale
        self.qk_scale = scale * LOG2E
        self.cap_in = scale / spec.softcap if spec.softcap > 0 else 0.0
        self.cap_out = spec.softcap * LOG2E
        self.natural = (scale, spec.softcap)     # (qk_scale, cap_out) in natural units, before a score_mod
        self.slopes, self.slope_stride = None, 0
        if alibi is not None:
            self.slopes = alibi.contiguous()
            self.slope_stride = self.slopes.stride(0) if self.slopes.dim() == 2 else 0
        self.cu_q, self.cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (None, None)
        dropout = spec.dropout_p > 0
        self.rng = rng_state if dropout else None
        self.drop_threshold = threshold24(spec.dropout_p) if dropout else 0
        self.drop_scale = 1.0 / (1.0 - spec.dropout_p)
        if spec.dtype == torch.float32:
            precision = "tf32" if env.flag("FLASHPORT_ALLOW_TF32") else "ieee"
        else:
            precision = "tf32"  # ignored for 16-bit inputs
        self.constexprs = dict(
            D=spec.head_dim, DV=spec.head_dim_v, BLOCK_D=block_dim(spec.head_dim),
            BLOCK_DV=block_dim(spec.head_dim_v), IS_VARLEN=varlen, HAS_LEFT=spec.visibility.has_left,
            HAS_RIGHT=spec.visibility.has_right, SOFTCAP=spec.softcap > 0, ALIBI=alibi is not None,
            DROPOUT=dropout, PRECISION=precision, ALIGN=16)
        self.cover(q, k, v)
        self.with_mods(mods)
        self.block_mask = block_mask
        self.constexprs["BLOCK_SKIP"] = block_mask is not None

    def with_mods(self, mods) -> None:
        """The generated mod functions (kernels.mod_codegen.CompiledMods or None) and their captured tensors.
        A score_mod sees natural units: its kernels score in natural units up to it (scale and softcap here, the
        ALiBi slope in the kernel) and convert to log2 after it."""
        self.mods = None if mods is None else mods.cap()
        self.score_grad = None if mods is None else mods.score_grad   # the backward kernels' SCORE_GRAD
        # what the mods add to a kernel's footprint, for tuning.launch_with_fallback's remembered configs
        self.variant = () if mods is None else (mods.score, mods.mask, mods.score_grad, mods.cap_grad)
        self.constexprs.update(SCORE_MOD=None if mods is None else mods.score,
                               MASK_MOD=None if mods is None else mods.mask)
        if mods is not None and mods.score is not None:
            self.qk_scale, self.cap_out = self.natural

    def skip(self, block_m: int, block_n: int):
        """The kernels' `skip` argument for tiles of block_m x block_n (kernels/block_skip.py), or None."""
        if self.block_mask is None:
            return None
        from .block_skip import skip_args
        return skip_args(self.block_mask, self.seqlen_q, self.seqlen_k, block_m, block_n)

    def cover(self, *tensors) -> None:
        """Lower ALIGN (see `offset`) to what the batch / sequence / head strides of `tensors` share."""
        self.constexprs["ALIGN"] = stride_align(*tensors, align=self.constexprs["ALIGN"])

    def strides(self, x):
        return head_strides(x, self.varlen)


def head_strides(x: torch.Tensor, varlen: bool) -> tuple:
    """(batch, seq, head) strides of a [B, S, H, D] or packed (varlen) [total, H, D] tensor (head dim: 1)."""
    st = x.stride()
    return (0, st[0], st[1]) if varlen else st[:3]


def stride_align(*tensors, align: int = 16) -> int:
    """The largest power of two <= align dividing every stride but the last of every tensor: the ALIGN
    constexpr (see `offset`)."""
    for x in tensors:
        for st in x.stride()[:-1]:
            while align > 1 and st % align:
                align //= 2
    return align


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids in plain integer arithmetic (triton.cdiv is a constexpr function:
    microseconds per host call, on every launch)."""
    return -(-a // b)


def block_dim(d: int) -> int:
    """Head dims are padded in-kernel to a power of two >= 16 (tl.dot's minimum).  Plain integer
    arithmetic: triton.next_power_of_2 is a constexpr function, several microseconds per host call."""
    return max(16, 1 << (d - 1).bit_length())


# ----------------------------------------------------------------------------- helpers of generated mods
# Called by the functions flashport.kernels.mod_codegen generates from score_mod / mask_mod.
@triton.jit
def clamp_index(x, n):
    """An index into a dimension of size n by PyTorch's rule (a negative index counts from the end), clamped into
    [0, n): a mod evaluated on a tile's out-of-range rows or keys never reads outside its captured tensor."""
    x = tl.where(x < 0, x + n, x)
    return tl.minimum(tl.maximum(x, 0), n - 1).to(tl.int32)


@triton.jit
def add_reduced(base, off, val, live, q_idx, kv_idx, MODE: tl.constexpr):
    """base[off] += val over a score tile with float32 atomics (val is 0 where not `live`), the terms that share an element summed first where
    MODE says which do (mod_codegen.REDUCE): 0 none; 1 off is one element; 2 off varies with the query only; 3 with
    the key only; 4 with q_idx - kv_idx only, a relative-position table (one sum per diagonal of the tile).  A
    contended element takes its atomics one at a time: a 128x64 tile of a relative table hits each of ~191
    elements ~43 times over, where the per-diagonal sums add each once."""
    KV_AXIS: tl.constexpr = 0 if kv_idx.shape[0] > 1 else 1
    if MODE == 0:
        tl.atomic_add(base + off, val, mask=live)
    elif MODE == 1:
        tl.atomic_add(base + tl.max(tl.max(off, 1), 0), tl.sum(tl.sum(val, 1), 0))
    elif MODE == 2:
        tl.atomic_add(base + tl.max(off, KV_AXIS), tl.sum(val, KV_AXIS))
    elif MODE == 3:
        tl.atomic_add(base + tl.max(off, 1 - KV_AXIS), tl.sum(val, 1 - KV_AXIS))
    else:
        # a skew: entry (r, c) gathers element (r, (r + c) % Y), so element (i, j) lands in column (j - i) % Y after
        # wrap = (r + c) // Y turns, and a (wrap, column) pair is the one diagonal j - i = c - wrap * Y.  (Along
        # axis 1, the score tile's key axis in the dK/dV kernel: skewing along axis 0 spilled ~2x more on sm_90a.)
        X: tl.constexpr = val.shape[0]
        Y: tl.constexpr = val.shape[1]
        row = tl.arange(0, X)[:, None]
        col = tl.arange(0, Y)[None, :]
        idx = (col + row) % Y
        w, o, wrap = tl.gather(val, idx, 1), tl.gather(off, idx, 1), (col + row) // Y
        for turn in tl.static_range((X + 2 * Y - 2) // Y):
            on = wrap == turn
            at = tl.max(tl.where(on, o, -1), 0)
            tl.atomic_add(base + at, tl.sum(tl.where(on, w, 0.0), 0), mask=at >= 0)


@triton.jit
def floor_div(a, b):
    """PyTorch's floor division of integers.  Written so that it holds whether `//` truncates (compiled Triton,
    C's rule) or floors: a remainder whose sign differs from the divisor's takes the quotient one step down."""
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def floor_mod(a, b):
    """PyTorch's remainder of integers (the sign of the divisor)."""
    return a - floor_div(a, b) * b


@triton.jit
def live_row(skip, b, h, tile, Q_TILES: tl.constexpr, BLOCK_SKIP: tl.constexpr):
    """(base, step) of this program's line in a block mask's live-tile table [B, Hq, Q tiles, K tiles] (strides in
    `skip`, kernels/block_skip.py): the row of Q tile `tile` (Q_TILES, the forward's and dQ's loops over key tiles) or
    the column of K tile `tile` (dK/dV's loop over query tiles).  (0, 0) without a block mask."""
    base = 0
    step = 0
    if BLOCK_SKIP:
        if Q_TILES:
            base = skip[0] + b * skip[1] + h * skip[2] + tile * skip[3]
            step = skip[4]
        else:
            base = skip[0] + b * skip[1] + h * skip[2] + tile * skip[4]
            step = skip[3]
    return base, step


@triton.jit
def tile_state(skip_base, start, BLOCK: tl.constexpr, skip_step, BLOCK_SKIP: tl.constexpr):
    """The block mask's state of the kernel tile starting at `start` (kernels/block_skip.py): 0 empty (skipped),
    1 partial (mask_mod evaluated), 2 full (mask_mod true on every pair: not evaluated).  Without a block mask 1, a
    constant the caller's `if`s fold away (the loop body then compiles as it did before)."""
    if BLOCK_SKIP:
        return tl.load(skip_base + (start // BLOCK) * skip_step)
    else:
        return 1
