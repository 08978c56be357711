"""Score math shared by the lax backends (xla, blockwise): grouped layouts, precision, softcap.

GQA without expanding K/V: q [B, Sq, Hq, D] is viewed as [B, Sq, Hkv, G, D] (query head h reads KV head
h // G) and contracted against k [B, n, Hkv, D] into scores [B, Hkv, G, Sq, n].
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import env
from .spec import JaxSpec


def grouped(spec: JaxSpec, x):
    """[B, Sq, Hq, E] -> [B, Sq, Hkv, G, E] (a view, no copy)."""
    return x.reshape(x.shape[0], x.shape[1], spec.heads_kv, spec.groups, x.shape[-1])


def ungrouped_rows(spec: JaxSpec, x):
    """[B, Hkv, G, Sq, ...] -> [B, Hq, Sq, ...]."""
    return x.reshape(x.shape[0], spec.heads_q, *x.shape[3:])


def acc_dtype(spec: JaxSpec):
    return jnp.float64 if spec.dtype == "float64" else jnp.float32


def precision(spec: JaxSpec):
    """fp32 / fp64 inputs get IEEE dot products (TF32 only with FLASHPORT_ALLOW_TF32=1), as on the torch side."""
    if spec.dtype in ("float32", "float64") and not env.flag("FLASHPORT_ALLOW_TF32"):
        return lax.Precision.HIGHEST
    return None


def matmul_dtype(spec: JaxSpec):
    """Probabilities and dS enter the second matmuls in the input dtype for fp16 / bf16 (FlashAttention's
    convention), in the accumulator dtype otherwise."""
    return jnp.dtype(spec.dtype) if spec.dtype in ("float16", "bfloat16") else acc_dtype(spec)


def raw_scores(spec: JaxSpec, qg, k):
    """softmax_scale * q.k: qg [B, Sq, Hkv, G, D], k [B, n, Hkv, D] -> [B, Hkv, G, Sq, n] (accumulator dtype)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=acc_dtype(spec), precision=precision(spec))
    return s * spec.softmax_scale


def capped(spec: JaxSpec, s):
    """-> (final scores, tanh term or None): softcap * tanh(s / softcap) when softcap > 0."""
    if spec.softcap > 0:
        t = jnp.tanh(s / spec.softcap)
        return spec.softcap * t, t
    return s, None


def pv(spec: JaxSpec, p, v):
    """p [B, Hkv, G, Sq, n] @ v [B, n, Hkv, Dv] -> [B, Hkv, G, Sq, Dv] (accumulator dtype)."""
    return jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(matmul_dtype(spec)), v,
                      preferred_element_type=acc_dtype(spec), precision=precision(spec))


def to_output(spec: JaxSpec, o, dtype):
    """[B, Hkv, G, Sq, Dv] -> [B, Sq, Hq, Dv] in `dtype`."""
    b = o.shape[0]
    return jnp.transpose(o.reshape(b, spec.heads_q, spec.seqlen_q, o.shape[-1]), (0, 2, 1, 3)).astype(dtype)
