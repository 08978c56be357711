"""Programmable attention: score_mod, mask_mod, block masks and attn_bias (FlexAttention's signatures).

The score pipeline, one rule for every backend (DESIGN.md, "Programmable attention"):

    s = softmax_scale * q.k  ->  softcap  ->  ALiBi  ->  score_mod(s, b, h, q_idx, kv_idx)
      ->  + attn_bias[b, h, q_idx, kv_idx]  ->  visible = built-in rule AND mask_mod(b, h, q_idx, kv_idx)
      AND the block mask's tile is not empty  ->  softmax

The mods get integer index tensors that broadcast against each other and the score (b batch, h *query*
head, q_idx / kv_idx 0-based positions without the bottom-right shift), so a mod written for Flex's
vmap runs here on a whole tile at once.  `Programmable.scores` and `Programmable.visible` evaluate the
pipeline on any rectangle of the score matrix: the reference on all of it, blockwise tile by tile.

Gradients reach tensors a score_mod captures (a learnable relative-position table) and attn_bias: they
become extra inputs of the autograd Function (`differentiable`), found once per call by running the mod
on a one-element probe under a TorchFunctionMode (`captured_tensors`): whatever tensor that requires
grad enters one of its torch operations without having been made by it is a captured input.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .block_mask import BlockMask, as_block_mask, checked_mask, documents_of_starts
from .mask_rules import band_of

FEATURES = ("score_mod", "mask_mod", "block_mask", "attn_bias")


class _Probe(TorchFunctionMode):
    """Records the tensors requiring grad that a function reads but did not make."""

    def __init__(self):
        super().__init__()
        self.made: list = []          # kept alive so that their ids stay unique during the probe
        self.made_ids: set = set()
        self.captured: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in self.made_ids:
                self.captured.setdefault(id(t), t)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append(t)
                self.made_ids.add(id(t))
        return out


def captured_tensors(score_mod: Callable, device) -> tuple:
    """The tensors requiring grad that score_mod reads (closures, globals, module parameters alike), and what the
    probe call returned."""
    probe = _Probe()
    idx = torch.zeros((), dtype=torch.int64, device=device)
    with torch.enable_grad(), probe:
        result = score_mod(torch.zeros((), dtype=torch.float32, device=device), idx, idx, idx, idx)
    return tuple(probe.captured.values()), result


def checked_score(r) -> torch.Tensor:
    """A score_mod's result, which must be a floating tensor (the new scores)."""
    if not isinstance(r, torch.Tensor) or not r.is_floating_point():
        got = f"a {r.dtype} tensor" if isinstance(r, torch.Tensor) else type(r).__name__
        raise TypeError(f"score_mod must return a floating tensor (the new score), got {got}")
    return r


@dataclass
class Programmable:
    """The programmable part of one call (an input, not part of the hashable spec).

    block_mask: a flashport BlockMask (torch BlockMasks are converted); attn_bias: floating, broadcastable
    to [B, Hq, Sq, Sk]; captured: tensors score_mod reads that require grad."""

    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    block_mask: Optional[BlockMask] = None
    attn_bias: Optional[torch.Tensor] = None
    captured: tuple = ()

    @property
    def features(self) -> tuple:
        """The feature names present (the spec's `mods`, which capabilities are checked against)."""
        return tuple(f for f in FEATURES if getattr(self, f) is not None)

    @property
    def differentiable(self) -> tuple:
        """Extra inputs of the autograd Function, in order: attn_bias (when it requires grad), captured."""
        bias = (self.attn_bias,) if self.attn_bias is not None and self.attn_bias.requires_grad else ()
        return bias + self.captured

    @property
    def changes_scores(self) -> bool:
        return self.score_mod is not None or self.attn_bias is not None

    def scores(self, s: torch.Tensor, b, h, i, j) -> torch.Tensor:
        """score_mod, then + attn_bias, on scores `s` whose entries sit at the broadcast (b, h, i, j)."""
        if self.score_mod is not None:
            r = checked_score(self.score_mod(s, b, h, i, j))
            # broadcast only when the mod did not touch every index (a no-op expand trips Flex's lowering)
            s = (r if r.shape == s.shape else torch.broadcast_to(r, s.shape)).to(s.dtype)
        if self.attn_bias is not None:
            bias = self.attn_bias
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            # index only the broadcast dims of size > 1 (a size-1 dim broadcasts by itself)
            idx = tuple(x if n > 1 else torch.zeros_like(x) for x, n in zip((b, h, i, j), bias.shape))
            s = s + bias[idx].to(s.dtype)
        return s

    def visible(self, b, h, i, j) -> Optional[torch.Tensor]:
        """mask_mod AND the block mask's non-empty tiles at (b, h, i, j), or None when neither is given."""
        vis = None
        if self.block_mask is not None:
            vis = self.block_mask.tile_visible(b, h, i, j)
        if self.mask_mod is not None:
            m = checked_mask(self.mask_mod(b, h, i, j))
            vis = m if vis is None else vis & m
        return vis

    def tile(self, m0: int, m1: int, n0: int, n1: int) -> str:
        """"empty", "full" or "partial" for the rows [m0, m1) x keys [n0, n1) over every batch and head,
        from the block mask ("partial" without one: every pair is evaluated)."""
        if self.block_mask is None:
            return "partial"
        return self.block_mask.state_of(m0, m1, n0, n1)


