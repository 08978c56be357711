"""The visibility rule on JAX index arrays (flashport.masks.Visibility.sees, plus segments).

Row i sees key j iff  i + Sk - Sq - left <= j <= i + Sk - Sq + right  (bottom-right alignment, -1 =
unbounded) and, with segment ids, q_ids[i] == kv_ids[j].  Positions are global positions in the [B, S]
arrays: for packed sequences (Sq == Sk, shared ids) that is the same as positions within each sequence.
"""
from __future__ import annotations

import jax.numpy as jnp

from .spec import JaxSpec


def visible(spec: JaxSpec, i, j, q_seg=None, kv_seg=None):
    """Bool mask broadcast from i [..., Sq, 1] and j [..., 1, n] (and q_seg [B, Sq], kv_seg [B, n] when
    given: then the result is [B, 1, 1, Sq, n], the layout of the grouped scores [B, Hkv, G, Sq, n])."""
    ok = spec.visibility.sees(i, j)
    if q_seg is not None:
        ok = ok & (q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :])
    return ok


def rows_with_keys(spec: JaxSpec):
    """[Sq] bool: rows that see at least one key under the window rule alone (no segments): O(Sq)."""
    vis = spec.visibility
    i = jnp.arange(spec.seqlen_q)
    lo = jnp.zeros_like(i) if vis.left < 0 else jnp.maximum(0, i + vis.diag - vis.left)
    hi = jnp.full_like(i, spec.seqlen_k) if vis.right < 0 else jnp.minimum(spec.seqlen_k, i + vis.diag + vis.right + 1)
    return lo < hi
