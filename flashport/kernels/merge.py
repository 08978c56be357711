"""Exact merge of partial attention results in Triton: the flash-decoding combine, and the kernel
behind flashport.merge_attention_states on CUDA.

For P parts over disjoint key sets, per (b, i, h) row (same semantics as
flashport.merge.merge_states_torch):

    lse = log(sum_p exp(lse_p));   out = sum_p exp(lse_p - lse) * out_p

A part with lse_p = -inf contributes nothing (its output is never read into the sum, so garbage or
NaN there cannot leak); a row whose parts are all -inf comes out as zeros with lse = -inf.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..merge import merge_states_torch


@triton.jit
def _merge_kernel(
    O_PARTS, LSE_PARTS, OUT, LSE_OUT,
    stride_op, stride_ob, stride_oq, stride_oh,       # O_PARTS [P, B, Sq, Hq, Dv]
    stride_lp, stride_lb, stride_lh, stride_lq,       # LSE_PARTS [P, B, Hq, Sq]
    stride_outb, stride_outq, stride_outh,            # OUT [B, Sq, Hq, Dv]
    stride_lob, stride_loh, stride_loq,               # LSE_OUT [B, Hq, Sq]
    num_parts, seqlen_q, heads,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seqlen_q).to(tl.int64)
    i = (pid % seqlen_q).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    offs_dv = tl.arange(0, BLOCK_DV)
    o_mask = h_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    lse_base = LSE_PARTS + b * stride_lb + i * stride_lq + h * stride_lh
    o_base = O_PARTS + b * stride_ob + i * stride_oq + h[:, None] * stride_oh + offs_dv[None, :]

    # Pointers advance by the part strides (64-bit pointer arithmetic, no int32 index overflow).
    lse_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    lse_ptrs = lse_base
    for _ in range(num_parts):
        lse_max = tl.maximum(lse_max, tl.load(lse_ptrs, mask=h_ok, other=float("-inf")))
        lse_ptrs += stride_lp
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all parts empty: weights stay 0

    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    lse_ptrs = lse_base
    o_ptrs = o_base
    for _ in range(num_parts):
        w = tl.exp(tl.load(lse_ptrs, mask=h_ok, other=float("-inf")) - lse_max)
        used = w > 0.0
        # Masked load: an empty part's output is never read, so NaN there cannot reach the sum.
        o = tl.load(o_ptrs, mask=o_mask & used[:, None], other=0.0).to(tl.float32)
        acc += o * w[:, None]
        total += w
        lse_ptrs += stride_lp
        o_ptrs += stride_op

    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    out = acc / t_safe[:, None]
    lse = tl.where(seen, lse_max + tl.log(t_safe), float("-inf"))
    tl.store(OUT + b * stride_outb + i * stride_outq + h[:, None] * stride_outh + offs_dv[None, :],
             out.to(OUT.dtype.element_ty), mask=o_mask)
    tl.store(LSE_OUT + b * stride_lob + i * stride_loq + h * stride_loh, lse, mask=h_ok)


@functools.lru_cache(maxsize=256)
def _merge_meta(hq: int, dv: int) -> tuple[int, dict]:
    """(BLOCK_H, launch keywords) for Hq heads of width Dv: decided once per shape."""
    block_h = min(16, triton.next_power_of_2(hq))
    return block_h, dict(HEAD_DIM_V=dv, BLOCK_H=block_h, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                         num_warps=4 if block_h * dv >= 2048 else 2)


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge o_parts [P, B, Sq, Hq, Dv] / lse_parts [P, B, Hq, Sq] (any strides, last dim of o_parts
    unit-stride) into out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] float32, in place.  Launches on the
    current device: callers hold the device guard (the decode launcher already does)."""
    num_parts, bsz, sq, hq, dv = o_parts.shape
    if out.numel() == 0:
        return
    block_h, meta = _merge_meta(hq, dv)
    _merge_kernel[(bsz * sq, triton.cdiv(hq, block_h))](
        o_parts, lse_parts, out, lse,
        *o_parts.stride()[:4], *lse_parts.stride(), *out.stride()[:3], *lse.stride(),
        num_parts, sq, hq, **meta,
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
    o_parts = torch.stack([o if o.stride(-1) == 1 else o.contiguous() for o in outs])
    guard = torch.cuda.device(out.device) if out.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        merge_partials(o_parts, torch.stack(lses), out, lse)
    return out, lse

