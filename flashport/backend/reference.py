"""Backend `reference`: the specification.  Materialises the scores in float64 and follows the
contract literally (it is the oracle of the tests and of `flashport check`; never auto-selected).

For tests, `reference_attention(..., dropout_mask=...)` takes an explicit [B, Hq, Sq, Sk] keep-mask.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import dispatch
from ..capabilities import DTYPES, Capabilities
from ..dropout import dense_keep_mask
from ..kvcache import gather_pages
from ..masks import alibi_bias, visible
from ..programmable import FEATURES
from ..spec import AttnInputs, AttnSpec, alibi_per_batch, dense_spec, varlen_segments


def materialized_attention(q, k, v, *, scale: float, softcap: float = 0.0, alibi: Optional[torch.Tensor] = None,
                           left: int = -1, right: int = -1, seqlens_k: Optional[torch.Tensor] = None,
                           keep: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                           compute_dtype: torch.dtype = torch.float64, rows: Optional[torch.Tensor] = None,
                           seqlen_q=None, prog=None, batch_offset: int = 0):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out [B, Sq, Hq, Dv] (q's dtype),
    lse [B, Hq, Sq] float32.  alibi [B, Hq] float32; seqlens_k [B] valid keys per batch entry
    (bottom-right alignment uses them); keep [B, Hq, Sq, Sk] bool keep-mask for dropout.
    rows / seqlen_q: q holds only these query rows (int64 [Sq]) of a call with seqlen_q rows (an int or a
    tensor; the alignment and ALiBi use it), as the guard checks a few rows of a large call.
    prog: a flashport.programmable.Programmable (score_mod, attn_bias, mask_mod, block mask) or None; its mods
    see batch index batch_offset + b (a varlen call's sequence b)."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    cd = compute_dtype
    qf = q.to(cd).transpose(1, 2)                                   # [B, Hq, Sq, D]
    kf = k.to(cd).transpose(1, 2).repeat_interleave(g, dim=1)       # [B, Hq, Sk, D]
    vf = v.to(cd).transpose(1, 2).repeat_interleave(g, dim=1)       # [B, Hq, Sk, Dv]
    s = scale * (qf @ kf.transpose(-1, -2))                         # [B, Hq, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = (torch.arange(sq, device=q.device) if rows is None else rows.to(torch.int64))[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    sq_full = sq if seqlen_q is None else seqlen_q
    skv = sk if seqlens_k is None else seqlens_k.to(torch.int64)[:, None, None, None]
    if seqlens_k is not None:  # cache slots past the valid length may hold garbage, even NaN, and 0 * NaN = NaN
        vf = torch.where(torch.arange(sk, device=q.device)[None, None, :, None] < skv, vf, torch.zeros_like(vf))
    if alibi is not None:
        s = s + alibi_bias(alibi[:, :, None, None].to(cd), i, j, sq_full, skv).to(cd)
    vis = visible(i, j, sq_full, skv, left, right)
    if prog is not None:
        bi = (torch.arange(b, device=q.device) + batch_offset).view(b, 1, 1, 1)
        hi = torch.arange(hq, device=q.device).view(1, hq, 1, 1)
        s = prog.scores(s, bi, hi, i[None, None], j[None, None])
        mods = prog.visible(bi, hi, i[None, None], j[None, None])
        if mods is not None:
            vis = vis & mods
        # a score_mod may mask by returning -inf: such a pair is hidden (exp(-inf) = 0), and a row of them
        # sees no key (zeros, lse -inf), not the NaN of -inf - (-inf)
        vis = vis & (s.detach() != float("-inf"))
    vis = vis.expand(b, hq, sq, sk)
    # A finite fill keeps empty rows free of NaN in forward and backward: their l is 0, so p = 0,
    # out = 0 and lse = -inf, and every gradient through them is exactly zero.
    fill = -1e300 if cd == torch.float64 else max(-1e30, torch.finfo(cd).min)  # fp16 tops out at 65504
    filled = torch.where(vis, s, torch.full_like(s, fill))
    m = filled.amax(-1, keepdim=True).detach() if sk else filled.new_zeros(b, hq, sq, 1)  # Sk = 0: no keys
    e = torch.where(vis, torch.exp(filled - m), torch.zeros_like(s))
    l = e.sum(-1, keepdim=True)
    nonempty = l > 0
    p = e / torch.where(nonempty, l, torch.ones_like(l))
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, l, torch.ones_like(l))),
                      torch.full_like(l, float("-inf"))).squeeze(-1)
    if dropout_p > 0:
        p = p * keep.to(cd) / (1.0 - dropout_p)
    out = (p @ vf).transpose(1, 2)                                  # [B, Sq, Hq, Dv]
    return out.to(q.dtype), lse.to(torch.float32)


def _alibi_bh(spec: AttnSpec, slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # detached: the contract differentiates q, k, v only, like every other backend
    return alibi_per_batch(spec, None if slopes is None else slopes.detach())


def _keep(spec: AttnSpec, inputs: AttnInputs, sq: int, sk: int, batch_index=None, batch=None):
    if spec.dropout_p == 0:
        return None
    if inputs.dropout_mask is not None:
        return inputs.dropout_mask
    return dense_keep_mask(inputs.rng_state, spec.dropout_p, batch if batch is not None else spec.batch,
                           spec.heads_q, sq, sk, batch_index=batch_index)


def _kw(spec: AttnSpec):
    return dict(scale=spec.softmax_scale, softcap=spec.softcap, left=spec.window_left,
                right=spec.window_right, dropout_p=spec.dropout_p)


class ReferenceBackend(dispatch.Backend):
    """The specification: materialises every score in float64 and follows the contract literally, for every call
    and device (O(Sq * Sk) memory).  The oracle of the tests and of `flashport check`; never chosen automatically.
    Its backward recomputes the forward under autograd, so it also checks another backend's saved (out, lse)."""

    name = "reference"
    auto = False
    slow_on_gpu = True
    caps = Capabilities(devices=("cuda", "cpu", "mps", "xpu"), dtypes=DTYPES, max_head_dim=None,
                        materialises_scores=True, mods=FEATURES)

    def extra_bytes(self, spec: AttnSpec, role: str = "fwd") -> int:
        # the float64 scores and three temporaries of their size (filled, exp, probabilities)
        return super().extra_bytes(spec, role) + 4 * 8 * spec.batch * spec.heads_q * spec.seqlen_q * spec.seqlen_k

    def forward(self, spec: AttnSpec, inputs: AttnInputs):
        out, lse = self._forward(spec, inputs)
        return out, lse, None

    def backward(self, spec: AttnSpec, inputs: AttnInputs, saved: dispatch.Saved, dout, dlse):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (saved.q, saved.k, saved.v))
            out, lse = self._forward(spec, dataclasses.replace(inputs, q=q, k=k, v=v))
            outs, grads = (out,), (dout,)
            if dlse is not None:
                outs, grads = (out, lse), (dout, dlse)
            extras = () if inputs.prog is None else inputs.prog.differentiable
            return torch.autograd.grad(outs, (q, k, v, *extras), grads, allow_unused=True, materialize_grads=True)

    def _forward(self, spec: AttnSpec, inputs: AttnInputs):
        if spec.kind == "dense":
            return materialized_attention(
                inputs.q, inputs.k, inputs.v, alibi=_alibi_bh(spec, inputs.alibi_slopes),
                keep=_keep(spec, inputs, spec.seqlen_q, spec.seqlen_k), prog=inputs.prog, **_kw(spec))
        if spec.kind == "kvcache":
            k, v = inputs.k, inputs.v
            if spec.paged:
                k, v = gather_pages(k, inputs.block_table), gather_pages(v, inputs.block_table)
            return materialized_attention(inputs.q, k, v, alibi=_alibi_bh(spec, inputs.alibi_slopes),
                                          seqlens_k=inputs.seqlens_k, **_kw(spec))
        return self._varlen(spec, inputs)

    def _varlen(self, spec: AttnSpec, inputs: AttnInputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        segments = varlen_segments(inputs)
        alibi = _alibi_bh(spec, inputs.alibi_slopes)
        outs, lses = [], []
        for b, (q0, q1, k0, k1) in enumerate(segments):
            qb = q[q0:q1][None]
            kb, vb = k[k0:k1][None], v[k0:k1][None]
            keep = None
            if spec.dropout_p > 0:
                keep = (inputs.dropout_mask[b:b + 1, :, :qb.shape[1], :kb.shape[1]] if inputs.dropout_mask is not None
                        else dense_keep_mask(inputs.rng_state, spec.dropout_p, 1, spec.heads_q, qb.shape[1],
                                             kb.shape[1], batch_index=b))
            o, l = materialized_attention(qb, kb, vb, alibi=None if alibi is None else alibi[b:b + 1], keep=keep,
                                          prog=inputs.prog, batch_offset=b, **_kw(spec))
            outs.append(o[0])
            lses.append(l[0])
        tail = q.shape[0] - (segments[-1][1] if segments else 0)  # rows past cu_seqlens_q[-1]: zeros, lse -inf
        outs.append(q.new_zeros(tail, spec.heads_q, spec.head_dim_v))
        lses.append(torch.full((spec.heads_q, tail), float("-inf"), device=q.device))
        return torch.cat(outs, 0), torch.cat(lses, 1)


def reference_attention(q, k, v, *, dropout_mask: Optional[torch.Tensor] = None, **kwargs):
    """`flashport.attention` on the reference backend, with an optional explicit dropout keep-mask
    [B, Hq, Sq, Sk] (bool) in place of the one drawn from the generator."""
    return_lse = kwargs.get("return_lse", False)
    kwargs.pop("backend", None)
    spec, inputs = dense_spec(q, k, v, **{**_DEFAULTS, **kwargs})
    inputs.dropout_mask = dropout_mask
    if spec.dropout_p > 0 and dropout_mask is None:
        raise ValueError("reference_attention with dropout_p > 0 needs dropout_mask")
    out, lse = ReferenceBackend().run(spec, inputs)
    return (out, lse) if return_lse else out


_DEFAULTS = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 dropout_p=0.0, deterministic=False, return_lse=False, score_mod=None, mask_mod=None,
                 block_mask=None, attn_bias=None)
