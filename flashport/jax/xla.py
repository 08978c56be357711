"""Backend `xla`: the materialising path in jax.numpy, differentiated by JAX's autodiff.

Materialises the scores [B, Hkv, G, Sq, Sk] (accumulator dtype) for one fused XLA computation: fast for
short sequences, O(Sq * Sk) memory, so auto-selection uses it only up to AUTO_MAX_SCORES per head (a
named `backend="xla"` serves any length).  Serves every dtype, head dim, mask, softcap, GQA, segment ids
(shared or per side), lse, and empty rows (zeros, lse -inf, zero gradients: the masked exponent is
exp(-inf), never a where() over an overflow, so no NaN reaches a gradient).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import scores
from .mask import visible
from .registry import JaxBackend, JaxCapabilities

AUTO_MAX_SCORES = 1 << 20   # Sq * Sk: 1024 x 1024 per (batch, head)


class XlaBackend(JaxBackend):
    """jnp math materialising the scores; every feature, any platform; auto only for Sq * Sk <= 2^20."""

    name = "xla"
    caps = JaxCapabilities(dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=None,
                           materialises_scores=True,
                           notes=("materialises [B, Hq, Sq, Sk] scores; auto only for Sq*Sk <= 2^20",))

    def auto_reasons(self, spec):
        if spec.score_count > AUTO_MAX_SCORES:
            return [f"Sq*Sk = {spec.score_count} > {AUTO_MAX_SCORES} (materialises scores; auto uses it for "
                    "short sequences only)"]
        return []

    def forward(self, spec, opts, q, k, v, q_seg, kv_seg):
        s, _ = scores.capped(spec, scores.raw_scores(spec, scores.grouped(spec, q), k))
        i = jnp.arange(spec.seqlen_q)[:, None]
        j = jnp.arange(spec.seqlen_k)[None, :]
        vis = visible(spec, i, j, q_seg, kv_seg)
        m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(jnp.where(vis, s - m, -jnp.inf))
        l_i = jnp.sum(e, axis=-1, keepdims=True)
        seen = l_i > 0
        l_safe = jnp.where(seen, l_i, 1.0)
        out = scores.pv(spec, e / l_safe, v)
        lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]
        return scores.to_output(spec, out, q.dtype), scores.ungrouped_rows(spec, lse).astype(jnp.float32)
