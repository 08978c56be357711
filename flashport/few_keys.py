"""Attention over a handful of keys -- the sink tokens that `mods.sliding_window(w, n)` adds to a window -- with
the forward from the kernels and the backward as dense float32 math.

Why: a flash backward gives each key tile its own program, which walks every query row.  Over n <= 64 keys that
is B * Hkv programs walking all Sq rows each (32 programs over 16384 rows in the programmable suite), while the
whole gradient is a few matrix products over the [B, H, Sq, n] scores: linear memory, every SM busy.  So the
backward recomputes P = exp(s - lse) over those scores and applies the flash recurrence to them (dS = P (dP - D
+ d lse), with D = rowsum(P dP)), in float32 from the saved inputs, deterministic.

The forward stays the kernels' (one call with return_lse): there the rows are the parallel dimension already.
Off by default until a GPU run times both backwards (tools/gpu/gpu_s21.sh part f, PERFLOG row 74): the dense one
moves about 2.5 GB in the programmable suite's case, which may cost as much as the kernels' walk."""
from __future__ import annotations

import torch

from . import env

MAX_KEYS = 64   # the dense backward holds [B, H, Sq, n] float32 scores and dP: 2 * n floats per (row, head)


def attention(q, k, v, *, right: int, softmax_scale: float, softcap: float, deterministic: bool):
    """(out, lse) of `flashport.attention(q, k, v, window_size=(-1, right), return_lse=True, ...)` over
    Sk <= MAX_KEYS keys, with the dense backward where FLASHPORT_FEW_KEYS_DENSE_BWD=1 (else the kernels')."""
    from .api import attention as kernels
    kw = dict(window_size=(-1, right), softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic,
              return_lse=True)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not grads or k.shape[1] > MAX_KEYS or not env.flag("FLASHPORT_FEW_KEYS_DENSE_BWD"):
        return kernels(q, k, v, **kw)
    return FewKeys.apply(q, k, v, kw)


class FewKeys(torch.autograd.Function):
    """The kernels' call `kw` forward; dense_backward with its window's right bound, scale and softcap."""

    @staticmethod
    def forward(q, k, v, kw):
        from .api import attention as kernels
        return kernels(q, k, v, **kw)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.kw = inputs
        ctx.save_for_backward(q, k, v, output[1])

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, lse = ctx.saved_tensors
        kw = ctx.kw
        dq, dk, dv = dense_backward(q, k, v, lse, dout, dlse, right=kw["window_size"][1],
                                    scale=kw["softmax_scale"], softcap=kw["softcap"])
        return dq, dk, dv, None


def dense_backward(q, k, v, lse, dout, dlse, *, right: int, scale: float, softcap: float):
    """Gradients of (out, lse) = attention(q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D | Dv]) with bottom-right
    visibility j <= i + Sk - Sq + right, from the forward's lse [B, Hq, Sq] (-inf: a row that sees no key)."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kf, vf = (t.float().repeat_interleave(g, dim=2) for t in (k, v))     # [B, Sk, Hq, *]: n keys, cheap
    qf = q.float()
    do = dout.float()      # autograd materialises unused gradients as zeros: dout and dlse are tensors
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    visible = j <= i + sk - sq + right
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(visible & seen, torch.exp(s - torch.where(seen, lse[..., None], 0.0)), 0.0)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True) + dlse[..., None])
    if softcap > 0:
        ds = ds * (1 - (s / softcap) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    if g > 1:
        dk, dv = (t.view(b, sk, hkv, g, t.shape[-1]).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
