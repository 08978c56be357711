"""Exact merge of partial attention results over disjoint key sets (the flash-decoding combine).

    lse = log(sum_i exp(lse_i));   out = sum_i exp(lse_i - lse) * out_i

A part with lse = -inf contributes nothing; if every part is -inf the row is zeros with lse -inf.
"""
from __future__ import annotations

import warnings

import torch


def validate_states(outs, lses) -> None:
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outs and lses must be lists of tensors")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty lists of equal length, got {len(outs)} and {len(lses)}")
    o0 = outs[0]
    for n, (o, l) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(l, torch.Tensor):
            raise TypeError(f"outs[{n}] and lses[{n}] must be tensors")
        if not o.is_floating_point():
            raise TypeError(f"outs[{n}] must be a floating tensor (attention outputs), got {o.dtype}")
        if o.dim() != 4:
            raise ValueError(f"outs[{n}] must be [B, Sq, Hq, Dv], got shape {tuple(o.shape)}")
        if o.shape != o0.shape or o.dtype != o0.dtype or o.device != o0.device:
            raise ValueError(f"outs[{n}] {tuple(o.shape)} {o.dtype} {o.device} differs from outs[0]")
        b, sq, hq, _ = o.shape
        if l.dtype != torch.float32:
            raise TypeError(f"lses[{n}] must be float32, got {l.dtype}")
        if tuple(l.shape) != (b, hq, sq) or l.device != o.device:
            raise ValueError(f"lses[{n}] must be [B, Hq, Sq]={(b, hq, sq)} on {o.device}, got {tuple(l.shape)}")


def merge_states_torch(outs, lses):
    lse = torch.stack(lses)                                    # [P, B, Hq, Sq]
    lse_max = lse.amax(0)
    safe_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    w = torch.exp(lse - safe_max)                              # exp(-inf) = 0 for empty parts
    total = w.sum(0)
    merged_lse = torch.where(total > 0, safe_max + torch.log(total), torch.full_like(total, float("-inf")))
    w = torch.where(total > 0, w / total.clamp_min(1e-30), torch.zeros_like(w))  # [P, B, Hq, Sq]
    out = 0
    for o, wi in zip(outs, w):
        wi = wi.transpose(1, 2)[..., None]                     # [B, Sq, Hq, 1]
        out = out + torch.where(wi > 0, o.float() * wi, 0.0)  # a -inf part never leaks NaN/garbage
    return out.to(outs[0].dtype), merged_lse


class MergeStates(torch.autograd.Function):
    """The merge with its own backward: `fused(outs, lses)` (the Triton kernel on CUDA, one pass) forward, and per part

        d out_p = w_p * d out,    d lse_p = w_p * (r_p - sum_q w_q r_q + d lse),    r_p = <d out, out_p>,  w_p = exp(lse_p - lse)

    backward (out = sum_q w_q out_q and lse = log sum_q exp(lse_q), so d out / d lse_p = w_p (out_p - out) and
    d lse / d lse_p = w_p), instead of autograd through merge_states_torch's float32 temporaries.  <d out, out> is
    taken as sum_q w_q r_q, from the parts, not from the merged output rounded to its dtype (a bf16 out would cost
    the lse gradients ~1e-2).  A part with w_p = 0 (lse_p = -inf, or an empty row) gets zero gradients, whatever its
    output holds."""

    @staticmethod
    def forward(fused, n: int, *parts):
        return fused(list(parts[:n]), list(parts[n:]))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, n, *parts = inputs
        ctx.n = n
        ctx.save_for_backward(*parts, output[1])

    @staticmethod
    def backward(ctx, dout, dlse):
        n = ctx.n
        saved = ctx.saved_tensors
        outs, lses, lse = saved[:n], saved[n:2 * n], saved[2 * n]
        # create_graph=True (grad mode on in here): the PyTorch backward, whose operations autograd records
        fn = merge_backward_torch if torch.is_grad_enabled() else _backward_for(outs[0])
        try:
            d_outs, d_lses = fn(outs, lses, lse, dout, dlse)
        except Exception as e:  # noqa: BLE001 -- a Triton that rejects the kernel: the PyTorch backward, said once
            if fn is merge_backward_torch or isinstance(e, torch.cuda.OutOfMemoryError):
                raise   # (the PyTorch backward needs more memory than the kernel)
            _warn_fallback(e)
            d_outs, d_lses = merge_backward_torch(outs, lses, lse, dout, dlse)
        return (None, None, *d_outs, *d_lses)


_fell_back: list = []


def _warn_fallback(e: Exception) -> None:
    if _fell_back:
        return
    _fell_back.append(e)
    warnings.warn(f"flashport: the merge's backward kernel failed ({type(e).__name__}: {e}); using the PyTorch "
                  "backward (about ten float32 passes instead of one)", RuntimeWarning, stacklevel=3)


def _backward_for(o: torch.Tensor):
    """The Triton kernel on CUDA for half and float32 parts (one pass instead of about ten float32 ones), else
    merge_backward_torch (tests/interpreter runs the kernel on CPU tensors against it)."""
    if o.is_cuda and o.dtype in (torch.float16, torch.bfloat16, torch.float32):
        try:
            from .kernels.merge import merge_backward_triton
            return merge_backward_triton
        except ImportError:   # no Triton in this process
            pass
    return merge_backward_torch


def merge_backward_torch(outs, lses, lse, dout, dlse):
    """MergeStates' backward in PyTorch operations: (d outs, d lses)."""
    acc = torch.promote_types(outs[0].dtype, torch.float32)     # float32 for half types, float64 kept
    d = dout.to(acc)
    w = [torch.where(torch.isfinite(l) & torch.isfinite(lse), torch.exp(l - lse), 0.0) for l in lses]  # [B, Hq, Sq]
    # r_p = <d out, out_p> per row, 0 where the part does not count (its output may be garbage there)
    r = [torch.where(wp > 0, (d * o.to(acc)).sum(-1).transpose(1, 2), 0.0) for wp, o in zip(w, outs)]
    base = sum(wp * rp for wp, rp in zip(w, r))                  # <d out, out>, exact in acc
    g = base.neg() if dlse is None else dlse - base
    d_lses = [torch.where(wp > 0, wp * (rp + g), 0.0) for wp, rp in zip(w, r)]
    d_outs = [(d * wp.transpose(1, 2)[..., None]).to(o.dtype) for wp, o in zip(w, outs)]
    return d_outs, d_lses
