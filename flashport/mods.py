"""Ready-made mods for flashport.attention(score_mod=..., mask_mod=...), FlexAttention's signatures.

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor        score_mod(score, b, h, q_idx, kv_idx) -> score

Indices are integer tensors that broadcast against each other (h is the *query* head; positions are 0-based,
without the built-in rule's bottom-right shift).  Factories return the function; what they capture
(slopes, tables, document ids) is a tensor, so new values never need a new function, and a captured
table that requires grad receives its gradient.
"""
from __future__ import annotations

import torch


def _rule(mod, *rule):
    """Mark a mod with the built-in feature it is, in its own (top-left) positions.  For a mask_mod: ("band", left,
    right) shows row i the keys i - left .. i + right (-1 unbounded), ("prefix", P) the keys 0 .. max(i, P - 1),
    ("sinks", w, n) the keys i - w .. i and the first n keys up to i, ("documents", ids, causal) the keys of row i's
    document (up to i when causal) where each id is one run of positions.  For a score_mod: ("alibi", slopes) is the
    built-in ALiBi with those slopes.  backend=None runs such a mod as that feature, block mask or not
    (flashport/programmable.py's builtin_*).  Only for mods whose pattern is fixed when they are made, or that read
    a tensor the built-in reads too (the slopes, read at each call)."""
    mod.builtin_rule = rule
    return mod


def causal(b, h, q_idx, kv_idx):
    """Key j visible to query i iff j <= i (top-left aligned, as Flex's causal mask)."""
    return q_idx >= kv_idx


_rule(causal, "band", -1, 0)


def sliding_window(window: int, sinks: int = 0):
    """Causal sliding window of `window` keys behind each query, plus the first `sinks` tokens (attention
    sinks, StreamingLLM) visible to every later query."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx <= window) | (kv_idx < sinks))
    if window < 0:
        return mask_mod
    return _rule(mask_mod, "band", int(window), 0) if sinks <= 0 else _rule(mask_mod, "sinks", int(window), int(sinks))


def prefix_lm(prefix_len: int):
    """Bidirectional over the first `prefix_len` tokens, causal after them."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)
    return _rule(mask_mod, "prefix", int(prefix_len))


def document(doc_ids: torch.Tensor, causal: bool = True):
    """Packed documents: tokens see only their own document (and only earlier tokens when causal).
    doc_ids: int [S] (every batch entry) or [B, S]."""
    def mask_mod(b, h, q_idx, kv_idx):
        if doc_ids.dim() == 1:
            same = doc_ids[q_idx] == doc_ids[kv_idx]
        else:
            same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same
    return _rule(mask_mod, "documents", doc_ids, bool(causal))


def alibi(slopes: torch.Tensor):
    """ALiBi as a score_mod: score - slopes[h] * |q_idx - kv_idx| (slopes [Hq] float32)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return _rule(score_mod, "alibi", slopes)


def tanh_softcap(cap: float):
    """Gemma-2's logit soft-capping as a score_mod: cap * tanh(score / cap)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


def relative_position(table: torch.Tensor):
    """A learnable relative-position bias (T5 / Swin style): score + table[h, bucket(q_idx - kv_idx)].
    table: float [Hq, num_buckets]; distances are clamped into the table, centred on bucket num_buckets // 2.
    With table.requires_grad the table receives its gradient."""
    # The clamp bounds are 0-d tensors, not ints: compiled Flex under dynamic=True turns the ints a mod reads
    # (from a closure or table.shape) into symbolic sizes, which Inductor's Flex lowering cannot take
    # ("'ShapeAsConstantBuffer' object has no attribute 'dtype'", H100, torch 2.11); tensors are captured buffers.
    n = int(table.shape[-1])
    lo = torch.tensor(-(n // 2), device=table.device)
    hi = torch.tensor(n - 1 - n // 2, device=table.device)

    def score_mod(score, b, h, q_idx, kv_idx):
        bucket = torch.minimum(torch.maximum(q_idx - kv_idx, lo), hi) - lo
        return score + table[h, bucket]
    return score_mod


def block_sparse(num_q_blocks: int, num_kv_blocks: int, block_size: int = 128, density: float = 0.5,
                 seed: int = 0, device=None):
    """A random block-sparse pattern (a seeded [num_q_blocks, num_kv_blocks] layout, the diagonal kept),
    the shape of BigBird / fixed sparse attention."""
    g = torch.Generator().manual_seed(seed)
    layout = torch.rand(num_q_blocks, num_kv_blocks, generator=g) < density
    n = min(num_q_blocks, num_kv_blocks)
    layout[torch.arange(n), torch.arange(n)] = True
    layout = layout.to(device) if device is not None else layout

    def mask_mod(b, h, q_idx, kv_idx):
        return layout[q_idx // block_size, kv_idx // block_size]
    return mask_mod


def and_masks(*mods):
    """The pairs every mask_mod allows."""
    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out
    return mask_mod


def or_masks(*mods):
    """The pairs some mask_mod allows."""
    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out
    return mask_mod