def _mask_only(prog: Optional[Programmable]) -> bool:
    """Mods that are a mask alone (no score_mod, no attn_bias), all in a block mask that can show its rules."""
    return (prog is not None and prog.score_mod is None and prog.attn_bias is None and prog.block_mask is not None
            and prog.mask_mod is prog.block_mask.mask_mod)


def _mask_mod_only(prog: Optional[Programmable]) -> bool:
    """A mask_mod alone: no score_mod, attn_bias or block mask."""
    return prog is not None and prog.score_mod is None and prog.attn_bias is None and prog.block_mask is None


def _declared(prog: Optional[Programmable]) -> Optional[tuple]:
    """The rule a mask_mod declares (mods._rule: the ready-made causal, windows, prefix-LM, documents) in a mask-only
    call without a block mask, or None."""
    return getattr(prog.mask_mod, "builtin_rule", None) if _mask_mod_only(prog) else None


def builtin_window(prog: Optional[Programmable], window: tuple, batch: int, heads_q: int, sq: int,
                   sk: int) -> Optional[tuple]:
    """The built-in window (left, right) that a call with this window and these mods equals, where the mods are a
    mask alone that is a band: its block mask shows one (BlockMask.band), or its mask_mod declares one in top-left
    positions that the bottom-right rule can say for (Sq, Sk); else None.  The two rules intersect: each bound is
    the tighter of the two (-1 = unbounded)."""
    if _mask_only(prog):
        band = prog.block_mask.band(batch, heads_q)
    else:
        # what the mask_mod declares, or else the band its code provably is (mask_rules.band_of: a user's own causal
        # or sliding-window lambda); the other builtin_* want declared rules only, which are never a traced band
        rule, off = _declared(prog), sk - sq
        if rule is None and _mask_mod_only(prog):
            rule = band_of(prog.mask_mod)
        band = None
        if rule is not None and rule[0] == "band":
            band = tuple(-1 if w < 0 else w + sign * off for w, sign in zip(rule[1:], (1, -1)))
            if any(w >= 0 > v for w, v in zip(rule[1:], band)):
                band = None          # top-left bounds past the bottom-right diagonal: not a built-in window
    if band is None:
        return None
    return tuple(b if w < 0 else w if b < 0 else min(w, b) for w, b in zip(window, band))


def builtin_alibi(prog: Optional[Programmable], alibi: Optional[str], heads_q: int, sq: int, sk: int, device):
    """The slopes of a score_mod that declares it is ALiBi (mods.alibi), where the built-in ALiBi says the same (Sq
    = Sk, so its bottom-right distance is |i - j|; float32 slopes [Hq] on the call's device that need no gradient;
    the call has no slopes of its own), with the mods left without it; else (None, prog).  The pipeline puts the
    built-in ALiBi after softcap and before the score_mod, so with no other score_mod the order is the same."""
    rule = None if prog is None or prog.score_mod is None else getattr(prog.score_mod, "builtin_rule", None)
    if rule is None or rule[0] != "alibi" or alibi is not None or sq != sk:
        return None, prog
    slopes = rule[1]
    if (not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or tuple(slopes.shape) != (heads_q,)
            or slopes.device != torch.device(device) or slopes.requires_grad):
        return None, prog
    rest = Programmable(None, prog.mask_mod, prog.block_mask, prog.attn_bias, ())
    return slopes, (rest if rest.features else None)


def builtin_documents(prog: Optional[Programmable], batch: int, heads_q: int, sq: int, sk: int,
                      device) -> Optional[tuple]:
    """(cu_seqlens, max_seqlen, per_entry, causal) of a mask-only call that is packed documents: its block mask's
    (BlockMask.documents), or the document ids a mask_mod declares (mods.document) where each id is one run of
    positions in every batch entry (Sq = Sk, the ids on the call's device); else None."""
    if _mask_only(prog):
        return prog.block_mask.documents(batch, heads_q)
    rule = _declared(prog)
    if rule is None or rule[0] != "documents" or sq != sk:
        return None
    return _documents_of_ids(rule[1], rule[2], batch, sq, torch.device(device))


# id(ids) -> (weak reference to ids, ids._version when read, {(causal, batch, s): documents tuple or None})
_FOUND_DOCUMENTS: dict = {}


