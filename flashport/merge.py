"""Exact merge of partial attention results over disjoint key sets (the flash-decoding combine).

    lse = log(sum_i exp(lse_i));   out = sum_i exp(lse_i - lse) * out_i

A part with lse = -inf contributes nothing; if every part is -inf the row is zeros with lse -inf.
"""
from __future__ import annotations

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

        d out_p = w_p * d out,    d lse_p = w_p * (<d out, out_p - out> + d lse),    w_p = exp(lse_p - lse)

    backward (out = sum_q w_q out_q and lse = log sum_q exp(lse_q), so d out / d lse_p = w_p (out_p - out) and
    d lse / d lse_p = w_p), instead of autograd through merge_states_torch's float32 temporaries.  A part with
    w_p = 0 (lse_p = -inf, or an empty row) gets zero gradients, whatever its output holds."""

    @staticmethod
    def forward(ctx, fused, n: int, *parts):
        outs, lses = list(parts[:n]), list(parts[n:])
        out, lse = fused(outs, lses)
        ctx.n = n
        ctx.save_for_backward(*outs, *lses, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        n = ctx.n
        saved = ctx.saved_tensors
        outs, lses, out, lse = saved[:n], saved[n:2 * n], saved[2 * n], saved[2 * n + 1]
        acc = torch.promote_types(out.dtype, torch.float32)     # float32 for half types, float64 kept
        rowdot = lambda a, b: (a * b.to(acc)).sum(-1).transpose(1, 2)  # noqa: E731  [B, Sq, Hq, Dv] -> [B, Hq, Sq]
        d32 = None if dout is None else dout.to(acc)
        base = None if d32 is None else rowdot(d32, out)
        d_outs, d_lses = [], []
        for o, l in zip(outs, lses):
            w = torch.where(torch.isfinite(l) & torch.isfinite(lse), torch.exp(l - lse), 0.0)   # [B, Hq, Sq]
            g = torch.zeros_like(w) if d32 is None else rowdot(d32, o) - base
            if dlse is not None:
                g = g + dlse
            d_lses.append(torch.where(w > 0, w * g, 0.0))
            d_outs.append(None if d32 is None else (d32 * w.transpose(1, 2)[..., None]).to(o.dtype))
        return (None, None, *d_outs, *d_lses)
