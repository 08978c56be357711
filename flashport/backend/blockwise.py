"""Backend `blockwise`: FlashAttention-2 in plain PyTorch ops -- tiled online softmax, any device.

Forward (per query tile of BLOCK_M rows, looping over key tiles of BLOCK_N columns):

    s = scale * q_t @ k_t.T  (-> softcap * tanh(s / softcap), + ALiBi, hidden pairs -> -inf)
    m_new = max(m_i, rowmax(s));  p = exp(s - m_new);  alpha = exp(m_i - m_new)
    l_i = alpha * l_i + rowsum(p);  acc = alpha * acc + dropout(p) @ v_t;  m_i = m_new
    out = acc / l_i,  lse = m_i + log(l_i)

Backward recomputes each score tile from the saved LSE (p = exp(s - lse)), with
D_i = rowsum(dO * O) and dS = P * (dP - D), so only q, k, v, out, lse (and the dropout
rng_state) are kept between the passes: memory is O(S * D), never O(S^2).  Tiles the mask hides
entirely are skipped (masks.Visibility's key_range / query_range).

GQA/MQA never expands K/V: query heads are viewed as [Hkv, G] and the G query heads of one KV
head are stacked into the rows of one matmul against that head's keys, so dK/dV sum over the
group inside the matmul.  Arithmetic runs in float32 (float64 for float64 inputs).

It is deterministic by construction (a fixed sequential loop order, no atomics).  Varlen and the
KV cache read their lengths on the host (one sync), which is fine for this backend: it is the
portable fallback, not the fast path on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .. import dispatch
from ..capabilities import DTYPES, Capabilities
from ..dropout import dense_keep_mask, keep_mask
from ..kvcache import sequence_kv
from ..masks import Visibility, alibi_bias
from ..programmable import FEATURES
from ..spec import AttnInputs, AttnSpec, alibi_per_batch, varlen_segments
from . import tile_steps

# Tile sizes.  Module attributes (read at each call) so tests can shrink them to exercise
# multi-tile paths on small shapes.  A [BLOCK_M * G, BLOCK_N] float32 tile of 128 x 512 is 256 KiB:
# it stays in cache on a CPU while the matmuls are still big enough to run at full speed.
BLOCK_M = 128
BLOCK_N = 512
# A tile holds B * Hq * BLOCK_M * BLOCK_N scores; large batches x heads shrink the tile to this many
# elements (16 MiB in float32 per temporary) so memory stays bounded, whatever the batch.
TILE_ELEMENTS = 1 << 22

_NEG_INF = float("-inf")


def dropout_mask(rng_state: torch.Tensor, p: float, batch: int, heads_q: int, sq: int, sk: int) -> torch.Tensor:
    """The [B, Hq, Sq, Sk] bool keep-mask this backend applies for dropout (small shapes only).

    It is the shared Philox mask of flashport.dropout, evaluated per tile with the same
    (b, h, i, j) indices in forward and backward; here it is evaluated densely for tests."""
    return dense_keep_mask(rng_state, p, batch, heads_q, sq, sk)


@dataclass
class _Tiling:
    """Per-call constants shared by the forward and backward tile loops (the autograd options)."""

    scale: float
    softcap: float
    left: int
    right: int
    dropout_p: float
    rng_state: Optional[torch.Tensor]
    heads_q: int
    block_m: int
    block_n: int


def _fit(opt: _Tiling, rows: int, prog=None) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for `rows` = B * Hq query rows per tile row, within TILE_ELEMENTS; a block mask's
    own tiles when there is one (so that its empty tiles are skipped one by one)."""
    bm, bn = opt.block_m, opt.block_n
    if prog is not None and prog.block_mask is not None:
        bm, bn = prog.block_mask.block_size
    while rows * bm * bn > TILE_ELEMENTS and bm > 16:
        bm //= 2
    while rows * bm * bn > TILE_ELEMENTS and bn > 16:
        bn //= 2
    return bm, bn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_major(x: torch.Tensor, heads_kv: int, cd: torch.dtype) -> torch.Tensor:
    """[B, S, Hq, D] -> contiguous [B, Hkv, G, S, D] in the compute dtype (query head h = kv * G + g)."""
    b, s, hq, d = x.shape
    return x.reshape(b, s, heads_kv, hq // heads_kv, d).permute(0, 2, 3, 1, 4).to(cd).contiguous()


def _head_major(x: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """[B, S, Hkv, D] -> contiguous [B, Hkv, S, D] in the compute dtype."""
    return x.permute(0, 2, 1, 3).to(cd).contiguous()


def _rows(x: torch.Tensor, m0: int, m1: int) -> torch.Tensor:
    """[B, Hkv, G, S, ...] rows m0:m1 -> [B, Hkv, G * (m1 - m0), ...]: a group's rows share one matmul."""
    b, hkv, g = x.shape[:3]
    return x[:, :, :, m0:m1].reshape(b, hkv, g * (m1 - m0), *x.shape[4:])


def _mod_index(b0: int, batch: int, heads_kv: int, g: int, m0, m1, n0, n1, device):
    """(b, h, q_idx, kv_idx) of a tile viewed as [B, Hkv, G, BM, BN], broadcasting (h = kv * G + g)."""
    return (torch.arange(b0, b0 + batch, device=device).view(batch, 1, 1, 1, 1),
            torch.arange(heads_kv * g, device=device).view(1, heads_kv, g, 1, 1),
            torch.arange(m0, m1, device=device).view(1, 1, 1, -1, 1),
            torch.arange(n0, n1, device=device).view(1, 1, 1, 1, -1))


def _scores(q_t, k_t, m0, m1, n0, n1, vis: Visibility, opt: _Tiling, slopes, prog=None, b0=0, keep_pre=False,
            tile="partial"):
    """Final scores of one tile, [B, Hkv, G * BM, BN], hidden pairs at -inf; also tanh(raw / softcap)
    (for the softcap gradient) or None, and for the backward of a programmable call whose mods change the
    scores (keep_pre) the scores before the mods with the tile's index tensors, else None.  slopes:
    [B, Hkv, G, 1, 1] ALiBi slopes in the compute dtype, or None; tile: prog.tile() of this tile (the caller
    has it already).  The scale multiplies the product (not q beforehand) so rounding matches the math path:
    s = scale * (q @ k.T)."""
    s = (q_t @ k_t.transpose(-1, -2)).mul_(opt.scale)
    t = None
    if opt.softcap > 0:
        t = torch.tanh(s.div_(opt.softcap))
        s = opt.softcap * t
    partial = prog is not None and tile == "partial"
    needs_mask = not vis.tile_is_full(m0, m1, n0, n1) or partial
    if slopes is None and not needs_mask and prog is None:
        return s, t, None
    b, hkv, rows, bn = s.shape
    g = rows // (m1 - m0)
    s5 = s.view(b, hkv, g, m1 - m0, bn)
    i = torch.arange(m0, m1, device=s.device)[:, None]
    j = torch.arange(n0, n1, device=s.device)[None, :]
    if slopes is not None:
        s5 += alibi_bias(slopes, i, j, vis.sq, vis.sk).to(s.dtype)
    pre = None
    if prog is not None:
        idx = _mod_index(b0, b, hkv, g, m0, m1, n0, n1, s.device)
        if prog.changes_scores:
            if keep_pre:
                pre = (s5.clone(), idx)
            s5.copy_(prog.scores(s5, *idx))
    if needs_mask:
        hidden = ~vis.sees(i, j)
        if partial:
            seen = prog.visible(*idx)
            if seen is not None:
                hidden = hidden | ~seen
        s5.masked_fill_(hidden, _NEG_INF)
    return s, t, pre


def _through_mods(prog, pre, ds: torch.Tensor, grads: list) -> torch.Tensor:
    """Chain dS (after the mods) back through score_mod and attn_bias: returns dS before them and adds the
    gradients of prog.differentiable (attn_bias, captured tables) into `grads`."""
    s5, idx = pre
    extras = prog.differentiable
    with torch.enable_grad():
        x = s5.detach().requires_grad_()
        y = prog.scores(x, *idx)
        got = torch.autograd.grad(y, (x, *extras), ds.view(s5.shape), allow_unused=True, materialize_grads=True)
    for n, gr in enumerate(got[1:]):
        grads[n] = gr if grads[n] is None else grads[n] + gr
    return got[0].view(ds.shape)


def _keep(opt: _Tiling, b0: int, batch: int, heads_kv: int, m0, m1, n0, n1, device) -> torch.Tensor:
    """Dropout keep-mask of one tile, [B, Hkv, G * BM, BN]: the same (b, h, i, j) in fwd and bwd."""
    g = opt.heads_q // heads_kv
    bs = (torch.arange(batch, device=device) + b0).view(batch, 1, 1, 1, 1)
    hs = torch.arange(opt.heads_q, device=device).view(1, heads_kv, g, 1, 1)
    i = torch.arange(m0, m1, device=device).view(1, 1, 1, -1, 1)
    j = torch.arange(n0, n1, device=device).view(1, 1, 1, 1, -1)
    keep = keep_mask(opt.rng_state, opt.dropout_p, bs, hs, i, j, opt.heads_q)
    return keep.reshape(batch, heads_kv, g * (m1 - m0), n1 - n0)


def _slopes5(alibi: Optional[torch.Tensor], heads_kv: int, cd) -> Optional[torch.Tensor]:
    if alibi is None:
        return None
    b, hq = alibi.shape
    return alibi.to(cd).view(b, heads_kv, hq // heads_kv, 1, 1)


def _plain_steps(opt: _Tiling, slopes, prog, device, scores: int, rows: int):
    """(forward step, backward step, BLOCK_M, BLOCK_N) of a call: tile_steps' for a call whose tiles are plain (no
    softcap, ALiBi, dropout or mods: the scores are scale * q.k and the built-in mask), else None steps and the
    general loop below serves it.  rows = B * Hq (for _fit)."""
    if opt.softcap > 0 or slopes is not None or prog is not None or opt.dropout_p > 0:
        return (None, None, *_fit(opt, rows, prog))
    fwd, bwd, compiled = tile_steps.steps(device, scores)
    if compiled:
        opt = replace(opt, block_m=max(opt.block_m, tile_steps.BLOCK_M))
    return (fwd, bwd, *_fit(opt, rows))


def _hidden(vis: Visibility, m0: int, m1: int, n0: int, n1: int, g: int, device) -> Optional[torch.Tensor]:
    """bool [G * BM, BN] of the pairs the built-in rule hides in a tile (rows stacked per group as in _rows), or
    None when it hides none."""
    if vis.tile_is_full(m0, m1, n0, n1):
        return None
    hidden = ~vis.sees(torch.arange(m0, m1, device=device)[:, None], torch.arange(n0, n1, device=device)[None, :])
    return hidden.repeat(g, 1) if g > 1 else hidden


def forward_tiles(q, k, v, opt: _Tiling, alibi: Optional[torch.Tensor] = None, b0: int = 0, prog=None):
    """One dense problem.  q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]; alibi [B, Hq]
    float32 or None; b0 = batch index of q[0] (dropout counters); prog: the programmable mods or None.

    Returns out [B, Sq, Hq, Dv] in q's dtype and lse [B, Hq, Sq] in the compute dtype.
    Equivalent to materialized_attention(q, k, v, ...) without ever holding an [Sq, Sk] matrix."""
    b, sq, hq, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    cd = _compute_dtype(q.dtype)
    qh = _group_major(q, hkv, cd)                             # [B, Hkv, G, Sq, D]
    kh, vh = _head_major(k, cd), _head_major(v, cd)           # [B, Hkv, Sk, D|Dv]
    slopes = _slopes5(alibi, hkv, cd)
    out = torch.zeros(b, hkv, g, sq, dv, dtype=cd, device=q.device)
    lse = torch.full((b, hkv, g, sq), _NEG_INF, dtype=cd, device=q.device)
    step, _, block_m, block_n = _plain_steps(opt, slopes, prog, q.device, b * hq * sq * sk, b * hq)
    vis = Visibility(sq, sk, opt.left, opt.right)
    for m0 in range(0, sq, block_m):
        m1 = min(m0 + block_m, sq)
        lo, hi = vis.key_range(m0, m1)
        if lo >= hi:
            continue  # every row of this tile sees no key: zeros, lse -inf
        q_t = _rows(qh, m0, m1)
        m_i = torch.full(q_t.shape[:3], _NEG_INF, dtype=cd, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(*q_t.shape[:3], dv, dtype=cd, device=q.device)
        for n0 in range(lo, hi, block_n):
            n1 = min(n0 + block_n, hi)
            if step is not None:   # plain tile: tile_steps (compiled on a CPU where it pays)
                m_i, l_i, acc = step(q_t, kh[:, :, n0:n1], vh[:, :, n0:n1], m_i, l_i, acc, opt.scale,
                                     _hidden(vis, m0, m1, n0, n1, g, q.device))
                continue
            tile = "partial" if prog is None else prog.tile(m0, m1, n0, n1)
            if tile == "empty":
                continue
            s, _, _ = _scores(q_t, kh[:, :, n0:n1], m0, m1, n0, n1, vis, opt, slopes, prog, b0, tile=tile)
            keep = (_keep(opt, b0, b, hkv, m0, m1, n0, n1, q.device) / (1.0 - opt.dropout_p)
                    if opt.dropout_p > 0 else None)
            m_i, l_i, acc = tile_steps.online_softmax(s, vh[:, :, n0:n1], m_i, l_i, acc, keep)
        seen = l_i > 0
        acc /= torch.where(seen, l_i, torch.ones_like(l_i))[..., None]
        out[:, :, :, m0:m1] = acc.view(b, hkv, g, m1 - m0, dv)
        lse_t = torch.where(seen, m_i + torch.log(torch.where(seen, l_i, torch.ones_like(l_i))),
                            torch.full_like(l_i, _NEG_INF))
        lse[:, :, :, m0:m1] = lse_t.view(b, hkv, g, m1 - m0)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, hq, dv).to(q.dtype)
    return out, lse.reshape(b, hq, sq)


def backward_tiles(do, q, k, v, out, lse, dlse, opt: _Tiling, alibi: Optional[torch.Tensor] = None, b0: int = 0,
                   prog=None):
    """Gradients of one dense problem (shapes as forward_tiles; do like out, lse [B, Hq, Sq] in the
    compute dtype, dlse like lse or None).  Returns dq, dk, dv in the inputs' dtypes, then the gradients
    of prog.differentiable (attn_bias, captured tensors) when prog is given.

    Outer loop over key tiles (dK, dV accumulate per tile), inner loop over the query tiles that can
    see them; dQ accumulates in a float buffer.  With p = exp(s - lse) recomputed:
        dV += dropout(p).T @ dO;  dP = dropout(dO @ V.T);  dS = p * (dP - (rowsum(dO * O) - dlse))
        (softcap: dS *= 1 - tanh^2);  dQ += scale * dS @ K;  dK += scale * dS.T @ Q
    The dlse term makes gradients flow through a returned lse too (d lse_i / d s_ij = p_ij)."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    cd = _compute_dtype(q.dtype)
    qh = _group_major(q, hkv, cd)
    doh = _group_major(do, hkv, cd)
    kh, vh = _head_major(k, cd), _head_major(v, cd)
    slopes = _slopes5(alibi, hkv, cd)
    delta = (doh * _group_major(out, hkv, cd)).sum(-1)         # [B, Hkv, G, Sq]
    if dlse is not None:
        delta -= dlse.to(cd).view(b, hkv, g, sq)
    # Rows that see no key have lse = -inf; +inf there makes p = exp(-inf - inf) = 0, never NaN.
    lse_h = lse.to(cd).view(b, hkv, g, sq)
    lse_h = torch.where(lse_h == _NEG_INF, torch.full_like(lse_h, float("inf")), lse_h)
    dq = torch.zeros(b, hkv, g, sq, d, dtype=cd, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=cd, device=q.device)
    dvh = torch.zeros(b, hkv, sk, dv, dtype=cd, device=q.device)
    _, step, block_m, block_n = _plain_steps(opt, slopes, prog, q.device, b * hq * sq * sk, b * hq)
    vis = Visibility(sq, sk, opt.left, opt.right)
    dextras = [None] * (0 if prog is None else len(prog.differentiable))
    for n0 in range(0, sk, block_n):
        n1 = min(n0 + block_n, sk)
        lo, hi = vis.query_range(n0, n1)
        k_t, v_t = kh[:, :, n0:n1], vh[:, :, n0:n1]
        for m0 in range(lo, hi, block_m):
            m1 = min(m0 + block_m, hi)
            if step is not None:   # plain tile: tile_steps (compiled on a CPU where it pays)
                gq, gk, gv = step(_rows(qh, m0, m1), k_t, v_t, _rows(doh, m0, m1), _rows(lse_h, m0, m1),
                                  _rows(delta, m0, m1), opt.scale, _hidden(vis, m0, m1, n0, n1, g, q.device))
                dq[:, :, :, m0:m1] += gq.view(b, hkv, g, m1 - m0, d)
                dk[:, :, n0:n1] += gk
                dvh[:, :, n0:n1] += gv
                continue
            tile = "partial" if prog is None else prog.tile(m0, m1, n0, n1)
            if tile == "empty":
                continue
            q_t, do_t = _rows(qh, m0, m1), _rows(doh, m0, m1)
            s, t, pre = _scores(q_t, k_t, m0, m1, n0, n1, vis, opt, slopes, prog, b0, keep_pre=True, tile=tile)
            p = s.sub_(_rows(lse_h, m0, m1)[..., None]).exp_()
            dp = do_t @ v_t.transpose(-1, -2)
            if opt.dropout_p > 0:
                zk = _keep(opt, b0, b, hkv, m0, m1, n0, n1, q.device) / (1.0 - opt.dropout_p)
                dvh[:, :, n0:n1] += (p * zk).transpose(-1, -2) @ do_t
                dp.mul_(zk)
            else:
                dvh[:, :, n0:n1] += p.transpose(-1, -2) @ do_t
            ds = dp.sub_(_rows(delta, m0, m1)[..., None]).mul_(p)
            if pre is not None:
                ds = _through_mods(prog, pre, ds, dextras)
            if t is not None:
                ds.mul_(1.0 - t * t)
            dq[:, :, :, m0:m1] += (ds @ k_t).view(b, hkv, g, m1 - m0, d)
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ q_t
    dq = (dq * opt.scale).permute(0, 3, 1, 2, 4).reshape(b, sq, hq, d).to(q.dtype)
    dk = (dk * opt.scale).permute(0, 2, 1, 3).to(k.dtype)
    if prog is not None:  # a tensor no visible tile reached gets zeros, in its own shape and dtype
        dextras = [torch.zeros_like(x) if gr is None else gr.to(x.dtype)
                   for x, gr in zip(prog.differentiable, dextras)]
    return (dq, dk, dvh.permute(0, 2, 1, 3).to(v.dtype), *dextras)


@dataclass
class _Call:
    """Options object of the autograd Function: tiling constants plus the dense/varlen layout."""

    tiling: _Tiling
    alibi: Optional[torch.Tensor]          # [B, Hq] float32 or None
    segments: Optional[list] = None        # varlen: [(q0, q1, k0, k1)] per sequence; None = dense
    prog: object = None                    # dense programmable calls: flashport.programmable.Programmable

    def _alibi(self, b: int):
        return None if self.alibi is None else self.alibi[b:b + 1]

    def forward(self, q, k, v):
        if self.segments is None:
            return forward_tiles(q, k, v, self.tiling, self.alibi, prog=self.prog)
        hq, dv = q.shape[1], v.shape[2]
        out = q.new_zeros(q.shape[0], hq, dv)                 # rows past cu_seqlens_q[-1] stay zero
        lse = torch.full((hq, q.shape[0]), _NEG_INF, dtype=_compute_dtype(q.dtype), device=q.device)
        for b, (q0, q1, k0, k1) in enumerate(self.segments):
            if q1 > q0 and k1 > k0:
                o, l = forward_tiles(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], self.tiling, self._alibi(b), b,
                                     self.prog)
                out[q0:q1], lse[:, q0:q1] = o[0], l[0]
        return out, lse

    def backward(self, do, dlse, q, k, v, out, lse):
        if self.segments is None:
            return backward_tiles(do, q, k, v, out, lse, dlse, self.tiling, self.alibi, prog=self.prog)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        extras = [] if self.prog is None else [torch.zeros_like(x) for x in self.prog.differentiable]
        for b, (q0, q1, k0, k1) in enumerate(self.segments):
            if q1 > q0 and k1 > k0:
                g = backward_tiles(do[q0:q1][None], q[q0:q1][None], k[k0:k1][None], v[k0:k1][None],
                                   out[q0:q1][None], lse[:, q0:q1][None],
                                   None if dlse is None else dlse[:, q0:q1][None], self.tiling, self._alibi(b), b,
                                   self.prog)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
                for acc, gx in zip(extras, g[3:]):   # captured tensors: summed over the sequences
                    acc += gx
        return (dq, dk, dv, *extras)


def _kvcache(spec: AttnSpec, inputs: AttnInputs, opt: _Tiling, alibi):
    """Inference over a dense or paged cache: batch entry b attends to its first seqlens_k[b] keys
    (host values), gathered from its pages for a paged cache (an O(S * D) copy)."""
    q, kc, vc = inputs.q, inputs.k, inputs.v
    if inputs.seqlens_k is None:  # the whole dense cache is valid
        out, lse = forward_tiles(q, kc, vc, opt, alibi)
        return out, lse.to(torch.float32)
    outs, lses = [], []
    for b, n in enumerate(inputs.seqlens_k.tolist()):
        kb, vb = sequence_kv(kc, vc, inputs.block_table if spec.paged else None, b, n)
        o, l = forward_tiles(q[b:b + 1], kb, vb, opt, None if alibi is None else alibi[b:b + 1], b)
        outs.append(o)
        lses.append(l)
    if not outs:
        return q.new_zeros(*q.shape[:3], spec.head_dim_v), q.new_zeros(0, spec.heads_q, q.shape[1], dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses).to(torch.float32)


class BlockwiseBackend(dispatch.Backend):
    """Pure PyTorch tiled online softmax, forward and backward, on any device and dtype (float64 included), every
    call the contract allows, in O(S * D) memory.  Correct everywhere, at PyTorch-op speed: on a GPU auto lands
    here only when no kernel serves the call, and says so once.  Varlen and KV-cache calls read their lengths on
    the host.  Shares the Philox dropout mask and (out, lse) with the Triton kernels, so it mixes with them."""

    name = "blockwise"
    slow_on_gpu = True
    state_family = "blockwise"   # its private state: lse in the compute dtype (float64 for float64 inputs)
    caps = Capabilities(devices=("cuda", "cpu", "mps", "xpu"), dtypes=DTYPES, max_head_dim=None, mods=FEATURES,
                        notes=("varlen and KV cache read lengths on the host (a sync on a GPU)",))

    def extra_bytes(self, spec: AttnSpec, role: str = "fwd") -> int:
        # plus about four float32 score tiles alive at once (s, p, and the backward's dp, ds)
        return super().extra_bytes(spec, role) + 4 * 4 * min(TILE_ELEMENTS, max(1, spec.batch * spec.heads_q)
                                                             * BLOCK_M * BLOCK_N)

    def forward(self, spec: AttnSpec, inputs: AttnInputs):
        call, opt = _call(spec, inputs)
        if spec.kind == "kvcache":
            out, lse = _kvcache(spec, inputs, opt, call.alibi)
            return out, lse, None
        out, lse = call.forward(inputs.q, inputs.k, inputs.v)
        return out, lse.to(torch.float32), lse

    def backward(self, spec: AttnSpec, inputs: AttnInputs, saved: dispatch.Saved, dout, dlse):
        call, _ = _call(spec, inputs)
        lse = saved.private if saved.private is not None else saved.lse.to(_compute_dtype(saved.q.dtype))
        return call.backward(dout, dlse, saved.q, saved.k, saved.v, saved.out, lse)


def _call(spec: AttnSpec, inputs: AttnInputs) -> tuple[_Call, _Tiling]:
    alibi = alibi_per_batch(spec, inputs.alibi_slopes)
    opt = _Tiling(scale=spec.softmax_scale, softcap=spec.softcap, left=spec.window_left,
                  right=spec.window_right, dropout_p=spec.dropout_p, rng_state=inputs.rng_state,
                  heads_q=spec.heads_q, block_m=BLOCK_M, block_n=BLOCK_N)
    segments = varlen_segments(inputs) if spec.kind == "varlen" else None
    return _Call(opt, alibi, segments, inputs.prog), opt