def _documents_of_ids(ids: torch.Tensor, causal: bool, batch: int, s: int, device) -> Optional[tuple]:
    """BlockMask.documents' tuple from document ids [S] or [B, S] (the first s of each entry), or None where an id
    comes back after another (not packed: no varlen call equals it).  Reading the ids' run counts is a sync on a
    GPU, so the answer is kept for as long as the ids tensor lives unchanged (its version counter): a training
    loop's later calls with the same mod neither sync nor recompute, as a block mask's rules are found once."""
    if (not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool
            or ids.device != device or ids.dim() not in (1, 2) or ids.shape[-1] < s
            or (ids.dim() == 2 and ids.shape[0] != batch) or s == 0 or batch == 0):
        return None
    key = id(ids)
    entry = _FOUND_DOCUMENTS.get(key)
    if entry is None or entry[0]() is not ids or entry[1] != ids._version:
        entry = (weakref.ref(ids, lambda _, key=key: _FOUND_DOCUMENTS.pop(key, None)), ids._version, {})
        _FOUND_DOCUMENTS[key] = entry
    found = entry[2]
    if (causal, batch, s) not in found:
        found[(causal, batch, s)] = _read_documents(ids, bool(causal), batch, s)
    return found[(causal, batch, s)]


def _read_documents(ids: torch.Tensor, causal: bool, batch: int, s: int) -> Optional[tuple]:
    ids = ids.detach()[..., :s].expand(batch, s)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ranked = ids.sort(-1).values
    distinct = 1 + (ranked[:, 1:] != ranked[:, :-1]).sum(-1)
    per_entry = start.sum(-1)
    if not bool((per_entry == distinct).all()):   # as many runs as ids: each document in one piece
        return None
    return documents_of_starts(start, per_entry, bool(causal))


def builtin_prefix(prog: Optional[Programmable], batch: int, heads_q: int, sq: int, sk: int) -> Optional[int]:
    """The prefix length P of a mask-only call's prefix-LM mask (BlockMask.prefix, or a mask_mod that declares it,
    with Sq = Sk and 1 < P < S), or None."""
    if _mask_only(prog):
        return prog.block_mask.prefix(batch, heads_q)
    rule = _declared(prog)
    return rule[1] if rule is not None and rule[0] == "prefix" and sq == sk and 1 < rule[1] < sq else None


def builtin_sinks(prog: Optional[Programmable], sq: int, sk: int) -> Optional[tuple]:
    """(window, sinks) of a mask-only call whose mask_mod declares a sliding window with attention sinks
    (mods.sliding_window(w, sinks)), alone or with the block mask create_block_mask built from it, Sq = Sk; else
    None."""
    if prog is None or prog.score_mod is not None or prog.attn_bias is not None or sq != sk:
        return None
    bm = prog.block_mask
    if bm is not None and (not bm.find_band or bm.mask_mod is not prog.mask_mod):
        return None          # a block mask that may hide more than its mask_mod (converted from torch's)
    rule = getattr(prog.mask_mod, "builtin_rule", None)
    return rule[1:] if rule is not None and rule[0] == "sinks" else None


def build(score_mod, mask_mod, block_mask, attn_bias, *, batch: int, heads_q: int, sq: int, sk: int,
          device) -> Optional[Programmable]:
    """Validate the programmable keywords of a dense call (names in every error) -> Programmable or None."""
    if score_mod is None and mask_mod is None and block_mask is None and attn_bias is None:
        return None
    device = torch.device(device)
    for f, name in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
    bm = None
    if block_mask is not None:
        bm = as_block_mask(block_mask)
        if bm.mask_mod is not None:
            if mask_mod is None:
                mask_mod = bm.mask_mod
            elif mask_mod is not bm.mask_mod:
                raise ValueError("mask_mod and block_mask.mask_mod are different functions; pass one of them "
                                 "(a block mask brings its mask_mod)")
        bm.check(batch, heads_q, sq, sk, device)
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(attn_bias).__name__}")
        if not attn_bias.is_floating_point():
            raise TypeError(f"attn_bias must be a floating tensor, got {attn_bias.dtype}")
        if attn_bias.device != device:
            raise ValueError(f"attn_bias must be on q's device {device}, got {attn_bias.device}")
        full = (batch, heads_q, sq, sk)
        if attn_bias.dim() > 4 or any(n not in (1, f) for n, f in zip(reversed(attn_bias.shape), reversed(full))):
            raise ValueError(f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to [B, Hq, Sq, Sk]="
                             f"{list(full)}")
    captured = ()
    if score_mod is not None:
        try:
            captured, result = captured_tensors(score_mod, device)
        except Exception as e:  # a mod that fails on a scalar probe still runs on tiles; it just gets no captures
            raise ValueError(f"score_mod failed on a probe call score_mod(score, b, h, q_idx, kv_idx) with 0-d "
                             f"tensors: {type(e).__name__}: {e}") from e
        checked_score(result)
    return Programmable(score_mod, mask_mod, bm, attn_bias, captured)
