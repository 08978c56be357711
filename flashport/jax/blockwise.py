"""Backend `blockwise`: FlashAttention's online softmax in lax, linear memory, any platform.

Forward: a lax.fori_loop over key tiles of BLOCK_K keys carries, per query row, the running max m_i, the
running sum l_i and the unnormalised output acc (FlashAttention's names); a tile's scores
[B, Hkv, G, Sq, BLOCK_K] exist only inside one iteration, so no [Sq, Sk] array is ever built.
Backward (custom_vjp): recomputes each tile's probabilities from the saved lse, P = exp(S - lse), and
accumulates dQ over tiles while writing dK, dV tile by tile:
    dP = dO V^T,  dS = P * (dP - Delta + dlse),  Delta = rowsum(dO * O)
with the softcap's derivative (1 - tanh^2) applied to dS.  Rows that see no key have lse = -inf: P = 0,
out = 0 and every gradient through them is exactly zero.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import scores
from .mask import visible
from .registry import JaxBackend, JaxCapabilities
from .spec import JaxSpec

BLOCK_K = 512


class Options(NamedTuple):
    spec: JaxSpec
    block_k: int


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _padded(x, length: int):
    pad = length - x.shape[1]
    return x if pad == 0 else jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))


def _tile(opts: Options, x, start):
    return lax.dynamic_slice_in_dim(x, start, opts.block_k, axis=1)


def _mask(opts: Options, start, q_seg, kv_seg_p):
    spec = opts.spec
    i = jnp.arange(spec.seqlen_q)[:, None]
    j = start + jnp.arange(opts.block_k)[None, :]
    ks = None if kv_seg_p is None else _tile(opts, kv_seg_p, start)
    return visible(spec, i, j, q_seg, ks) & (j < spec.seqlen_k)   # j >= Sk: padding


def _tiles(spec: JaxSpec, block_k: int) -> int:
    return _round_up(spec.seqlen_k, block_k) // block_k


def _forward(opts: Options, q, k, v, q_seg, kv_seg):
    spec = opts.spec
    acc_t = scores.acc_dtype(spec)
    skp = _tiles(spec, opts.block_k) * opts.block_k
    kp, vp = _padded(k, skp), _padded(v, skp)
    ksp = None if kv_seg is None else _padded(kv_seg, skp)
    qg = scores.grouped(spec, q)
    rows = (q.shape[0], spec.heads_kv, spec.groups, spec.seqlen_q)

    def body(t, carry):
        m_i, l_i, acc = carry
        start = t * opts.block_k
        s, _ = scores.capped(spec, scores.raw_scores(spec, qg, _tile(opts, kp, start)))
        vis = _mask(opts, start, q_seg, ksp)
        m_new = jnp.maximum(m_i, jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)      # no key seen yet: nothing to rescale
        alpha = jnp.exp(m_i - m_safe)
        p = jnp.exp(jnp.where(vis, s - m_safe[..., None], -jnp.inf))
        l_i = alpha * l_i + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + scores.pv(spec, p, _tile(opts, vp, start))
        return m_new, l_i, acc

    init = (jnp.full(rows, -jnp.inf, acc_t), jnp.zeros(rows, acc_t), jnp.zeros(rows + (spec.head_dim_v,), acc_t))
    m_i, l_i, acc = lax.fori_loop(0, _tiles(spec, opts.block_k), body, init)
    seen = l_i > 0
    l_safe = jnp.where(seen, l_i, 1.0)
    out = scores.to_output(spec, acc / l_safe[..., None], q.dtype)
    lse = jnp.where(seen, jnp.where(jnp.isfinite(m_i), m_i, 0.0) + jnp.log(l_safe), -jnp.inf)
    return out, scores.ungrouped_rows(spec, lse).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise_attention(opts: Options, q, k, v, q_seg, kv_seg):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], segment ids [B, Sq] / [B, Sk] or None
    -> (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] float32)."""
    return _forward(opts, q, k, v, q_seg, kv_seg)


def _fwd(opts, q, k, v, q_seg, kv_seg):
    out, lse = _forward(opts, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _bwd(opts, res, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = res
    dout, dlse = cotangents
    spec = opts.spec
    acc_t, mm_t, prec = scores.acc_dtype(spec), scores.matmul_dtype(spec), scores.precision(spec)
    skp = _tiles(spec, opts.block_k) * opts.block_k
    kp, vp = _padded(k, skp), _padded(v, skp)
    ksp = None if kv_seg is None else _padded(kv_seg, skp)
    qg, dog = scores.grouped(spec, q), scores.grouped(spec, dout)
    grouped_rows = (q.shape[0], spec.heads_kv, spec.groups, spec.seqlen_q)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog.astype(acc_t), scores.grouped(spec, out).astype(acc_t))
    delta = delta - dlse.reshape(grouped_rows).astype(acc_t)
    lse_g = lse.reshape(grouped_rows).astype(acc_t)
    seen = jnp.isfinite(lse_g)
    lse_g = jnp.where(seen, lse_g, 0.0)

    def body(t, carry):
        dq, dk, dv = carry
        start = t * opts.block_k
        k_t, v_t = _tile(opts, kp, start), _tile(opts, vp, start)
        s, tanh = scores.capped(spec, scores.raw_scores(spec, qg, k_t))
        vis = _mask(opts, start, q_seg, ksp) & seen[..., None]
        p = jnp.exp(jnp.where(vis, s - lse_g[..., None], -jnp.inf))
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v_t, preferred_element_type=acc_t, precision=prec)
        ds = p * (dp - delta[..., None])
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        ds = (ds * spec.softmax_scale).astype(mm_t)
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_t, preferred_element_type=acc_t, precision=prec)
        dk_t = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=acc_t, precision=prec)
        dv_t = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(mm_t), dog, preferred_element_type=acc_t, precision=prec)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_t, start, axis=1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_t, start, axis=1)
        return dq, dk, dv

    b = q.shape[0]
    init = (jnp.zeros(qg.shape, acc_t), jnp.zeros((b, skp, spec.heads_kv, spec.head_dim), acc_t),
            jnp.zeros((b, skp, spec.heads_kv, spec.head_dim_v), acc_t))
    dq, dk, dv = lax.fori_loop(0, _tiles(spec, opts.block_k), body, init)
    return (dq.reshape(q.shape).astype(q.dtype), dk[:, :spec.seqlen_k].astype(k.dtype),
            dv[:, :spec.seqlen_k].astype(v.dtype), None, None)


blockwise_attention.defvjp(_fwd, _bwd)


class BlockwiseBackend(JaxBackend):
    """Online softmax over key tiles in lax (fori_loop), custom_vjp recomputing tiles from lse; every
    dtype, head dim, mask, softcap, GQA, segment ids (shared or per side), lse (differentiable) and empty
    rows; any platform; memory linear in Sq and Sk."""

    name = "blockwise"
    caps = JaxCapabilities(dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=None)
    block_k = BLOCK_K     # tests shrink it to cross several tiles on small shapes

    def options(self, spec):
        return Options(spec, max(8, min(self.block_k, _round_up(spec.seqlen_k, 8))))

    def forward(self, spec, opts, q, k, v, q_seg, kv_seg):
        return blockwise_attention(opts, q, k, v, q_seg, kv_seg)
