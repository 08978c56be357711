"""The float64 oracle for the JAX frontend: flashport's reference math (backend/reference.py) with segment
ids, in torch on the CPU, so JAX results are held to the same specification and the same tolerance rule
(flashport/check.py) as the torch backends.  Also the same-dtype math path of that rule (compute_dtype =
the input dtype: QK^T, softmax and PV materialised with every operation in that dtype).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..masks import visible


def to_torch(x, dtype: torch.dtype) -> torch.Tensor:
    """A jax / numpy array -> CPU torch tensor in `dtype` (bf16 travels through float32, exactly)."""
    a = np.asarray(x)
    if a.dtype.kind == "f" and a.dtype.itemsize < 4 or str(a.dtype) == "bfloat16":
        a = a.astype(np.float32)
    return torch.from_numpy(np.array(a, copy=True, order="C")).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, softcap: float = 0.0,
              left: int = -1, right: int = -1, q_seg: Optional[torch.Tensor] = None,
              kv_seg: Optional[torch.Tensor] = None, compute_dtype: torch.dtype = torch.float64):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] (torch, differentiable), segment ids
    [B, Sq] / [B, Sk] -> (out [B, Sq, Hq, Dv] in compute_dtype, lse [B, Hq, Sq] float64 or compute_dtype)."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    cd = compute_dtype
    qf = q.to(cd).transpose(1, 2)
    kf = k.to(cd).transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.to(cd).transpose(1, 2).repeat_interleave(g, dim=1)
    s = scale * (qf @ kf.transpose(-1, -2))                          # [B, Hq, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    vis = visible(i, j, sq, sk, left, right)[None, None]
    if q_seg is not None:
        vis = vis & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    vis = vis.expand(b, hq, sq, sk)
    fill = -1e300 if cd == torch.float64 else max(-1e30, torch.finfo(cd).min)
    filled = torch.where(vis, s, torch.full_like(s, fill))
    m = filled.amax(-1, keepdim=True).detach() if sk else filled.new_zeros(b, hq, sq, 1)
    e = torch.where(vis, torch.exp(filled - m), torch.zeros_like(s))
    l_i = e.sum(-1, keepdim=True)
    nonempty = l_i > 0
    one = torch.ones_like(l_i)
    p = e / torch.where(nonempty, l_i, one)
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, l_i, one)), torch.full_like(l_i, float("-inf")))
    return (p @ vf).transpose(1, 2), lse.squeeze(-1)
