"""Exact merge of partial attention results in Triton: the flash-decoding combine, and the kernel
behind flashport.merge_attention_states on CUDA.

For P parts over disjoint key sets, per (b, i, h) row (same semantics as
flashport.merge.merge_states_torch):

    lse = log(sum_p exp(lse_p));   out = sum_p exp(lse_p - lse) * out_p

A part with lse_p = -inf contributes nothing (its output is selected away before the sum, so garbage
or NaN there cannot leak); a row whose parts are all -inf comes out as zeros with lse = -inf.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda.gdc_wait)

from ..merge import merge_states_torch
from .common import device_guard


@triton.jit
def _program_rows(seqlen_q, heads, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    """A merge program's row (b, i), its BLOCK_H heads h (h_ok: inside Hq), and the part and Dv offsets of its tile."""
    pid = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    return ((pid // seqlen_q).to(tl.int64), (pid % seqlen_q).to(tl.int64), h, h < heads, tl.arange(0, BLOCK_P),
            offs_dv, offs_dv < HEAD_DIM_V)


@triton.jit
def _merge_kernel(
    O_PARTS, LSE_PARTS, OUT, LSE_OUT,
    stride_op, stride_ob, stride_oq, stride_oh,       # O_PARTS [P, B, Sq, Hq, Dv]
    stride_lp, stride_lb, stride_lh, stride_lq,       # LSE_PARTS [P, B, Hq, Sq]
    stride_outb, stride_outq, stride_outh,            # OUT [B, Sq, Hq, Dv]
    stride_lob, stride_loh, stride_loq,               # LSE_OUT [B, Hq, Sq]
    num_parts, seqlen_q, heads,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    ONE_CHUNK: tl.constexpr, WAIT_PRIOR: tl.constexpr,
):
    # One program per (b, i) and BLOCK_H heads; the parts are read BLOCK_P at a time as one
    # [BLOCK_H, BLOCK_P, BLOCK_DV] tile, so a 64-way flash-decoding merge is a single round trip to
    # memory instead of 64 dependent loads (at batch 1 the merge is latency-bound, not bandwidth-bound).
    if WAIT_PRIOR:  # launched early by programmatic dependent launch: wait for the split kernel's writes
        tl.extra.cuda.gdc_wait()
    b, i, h, h_ok, offs_p, offs_dv, dv_ok = _program_rows(seqlen_q, heads, HEAD_DIM_V, BLOCK_H, BLOCK_P, BLOCK_DV)
    lse_base = LSE_PARTS + b * stride_lb + i * stride_lq + h * stride_lh                     # [BLOCK_H]
    o_base = O_PARTS + b * stride_ob + i * stride_oq + h[:, None] * stride_oh + offs_dv[None, :]

    lse_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if not ONE_CHUNK:  # first pass: the max over all parts, so the weights below never overflow
        for p0 in range(0, num_parts, BLOCK_P):
            p = (p0 + offs_p).to(tl.int64)
            lp = tl.load(lse_base[:, None] + p[None, :] * stride_lp,
                         mask=h_ok[:, None] & (p[None, :] < num_parts), other=float("-inf"))
            lse_max = tl.maximum(lse_max, tl.max(lp, 1))

    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p = (p0 + offs_p).to(tl.int64)
        p_ok = p < num_parts
        lp = tl.load(lse_base[:, None] + p[None, :] * stride_lp, mask=h_ok[:, None] & p_ok[None, :],
                     other=float("-inf"))                                                  # [BLOCK_H, BLOCK_P]
        # The outputs are loaded without waiting for the lse (their mask does not depend on it) ...
        o = tl.load(o_base[:, None, :] + p[None, :, None] * stride_op,
                    mask=h_ok[:, None, None] & p_ok[None, :, None] & dv_ok[None, None, :], other=0.0)
        if ONE_CHUNK:
            lse_max = tl.max(lp, 1)
        m = tl.where(lse_max == float("-inf"), 0.0, lse_max)    # all parts empty: weights stay 0
        w = tl.exp(lp - m[:, None])
        # ... and an empty part (w = 0) is selected away, so garbage or NaN there cannot reach the sum.
        o = tl.where((w > 0.0)[:, :, None], o.to(tl.float32), 0.0)
        acc += tl.sum(o * w[:, :, None], 1)
        total += tl.sum(w, 1)

    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    out = acc / t_safe[:, None]
    lse = tl.where(seen, lse_max + tl.log(t_safe), float("-inf"))
    tl.store(OUT + b * stride_outb + i * stride_outq + h[:, None] * stride_outh + offs_dv[None, :],
             out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(LSE_OUT + b * stride_lob + i * stride_loq + h * stride_loh, lse, mask=h_ok)


@triton.jit
def _part_terms(lse_base, o_base, p, p_ok, h_ok, dv_ok, lse, dout, stride_lp, stride_op):
    """(w, r) of BLOCK_P parts: w_p = exp(lse_p - lse) (0 where either is not finite) and r_p = <d out, out_p>
    (0 where w_p = 0, whatever out_p holds there), both [BLOCK_H, BLOCK_P] float32."""
    lp = tl.load(lse_base[:, None] + p[None, :] * stride_lp, mask=h_ok[:, None] & p_ok[None, :],
                 other=float("-inf"))
    ok = (tl.abs(lp) < float("inf")) & (tl.abs(lse) < float("inf"))[:, None]
    w = tl.where(ok, tl.exp(tl.where(ok, lp - lse[:, None], 0.0)), 0.0)
    o = tl.load(o_base[:, None, :] + p[None, :, None] * stride_op,
                mask=h_ok[:, None, None] & p_ok[None, :, None] & dv_ok[None, None, :], other=0.0)
    o = tl.where((w > 0.0)[:, :, None], o.to(tl.float32), 0.0)
    return w, tl.sum(o * dout[:, None, :], 2)


@triton.jit
def _merge_bwd_kernel(
    O_PARTS, LSE_PARTS, LSE, DOUT, DLSE, D_O_PARTS, D_LSE_PARTS,
    stride_op, stride_ob, stride_oq, stride_oh,       # O_PARTS and D_O_PARTS [P, B, Sq, Hq, Dv], same strides
    stride_lp, stride_lb, stride_lh, stride_lq,       # LSE_PARTS and D_LSE_PARTS [P, B, Hq, Sq], same strides
    stride_sb, stride_sh, stride_sq,                  # LSE and DLSE [B, Hq, Sq], same strides
    stride_db, stride_dq, stride_dh,                  # DOUT [B, Sq, Hq, Dv]
    num_parts, seqlen_q, heads,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    ONE_CHUNK: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    # merge.MergeStates' backward in one pass over the rows (two over the parts when they exceed one chunk: the
    # sum over all parts of w_p r_p comes first):  d out_p = w_p d out,  d lse_p = w_p (r_p - sum_q w_q r_q + d lse)
    b, i, h, h_ok, offs_p, offs_dv, dv_ok = _program_rows(seqlen_q, heads, HEAD_DIM_V, BLOCK_H, BLOCK_P, BLOCK_DV)
    row = b * stride_sb + i * stride_sq + h * stride_sh
    lse = tl.load(LSE + row, mask=h_ok, other=float("-inf"))
    g = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_DLSE:
        g = tl.load(DLSE + row, mask=h_ok, other=0.0)
    dout = tl.load(DOUT + b * stride_db + i * stride_dq + h[:, None] * stride_dh + offs_dv[None, :],
                   mask=h_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    l_off = b * stride_lb + i * stride_lq + h * stride_lh                                 # [BLOCK_H]
    o_off = b * stride_ob + i * stride_oq + h[:, None] * stride_oh + offs_dv[None, :]     # [BLOCK_H, BLOCK_DV]
    base = tl.zeros([BLOCK_H], dtype=tl.float32)
    if not ONE_CHUNK:
        for p0 in range(0, num_parts, BLOCK_P):
            p = (p0 + offs_p).to(tl.int64)
            w, r = _part_terms(LSE_PARTS + l_off, O_PARTS + o_off, p, p < num_parts, h_ok, dv_ok, lse, dout,
                               stride_lp, stride_op)
            base += tl.sum(w * r, 1)
    for p0 in range(0, num_parts, BLOCK_P):
        p = (p0 + offs_p).to(tl.int64)
        p_ok = p < num_parts
        w, r = _part_terms(LSE_PARTS + l_off, O_PARTS + o_off, p, p_ok, h_ok, dv_ok, lse, dout, stride_lp,
                           stride_op)
        if ONE_CHUNK:
            base = tl.sum(w * r, 1)
        d_lse = tl.where(w > 0.0, w * (r + (g - base)[:, None]), 0.0)
        tl.store(D_LSE_PARTS + l_off[:, None] + p[None, :] * stride_lp, d_lse, mask=h_ok[:, None] & p_ok[None, :])
        tl.store(D_O_PARTS + o_off[:, None, :] + p[None, :, None] * stride_op,
                 (dout[:, None, :] * w[:, :, None]).to(D_O_PARTS.dtype.element_ty),
                 mask=h_ok[:, None, None] & p_ok[None, :, None] & dv_ok[None, None, :])


# Elements of the [BLOCK_H, BLOCK_P, BLOCK_DV] float32 tile one program holds (32 registers per thread
# at 8 warps): the whole split count of a decode call (<= 64 parts at Dv = 128) fits in one chunk.
TILE_ELEMS = 8192


@functools.lru_cache(maxsize=256)
def _merge_meta(parts: int, hq: int, dv: int, tile_elems: int = TILE_ELEMS) -> tuple[int, dict]:
    """(BLOCK_H, launch keywords) for `parts` parts of Hq heads of width Dv: decided once per shape."""
    block_dv = max(16, triton.next_power_of_2(dv))
    block_p = max(1, min(triton.next_power_of_2(parts), tile_elems // block_dv))
    block_h = max(1, min(triton.next_power_of_2(hq), tile_elems // (block_p * block_dv)))
    elems = block_h * block_p * block_dv
    return block_h, dict(HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_P=block_p, BLOCK_DV=block_dv,
                         ONE_CHUNK=parts <= block_p, num_warps=8 if elems >= 8192 else 4 if elems >= 2048 else 2)


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   tile_elems: int = TILE_ELEMS, after_prior: bool = False) -> None:
    """Merge o_parts [P, B, Sq, Hq, Dv] / lse_parts [P, B, Hq, Sq] (any strides, last dim of o_parts
    unit-stride) into out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] float32, in place.  Launches on the
    current device: callers hold the device guard (the decode launcher already does).  tile_elems
    bounds the per-program tile (tests lower it to exercise the multi-chunk path).  after_prior: launch
    with programmatic dependent launch (sm_90+) so that the merge's programs start while the kernel
    before it (which must call gdc_launch_dependents) drains, and wait on the device for its writes."""
    num_parts, bsz, sq, hq, dv = o_parts.shape
    if out.numel() == 0:
        return
    block_h, meta = _merge_meta(num_parts, hq, dv, tile_elems)
    _merge_kernel[(bsz * sq, triton.cdiv(hq, block_h))](
        o_parts, lse_parts, out, lse,
        *o_parts.stride()[:4], *lse_parts.stride(), *out.stride()[:3], *lse.stride(),
        num_parts, sq, hq, **meta, WAIT_PRIOR=after_prior, launch_pdl=after_prior,
    )


def merge_states_triton(outs, lses):
    """flashport.merge.merge_states_torch in one Triton kernel: outs list of [B, Sq, Hq, Dv], lses list
    of [B, Hq, Sq] float32 -> (out in outs' dtype, lse [B, Hq, Sq] float32).  Inputs are validated
    by the caller (flashport.merge_attention_states)."""
    o0 = outs[0]
    bsz, sq, hq, dv = o0.shape
    out = torch.empty(bsz, sq, hq, dv, dtype=o0.dtype, device=o0.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=o0.device)
    if out.numel() == 0:  # nothing to launch for; the PyTorch merge handles empty shapes
        return merge_states_torch(outs, lses)
    o_parts = _stacked(outs)
    with device_guard(out.device):
        merge_partials(o_parts, torch.stack(lses), out, lse)
    return out, lse


def _stacked(outs) -> torch.Tensor:
    """The parts' outputs as one [P, B, Sq, Hq, Dv] tensor with a unit-stride last dim (the kernels' layout)."""
    return torch.stack([o if o.stride(-1) == 1 else o.contiguous() for o in outs])


def merge_backward_triton(outs, lses, lse, dout, dlse, tile_elems: int = TILE_ELEMS):
    """merge.merge_backward_torch in one Triton kernel: the parts' (d outs, d lses), each a view of one stacked
    buffer.  outs [B, Sq, Hq, Dv] in one dtype (float16 / bfloat16 / float32), lses and lse [B, Hq, Sq] float32,
    dlse None or like lse."""
    n = len(outs)
    o_parts = _stacked(outs)
    lse_parts = torch.stack(lses)
    d_o, d_lse = torch.empty_like(o_parts), torch.empty_like(lse_parts)    # the parts' strides, as the kernel assumes
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    _, bsz, sq, hq, dv = o_parts.shape
    if o_parts.numel() and lse.numel():
        block_h, meta = _merge_meta(n, hq, dv, tile_elems)
        with device_guard(o_parts.device):
            _merge_bwd_kernel[(bsz * sq, triton.cdiv(hq, block_h))](
                o_parts, lse_parts, lse, dout, lse if dlse is None else dlse, d_o, d_lse,
                *o_parts.stride()[:4], *lse_parts.stride(), *lse.stride(), *dout.stride()[:3],
                n, sq, hq, **meta, HAS_DLSE=dlse is not None)
    else:
        d_o.zero_()
        d_lse.zero_()
    return list(d_o.unbind(0)), list(d_lse.unbind(0))
