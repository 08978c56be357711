"""Block masks: which (query tile, key tile) pairs of a mask_mod are empty, full or partial.

`create_block_mask` evaluates the mask_mod once, vectorised over the tile grid, and keeps one int8 per
tile and (batch, head): EMPTY tiles are skipped, FULL tiles need no per-element mask, PARTIAL tiles apply
the mask_mod.  Built once and reused across calls and layers, like FlexAttention's; a
`torch.nn.attention.flex_attention.BlockMask` is accepted and converted (`as_block_mask`).

A block mask may show exactly the pairs of a built-in rule: a causal or sliding-window mask_mod is the
commonest mask there is.  `BlockMask.band` finds that rule (masks.Visibility's window, bottom-right
aligned), so that backend=None runs such a call on the built-in kernels, which skip and mask those tiles
without evaluating any mod (DESIGN.md: a plain causal mask_mod within 5% of causal=True).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2
# Elements of the mask_mod evaluated at once while building (a bool each): bounded whatever the shape.
EVAL_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class BlockMask:
    """state: int8 [B or 1, H or 1, ceil(Sq / q_block), ceil(Sk / kv_block)] of EMPTY / PARTIAL / FULL.
    A batch or head dimension of 1 applies to every batch entry or query head."""

    state: torch.Tensor
    seq_lengths: tuple
    block_size: tuple            # (q_block, kv_block)
    mask_mod: Optional[Callable] = None
    # band() looks for a built-in rule only in masks built here: a converted torch BlockMask is converted anew at
    # every call, and looking would cost each call O(Sq * kv_block) mask_mod evaluations
    find_band: bool = True

    @property
    def shape(self) -> tuple:
        return tuple(self.state.shape)

    def sparsity(self) -> float:
        """Fraction of tiles that are empty (work a kernel skips)."""
        return float((self.state == EMPTY).float().mean()) if self.state.numel() else 0.0

    def check(self, batch: int, heads_q: int, sq: int, sk: int, device) -> None:
        b, h, nq, nk = self.state.shape
        qb, kb = self.block_size
        if (sq, sk) != tuple(self.seq_lengths) or nq != -(-sq // qb) or nk != -(-sk // kb):
            raise ValueError(f"block_mask was built for (Sq, Sk)={tuple(self.seq_lengths)}, the call has ({sq}, {sk})")
        if b not in (1, batch) or h not in (1, heads_q):
            raise ValueError(f"block_mask has batch x heads {b} x {h}; the call needs 1 or {batch} x 1 or {heads_q}")
        if self.state.device != torch.device(device):
            raise ValueError(f"block_mask is on {self.state.device}, the call on {device}")

    def _summary(self):
        # per (query tile, key tile) over every batch entry and head, on the host: read by tile loops
        s = self.__dict__.get("_host")
        if s is None:
            st = self.state.cpu()
            s = ((st != EMPTY).flatten(0, 1).any(0), (st == FULL).flatten(0, 1).all(0))
            object.__setattr__(self, "_host", s)
        return s

    def state_of(self, m0: int, m1: int, n0: int, n1: int) -> str:
        """"empty", "full" or "partial" for rows [m0, m1) x keys [n0, n1), over every batch entry and head."""
        qb, kb = self.block_size
        any_, all_ = self._summary()
        rows, cols = slice(m0 // qb, (m1 - 1) // qb + 1), slice(n0 // kb, (n1 - 1) // kb + 1)
        if not bool(any_[rows, cols].any()):
            return "empty"
        return "full" if bool(all_[rows, cols].all()) else "partial"

    def band(self, batch: int, heads: int) -> Optional[tuple]:
        """The window (left, right) of the built-in rule (masks.Visibility: bottom-right aligned, -1 unbounded)
        under which a call of `batch` x `heads` sees exactly the pairs this block mask shows it, or None when no
        window does."""
        return self._rules(batch, heads)[0]

    def documents(self, batch: int, heads: int) -> Optional[tuple]:
        """(cu_seqlens, max_seqlen, per_entry, causal) where this block mask shows packed documents to a call of
        `batch` x `heads` (Sq = Sk): row i sees the keys of its own document (up to i when causal) and nothing
        else, the same for every head.  cu_seqlens: int32 [n + 1], the documents of every batch entry in turn, as
        attention_varlen takes them on the [B * S] rows; per_entry: int64 [batch], documents per entry.  None
        otherwise."""
        return self._rules(batch, heads)[1]

    def prefix(self, batch: int, heads: int) -> Optional[int]:
        """P where this block mask shows prefix-LM to a call of `batch` x `heads` (Sq = Sk): row i sees keys 0 to
        max(i, P - 1), every batch entry and head alike (0 < P < S; P = 1 is causal, a band).  None otherwise."""
        return self._rules(batch, heads)[2]

    def _rules(self, batch: int, heads: int) -> tuple:
        # found once per (batch, heads) and kept (the mask_mod runs on the PARTIAL tiles only: O(Sq * kv_block) per
        # partial tile of a row tile, with the call's own b and h)
        if not self.find_band:
            return None, None, None
        rules = self.__dict__.setdefault("_rules_found", {})
        if (batch, heads) not in rules:
            found = [None, None, None]
            runs = _row_runs(self, batch, heads, 2 * (-(-self.block_size[0] // self.block_size[1]) + 1))
            found[0] = None if runs is None else _band(runs, *self.seq_lengths)
            if found[0] is None and self.seq_lengths[0] == self.seq_lengths[1]:
                found[2] = None if runs is None else _prefix(runs)
                runs = runs or _row_runs(self, batch, heads, None)   # documents cross more PARTIAL tiles
                found[1] = None if runs is None or found[2] is not None else _documents(runs, batch)
            rules[(batch, heads)] = tuple(found)
        return rules[(batch, heads)]

    def tile_visible(self, b, h, i, j) -> torch.Tensor:
        """Whether the tile holding (b, h, i, j) (broadcasting index tensors) is not empty."""
        qb, kb = self.block_size
        bb = b if self.state.shape[0] > 1 else torch.zeros_like(b)
        hh = h if self.state.shape[1] > 1 else torch.zeros_like(h)
        return self.state[bb, hh, i // qb, j // kb] != EMPTY


def checked_mask(m) -> torch.Tensor:
    """A mask_mod's result, which must be a bool tensor as in Flex: an additive 0 / -inf mask or an int would
    otherwise be read as visible wherever it is nonzero."""
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        got = f"a {m.dtype} tensor" if isinstance(m, torch.Tensor) else type(m).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True where the key is visible), got {got}")
    return m


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Sq: int, Sk: int,
                      device=None, block_size=128) -> BlockMask:
    """Evaluate mask_mod(b, h, q_idx, kv_idx) -> bool on the whole grid, once, in bounded chunks, and
    classify every tile.  B / H None: the mask does not depend on them (one entry for all).
    block_size: an int or (q_block, kv_block)."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    for n, name in ((B, "B"), (H, "H")):
        if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(n).__name__}")
        if n is not None and n < 1:
            raise ValueError(f"{name} must be positive or None (the mask does not depend on it), got {n}")
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"block_size must be an int or a pair (q_block, kv_block) of ints, got {block_size!r}")
    qb, kb = pair
    for n, name in ((Sq, "Sq"), (Sk, "Sk"), (qb, "block_size"), (kb, "block_size")):
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < (1 if name == "block_size" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'block_size' else 'non-negative'} int, got {n!r}")
    b, h = B or 1, H or 1
    try:
        device = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device, got {device!r}") from e
    nq, nk = -(-Sq // qb), -(-Sk // kb)
    state = torch.full((b, h, nq, nk), EMPTY, dtype=torch.int8, device=device)
    bi = torch.arange(b, device=device).view(b, 1, 1, 1)
    hi = torch.arange(h, device=device).view(1, h, 1, 1)
    # a chunk of whole key tiles per row tile, within EVAL_ELEMENTS
    tiles_k = max(1, min(nk, EVAL_ELEMENTS // max(1, b * h * qb * kb)))
    for t in range(nq):
        i = torch.arange(t * qb, min((t + 1) * qb, Sq), device=device)
        for c0 in range(0, nk, tiles_k):
            c1 = min(c0 + tiles_k, nk)
            j = torch.arange(c0 * kb, min(c1 * kb, Sk), device=device)
            m = checked_mask(mask_mod(bi, hi, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)))
            m = torch.broadcast_to(m, (b, h, i.numel(), j.numel()))
            pad = (c1 - c0) * kb - j.numel()   # keys past Sk: neither visible nor masking
            anyv = torch.nn.functional.pad(m, (0, pad), value=False).view(b, h, i.numel(), c1 - c0, kb).any(-1).any(2)
            allv = torch.nn.functional.pad(m, (0, pad), value=True).view(b, h, i.numel(), c1 - c0, kb).all(-1).all(2)
            state[:, :, t, c0:c1] = torch.where(allv, FULL, torch.where(anyv, PARTIAL, EMPTY)).to(torch.int8)
    return BlockMask(state, (Sq, Sk), (qb, kb), mask_mod)


def _row_runs(bm: BlockMask, batch: int, heads: int, max_partial: Optional[int]) -> Optional[tuple]:
    """(count, first, last): int64 [B*, H*, Sq] (B* in 1 or batch, H* in 1 or heads) of each row's visible keys,
    its first (Sk where none) and its last (-1 where none); or None where some row's keys cannot be a run.

    Rows that see runs of keys (a band, documents) make each row tile's non-empty tiles contiguous; a band's
    edges also cross at most ceil(q_block / kv_block) + 1 PARTIAL tiles each per row tile (max_partial).  Both
    are read from the tiles alone.  Then FULL tiles count whole and the mask_mod runs on the PARTIAL ones only,
    with the call's b and h as broadcast dimensions (a mod that reads neither is evaluated once for all)."""
    sq, sk = bm.seq_lengths
    qb, kb = bm.block_size
    st = bm.state
    dev = st.device
    if sq == 0 or sk == 0 or st.shape[0] not in (1, batch) or st.shape[1] not in (1, heads):
        return None
    nk = st.shape[3]
    cols = torch.arange(nk, device=dev)
    seen, full, part = st != EMPTY, st == FULL, st == PARTIAL
    t0 = torch.where(seen, cols, nk).amin(-1)
    t1 = torch.where(seen, cols, -1).amax(-1)
    kmax = int(part.sum(-1).max())
    if (not bool(((t1 < 0) | (seen.sum(-1) == t1 - t0 + 1)).all()) or (kmax and bm.mask_mod is None)
            or (max_partial is not None and kmax > max_partial)):
        return None
    width = (sk - cols * kb).clamp_max(kb)                          # keys of each key tile
    fcount = (full * width).sum(-1)                                 # [b', h', nq]: keys of the FULL tiles
    ffirst = torch.where(full, cols * kb, sk).amin(-1)
    flast = torch.where(full, cols * kb + width - 1, -1).amax(-1)
    pcols = torch.where(part, cols, nk).sort(-1).values[..., :kmax]  # [b', h', nq, kmax]: PARTIAL tiles, nk pads
    bi = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    hi = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    keys = torch.arange(kb, device=dev)
    chunks = []
    rows = max(1, EVAL_ELEMENTS // max(1, 4 * batch * heads * kb))   # rows per chunk of mask_mod evaluations
    for r0 in range(0, sq, rows):
        qi = torch.arange(r0, min(r0 + rows, sq), device=dev)
        rt = qi // qb
        fc, ff, fl, pc = fcount[..., rt], ffirst[..., rt], flast[..., rt], pcols[..., rt, :]
        qi = qi.view(1, 1, -1, 1)
        for n in range(kmax):
            j0 = pc[..., n] * kb                                      # [b', h', rows]: the tile's first key
            j = j0[..., None] + keys
            vis = (j < sk) & checked_mask(bm.mask_mod(bi, hi, qi, j.clamp(0, sk - 1)))
            u8 = vis.to(torch.uint8)
            fc = fc + u8.sum(-1)
            seen_any = u8.amax(-1) > 0
            ff = torch.minimum(ff, torch.where(seen_any, j0 + u8.argmax(-1), sk))
            fl = torch.maximum(fl, torch.where(seen_any, j0 + kb - 1 - u8.flip(-1).argmax(-1), -1))
        chunks.append((fc, ff, fl))
    bh = torch.broadcast_shapes(*(x.shape[:2] for c in chunks for x in c))
    count, first, last = (torch.cat([c[n].expand(*bh, -1) for c in chunks], -1) for n in range(3))
    return count, first, last


def _band(runs: tuple, sq: int, sk: int) -> Optional[tuple]:
    """BlockMask.band from the rows' runs: the rows a bound clips give its value, which is then held to every
    row."""
    count, first, last = runs
    dev = count.device
    some = count > 0
    if not bool(some.any()) or not bool((~some | (count == last - first + 1)).all()):
        return None                                                  # a row with a hole, or nothing visible
    diag = torch.arange(sq, device=dev) + (sk - sq)                  # row i's diagonal key (bottom-right)
    options = []   # per bound: the one value the rows that it clips give, or where it clips none of them,
    for bound, keep in ((diag - first, some & (first > 0)), (last - diag, some & (last < sk - 1))):
        vals = bound[keep]   # unbounded or (where rows see nothing because of it) the tightest value that fits
        if vals.numel() == 0:
            options.append((-1, max(0, int(bound[some].max()))))
        elif bool((vals == vals[0]).all()) and int(vals[0]) >= 0:
            options.append((int(vals[0]),))
        else:
            return None
    for left in options[0]:
        for right in options[1]:
            lo = (diag - left).clamp_min(0) if left >= 0 else torch.zeros_like(diag)
            hi_ = (diag + right).clamp_max(sk - 1) if right >= 0 else torch.full_like(diag, sk - 1)
            want = (hi_ - lo + 1).clamp_min(0)
            if bool(((count == want) & (~some | ((first == lo) & (last == hi_)))).all()):
                return left, right
    return None


def _prefix(runs: tuple) -> Optional[int]:
    """BlockMask.prefix from the rows' runs: every row's run opens at key 0 and closes at max(i, P - 1)."""
    count, first, last = runs
    i = torch.arange(count.shape[-1], device=count.device)
    p = int(last.reshape(-1)[0]) + 1
    if not 1 < p < count.shape[-1]:
        return None
    ok = (first == 0) & (last == torch.clamp_min(i, p - 1)) & (count == last + 1)
    return p if bool(ok.all()) else None


def _documents(runs: tuple, batch: int) -> Optional[tuple]:
    """BlockMask.documents from the rows' runs: a document starts at each row whose run starts at itself, and
    every row must see its document from that start to itself (causal) or to the document's end."""
    count, first, last = runs
    if any(bool((x != x[:, :1]).any()) for x in runs):
        return None                                   # the documents differ between heads
    count, first, last = (x[:, 0].expand(batch, -1) for x in runs)   # [batch, S]
    s = first.shape[-1]
    i = torch.arange(s, device=first.device)
    start = first == i
    doc_start = torch.cummax(torch.where(start, i, 0), -1).values      # the last start at or before each row
    nxt = torch.flip(torch.cummin(torch.flip(torch.where(start, i, s), [-1]), -1).values, [-1])
    doc_end = torch.cat([nxt[:, 1:], torch.full_like(nxt[:, :1], s)], -1) - 1   # the last row of its document
    causal = bool((last == i).all())
    if not bool(start[:, 0].all() and ((first == doc_start) & (count == last - first + 1)).all()) or not (
            causal or bool((last == doc_end).all())):
        return None
    return documents_of_starts(start, start.sum(-1), causal)


def documents_of_starts(start: torch.Tensor, per_entry: torch.Tensor, causal: bool) -> tuple:
    """BlockMask.documents' tuple from start [batch, S] (True at each document's first row) and per_entry (its row
    sums): cu_seqlens over the batch * S rows, the longest document, per_entry, causal."""
    batch, s = start.shape
    i = torch.arange(s, device=start.device)
    rows = (i + s * torch.arange(batch, device=start.device)[:, None])[start]   # every document's first row, in order
    cu = torch.cat([rows, rows.new_full((1,), batch * s)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()), per_entry, causal


def _is_noop(fn) -> bool:
    return fn is None or getattr(fn, "__name__", "") == "noop_mask"


def as_block_mask(bm) -> BlockMask:
    """A flashport BlockMask, or one converted from torch's flex_attention BlockMask."""
    if isinstance(bm, BlockMask):
        return bm
    if not all(hasattr(bm, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths")):
        raise TypeError(f"block_mask must come from flashport.create_block_mask or torch's create_block_mask, "
                        f"got {type(bm).__name__}")
    qb, kb = bm.BLOCK_SIZE
    sq, sk = bm.seq_lengths
    nq, nk = -(-sq // qb), -(-sk // kb)
    b, h = bm.kv_num_blocks.shape[:2]
    state = torch.zeros((b, h, nq, nk + 1), dtype=torch.int8, device=bm.kv_num_blocks.device)

    def mark(num, idx, value):
        live = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        cols = torch.where(live, idx.long(), nk)[..., :nq, :]       # dead slots land in the dropped column
        state.scatter_(3, cols, torch.full_like(cols, value, dtype=torch.int8))

    mark(bm.kv_num_blocks[..., :nq], bm.kv_indices, PARTIAL)
    if getattr(bm, "full_kv_num_blocks", None) is not None:
        mark(bm.full_kv_num_blocks[..., :nq], bm.full_kv_indices, FULL)
    mask_mod = None if _is_noop(getattr(bm, "mask_mod", None)) else bm.mask_mod
    if mask_mod is None:
        state = torch.where(state == PARTIAL, FULL, state)   # without a mask_mod a listed tile is seen whole
    return BlockMask(state[..., :nk].contiguous(), (sq, sk), (qb, kb), mask_mod, find_band=False)
